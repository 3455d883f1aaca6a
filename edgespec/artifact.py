"""What is on disk: an exported artifact directory, checked before anything runs."""
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import EdgespecError

FORMAT_VERSION = 2  # 2: attention pad rows (engine.py), int4 zero points
MANIFEST = "manifest.json"
GRAPHS = ("lower", "upper", "head")
DRAFT_GRAPH, DRAFT_VOCAB = "draft", "draft_vocab.npy"  # optional: exit adapter, shortlist


@dataclass
class Artifact:
    path: Path
    manifest: dict

    @property
    def arch(self) -> dict:
        return self.manifest["architecture"]

    @property
    def exit_layer(self) -> int:
        return self.manifest["exit_layer"]

    @property
    def max_context(self) -> int:
        return self.manifest["max_context"]

    @property
    def eos_token_ids(self) -> list:
        return self.manifest["eos_token_ids"]

    @property
    def graphs(self) -> tuple:
        """The graphs to load: the three always, the draft graph when export made one."""
        return GRAPHS + ((DRAFT_GRAPH,) if f"{DRAFT_GRAPH}.onnx" in self.manifest["files"] else ())

    def graph(self, name: str) -> Path:
        return self.path / f"{name}.onnx"

    def draft_vocab(self):
        """Token ids of the draft graph's shortlisted head (its logit i is token ids[i])."""
        if DRAFT_VOCAB not in self.manifest["files"]:
            return None
        return np.load(self.path / DRAFT_VOCAB)


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
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise EdgespecError(f"{path} has artifact format version {version}, this edgespec "
                            f"reads version {FORMAT_VERSION}; export the model again")
    for name, info in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise EdgespecError(f"{file} is missing; export the model again")
        if file.stat().st_size != info["bytes"]:
            raise EdgespecError(f"{file} has {file.stat().st_size} bytes, the manifest says "
                                f"{info['bytes']} (truncated or edited); export the model again")
        if verify and sha256_file(file) != info["sha256"]:
            raise EdgespecError(f"{file} does not match its sha256 in the manifest (corrupt or "
                                "edited); export the model again")
    return Artifact(path, manifest)
