"""Write an artifact directory: graphs with external weights, tokenizer, manifest.

Each weight is stored once, as the graphs are built (WeightFiles). A tensor used by two
graphs under the same name (the tied embedding table of lower and head, the rotary tables of
lower and upper) is written into the data file of the first graph that has it; the other
graph points at the same bytes.
"""
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from edgespec.artifact import FORMAT_VERSION, MANIFEST, sha256_file

from .graph import ONNX_DTYPE

ALIGN = 4096  # page-aligned weights can be memory-mapped by ONNX Runtime


@dataclass(frozen=True)
class Stored:
    """A weight's place in a data file: what a graph's initializer points at."""
    location: str
    offset: int
    nbytes: int
    dtype: np.dtype
    digest: str


class WeightFiles:
    """An artifact's data files, written while the graphs are built: a weight goes to disk
    when a graph first names it, so no graph holds its weights in memory. A name stored
    once (the tied table of lower and head, a batch graph's layers) is written once; a graph
    that names it again points at the same bytes, which must be the same."""

    def __init__(self, out: Path):
        self.out, self.stored = out, {}  # weight name -> Stored

    def put(self, name, array, location) -> Stored:
        """Store `array` as `name` in `location` unless it is stored already."""
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        digest = hashlib.sha1(data).hexdigest()
        if name in self.stored:
            if self.stored[name].digest != digest:
                raise ValueError(f"tensor {name} differs between graphs")
            return self.stored[name]
        with open(self.out / location, "ab") as f:
            f.write(b"\0" * (-f.tell() % ALIGN))
            self.stored[name] = Stored(location, f.tell(), data.nbytes, array.dtype, digest)
            f.write(data)
        return self.stored[name]

    def clear(self):
        """Delete every data file written (the graphs built anew)."""
        self.drop({s.location for s in self.stored.values()})

    def drop(self, locations):
        """Delete these data files and forget what they held (a graph written anew)."""
        for location in locations:
            (self.out / location).unlink(missing_ok=True)
        self.stored = {n: s for n, s in self.stored.items() if s.location not in locations}


def _external(name, stored: Stored, shape):
    tensor = TensorProto(name=name, data_type=ONNX_DTYPE[np.dtype(stored.dtype)], dims=shape)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", stored.location), ("offset", str(stored.offset)),
                       ("length", str(stored.nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def write_graphs(graphs, out: Path):
    """graph.onnx for each graph (its weights are in the data files already), and an empty
    graph.data for one that stored none: the runtime's file list names every graph's."""
    for g in graphs:
        initializers = [numpy_helper.from_array(w, name) if isinstance(w, np.ndarray)
                        else _external(name, *w) for name, w in g.initializers.items()]
        if not g.shares_weights and not (out / f"{g.name}.data").exists():
            (out / f"{g.name}.data").write_bytes(b"")
        onnx.save_model(g.model(initializers), out / f"{g.name}.onnx")


def write_tokenizer(source, out: Path):
    source.tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(source.chat_template)


def write_manifest(out: Path, fields: dict):
    """The manifest lists every other file in the directory with its size and sha256."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format_version": FORMAT_VERSION, **fields, "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
