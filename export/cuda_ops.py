"""Whether ONNX Runtime's CUDA kernels take an exported graph, checked without a GPU.

Each node's op, domain, opset and input and output types are looked up in the CUDA kernels
ONNX Runtime registers (data/cuda_kernels.json, made from its docs/OperatorKernels.md by
`python -m edgespec.export.cuda_ops --table OperatorKernels.md RELEASE SOURCE`), and RULES check the
attribute and input combinations those kernels refuse or read wrongly. Integer arithmetic
that only feeds inputs the CUDA kernels read from CPU memory (shapes, axes, lengths) is kept
on the CPU by ONNX Runtime by design: it is listed apart, not as a problem. Not seen here:
numerics, shapes known only at run time, the device's compute capability and which kernel
ONNX Runtime picks for it.

`python -m edgespec.export.cuda_ops ARTIFACT` prints the check of each graph of an artifact.
"""
import argparse
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from edgespec.errors import EdgespecError

TABLE = Path(__file__).parent / "data" / "cuda_kernels.json"
ONNX, MS = "ai.onnx", "com.microsoft"
# the ops export emits: the rows of OperatorKernels.md the table keeps
EXPORT_OPS = {ONNX: ("Add", "Cast", "Concat", "Exp", "Gather", "Gelu", "Gemm", "Identity",
                     "Less", "MatMul", "Max", "Min", "Mul", "Reciprocal",
                     "ReduceSum", "Reshape", "SimplifiedLayerNormalization", "Slice", "Split",
                     "Sub", "TopK", "Unsqueeze", "Where"),
              MS: ("GatherBlockQuantized", "GroupQueryAttention", "MatMulNBits", "QuickGelu",
                   "SkipSimplifiedLayerNormalization")}
# inputs the CUDA kernels read from CPU memory (InputMemoryType(OrtMemTypeCPUInput, i) in
# their kernel definitions): ONNX Runtime computes what feeds only these on the CPU
CPU_INPUTS = {(ONNX, "Reshape"): {1}, (ONNX, "Slice"): {1, 2, 3, 4}, (ONNX, "Split"): {1},
              (ONNX, "Unsqueeze"): {1}, (ONNX, "ReduceSum"): {1},
              (ONNX, "TopK"): {1}, (MS, "GroupQueryAttention"): {6}}
INTEGERS = {TensorProto.INT32, TensorProto.INT64}


@dataclass
class CudaCheck:
    """What the check found in one graph."""
    graph: str
    nodes: int = 0
    problems: list = field(default_factory=list)  # "node NAME (Op): why" CUDA would not run it
    on_cpu: list = field(default_factory=list)    # nodes ONNX Runtime keeps on the CPU by design
    needs: dict = field(default_factory=dict)     # what the graph uses -> the first release with it


@functools.cache
def kernels() -> dict:
    return json.loads(TABLE.read_text())


def check_cuda_graph(model) -> CudaCheck:
    """Check one graph (a ModelProto or the path of an .onnx file; external weights are not
    read) against ONNX Runtime's CUDA kernels."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    g = _Graph(model)
    found = CudaCheck(model.graph.name, len(g.nodes))
    cpu = g.kept_on_cpu()
    for i, node in enumerate(g.nodes):
        if i in cpu:
            found.on_cpu.append(f"{node.name} ({node.op_type})")
            continue
        why = g.kernel_problem(i) or RULES.get(node.op_type, _no_rule)(node, g, found)
        if why:
            found.problems.append(f"node {node.name} ({node.op_type}): {why}")
    return found


def check_cuda_artifact(directory) -> list:
    """The check of every graph of an artifact directory."""
    return [check_cuda_graph(path) for path in sorted(Path(directory).glob("*.onnx"))]


def require_cuda_kernels(directory):
    """Raise, in one line, if ONNX Runtime's CUDA kernels would refuse or misread a graph."""
    problems = [f"{c.graph}.onnx {p}" for c in check_cuda_artifact(directory) for p in c.problems]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise EdgespecError(f"this --device cuda export would not run on ONNX Runtime's CUDA "
                            f"kernels ({kernels()['release']}): {problems[0]}{more}")


def needed_release(checks) -> tuple:
    """(release, what needs it): the earliest onnxruntime-gpu that has every kernel the graphs
    use, by the releases RULES know; ("", "") when they know of none."""
    needs = {what: release for c in checks for what, release in c.needs.items()}
    if not needs:
        return "", ""
    what = max(needs, key=lambda w: tuple(map(int, needs[w].split("."))))
    return needs[what], what


class _Graph:
    """A graph's values: the element type and dims of each one known, and who reads it."""

    def __init__(self, model):
        self.graph = model.graph
        self.opsets = {_domain(o.domain): o.version for o in model.opset_import}
        values = [*self.graph.input, *self.graph.value_info, *self.graph.output]
        self.types = {v.name: v.type.tensor_type.elem_type for v in values}
        self.dims = {v.name: [d.dim_value or None for d in v.type.tensor_type.shape.dim]
                     for v in values}
        for t in self.graph.initializer:
            self.types[t.name], self.dims[t.name] = t.data_type, list(t.dims)
        self.nodes, self.schemas, self.readers = list(self.graph.node), [], {}
        for n, node in enumerate(self.nodes):  # types flow in node order (export sorts it)
            schema = _schema(_domain(node.domain), node.op_type,
                             self.opsets.get(_domain(node.domain), 1))
            self.schemas.append(schema)
            if schema is not None:
                self.type_outputs(node, schema)
            for i, name in enumerate(node.input):
                self.readers.setdefault(name, []).append((n, i))

    def type_outputs(self, node, schema):
        """Note the element types of the node's outputs, from its inputs' and its schema."""
        bound = self.bound(node, schema)
        for i, name in enumerate(node.output):
            formal = schema.outputs[min(i, len(schema.outputs) - 1)]
            elem = (_attrs(node)["to"] if node.op_type == "Cast" else
                    bound.get(formal.typeStr) or _single_type(schema, formal.typeStr))
            if name and elem:
                self.types.setdefault(name, elem)

    def bound(self, node, schema) -> dict:
        """Type constraint -> the element type the node's inputs give it."""
        bound = {}
        for i, name in enumerate(node.input):
            if name and name in self.types:
                bound.setdefault(schema.inputs[min(i, len(schema.inputs) - 1)].typeStr,
                                 self.types[name])
        return bound

    def kept_on_cpu(self) -> set:
        """Nodes whose integer outputs are read only where a CUDA kernel reads CPU memory, or
        by other such nodes: ONNX Runtime places them on the CPU (their indices)."""
        outputs, cpu = {o.name for o in self.graph.output}, set()

        def read_on_cpu(name):  # an integer that every reader takes in CPU memory
            readers = self.readers.get(name)
            return (name not in outputs and self.types.get(name) in INTEGERS and readers and
                    all(r in cpu or i in CPU_INPUTS.get(_key(self.nodes[r]), ())
                        for r, i in readers))
        for n in reversed(range(len(self.nodes))):  # readers come after what they read
            if all(read_on_cpu(name) for name in self.nodes[n].output):
                cpu.add(n)
        return cpu

    def kernel_problem(self, n):
        """Why no CUDA kernel in the table takes node n's op, opset and types (or None)."""
        node, schema = self.nodes[n], self.schemas[n]
        domain, op = _domain(node.domain), node.op_type
        rows = kernels()["kernels"].get(domain, {}).get(op)
        if rows is None:
            return (f"not among the ops of {TABLE.name}; add it to EXPORT_OPS in "
                    "export/cuda_ops.py and remake the table from OperatorKernels.md")
        if not rows:
            return "ONNX Runtime has no CUDA kernel for it (it would run on the CPU)"
        version = schema.since_version if schema else self.opsets.get(domain, 1)
        row = next((r for r in rows if r[0] <= version and (r[1] is None or version <= r[1])),
                   None)
        if row is None:
            return (f"its opset {version} has no CUDA kernel (they cover "
                    f"{', '.join(_span(r) for r in rows)})")
        if schema is None:
            return None
        for names, formals, what in ((node.input, schema.inputs, "input"),
                                     (node.output, schema.outputs, "output")):
            for i, name in enumerate(names):
                formal = formals[min(i, len(formals) - 1)]
                allowed = row[2].get(formal.typeStr)
                elem = self.types.get(name) if name else None
                if allowed and elem and _type_name(elem) not in allowed:
                    return (f"{what} {formal.name} is {_type_name(elem)}; its CUDA kernels take "
                            f"{', '.join(allowed)}")
        return None


# -- combinations the CUDA kernels refuse or read wrongly, beyond op and types ----------------

def _matmul_nbits(node, g, found):
    """contrib_ops/cuda/quantization/matmul_nbits.{h,cc}, cpu/quantization/matmul_nbits_helper.h"""
    a, inputs = _attrs(node), list(node.input) + [""] * 6
    bits, block = a.get("bits", 4), a.get("block_size", 0)
    if bits not in (2, 4, 8):
        return f"bits {bits}; CUDA's MatMulNBits takes 2, 4 or 8"
    if block < 16 or block & (block - 1):
        return f"block_size {block}; it must be a power of 2 of at least 16"
    if bits == 2 and (block > 256 or inputs[4]):
        return "2-bit weights take blocks of at most 256 and no g_idx on CUDA"
    zero, scales = inputs[3], inputs[2]
    if zero and g.types.get(zero) not in (TensorProto.UINT8, g.types.get(scales)):
        return (f"zero points of type {_type_name(g.types.get(zero))}; CUDA takes uint8 or the "
                "scales' type")
    if inputs[5]:
        found.needs["MatMulNBits with a bias"] = "1.28"  # earlier: "does not support bias"
    return None


def _gather_block_quantized(node, g, found):
    """contrib_ops/cuda/quantization/gather_block_quantized.{cc,cu}"""
    found.needs["GatherBlockQuantized"] = "1.23"  # 1.22 has no CUDA kernel for it
    a, dims = _attrs(node), g.dims.get(node.input[0])
    if not dims or dims[-1] is None:
        return None
    axis, block, bits = a.get("quantize_axis", 1), a.get("block_size", 128), a.get("bits", 4)
    if axis % len(dims) != len(dims) - 1:
        return f"quantize_axis {axis}; CUDA's GatherBlockQuantized takes the last axis only"
    if block < 16 or block & (block - 1):
        return f"block_size {block}; it must be a power of 2 of at least 16"
    if g.types.get(node.input[0]) != TensorProto.UINT8:
        return None
    if bits not in (2, 4, 8):
        return f"bits {bits}; uint8 data holds 2, 4 or 8"
    per_byte, row = 8 // bits, dims[-1] * (8 // bits)
    if row % block:
        return (f"rows of {row} values are not whole blocks of {block}, and CUDA reads the "
                "scales by flat block index")
    if len(node.input) > 3 and node.input[3] and (row // block) % per_byte:
        return (f"{bits}-bit zero points of rows of {row // block} blocks: CUDA reads them by "
                f"flat block index, but they are packed {per_byte} to a byte row by row, so "
                "rows would read other rows' zero points; export with --int4-scheme zp")
    return None


def _group_query_attention(node, g, found):
    """contrib_ops/cuda/bert/group_query_attention.cc and its workspace checks"""
    a = _attrs(node)
    heads, kv_heads = a.get("num_heads", 0), a.get("kv_num_heads", 0)
    if kv_heads <= 0 or heads % kv_heads:
        return f"num_heads {heads} is not a multiple of kv_num_heads {kv_heads}"
    past = g.dims.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    head_size = past[3] if past and len(past) == 4 else None
    if head_size and head_size % 8:
        return f"head size {head_size}; CUDA's GroupQueryAttention takes multiples of 8"
    return None


def _no_rule(node, g, found):
    return None


RULES = {"MatMulNBits": _matmul_nbits, "GatherBlockQuantized": _gather_block_quantized,
         "GroupQueryAttention": _group_query_attention}


# -- ONNX Runtime's schemas, and the table made from its OperatorKernels.md --------------------

@functools.cache
def _schemas() -> dict:
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state
    by_op = {}
    for s in ort_state.get_all_operator_schema():
        by_op.setdefault((_domain(s.domain), s.name), []).append(s)
    return by_op


def _schema(domain, op, opset):
    versions = [s for s in _schemas().get((domain, op), []) if s.since_version <= opset]
    return max(versions, key=lambda s: s.since_version, default=None)


def _single_type(schema, type_str):
    """The element type a formal parameter can only have (tensor(int64), or a constraint
    that allows one type), else None."""
    allowed = next((c.allowed_type_strs for c in schema.type_constraints
                    if c.type_param_str == type_str), [type_str])
    if len(allowed) != 1 or not allowed[0].startswith("tensor("):
        return None
    return TensorProto.DataType.Value(allowed[0][len("tensor("):-1].upper())


def _key(node) -> tuple:
    return _domain(node.domain), node.op_type


def _domain(domain) -> str:
    return domain if domain not in ("", "ai.onnx") else ONNX


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _type_name(elem) -> str:
    return TensorProto.DataType.Name(elem).lower() if elem else "unknown"


def _span(row) -> str:
    since, until = row[0], row[1]
    return f"{since}+" if until is None else f"{since}" if since == until else f"{since}-{until}"


def parse_operator_kernels(text: str) -> dict:
    """The CUDA rows of docs/OperatorKernels.md for EXPORT_OPS: domain -> op -> [[since,
    until or None, {constraint: [element types]}]]; [] for an op with no CUDA kernel."""
    section = text.split("## Operators implemented by CUDAExecutionProvider", 1)[1]
    section = section.split("<a name=", 1)[0]
    table, domain, op = {d: {o: [] for o in ops} for d, ops in EXPORT_OPS.items()}, None, None
    for line in section.splitlines():
        cells = line.split("|")[1:-1]
        if len(cells) != 4:
            continue
        if cells[0].startswith("**Operator Domain:**"):
            domain = cells[0].split("*")[-2]
            continue
        op = cells[0] or op
        if domain not in table or op not in table[domain]:
            continue
        since, until = _versions(cells[2])
        types = {}
        for part in cells[3].split("<br/>"):
            name, _, allowed = part.partition("=")
            types[name.strip(" *")] = re.findall(r"(?<!seq\()tensor\((\w+)\)", allowed)
        table[domain][op].append([since, until, types])
    return table


def _versions(cell):
    numbers = [int(n) for n in re.findall(r"\d+", cell)]
    if cell.endswith("+"):
        return numbers[0], None
    return numbers[0], numbers[-1]


def _table_json(release, source, rows) -> str:
    """The table as JSON, one op to a line."""
    domains = ",\n".join(f' {json.dumps(d)}: {{\n' + ",\n".join(
        f'  {json.dumps(op)}: {json.dumps(kernels)}' for op, kernels in ops.items()) + "\n }"
        for d, ops in rows.items())
    return (f'{{"release": {json.dumps(release)},\n "source": {json.dumps(source)},\n'
            f' "kernels": {{\n{domains}}}}}\n')


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m edgespec.export.cuda_ops",
                                description="Check an artifact's graphs against ONNX Runtime's "
                                "CUDA kernels, or make the table of those kernels.")
    p.add_argument("artifact", nargs="?", help="an artifact directory to check")
    p.add_argument("--table", nargs=3, metavar=("OPERATOR_KERNELS_MD", "RELEASE", "SOURCE"),
                   help=f"write {TABLE.name} from ONNX Runtime's docs/OperatorKernels.md")
    args = p.parse_args(argv)
    if args.table:
        path, release, source = args.table
        rows = parse_operator_kernels(Path(path).read_text())
        TABLE.write_text(_table_json(release, source, rows))
        print(f"wrote {TABLE}: {sum(map(len, rows.values()))} ops")
        return
    if not args.artifact:
        p.error("give an artifact directory, or --table")
    checks = check_cuda_artifact(args.artifact)
    for c in checks:
        print(f"{c.graph}: {c.nodes} nodes, {len(c.problems)} problems, {len(c.on_cpu)} kept "
              f"on the CPU by design")
        for line in c.problems:
            print(f"  problem: {line}")
        for line in c.on_cpu:
            print(f"  on the CPU: {line}")
    release, what = needed_release(checks)
    print(f"checked against {kernels()['release']}"
          + (f"; needs onnxruntime-gpu >= {release} ({what})" if release else ""))


if __name__ == "__main__":
    main()
