"""What crosses the bus between host and device while a model decodes: io-bound tensors held
outside the device (Transfers, through ONNX Runtime's own IOBinding methods) and the Memcpy
nodes ONNX Runtime puts inside the graphs (its profiler), per decoded token.

benchmarks/gpu_check.py counts them on CUDA; on the CPU provider both are zero.
"""
import contextlib
import json
import tempfile
import weakref
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

import edgespec
from edgespec import engine as engine_module
from edgespec.sampling import SamplingParams

COPY_TOKENS = 32  # tokens decoded while copies are counted (profiled: slower)
MEMCPY_OPS = ("MemcpyFromHost", "MemcpyToHost")


def _nbytes(element_type, shape) -> int:
    """Bytes of a tensor of numpy dtype or ORT type string ("tensor(float16)")."""
    if isinstance(element_type, str) and element_type.startswith("tensor("):
        element_type = {"float": "float32", "double": "float64"}.get(
            element_type[7:-1], element_type[7:-1])
    return int(np.prod(shape)) * np.dtype(element_type).itemsize  # a scalar: shape []


class Transfers:
    """Counts, while active, every io-bound run of any session and the tensors it has bound
    outside `device` memory: each is copied across the bus at every run (to the device
    before it, or back after it). A kernel that reads an input on the host (such as
    GroupQueryAttention's total_seq_len) is counted though ONNX Runtime copies nothing.
    Done through ONNX Runtime's own IOBinding and InferenceSession methods, so it sees
    whatever the engine binds."""

    def __init__(self, device: str):
        self.device = device
        self.totals = defaultdict(Counter)  # session -> runs, to_device, to_host and bytes
        self._bound = weakref.WeakKeyDictionary()  # binding -> {(direction, name): (where, bytes)}
        self._undo = []

    def snapshot(self) -> dict:
        return {session: Counter(counts) for session, counts in self.totals.items()}

    def since(self, before: dict) -> dict:
        """What ran since `before` (a snapshot), by session."""
        return {s: counts - before.get(s, Counter()) for s, counts in self.totals.items()}

    def __enter__(self):
        io, session = ort.IOBinding, ort.InferenceSession
        self._wrap(io, "bind_cpu_input", "in", lambda name, array: ("cpu", array.nbytes))
        self._wrap(io, "bind_input", "in", lambda name, device_type, device_id, element_type,
                   shape, buffer_ptr: (device_type, _nbytes(element_type, shape)))
        self._wrap(io, "bind_output", "out", lambda name, device_type="cpu", device_id=0,
                   element_type=None, shape=None, buffer_ptr=None:
                   (device_type, _nbytes(element_type, shape) if element_type else 0))
        for method, direction in (("bind_ortvalue_input", "in"), ("bind_ortvalue_output", "out")):
            self._wrap(io, method, direction, lambda name, value:
                       (value.device_name(), _nbytes(value.data_type(), value.shape())))
        run = vars(_owner(session, "run_with_iobinding"))["run_with_iobinding"]

        def counted(sess, binding, *args, **kwargs):
            result = run(sess, binding, *args, **kwargs)
            counts = self.totals[sess]
            counts["runs"] += 1
            for (direction, _), (where, nbytes) in self._bound.get(binding, {}).items():
                if where.lower() != self.device:
                    way = "to_device" if direction == "in" else "to_host"
                    counts[way] += 1
                    counts[way + "_bytes"] += nbytes
            return result
        self._patch(session, "run_with_iobinding", counted)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def _wrap(self, cls, method, direction, where):
        bind = vars(_owner(cls, method))[method]

        def recorded(binding, name, *args, **kwargs):
            bind(binding, name, *args, **kwargs)
            self._bound.setdefault(binding, {})[(direction, name)] = where(name, *args, **kwargs)
        self._patch(cls, method, recorded)

    def _patch(self, cls, name, function):
        owner = _owner(cls, name)
        self._undo.append((owner, name, vars(owner)[name]))
        setattr(owner, name, function)


def _owner(cls, name):
    return next(c for c in cls.__mro__ if name in vars(c))


@contextlib.contextmanager
def profiled_sessions(folder: Path):
    """Sessions the engine makes meanwhile write ONNX Runtime profiles into `folder`, one
    file each (end_profiling() names it)."""
    made, count = engine_module._session_options, [0]

    def options(*args, **kwargs):
        opts = made(*args, **kwargs)
        count[0] += 1
        opts.enable_profiling = True
        opts.profile_file_prefix = str(folder / f"session{count[0]}")
        return opts
    engine_module._session_options = options
    try:
        yield
    finally:
        engine_module._session_options = made


def read_profile(path) -> dict:
    """One session's profile: its runs, the nodes each provider ran, the Memcpy nodes (a
    copy between host and device inside the graph) and how many a run runs (each runs
    every node: the graphs have no branches)."""
    events = json.loads(Path(path).read_text())
    runs = sum(e.get("cat") == "Session" and e.get("name") == "model_run" for e in events)
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    placed = {}
    for e in nodes:
        placed[e["name"][:-len("_kernel_time")]] = (e["args"].get("provider"),
                                                    e["args"].get("op_name"))
    memcpy = sum(e["args"].get("op_name") in MEMCPY_OPS for e in nodes)
    return {"runs": runs,
            "nodes_by_provider": dict(Counter(provider for provider, _ in placed.values())),
            "memcpy_nodes": sorted(f"{name} ({op})" for name, (_, op) in placed.items()
                                   if op in MEMCPY_OPS),
            "memcpy_per_run": memcpy / runs if runs else 0.0}


def count_copies(artifact, device, ids, tokens=COPY_TOKENS) -> dict:
    """Host-device copies per decoded token, greedy plain and speculative, on prompt `ids`:
    io-bound tensors outside the device (Transfers) plus Memcpy nodes (the profiles); the
    prompt's prefill is left out (a 1-token reply runs only the prefill)."""
    with tempfile.TemporaryDirectory() as folder, Transfers(device) as seen, \
            profiled_sessions(Path(folder)):
        model = edgespec.load(artifact, device=device)
        greedy = {**asdict(SamplingParams()), "ignore_eos": True}
        before = seen.snapshot()
        model.generate_ids(ids, 1, mode="plain", **greedy)
        prefill = seen.since(before)
        decoded = {}
        for mode in ("plain", "speculative"):
            model.forget()
            before = seen.snapshot()
            reply = model.generate_ids(ids, tokens, mode=mode, **greedy)
            ran = seen.since(before)
            decoded[mode] = ({s: c - prefill.get(s, Counter()) for s, c in ran.items()},
                             reply.n_generated - 1)
        graphs = {name: read_profile(session.end_profiling())
                  for name, session in model.engine.sessions.items()}
    names = {session: name for name, session in model.engine.sessions.items()}
    report = {"tokens": tokens, "graphs": graphs}
    for mode, (by_session, n) in decoded.items():
        total = Counter()
        for session, counts in by_session.items():
            total.update(counts)
            total["memcpy"] += counts["runs"] * graphs[names[session]]["memcpy_per_run"]
        per = {key: total[key] / n for key in ("runs", "to_device", "to_host", "memcpy",
                                               "to_device_bytes", "to_host_bytes")}
        per["copies"] = per["to_device"] + per["to_host"] + per["memcpy"]
        report[mode] = per
    return report
