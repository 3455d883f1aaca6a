"""`edgespec export`: source model -> quantized lower/upper/head artifact directory."""
import contextlib
import shutil
import time
from collections import ChainMap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from edgespec import __version__
from edgespec.engine import cuda_problem, return_freed_memory, set_threads
from edgespec.errors import EdgespecError

from edgespec.artifact import BATCH_SIZES, DRAFT_VOCAB

from . import cuda_ops, fidelity, memory, quality
from .calibrate import ADAPTIVE, calibrate_draft, instructions, round_costs
from . import graph
from .gptq import quantize_layers
from .graph import ACCURACY_LEVEL, Blocks, build_draft, build_head, build_lower, build_upper
from .progress import progress
from .quantize import BLOCK, INT4_SCHEMES
from .source import load_source
from .writer import WeightFiles, write_graphs, write_manifest, write_tokenizer

PRECISIONS = ("auto", "int4", "int8", "fp16", "fp32")
# int4 follows these too loosely on the quality gate (top-1 against the float model on the
# quality passage), int8 closely (DESIGN.md has the numbers)
INT8_BY_DEFAULT = ("gemma3",)
# their residual stream passes float16's range (65504): float16 exports keep it in float32
FP32_RESIDUAL = ("gemma3",)
HEAD_BITS = (8, 4, "mixed")
DEFAULT_MAX_CONTEXT = 4096
DEFAULT_ADAPTER_MINUTES = 8.0
DEFAULT_CALIBRATION_MINUTES = 5.0
DEFAULT_HEAD_BITS = "mixed"
FIDELITY_MINUTES = 10  # the fidelity gate's budget: a large model answers fewer questions


def default_exit_layer(num_layers: int) -> int:
    """Three quarters of the depth, when calibration does not choose (DESIGN.md)."""
    return max(1, min(num_layers - 1, round(num_layers * 3 / 4)))


def default_precision(arch) -> str:
    """What --precision auto means for this architecture."""
    return "int8" if arch.model_type in INT8_BY_DEFAULT else "int4"


def check_formats(precision, device, int4_scheme, head_bits):
    """The options that need no model: checked before minutes are spent loading one."""
    if precision not in PRECISIONS:
        raise EdgespecError(f"unknown precision {precision}; choose one of {', '.join(PRECISIONS)}")
    if int4_scheme not in ("auto", *INT4_SCHEMES):
        raise EdgespecError(f"unknown int4 scheme {int4_scheme}; choose one of "
                            f"auto, {', '.join(INT4_SCHEMES)}")
    if int4_scheme == "source" and precision not in ("auto", "int4"):
        raise EdgespecError(f"--int4-scheme source keeps a GGUF's grids, which --precision "
                            f"{precision} would re-round; drop one of them")
    if head_bits not in HEAD_BITS:
        raise EdgespecError(f"unsupported head bits {head_bits}; choose 8, 4 or mixed")
    if device not in ("cpu", "cuda"):
        raise EdgespecError(f"unknown device {device}; choose cpu or cuda")


def check_options(arch, exit_layer, max_context, precision):
    if precision in ("int4", "int8"):
        inputs = {"hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
                  "num_heads * head_dim": arch.num_heads * arch.head_dim}
        for name, size in inputs.items():
            if size % BLOCK:
                raise EdgespecError(f"{precision} needs layer inputs in blocks of {BLOCK}, but the "
                                    f"model's {name} is {size}; export with --precision fp16")
    if not 1 <= exit_layer < arch.num_layers:
        raise EdgespecError(f"exit layer {exit_layer} is out of range; the model has "
                            f"{arch.num_layers} layers, so choose 1..{arch.num_layers - 1}")
    if not 16 <= max_context <= arch.max_position_embeddings:
        raise EdgespecError(f"max context {max_context} is out of range; choose 16.."
                            f"{arch.max_position_embeddings} (the model's limit)")


def export_model(model=None, out=None, exit_layer=None, precision="auto", max_context=None,
                 device="cpu", adapter=None, shortlist=None, calibrate=False,
                 adapter_minutes=DEFAULT_ADAPTER_MINUTES, save_adapter=None, int4_scheme="auto",
                 head_bits=DEFAULT_HEAD_BITS, calibration_minutes=DEFAULT_CALIBRATION_MINUTES,
                 gptq=True, threads=None, max_memory=None, log=print):
    """Export MODEL (None: the bundled SmolLM2) and return the manifest written.

    exit_layer: a layer number, None (3/4 of the depth) or "auto" (chosen by measured speed
    among a few candidates). adapter: None (raw early exit), "auto" (the shipped adapter
    for this model, else train one), "train", or an adapter file. shortlist: None (full
    vocabulary for the draft head), a size, or "auto". calibrate: measure the draft policy
    (k, threshold, lookup) on the artifact and make the best the default, within
    calibration_minutes (how much is measured and whether an "auto" adapter is trained is
    sized to it; adapter_minutes caps the training). save_adapter: keep
    the adapter used in this file (fp16) for later exports. int4_scheme: "source" (a
    quantized GGUF's own grids, kept), "zp" (weights re-rounded to 4-bit zero points) or
    "auto" (source for a quantized GGUF, else zp); head_bits: 8, 4 or "mixed" (the most used
    tokens at 8 bits, the rest at 4) for the vocabulary table of zp artifacts. gptq: choose the zp int4 weights of the
    decoder layers and the table's 4-bit rows by GPTQ on calibration text (export/gptq.py),
    else round each on its own. threads: the CPU threads calibration and the round costs
    are measured at (default: what the runtime uses on this machine); the manifest records
    them. max_memory: GB the export may take (default: what is available); an export whose
    estimated peak is above it is refused before anything is built."""
    start = time.perf_counter()
    check_formats(precision, device, int4_scheme, head_bits)
    set_threads(threads)  # the process's one pool: every measurement runs on it
    log(f"reading {model or 'the bundled SmolLM2-135M-Instruct'} ...")
    source = load_source(model)
    log(f"read {source.arch.model_type}: {source.arch.num_layers} layers, hidden "
        f"{source.arch.hidden_size}, vocabulary {source.arch.vocab_size}"
        f"{_tensor_types(source)} in {time.perf_counter() - start:.0f} s")
    int4_scheme = _int4_scheme(source, int4_scheme, precision)
    plan = _plan(source, out, exit_layer, precision, max_context, device, adapter,
                 int4_scheme, log)
    memory.check_fits(memory.estimate(source, plan.precision, int4_scheme, plan.max_context),
                      max_memory, log)
    runs_here = _runs_here(plan, shortlist, log)
    with _staged(plan.out) as partial:
        artifact = _build(source, plan, partial, int4_scheme,
                          8 if plan.precision == "int8" else head_bits, gptq, log)
        if not runs_here or (plan.adapter is None and shortlist is None and not calibrate
                             and not plan.auto):
            artifact.write(plan.exit_layer, ADAPTIVE)
        else:
            calibrate_draft(artifact, plan.exit_layer, plan.auto, plan.adapter, shortlist,
                            calibrate, adapter_minutes, calibration_minutes, save_adapter, log)
        artifact.release()
        if runs_here:
            _measure(artifact, source, partial, plan, log)
        manifest = artifact.finish(time.perf_counter() - start)
    _summary(plan.out, manifest, time.perf_counter() - start, log)
    return manifest


@dataclass
class _Plan:
    """What an export makes, its options resolved against the model."""
    precision: str
    exit_layer: int
    auto: bool          # the exit layer is calibration's to choose
    max_context: int
    device: str
    dtype: type         # activations: fp32 on CPU (fast int4 kernels), fp16 on CUDA (its
    #                     GroupQueryAttention needs it)
    residual_dtype: type  # the residual stream's: dtype's, or fp32 where it overflows fp16
    adapter: object
    out: Path


def _int4_scheme(source, int4_scheme, precision) -> str:
    """auto: keep a quantized GGUF's own grids (answers as the file's model gives them), else
    zero points; "source" needs such a file."""
    quantized = getattr(source.weights, "quantized_types", lambda: [])()
    if int4_scheme == "auto":
        return "source" if quantized and precision in ("auto", "int4") else "zp"
    if int4_scheme == "source" and not quantized:
        raise EdgespecError(f"--int4-scheme source keeps a quantized GGUF's grids, but "
                            f"{source.origin} has none; use --int4-scheme zp")
    return int4_scheme


def _plan(source, out, exit_layer, precision, max_context, device, adapter, int4_scheme,
          log) -> _Plan:
    arch = source.arch
    if adapter is not None and arch.sandwich_norms:
        log(f"no exit adapter for {arch.model_type}: the adapter is a Llama block; the draft "
            "exits raw")
        adapter = None
    if precision == "auto" and int4_scheme == "source":
        precision = "int4"  # the file's own grids: 4-bit codes at 4 bits, 5 to 8 at 8
    if precision == "auto":
        precision = default_precision(arch)
        if precision != "int4":
            log(f"precision {precision}: int4 follows {arch.model_type} too loosely "
                "(--precision int4 to override)")
    auto = exit_layer == "auto"
    exit_layer = default_exit_layer(arch.num_layers) if exit_layer in (None, "auto") else exit_layer
    max_context = max_context or min(DEFAULT_MAX_CONTEXT, arch.max_position_embeddings)
    check_options(arch, exit_layer, max_context, precision)
    suffix = f"-{precision}" if precision in ("fp16", "fp32") else ""
    dtype = np.float16 if device == "cuda" else np.float32
    residual_dtype = np.float32 if arch.model_type in FP32_RESIDUAL else dtype
    if residual_dtype != dtype:
        log(f"float16 activations with the residual stream in float32: {arch.model_type}'s "
            "passes float16's range")
    return _Plan(precision, exit_layer, auto, max_context, device, dtype, residual_dtype,
                 adapter, Path(out or Path("models") / (source.name + suffix)))


@contextlib.contextmanager
def _staged(out: Path):
    """A directory to write the artifact in, renamed to `out` only when all of it is there:
    an error or Ctrl-C leaves no half-written artifact behind and `out` untouched."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def _build(source, plan, partial, int4_scheme, head_bits, gptq, log) -> "ArtifactBuilder":
    """Quantize the weights (GPTQ where it applies) and start the artifact."""
    # a ChainMap: the exit adapter's weights join the model's without writing into them
    # (a GGUF's are read-only, dequantized on lookup)
    source_grid = source.weights.quantized if int4_scheme == "source" else None
    blocks = Blocks(source.arch, ChainMap({}, source.weights), plan.precision,
                    plan.max_context, head_bits, source_grid, plan.residual_dtype)
    gptq = gptq and plan.precision == "int4" and int4_scheme == "zp"
    if gptq:
        quantize_layers(blocks, source, instructions()[0], log)
        return_freed_memory()  # the reference model's pass
    return ArtifactBuilder(source, blocks, partial, plan.dtype, {
        "source": {"model": source.origin, "sha256": source.sha256},
        "architecture": source.arch.to_dict(),
        "precision": plan.precision,
        "activation_dtype": np.dtype(plan.dtype).name,
        "residual_dtype": np.dtype(plan.residual_dtype).name,
        "device": plan.device,
        "max_context": plan.max_context,
        "eos_token_ids": source.eos_token_ids,
        "bos_token_id": source.bos_token_id,
        "chat_template": "chat_template.jinja",
        **({"sampling": source.sampling} if source.sampling else {}),
        "build": {"edgespec": __version__, "int4_block_size": BLOCK, "int4_gptq": gptq,
                  "int4_accuracy_level": ACCURACY_LEVEL, "int4_scheme": int4_scheme,
                  **({"source_types": source.weights.quantized_types()}
                     if int4_scheme == "source" else
                     {"head_bits": head_bits, **({"head_8bit_tokens": graph.FREQUENT_TOKENS}
                                                 if head_bits == "mixed" else {})})},
    })


def _runs_here(plan, shortlist, log) -> bool:
    """Whether the artifact can run on this machine's device, so that export measures it
    there. When not (a CUDA export without CUDA), what only running it chooses keeps its
    default, and what only running it can make is refused before anything is built."""
    problem = cuda_problem() if plan.device == "cuda" else None
    if not problem:
        return True
    asked = [flag for flag, given in (("--adapter", plan.adapter not in (None, "auto")),
                                      ("--shortlist", shortlist not in (None, "auto"))) if given]
    if asked:
        raise EdgespecError(f"{' and '.join(asked)} run the artifact to make its draft, and "
                            f"{problem}: export on the machine with the GPU, or drop them")
    log(f"{problem}: calibration, the round costs and the quality and fidelity gates run the "
        f"artifact on its device, so they are skipped (exit layer {plan.exit_layer}, the "
        "adaptive draft policy); export on the machine with the GPU to measure them")
    plan.auto, plan.adapter = False, None
    return False


def _measure(artifact, source, partial, plan, log):
    """Round costs by rows on the artifact's device, and the quality and fidelity gates,
    into the manifest's fields."""
    log("measuring what verifying more rows at once costs here ...")
    costs = round_costs(partial)
    if plan.device != "cpu":
        log("batch round costs: several sequences at once decode on the CPU provider only; "
            "not measured")
    artifact.fields.update(costs)
    return_freed_memory()  # each phase's sessions and passes, before the next's
    log("measuring quality against the full-precision model ...")
    artifact.fields["quality"] = quality.measure(source, partial, plan.max_context)
    return_freed_memory()
    log("measuring fidelity: greedy answers against the full-precision model's ...")
    gate = fidelity.measure(source, partial, plan.max_context, FIDELITY_MINUTES * 60)
    if gate:
        artifact.fields["fidelity"] = gate


class ArtifactBuilder:
    """Writes (and rewrites, while calibration tries exit layers and drafts) one artifact.
    Weights go to disk as each graph is built (WeightFiles): memory holds a layer's."""

    def __init__(self, source, blocks, out, dtype, fields):
        self.source, self.blocks, self.out, self.dtype, self.fields = source, blocks, out, dtype, fields
        self.files, self.exit_layer, self.extra = WeightFiles(out), None, {}
        write_tokenizer(source, out)

    def write(self, exit_layer, draft, adapter=None, vocab=None, with_draft=False):
        """Write the graphs for `exit_layer` (and the draft graph) and the manifest."""
        blocks, arch = self.blocks, self.blocks.arch
        if exit_layer != self.exit_layer:
            self.files.clear()
            # each layer's weights are dequantized, quantized and written in turn, once for
            # the graph of one sequence and its batch graphs (the same weights)
            slot_counts = (1, *BATCH_SIZES)
            with progress(arch.num_layers + 1, f"building {blocks.precision} graphs (exit layer "
                          f"{exit_layer}): layers + head", unit="layer") as bar:
                blocks.on_layer = lambda: bar.update(1)
                graphs = (build_lower(blocks, exit_layer, self.dtype, slot_counts, self.files)
                          + build_upper(blocks, exit_layer, self.dtype, slot_counts, self.files)
                          + [build_head(blocks, self.dtype, self.files)])
                bar.update(1)
            blocks.on_layer = lambda: None
            write_graphs(graphs, self.out)
            self.exit_layer = exit_layer
        self.files.drop({"draft.data"})
        for name in (DRAFT_VOCAB, "draft.onnx"):
            (self.out / name).unlink(missing_ok=True)
        self.extra.pop("draft_graph", None)
        if with_draft:
            self.extra["draft_graph"] = {"adapter": adapter is not None, "vocab": arch.vocab_size
                                         if vocab is None else len(vocab)}
            if adapter is not None:
                n = arch.num_layers  # the adapter is stored as one more decoder layer
                blocks.w.update({f"model.layers.{n}.{k}": w for k, w in adapter.items()})
            write_graphs([build_draft(blocks, adapter is not None, vocab, self.dtype,
                                      self.files)], self.out)
            np.save(self.out / DRAFT_VOCAB, np.arange(arch.vocab_size) if vocab is None
                    else np.asarray(vocab, np.int64))
        if self.fields["device"] == "cuda":  # refused before anything is measured on it
            cuda_ops.require_cuda_kernels(self.out)
        self.fields.update(exit_layer=exit_layer, draft=draft)
        return write_manifest(self.out, {**self.fields, **self.extra})

    def release(self):
        """Drop the weights kept for rebuilding graphs: they are on disk now."""
        self.blocks.release()
        return_freed_memory()

    def finish(self, seconds):
        self.fields["build"]["seconds"] = round(seconds, 1)
        return write_manifest(self.out, {**self.fields, **self.extra})


def _tensor_types(source) -> str:
    gguf = getattr(source.weights, "gguf", None)
    if gguf is None:
        return ""
    return "; GGUF tensors " + ", ".join(f"{kind} {n}" for kind, n in gguf.type_counts().items())


def _scheme_line(manifest) -> str:
    build = manifest["build"]
    if build["int4_scheme"] == "source":
        return (f"  int4 scheme source: the GGUF's own grids ({', '.join(build['source_types'])}),"
                " so replies follow the file's model\n")
    return ("  int4 scheme zp: weights rounded to 4-bit zero points (a GGUF's grids are not "
            "kept: its fidelity below)\n")


def _fidelity_line(f) -> str:
    if not f:
        return ""
    if not f["questions"]:
        return (f"  fidelity: no question measured; the full-precision model's replies took "
                f"{f['reference_rounds']} rounds and did not finish within the gate's "
                f"{FIDELITY_MINUTES} minutes (the artifact drafts them: it agrees little)\n")
    return (f"  fidelity on short questions: first 16 greedy tokens equal to the full-precision "
            f"model's on {f['first16_equal']} of {f['questions']}, teacher-forced top-1 "
            f"{f['top1_agreement']:.3f}, right answers {f['right']} (full precision "
            f"{f['reference_right']})"
            + (f"; {f['left_out']} questions left out to fit the gate's {FIDELITY_MINUTES} "
               "minutes" if f.get("left_out") else "") + "\n")


def _summary(out, manifest, seconds, log):
    arch, files = manifest["architecture"], manifest["files"]
    sizes = "  ".join(f"{name} {files[name]['bytes'] / 1e6:.1f} MB" for name in
                      ("lower.data", "upper.data", "head.data") if name in files)
    shared = " (head reads the tied embedding table stored in lower.data)" \
        if arch["tie_word_embeddings"] else ""
    draft, graph, q = manifest["draft"], manifest.get("draft_graph", {}), manifest.get("quality")
    f = manifest.get("fidelity")
    drafter = "exit adapter" if graph.get("adapter") else "raw exit"
    speed = [r["speedup"] for r in draft.get("calibration", {}).get("policies", [])]
    log(f"exported {out}: {arch['model_type']}, {arch['num_layers']} layers, exit layer "
        f"{manifest['exit_layer']}, {manifest['precision']}, context {manifest['max_context']}\n"
        f"  weights, each stored once: {sizes}{shared}\n"
        + (_scheme_line(manifest) if manifest["precision"] == "int4" else "") +
        f"  draft: {drafter}, head over {graph.get('vocab', arch['vocab_size'])} tokens; policy k "
        f"{draft['k']}, threshold {draft['threshold']}, lookup k {draft.get('lookup_k', 0)}, "
        f"{'adaptive' if draft.get('adaptive') else 'fixed'}"
        + (f"; measured {max(speed):.2f}x plain on the calibration prompts" if speed else "")
        + "\n"
        + (f"  a round of M rows costs (plain steps, {manifest['threads']} threads): " + ", ".join(
            f"{rows}: {cost:.2f}" for rows, cost in manifest["round_costs"].items()) + "\n"
           if "round_costs" in manifest else "") +
        (f"  quality on a fixed {q['tokens']}-token text: top-1 agreement "
         f"{q['top1_agreement']:.3f} with the full-precision model, perplexity "
         f"{q['perplexity']:.2f} (full precision {q['reference_perplexity']:.2f})\n" if q else
         "  quality and fidelity: not measured (the artifact's device is not here)\n")
        + _fidelity_line(f) +
        f"  total {sum(f['bytes'] for f in files.values()) / 1e6:.1f} MB in {seconds:.0f} s")
