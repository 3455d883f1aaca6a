"""What is on disk: an exported artifact directory, checked before anything runs."""
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EdgespecError, is_int, is_number
from .sampling import CHAT_DEFAULTS, SAMPLING_FIELDS, SamplingParams

FORMAT_VERSION = 3  # 2: attention pad rows (engine.py), int4 zero points; 3: batch graphs
MANIFEST = "manifest.json"
GRAPHS = ("lower", "upper", "head")
BATCH_GRAPHS = ("lower", "upper")  # each also as lower_x{slots}: that many sequences at once
BATCH_SIZES = (2, 4, 8)
DRAFT_GRAPH, DRAFT_VOCAB = "draft", "draft_vocab.npy"  # optional: exit adapter, shortlist
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ARCH_NUMBERS = ("vocab_size", "hidden_size", "num_layers", "num_kv_heads", "head_dim")
PAD_ROWS = 1  # zero rows each graph appends to its attention calls (engine.py says why)
MAX_CONTEXT = 1 << 20  # beyond this a KV cache is too large for any device edgespec targets
CHOICES = {"device": ("cpu", "cuda"), "activation_dtype": ("float32", "float16"),  # optional
           "residual_dtype": ("float32", "float16")}
DRAFT_POLICY = {"k": int, "lookup_k": int, "threshold": (int, float), "adaptive": bool}


@dataclass
class Artifact:
    path: Path
    manifest: dict
    _draft_vocab: np.ndarray = None

    @property
    def arch(self) -> dict:
        return self.manifest["architecture"]

    @property
    def exit_layer(self) -> int:
        return self.manifest["exit_layer"]

    @property
    def sampling(self) -> SamplingParams:
        """What replies sample with unless told otherwise: the source model's recommended
        settings (recorded at export), else the chat defaults."""
        if "sampling" not in self.manifest:
            return CHAT_DEFAULTS
        return SamplingParams(**self.manifest["sampling"])

    @property
    def max_context(self) -> int:
        return self.manifest["max_context"]

    @property
    def eos_token_ids(self) -> list:
        return self.manifest["eos_token_ids"]

    @property
    def graphs(self) -> tuple:
        """The graphs to load: the three always, the draft graph when export made one."""
        return _graphs(self.manifest["files"])

    def graph(self, name: str) -> Path:
        return self.path / f"{name}.onnx"

    def batch_graph(self, name: str, slots: int) -> Path:
        """The graph that runs `name`'s layers for `slots` sequences at once (their weights
        are the single-sequence graph's)."""
        return self.graph(batch_name(name, slots))

    def draft_vocab(self):
        """Token ids of the draft graph's shortlisted head (its logit i is token ids[i]),
        checked against the vocabulary when the artifact is opened; None without a draft graph."""
        return self._draft_vocab


def batch_name(graph: str, slots: int) -> str:
    """The name of a graph that runs `slots` sequences at once (1: the graph itself)."""
    return graph if slots == 1 else f"{graph}_x{slots}"


def _graphs(files) -> tuple:
    return GRAPHS + ((DRAFT_GRAPH,) if f"{DRAFT_GRAPH}.onnx" in files else ())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_artifact(path, verify: bool = True) -> Artifact:
    """Read the manifest and check every file it lists (sizes always, sha256 if verify)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        what = "does not exist" if not path.exists() else f"has no {MANIFEST}"
        raise EdgespecError(f"artifact {path} {what}; create one with `edgespec export`")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgespecError(f"{path / MANIFEST} is corrupt ({e}); export the model again") from e
    problem = _Problem(path / MANIFEST)
    if not isinstance(manifest, dict):
        raise problem(f"holds {_shown(manifest)}, not a JSON object")
    version = problem.field(manifest, "format_version")
    problem.require(is_int(version, 0), "format_version", version,
                    f"the integer {FORMAT_VERSION}")
    if version != FORMAT_VERSION:
        raise EdgespecError(f"{path} has artifact format version {version}, this edgespec "
                            f"reads version {FORMAT_VERSION}; export the model again")
    _check_manifest(manifest, problem)
    for name, info in manifest["files"].items():
        _check_file(path, name, info, verify)
    artifact = Artifact(path, manifest)
    if DRAFT_VOCAB in manifest["files"]:
        artifact._draft_vocab = _load_draft_vocab(path / DRAFT_VOCAB, manifest)
    return artifact


class _Problem:
    """Makes the one-line error for a manifest field that is missing or wrong."""

    def __init__(self, manifest_path):
        self.where = manifest_path

    def __call__(self, what) -> EdgespecError:
        return EdgespecError(f"{self.where} {what}; export the model again")

    def field(self, fields, key, prefix=""):
        if not isinstance(fields, dict) or key not in fields:
            raise self(f"has no {prefix}{key}")
        return fields[key]

    def require(self, ok, name, value, expected):
        if not ok:
            raise self(f"says {name} is {_shown(value)}; it must be {expected}")


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_positive(value) -> bool:
    return is_number(value) and value > 0


def _check_manifest(manifest, problem):
    """Every field the runtime reads is there and of the right kind, checked once on open so
    that the engine, the tokenizer and the model can index the manifest without guarding."""
    arch = problem.field(manifest, "architecture")
    for key in ARCH_NUMBERS:
        value = problem.field(arch, key, "architecture.")
        problem.require(is_int(value, 1), f"architecture.{key}", value, "an integer >= 1")
    head_dim = arch["head_dim"]  # rotary embeddings turn pairs of dimensions
    problem.require(head_dim % 2 == 0, "architecture.head_dim", head_dim, "an even integer")
    layers, vocab = arch["num_layers"], arch["vocab_size"]
    exit_layer = problem.field(manifest, "exit_layer")
    problem.require(is_int(exit_layer, 1, layers), "exit_layer", exit_layer,
                    f"an integer in 1..{layers - 1}")
    context = problem.field(manifest, "max_context")
    problem.require(is_int(context, 2, MAX_CONTEXT + 1), "max_context", context,
                    f"an integer in 2..{MAX_CONTEXT} (export with a smaller --max-context)")
    eos = problem.field(manifest, "eos_token_ids")
    problem.require(isinstance(eos, list) and all(is_int(t, 0, vocab) for t in eos),
                    "eos_token_ids", eos, f"a list of token ids in 0..{vocab - 1}")
    for key, choices in CHOICES.items():
        if key in manifest:
            problem.require(manifest[key] in choices, key, manifest[key], " or ".join(choices))
    _check_draft_policy(manifest.get("draft", {}), problem)
    _check_sampling(manifest.get("sampling", {}), problem)
    costs = manifest.get("round_costs", {"1": 1.0})
    problem.require(isinstance(costs, dict) and "1" in costs and all(
        k.isdigit() and int(k) >= 1 and _is_positive(v) for k, v in costs.items()),
        "round_costs", costs,
        'an object of row counts ("1", "2", ...) to positive numbers, "1" among them')
    problem.require(is_int(manifest.get("threads", 1), 1, 4096), "threads",
                    manifest.get("threads"), "an integer in 1..4096")
    batches = manifest.get("batch_round_costs", {})
    problem.require(isinstance(batches, dict) and all(
        k in map(str, BATCH_SIZES) and isinstance(v, dict) and v and all(
            r.isdigit() and _is_positive(c) for r, c in v.items())
        for k, v in batches.items()), "batch_round_costs", batches,
        f'an object of batch sizes ({", ".join(map(str, BATCH_SIZES))}) to objects of row '
        'counts to positive numbers')
    graph = manifest.get("draft_graph", {})
    problem.require(isinstance(graph, dict) and is_int(graph.get("vocab", 1), 1),
                    "draft_graph", graph, '{"vocab": an integer >= 1}')
    _check_file_list(manifest, problem)


def _check_draft_policy(draft, problem):
    problem.require(isinstance(draft, dict), "draft", draft, "an object")
    for key, kind in DRAFT_POLICY.items():
        if key in draft:  # ranges are DraftPolicy's to check
            value = draft[key]
            problem.require(isinstance(value, kind) and (kind is bool or not isinstance(
                value, bool)), f"draft.{key}", value, f"of type {_kind_name(kind)}")


def _check_sampling(sampling, problem):
    problem.require(isinstance(sampling, dict) and set(sampling) <= set(SAMPLING_FIELDS),
                    "sampling", sampling, f"an object of {', '.join(SAMPLING_FIELDS)}")
    try:
        SamplingParams(**sampling)
    except EdgespecError as e:
        raise problem(f"sampling: {e}") from None


def _kind_name(kind) -> str:
    return {int: "integer", bool: "boolean"}.get(kind, "number")


def _check_file_list(manifest, problem):
    """Plain names inside the artifact, each with a size and a sha256, and among them every
    file the runtime reads."""
    files = problem.field(manifest, "files")
    problem.require(isinstance(files, dict), "files", files, "an object")
    for name, info in files.items():
        if not _plain_name(name):
            raise problem(f"lists the file name {name!r}: a file name must be a plain name "
                          "inside the artifact (no separators, no .., not absolute)")
        problem.require(isinstance(info, dict) and is_int(info.get("bytes"), 0) and
                        re.fullmatch("[0-9a-f]{64}", str(info.get("sha256"))) is not None,
                        f"files[{name!r}]", info, '{"bytes": an integer, "sha256": 64 hex digits}')
    template = problem.field(manifest, "chat_template")
    problem.require(isinstance(template, str), "chat_template", template, "a file name")
    graphs = _graphs(files)
    required = [f"{g}.{ext}" for g in graphs for ext in ("onnx", "data")] + \
        [f"{batch_name(g, slots)}.onnx" for g in BATCH_GRAPHS for slots in BATCH_SIZES] + \
        list(TOKENIZER_FILES) + ([DRAFT_VOCAB] if DRAFT_GRAPH in graphs else [])
    for name in required:
        if name not in files:
            raise problem(f"does not list {name}")
    if template not in files:
        raise problem(f"does not list {template} (its chat_template)")


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and \
        not Path(name).is_absolute()


def _check_file(artifact: Path, name: str, info: dict, verify: bool):
    file = artifact / name  # a plain name (_check_file_list): only a link can lead out
    if file.is_symlink():
        raise EdgespecError(f"{file} is a symbolic link (to {os.readlink(file)}); an "
                            "artifact's files must be plain files inside it: replace the link "
                            "with a copy of the file, or export the model again")
    if not file.is_file():
        raise EdgespecError(f"{file} is missing; export the model again")
    if file.stat().st_size != info["bytes"]:
        raise EdgespecError(f"{file} has {file.stat().st_size} bytes, the manifest says "
                            f"{info['bytes']} (truncated or edited); export the model again")
    if verify and sha256_file(file) != info["sha256"]:
        raise EdgespecError(f"{file} does not match its sha256 in the manifest (corrupt or "
                            "edited); export the model again")


def _load_draft_vocab(file: Path, manifest: dict) -> np.ndarray:
    """The shortlist's token ids, checked: one row of ids in the vocabulary, as many as
    the draft graph scores."""
    try:
        ids = np.load(file)
    except (ValueError, OSError, EOFError) as e:
        raise EdgespecError(f"{file} is not a readable numpy array ({e}); "
                            "export the model again") from e
    vocab = manifest["architecture"]["vocab_size"]
    problem = None
    if not np.issubdtype(ids.dtype, np.integer):
        problem = f"holds {ids.dtype} values, not integer token ids"
    elif ids.ndim != 1:
        problem = f"has shape {ids.shape}, not one row of token ids"
    elif len(ids) == 0:
        problem = "is empty"
    elif ids.min() < 0 or ids.max() >= vocab:
        problem = f"holds token id {ids.min() if ids.min() < 0 else ids.max()}; the " \
                  f"vocabulary has ids in 0..{vocab - 1}"
    elif len(ids) != manifest.get("draft_graph", {}).get("vocab", len(ids)):
        problem = f"holds {len(ids)} ids, the manifest's draft_graph.vocab says " \
                  f"{manifest['draft_graph']['vocab']}"
    if problem:
        raise EdgespecError(f"{file} {problem}; export the model again")
    return ids
