"""One MatMulNBits at one row (or more), per weight layout, interleaved in one process.

Each layout is a one-node model of random codes, scales and zero points (int8 activations,
accuracy level 4, as the artifacts use), its own session with thread spinning off so that an
idle session does not steal the running one's cores. Prints the median time of each and its
rate in weights a second: what a plain step pays per layout.

    .venv/bin/python benchmarks/matmul_nbits.py --shape 151936x1536 --shape 1536x8960
"""
import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

LAYOUTS = {"8 bits, 16s": (8, 16), "8 bits, 32s": (8, 32), "4 bits, 32s": (4, 32),
           "4 bits, 16s": (4, 16), "2 bits, 32s": (2, 32)}


def one_node_model(n, k, bits, block, rng):
    blocks = k // block
    per_byte = 8 // bits
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // per_byte),
                                                  dtype=np.uint8), "B"),
             numpy_helper.from_array((rng.random(n * blocks, dtype=np.float32) + 0.5) * 1e-2, "S"),
             numpy_helper.from_array(rng.integers(0, 256, n * -(-blocks // per_byte),
                                                  dtype=np.uint8), "Z")]
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "one", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["rows", k])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["rows", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def session(model, threads):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", action="append", help="NxK (out x in); repeatable")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    for shape in args.shape or ["151936x1536", "1536x8960"]:
        n, k = map(int, shape.split("x"))
        sessions = {name: session(one_node_model(n, k, bits, block, rng), args.threads)
                    for name, (bits, block) in LAYOUTS.items()}
        x = {"x": rng.standard_normal((args.rows, k)).astype(np.float32)}
        times = {name: [] for name in sessions}
        for s in sessions.values():
            s.run(None, x)
        for _ in range(args.repeat):
            for name, s in sessions.items():
                start = time.perf_counter()
                s.run(None, x)
                times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            t = statistics.median(ts)
            print(f"{shape} x {args.rows} row(s)  {name:12s} {t * 1e3:8.3f} ms  "
                  f"{n * k / t / 1e9:5.1f} G weights/s")


if __name__ == "__main__":
    main()
