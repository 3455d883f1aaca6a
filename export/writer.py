"""Write an artifact directory: graphs with external weights, tokenizer, manifest.

Each weight is stored once. A tensor used by two graphs under the same name (the tied
embedding table of lower and head, the rotary tables of lower and upper) is written into the
data file of the first graph that has it; the other graph points at the same bytes.
"""
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from edgespec.artifact import FORMAT_VERSION, MANIFEST, sha256_file

from .graph import ONNX_DTYPE
from .progress import progress

ALIGN = 4096  # page-aligned weights can be memory-mapped by ONNX Runtime


def _external(name, array, location, offset):
    tensor = TensorProto(name=name, data_type=ONNX_DTYPE[array.dtype], dims=array.shape)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)),
                       ("length", str(array.nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def write_graphs(graphs, out: Path):
    """Write graph.onnx + graph.data for each graph; shared tensors are written once."""
    stored = {}  # tensor name -> (location, offset, array) of its only copy
    total = sum(a.nbytes for g in graphs for a in g.initializers.values())
    with progress(total, f"writing {', '.join(g.name for g in graphs)}", unit="B",
                  unit_scale=True) as bar:
        for g in graphs:
            _write_graph(g, out, stored, bar)


def _write_graph(g, out, stored, bar):
    """graph.onnx, and graph.data for the weights no graph before it stored (a batch graph,
    whose weights are all another's, has none)."""
    location, data = f"{g.name}.data", None
    initializers = []
    try:
        for name, array in g.initializers.items():
            bar.update(array.nbytes)
            if array.dtype == np.int64:  # shape constants stay inline for shape inference
                initializers.append(numpy_helper.from_array(array, name))
                continue
            if name in stored:
                loc, offset, first = stored[name]
                if memoryview(first).cast("B") != memoryview(array).cast("B"):  # no copies
                    raise ValueError(f"tensor {name} differs between graphs")
            else:
                data = data or open(out / location, "wb")
                data.write(b"\0" * (-data.tell() % ALIGN))
                loc, offset = location, data.tell()
                data.write(memoryview(array).cast("B"))
                stored[name] = (loc, offset, array)
            initializers.append(_external(name, array, loc, offset))
    finally:
        if data:
            data.close()
        elif not g.shares_weights:  # the runtime's file list names every graph's data file
            (out / location).write_bytes(b"")
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
