"""`edgespec export`: source model -> quantized lower/upper/head artifact directory."""
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edgespec import __version__
from edgespec.errors import EdgespecError

from .graph import ACCURACY_LEVEL, Blocks, build_head, build_lower, build_upper
from .quantize import BLOCK
from .source import load_source
from .writer import write_graphs, write_manifest, write_tokenizer

PRECISIONS = ("int4", "fp16", "fp32")
DEFAULT_MAX_CONTEXT = 4096
DEFAULT_DRAFT_K = 4  # until calibration measures a better policy


def default_exit_layer(num_layers: int) -> int:
    """Three quarters of the depth until calibration chooses (DESIGN.md)."""
    return max(1, min(num_layers - 1, round(num_layers * 3 / 4)))


def check_options(arch, exit_layer, precision, max_context, device):
    if precision not in PRECISIONS:
        raise EdgespecError(f"unknown precision {precision}; choose one of {', '.join(PRECISIONS)}")
    if device not in ("cpu", "cuda"):
        raise EdgespecError(f"unknown device {device}; choose cpu or cuda")
    if not 1 <= exit_layer < arch.num_layers:
        raise EdgespecError(f"exit layer {exit_layer} is out of range; the model has "
                            f"{arch.num_layers} layers, so choose 1..{arch.num_layers - 1}")
    if not 16 <= max_context <= arch.max_position_embeddings:
        raise EdgespecError(f"max context {max_context} is out of range; choose 16.."
                            f"{arch.max_position_embeddings} (the model's limit)")


def export_model(model=None, out=None, exit_layer=None, precision="int4", max_context=None,
                 device="cpu", log=print):
    """Export MODEL (None: the bundled SmolLM2) and return the manifest written."""
    start = time.perf_counter()
    log(f"reading {model or 'the bundled SmolLM2-135M-Instruct'} ...")
    source = load_source(model)
    arch = source.arch
    exit_layer = default_exit_layer(arch.num_layers) if exit_layer is None else exit_layer
    max_context = max_context or min(DEFAULT_MAX_CONTEXT, arch.max_position_embeddings)
    check_options(arch, exit_layer, precision, max_context, device)
    out = Path(out or Path("models") / (source.name + ("" if precision == "int4" else f"-{precision}")))
    # activations: fp32 on CPU (fast int4 kernels), fp16 on CUDA (GroupQueryAttention needs it)
    dtype = np.float16 if device == "cuda" else np.float32

    blocks = Blocks(arch, source.weights, precision, max_context)
    with tqdm(total=arch.num_layers + 1, desc=f"building {precision} graphs", unit="layer") as bar:
        blocks.on_layer = lambda: bar.update(1)
        graphs = [build_lower(blocks, exit_layer, dtype), build_upper(blocks, exit_layer, dtype),
                  build_head(blocks, dtype)]
        bar.update(1)

    partial = out.with_name(out.name + ".partial")  # a failed export leaves `out` untouched
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_graphs(graphs, partial)
    write_tokenizer(source, partial)
    manifest = write_manifest(partial, {
        "source": {"model": source.origin, "sha256": source.sha256},
        "architecture": arch.to_dict(),
        "exit_layer": exit_layer,
        "draft": {"k": DEFAULT_DRAFT_K, "threshold": 0.0},
        "precision": precision,
        "activation_dtype": np.dtype(dtype).name,
        "device": device,
        "max_context": max_context,
        "eos_token_ids": source.eos_token_ids,
        "bos_token_id": source.bos_token_id,
        "chat_template": "chat_template.jinja",
        "build": {"edgespec": __version__, "int4_block_size": BLOCK, "int4_accuracy_level": ACCURACY_LEVEL,
                  "seconds": round(time.perf_counter() - start, 1)},
    })
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    _summary(out, manifest, time.perf_counter() - start, log)
    return manifest


def _summary(out, manifest, seconds, log):
    arch, files = manifest["architecture"], manifest["files"]
    sizes = "  ".join(f"{name} {files[name]['bytes'] / 1e6:.1f} MB" for name in
                      ("lower.data", "upper.data", "head.data") if name in files)
    shared = " (head reads the tied embedding table stored in lower.data)" \
        if arch["tie_word_embeddings"] else ""
    log(f"exported {out}: {arch['model_type']}, {arch['num_layers']} layers, exit layer "
        f"{manifest['exit_layer']}, {manifest['precision']}, context {manifest['max_context']}\n"
        f"  weights, each stored once: {sizes}{shared}\n"
        f"  total {sum(f['bytes'] for f in files.values()) / 1e6:.1f} MB in {seconds:.0f} s")
