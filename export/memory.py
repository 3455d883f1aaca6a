"""What an export will hold in memory, estimated from the source's header before any weight
is read, and the refusal, in one line, when the machine cannot hold it.

Export builds the artifact a layer at a time (the largest single tensor sets that phase),
then loads the artifact to calibrate the draft and run the gates, beside the full-precision
reference's one decoder layer. The second phase is the peak for any model worth exporting:
it is what running the artifact takes, plus a layer.
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError

# ONNX Runtime's resident bytes per byte of artifact weights: MatMulNBits' prepacked
# layouts carry per-block sums beside the codes (DESIGN.md, Larger models), with room
RESIDENT = 1.3
# Python, torch, transformers, the tokenizer and ONNX Runtime themselves
PROCESS_BYTES = 0.8e9
# the build's working set over its largest tensor's float32 size (codes, scales, packing)
BUILD = 2.5
# bytes per weight in the artifact, by GGUF type kept as it is (int4 scheme "source"): the
# codes at 4 or 8 bits, float32 scales and zero points per block of 32 (Q6_K: 16), and the
# residual block sums of the types with a minimum
SOURCE_BYTES = {"Q4_0": 0.64, "Q4_1": 0.66, "Q4_K": 0.66, "Q5_0": 1.16, "Q5_1": 1.19,
                "Q5_K": 1.19, "Q8_0": 1.16, "Q6_K": 1.31, "F32": 4.0, "F16": 4.0, "BF16": 4.0}
# ... and by precision where the weights are quantized anew
PRECISION_BYTES = {"int4": 0.64, "int8": 1.16, "fp16": 2.0, "fp32": 4.0}
GB = 1e9
# the longest context calibration and the gates run an engine at (short texts; the quality
# passage), so theirs is the KV cache the peak holds, not the artifact's
MEASURED_CONTEXT = 1024


@dataclass
class Estimate:
    artifact: int   # the artifact's weights on disk
    running: int    # the artifact loaded, a short sequence's KV cache, a reference layer, the process
    build: int      # building the graphs
    source: int     # the source's weights held in memory (a GGUF is read a tensor at a time)

    @property
    def peak(self) -> int:
        return self.source + max(self.running, self.build)

    def describe(self) -> str:
        return (f"memory: about {size(self.peak)} at the peak (the {size(self.artifact)} "
                "artifact loaded for calibration and the gates"
                + (f", the source's {size(self.source)} of float weights"
                   if self.source else "") + ")")


def size(n) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def estimate(source, precision, int4_scheme, max_context) -> Estimate:
    """The export's memory, from the shapes and types of the source's tensors."""
    a, sizes = source.arch, tensor_sizes(source.weights)
    types = tensor_types(source.weights) if int4_scheme == "source" else {}
    artifact = sum(n * (SOURCE_BYTES.get(types.get(name), PRECISION_BYTES[precision])
                        if name.endswith(".weight") and "norm" not in name else 4)
                   for name, n in sizes.items())
    kv = 2 * a.num_layers * a.num_kv_heads * (min(max_context, MEASURED_CONTEXT) + 1) * \
        a.head_dim * 4
    layer = 4 * sum(n for name, n in sizes.items() if name.startswith("model.layers.0."))
    return Estimate(artifact=int(artifact),
                    running=int(RESIDENT * artifact + kv + 4 * max_context * a.hidden_size
                                + layer + PROCESS_BYTES),
                    build=int(BUILD * 4 * max(sizes.values()) + PROCESS_BYTES),
                    source=0 if hasattr(source.weights, "shape") else 4 * sum(sizes.values()))


def tensor_sizes(weights) -> dict:
    """Parameter name -> number of values, without reading any (a GGUF or safetensors
    source), or of the arrays given."""
    shape = getattr(weights, "shape", lambda name: np.shape(weights[name]))
    return {name: int(np.prod(shape(name))) for name in weights}


def tensor_types(weights) -> dict:
    """Parameter name -> its GGUF type's name ({} for other sources)."""
    if not hasattr(weights, "type_name"):
        return {}
    return {name: weights.type_name(name) for name in weights}


def available_bytes() -> int:
    """Memory this process can take now: the system's available memory, or less under a
    control group's limit."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            available = min(available, int(text))
    return available


def check_fits(need: Estimate, limit_gb=None, log=print):
    """Refuse an export whose estimated peak is above `limit_gb` (default: the memory
    available now), before anything is built."""
    limit = limit_gb * GB if limit_gb is not None else available_bytes()
    log(need.describe() + f"; {size(limit)} " +
        ("allowed (--max-memory)" if limit_gb is not None else "available"))
    if need.peak <= limit:
        return
    fix = ("save the checkpoint as safetensors: they are read a tensor at a time" if need.source else
           "free memory or export on a machine with more: running the artifact needs about "
           f"{size(need.running - PROCESS_BYTES)}, its weights and a short sequence's KV "
           "cache")
    allowed = "are allowed" if limit_gb is not None else "are available"
    raise EdgespecError(f"this export needs about {size(need.peak)} of memory and "
                        f"{size(limit)} {allowed}; {fix}")
