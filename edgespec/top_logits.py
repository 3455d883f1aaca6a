"""A row's largest logits, found by ONNX Runtime's TopK in one call: between two runs of
the model each numpy call pays its fixed cost again, and numpy needs a max, a comparison and
a selection for what TopK does at once (DESIGN.md, Sampling)."""
from importlib import resources

import numpy as np
import onnxruntime as ort

GRAPH = resources.files("edgespec") / "data" / "top_k.onnx"  # export/graph.py: build_top_k


class TopLogits:
    """`top(z)`: the `k` largest values of the C-contiguous float32 row z and their ids
    (arrays that the next call overwrites)."""
    k = 64

    def __init__(self, options: ort.SessionOptions):
        self.session = ort.InferenceSession(GRAPH.read_bytes(), options,
                                            providers=["CPUExecutionProvider"])
        self.values = np.zeros([1, self.k], np.float32)
        self.ids = np.zeros([1, self.k], np.int64)
        self.binding = self.session.io_binding()
        for name, array in (("values", self.values), ("ids", self.ids)):
            self.binding.bind_output(name, "cpu", 0, array.dtype.type, array.shape,
                                     array.ctypes.data)

    def __call__(self, z: np.ndarray):
        self.binding.bind_input("logits", "cpu", 0, np.float32, [1, z.size], z.ctypes.data)
        self.session.run_with_iobinding(self.binding)
        return self.ids[0], self.values[0]
