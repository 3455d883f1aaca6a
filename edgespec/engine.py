"""Sessions, buffers and binding: runs lower, upper and head with the KV cache in place.

Every KV buffer [1, kv_heads, max_context + PAD_ROWS, head_dim] is allocated once on the
provider's device and bound as both past and present of its GroupQueryAttention, which
writes the new positions in place. A cache's "length" is the number of valid positions;
rolling back is lowering it. The exit hidden state of every position lives in one more
buffer indexed the same way (LayerSkip's exit query cache): lower writes a position's row,
upper and the draft head read it, so the draft's lower-layer work is the verifier's. The
host sees only token ids, lengths and logits.

Losslessness rule: a token's numerics must not depend on how it reached the cache (a plain
step, an early-exit draft, a prompt-lookup round or a prefill chunk). ONNX Runtime's CPU
GroupQueryAttention takes another GEMM path for one query row than for several, and int8
activations downstream turn those last bits into different tokens. So every graph appends
PAD_ROWS zero rows to each attention call (export/graph.py): attention always sees several
rows, the linear layers only the real ones (bit-exact for any row count). The pad's KV lands
one position past the valid length, so the caches hold one position more than the context.
Second, its scores GEMM (MLAS, K = head_dim) sums K in one pass or in slices depending on
the call's total length; for head_dim > 128 (Gemma 3) a call is cut where that changes
(`gemm_cuts`), so a row's scores round as in its own plain step. See DESIGN.md.

The optional draft graph (exit adapter and shortlisted head) reads exit states too and has
its own KV cache; it only proposes tokens, so its numerics never touch the output.

What belongs to one conversation (its KV buffers, exit states, lengths and the calls
bound to them) is a Sequence; the sessions and weights are the engine's, shared by every
sequence. Every call names its sequence and the first position it writes: `lower`,
`upper` and `prefill` run one sequence on the single-sequence graphs, `forward` the rows of
several in one call of the batch graphs. There the linear layers see all rows packed (a
row's bits do not depend on the others), and each sequence has its own GroupQueryAttention
on its own cache with its own pad row, exactly as when it runs alone, so a reply in a batch
is bit for bit its solo reply. `head` reads rows of the final states the last `upper` or
`forward` wrote; `draft_head` a position of a sequence's exit states.
"""
import ctypes
import os
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as ort_state

from .artifact import BATCH_SIZES, MANIFEST, PAD_ROWS, Artifact
from .errors import EdgespecError
from .sampling import ranked, row_top

CHUNK = 256  # the most positions one call handles (prefill is cut into chunks)
HEAD_ROWS = 64  # the most rows of a head call kept bound for reuse
COST_ROWS = (1, 2, 3, 4, 6, 8, 16, 32)  # the rows of a round whose cost round_costs measures
BATCH_ROWS = (1, 2, 3, 4, 6, 8)  # rows per sequence of the batch rounds it measures
COSTS_STEPS = 150  # about what one repeat of every round measured costs, in plain steps
NUMPY_DTYPE = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _k_slices(n, k):
    """How many slices of K MLAS's SGEMM sums for an N x K operand (sgemm.cpp, A not
    transposed: strides 128 x 128, the K stride widened when N is small)."""
    stride_n = stride_k = 128
    if n >= k:
        while stride_k // 2 >= k:
            stride_k //= 2
    else:
        while stride_n > 16 and stride_n // 2 >= n:
            stride_n, stride_k = stride_n // 2, stride_k * 2
    return -(-k // stride_k)


def gemm_cuts(head_dim) -> list:
    """Positions no call may span: GroupQueryAttention's Q.K' GEMM has N = the call's total
    length (its last position + 1 + PAD_ROWS) and K = head_dim, so a row run among later
    ones must not cross a total length where the number of K slices changes."""
    return [total - PAD_ROWS for total in (16, 32, 64)
            if _k_slices(total, head_dim) != _k_slices(total + 1, head_dim)]


CUDA = "CUDAExecutionProvider"
_cuda_problem = ...  # why CUDA cannot run here (None: it can), found once per process


def cuda_problem():
    """None when ONNX Runtime can run a graph on a CUDA GPU here, else why not, in words:
    onnxruntime-gpu lists its CUDA provider even where the provider cannot load (no GPU, no
    driver), so a one-node graph is run on it once."""
    global _cuda_problem
    if _cuda_problem is ...:
        _cuda_problem = _probe_cuda()
    return _cuda_problem


def _probe_cuda():
    available = ort.get_available_providers()
    if CUDA not in available:
        return f"this onnxruntime has no CUDA provider (it offers {', '.join(available)})"
    from onnx import TensorProto, helper
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [value],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    try:
        session = open_session(helper.make_model(graph).SerializeToString(), "a probe", CUDA, 1)
        session.run(None, {"x": np.ones(1, np.float32)})
    except Exception as e:  # ORT's own types too: no driver, no device, ...
        return f"onnxruntime-gpu's CUDA provider does not run here ({e})"
    return None


def choose_provider(artifact: Artifact, device: str = "auto") -> str:
    """The provider an artifact runs on: CUDA for an artifact built for it (device auto or
    cuda), the CPU for a CPU artifact; device cpu runs either on the CPU. Anything else
    would run silently slow or not at all, so it is refused in one line."""
    if device not in ("auto", "cpu", "cuda"):
        raise EdgespecError(f"unknown device {device}; use auto, cpu or cuda")
    built_for = artifact.manifest.get("device", "cpu")
    if device == "cpu" or (device == "auto" and built_for == "cpu"):
        return "CPUExecutionProvider"
    if built_for != "cuda":
        raise EdgespecError(f"{artifact.path} was exported for the CPU (float32 activations, "
                            "which CUDA's attention kernels do not take); export it again with "
                            "--device cuda to run it on the GPU")
    problem = cuda_problem()
    if problem:
        raise EdgespecError(f"{artifact.path} was exported for CUDA, and {problem}; install "
                            "onnxruntime-gpu on a machine with a CUDA GPU, or load it with "
                            "device cpu to run its float16 graphs on the CPU (slowly)")
    return CUDA


def open_session(graph, name, provider, threads) -> ort.InferenceSession:
    """A session of `graph` (a path, or a model's bytes) on `provider` alone: on CUDA, a
    node without a CUDA kernel is an error, never a silent copy to and from the CPU."""
    options = _session_options(threads)
    if provider == CUDA:
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    try:  # enable_fallback=0: no retry on the CPU when the provider fails
        session = ort.InferenceSession(graph, options, providers=[provider], enable_fallback=0)
    except Exception as e:  # ORT raises its own types for bad graphs and data
        if "fallback to CPU EP has been explicitly disabled" in str(e):
            raise EdgespecError(f"{name} has nodes with no {provider} kernel, which would run "
                                "on the CPU; export it again with --device cuda (export checks "
                                "its graphs against CUDA's kernels)") from e
        raise EdgespecError(f"cannot load {name}: {e}") from e
    if session.get_providers()[0] != provider:
        raise EdgespecError(f"{name} runs on {session.get_providers()[0]}, not {provider}")
    return session


_pool_threads = None  # size of the process-wide thread pool, once made


def default_threads() -> int:
    """The threads the runtime uses when not told: one per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(threads: int = None) -> int:
    """Make the process-wide thread pool with `threads` (None: default_threads()) unless
    it is made; the pool's size. Sessions run in turn, many times per token: with a pool
    each, the idle pools' spinning threads starve the running one. The pool is made once
    per process; later counts do not resize it."""
    global _pool_threads
    if _pool_threads is None:
        _pool_threads = threads or default_threads()
        ort_state.set_global_thread_pool_sizes(_pool_threads, 1)
    return _pool_threads


def _session_options(threads):
    """Options that make the sessions share the process's one thread pool."""
    set_threads(threads)
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.log_severity_level = 3
    return options


class _Call:
    """One graph bound for one shape: host inputs are numpy arrays the loop writes into."""

    def __init__(self, session, binding, host):
        self.session, self.binding, self.host = session, binding, host
        self.logits = None  # a head's logits output, where it is bound (_bind_logits)
        self.rows_out = None  # upper: the final_states row its output is bound at

    def run(self):
        self.session.run_with_iobinding(self.binding)


def _check_graphs(artifact: Artifact, sessions: dict):
    """The manifest's architecture numbers are the graphs' own: the engine sizes its buffers
    from them, and a mismatch would fail deep inside ONNX Runtime, in words about tensors."""
    def agree(graph, tensor, axis, key, want):
        have = tensor.shape[axis] if len(tensor.shape) > axis else None
        if isinstance(have, int) and have != want:
            raise EdgespecError(f"{artifact.path / MANIFEST} says {key} is {want}, but "
                                f"{graph}.onnx's {tensor.name} has {have} there; export the "
                                "model again")

    a = artifact.arch
    for graph, session in sessions.items():
        for tensor in session.get_inputs():
            if tensor.name.startswith("past_"):  # [1, kv heads, positions, head dim]
                agree(graph, tensor, 1, "architecture.num_kv_heads", a["num_kv_heads"])
                agree(graph, tensor, 3, "architecture.head_dim", a["head_dim"])
            elif tensor.name in ("hidden", "exit_hidden"):  # [1, rows, hidden size]
                agree(graph, tensor, 2, "architecture.hidden_size", a["hidden_size"])
    agree("head", sessions["head"].get_outputs()[0], 2, "architecture.vocab_size",
          a["vocab_size"])
    layers = {"lower": artifact.exit_layer, "upper": a["num_layers"] - artifact.exit_layer}
    for graph, want in layers.items():
        have = sum(i.name.startswith("past_key") for i in sessions[graph].get_inputs())
        if have != want:
            raise EdgespecError(f"{artifact.path / MANIFEST} says architecture.num_layers is "
                                f"{a['num_layers']} and exit_layer {artifact.exit_layer}, so "
                                f"{graph}.onnx should hold {want} layers, but it holds {have}; "
                                "export the model again")


class Engine:
    def __init__(self, artifact: Artifact, device: str = "auto", threads: int = None,
                 max_context: int = None):
        """max_context: the positions a sequence holds, at most the artifact's (default)."""
        self.artifact = artifact
        self.provider = choose_provider(artifact, device)
        return_freed_memory()  # an engine let go before this one must not lie under it
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self.threads = set_threads(threads)  # what it runs with, whatever `threads` asked
        self.sessions = {}
        for name in artifact.graphs:
            path = artifact.graph(name)
            self.sessions[name] = open_session(str(path), path, self.provider, threads)
        _check_graphs(artifact, self.sessions)
        # the heads give their top candidates (CUDA artifacts): read once, asked every round
        self._top_graphs = _has_top(self.sessions["head"])
        a = artifact.arch
        self.hidden_size, self.vocab_size = a["hidden_size"], a["vocab_size"]
        self.max_context = check_context(max_context, artifact.max_context)
        # the graphs compute (KV caches, logits) in dtype; the hidden states they pass on are
        # the residual stream, which a float16 artifact may keep in float32 (export/graph.py)
        self.dtype = NUMPY_DTYPE[self.sessions["head"].get_outputs()[0].type]
        self.state_dtype = NUMPY_DTYPE[self.sessions["upper"].get_inputs()[0].type]
        self.kv_shape = [1, a["num_kv_heads"], self.max_context + PAD_ROWS, a["head_dim"]]
        self.final_states = self._alloc([1, CHUNK, self.hidden_size], self.state_dtype)
        self.cuts = gemm_cuts(a["head_dim"])
        # a sequence's KV buffers: every layer's of lower, upper and the draft graph
        self.kv_names = [name for s in self.sessions if s != "head" for name in self._past_names(s)]
        self._head_calls, self._spaces = {}, {}
        self.host_bytes = 0  # what the host has read of the heads' outputs (from a GPU: copied)
        self._threads = threads
        self._batch = None  # the batch graphs' sessions and buffers, made when first used
        self.draft_vocab = artifact.draft_vocab()  # the draft graph's token ids, if any
        if "draft" in self.sessions:
            self._draft_logits = np.full(self.vocab_size, -np.inf, np.float32)  # -inf: not
            # in the shortlist, so never drafted

    def unload(self, graphs):
        """Let these graphs' sessions go: an engine that runs only the others from here on
        (the single-sequence methods need lower and upper)."""
        for name in graphs:
            del self.sessions[name]
        return_freed_memory()

    def _alloc(self, shape, dtype=None):
        return ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype or self.dtype,
                                                         self.device, 0)

    def _past_names(self, graph):
        return [i.name for i in self.sessions[graph].get_inputs() if i.name.startswith("past_")]

    def new_sequence(self, positions: int = None) -> "Sequence":
        """A new conversation's buffers (KV of every layer and exit states), allocated now:
        `sequence_bytes` of memory. positions: fewer than max_context (a measurement's)."""
        return Sequence(self, positions or self.max_context)

    @property
    def sequence_bytes(self) -> int:
        """The memory one sequence holds: its KV caches and exit states."""
        return self.bytes_for_context(self.max_context)

    def bytes_for_context(self, context: int) -> int:
        """The memory a sequence of `context` positions would hold."""
        kv_row = int(np.prod(self.kv_shape[:2] + self.kv_shape[3:]))
        per_kv = kv_row * np.dtype(self.dtype).itemsize
        states = context * self.hidden_size * np.dtype(self.state_dtype).itemsize
        return len(self.kv_names) * per_kv * (context + PAD_ROWS) + states

    # -- binding ---------------------------------------------------------------------------

    def _bind_rows(self, bind, name, states: ort.OrtValue, first: int, count: int):
        """Bind rows [first, first+count) of a hidden-state buffer, in place, by pointer."""
        offset = first * self.hidden_size * np.dtype(self.state_dtype).itemsize
        bind(name, self.device, 0, self.state_dtype, [1, count, self.hidden_size],
             states.data_ptr() + offset)

    def _layer_call(self, seq, graph, count):
        """lower, upper or draft bound to `seq`'s KV buffers for `count` rows, bound once
        (the calls live with the sequence)."""
        call = seq.calls.get((graph, count))
        if call is not None:
            return call
        session = self.sessions[graph]
        binding = session.io_binding()
        host = {"seqlens_k": np.zeros([1], np.int32), "total_seq_len": np.zeros([], np.int32)}
        if graph == "lower":
            host["input_ids"] = np.zeros([1, count], np.int64)
        inputs = {i.name for i in session.get_inputs()}  # a raw-exit draft has no lengths
        for name, array in host.items():
            if name in inputs:
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        for past in self._past_names(graph):
            binding.bind_ortvalue_input(past, seq.kv[past])
            binding.bind_ortvalue_output(past.replace("past_", "present_"), seq.kv[past])
        call = _Call(session, binding, host)
        if graph == "draft":
            self._bind_logits(call, 1, len(self.draft_vocab))
        if count <= 16:  # decode and verify shapes recur; long prefill chunks do not
            seq.calls[(graph, count)] = call
        return call

    def _head_call(self, states, rows):
        key = ("head", id(states), rows)
        call = self._head_calls.get(key)
        if call is not None:
            return call
        session = self.sessions["head"]
        binding = session.io_binding()
        host = {"rows": np.arange(rows, dtype=np.int64)}
        self._bind_rows(binding.bind_input, "hidden", states, 0, states.shape()[1])
        binding.bind_ortvalue_input("rows", ort.OrtValue.ortvalue_from_numpy(host["rows"]))
        call = _Call(session, binding, host)
        self._bind_logits(call, rows, self.vocab_size)
        if rows <= HEAD_ROWS:
            self._head_calls[key] = call
        return call

    def _bind_logits(self, call, rows, vocab):
        """Bind a head's outputs: the logits on the device (the host reads them in `_logits`,
        a copy from a GPU) and its top_outputs, where the graph has them, on the host."""
        shape = [1, rows, vocab]
        if self.device == "cpu":
            # calls kept for reuse write into one buffer per width: a buffer each would hold
            # a row count's logits apiece (hundreds of MB with a large vocabulary)
            call.host["logits"] = self._logits_space(vocab)[:, :rows] if rows <= HEAD_ROWS \
                else np.zeros(shape, self.dtype)
            call.logits = ort.OrtValue.ortvalue_from_numpy(call.host["logits"])
        else:
            call.logits = ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype,
                                                                    self.device, 0)
        call.binding.bind_ortvalue_output("logits", call.logits)
        if _has_top(call.session):
            call.host["top1_probability"] = np.zeros([1, rows], np.float32)
            call.binding.bind_ortvalue_output("top1_probability", ort.OrtValue.ortvalue_from_numpy(
                call.host["top1_probability"]))
            self._bind_top(call, rows, 1)

    def _bind_top(self, call, rows, k):
        """Bind the graph's top_k input and its top outputs for k candidates a row."""
        call.host["top_k"] = np.array([k], np.int64)
        call.binding.bind_ortvalue_input("top_k", ort.OrtValue.ortvalue_from_numpy(
            call.host["top_k"]))
        for name, dtype in (("top_values", np.float32), ("top_ids", np.int64)):
            call.host[name] = np.zeros([1, rows, k], dtype)
            call.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(
                call.host[name]))

    def _logits_space(self, vocab) -> np.ndarray:
        """The host logits buffer [1, HEAD_ROWS, vocab] the kept head calls share."""
        if vocab not in self._spaces:
            self._spaces[vocab] = _host_array([1, HEAD_ROWS, vocab], self.dtype)
        return self._spaces[vocab]

    def _logits(self, call) -> np.ndarray:
        """A head call's logits on the host [1, rows, vocab]."""
        logits = call.host["logits"] if self.device == "cpu" else call.logits.numpy()
        self.host_bytes += logits.nbytes
        return logits

    def _top(self, call, name) -> np.ndarray:
        """A head call's top output on the host ([1, rows] or [1, rows, k])."""
        self.host_bytes += call.host[name].nbytes
        return call.host[name]

    def computes_top(self, k: int, draft: bool = False) -> bool:
        """Whether the head (the draft head) gives a row's k largest logits and the tie
        after them on the device: a CUDA artifact's graphs do, for k below the vocabulary."""
        draft = draft and "draft" in self.sessions
        return self._top_graphs and k < (len(self.draft_vocab) if draft else self.vocab_size)

    def _ranked_rows(self, call, k, rows) -> list:
        """ranked() of each row's k largest logits with the ties of the k-th, from the
        graph's k + 1 largest; a row whose ties run past them reads its whole row."""
        values, ids = self._top(call, "top_values")[0], self._top(call, "top_ids")[0]
        out, logits = [], None
        for row in range(rows):
            if values[row, k] < values[row, k - 1]:
                out.append(ranked(values[row, :k], ids[row, :k]))
                continue
            if logits is None:  # one copy for the call's tied rows
                logits = self._logits(call)[0]
            out.append(row_top(logits[row].astype(np.float32), k))
        return out

    # -- the three graphs ------------------------------------------------------------------

    @staticmethod
    def _check_room(seq, first, count):
        if first + count > seq.positions:
            raise ContextFull(f"the context is full ({seq.positions} tokens)")

    @staticmethod
    def _set_lengths(call, first, count):
        """Lengths for a call on positions [first, first + count), counting the pad rows."""
        call.host["seqlens_k"][0] = first + count + PAD_ROWS - 1
        call.host["total_seq_len"][...] = first + count + PAD_ROWS

    def _pieces(self, first, count):
        """[first, first + count) as (first, count) pieces no longer than CHUNK that span
        no GEMM cut."""
        ends = [c for c in self.cuts if first < c < first + count] + [first + count]
        for end in ends:
            while first < end:
                n = min(CHUNK, end - first)
                yield first, n
                first += n

    def lower(self, seq, first: int, ids):
        """Run lower on `ids` at positions first.. of `seq` (which forgets what it held from
        `first` on); their exit states land at their positions."""
        if first > seq.lower_len:
            raise ValueError(f"lower at {first} would leave a gap after {seq.lower_len}")
        self._check_room(seq, first, len(ids))
        seq.rollback(first)
        seq.tokens[first:] = [int(t) for t in ids]
        for start, count in self._pieces(first, len(ids)):
            call = self._layer_call(seq, "lower", count)
            call.host["input_ids"][0] = ids[start - first:start - first + count]
            self._bind_rows(call.binding.bind_output, "exit_hidden", seq.exit_states, start,
                            count)
            self._set_lengths(call, start, count)
            call.run()
        seq.lower_len = first + len(ids)

    def upper(self, seq, first: int, count: int):
        """Run upper on the exit states of positions [first, first + count) of `seq` (lower
        ran them); their final states land in rows 0..count-1 of final_states."""
        if not first <= seq.upper_len or first + count > seq.lower_len:
            raise ValueError(f"upper on {count} rows at {first}: lower holds {seq.lower_len}, "
                             f"upper {seq.upper_len}")
        for start, n in self._pieces(first, count):
            call = self._layer_call(seq, "upper", n)
            self._bind_rows(call.binding.bind_input, "exit_hidden", seq.exit_states, start, n)
            if call.rows_out != start - first:  # rebinding is not free: only when it moved
                call.rows_out = start - first
                self._bind_rows(call.binding.bind_output, "final_hidden", self.final_states,
                                call.rows_out, n)
            self._set_lengths(call, start, n)
            call.run()
        seq.upper_len = first + count

    def head(self, rows):
        """Logits [len(rows), vocab] (a host array the next head call overwrites) for rows of
        the final states the last `upper` or `forward` wrote."""
        return self._logits(self._run_head(self.final_states, rows))[0]

    def head_top(self, rows, k: int) -> list:
        """For each of those rows (where computes_top(k)), ranked() of its k largest logits
        and every tie of the k-th: only those cross from a GPU, not the logits."""
        rows = list(rows)
        return self._ranked_rows(self._run_head(self.final_states, rows, k + 1), k, len(rows))

    def _run_head(self, states, rows, top=1) -> _Call:
        """Run the head on `rows` of `states`, its TopK (if any) giving `top` a row."""
        rows = list(rows)
        call = self._head_call(states, len(rows))
        call.host["rows"][:] = rows
        if "top_k" in call.host and call.host["top_k"][0] != top:
            self._bind_top(call, len(rows), top)
        call.run()
        if self.device != "cpu":
            call.binding.synchronize_outputs()
        return call

    def draft_head(self, seq, position: int):
        """Draft logits [vocab] after `position` of `seq` (lower ran it): the draft graph
        (exit adapter, shortlisted head; -inf outside the shortlist) or the shared head on
        its exit state. The adapter first catches up on positions it has not seen."""
        call = self._run_draft(seq, position)
        if "draft" not in self.sessions:
            return self._logits(call)[0, 0]
        self._draft_logits[self.draft_vocab] = self._logits(call)[0, 0]
        return self._draft_logits

    def draft_top(self, seq, position: int, k: int, probability: bool) -> tuple:
        """(ranked() top k of draft_head's logits with the ties of the k-th, the top token's
        probability if asked, else None), where computes_top(k, draft=True)."""
        call = self._run_draft(seq, position, k + 1)
        top = self._ranked_rows(call, k, 1)[0]
        if "draft" in self.sessions:  # the shortlist's ids, ascending: the order holds
            top = [(value, int(self.draft_vocab[i])) for value, i in top]
        return top, float(self._top(call, "top1_probability")[0, 0]) if probability else None

    def _run_draft(self, seq, position, top=1) -> _Call:
        if position >= seq.lower_len:
            raise ValueError(f"no exit state at {position}: lower holds {seq.lower_len}")
        if "draft" not in self.sessions:
            return self._run_head(seq.exit_states, [position], top)
        start = min(seq.draft_len, position) if self._past_names("draft") else position
        for first, count in self._pieces(start, position + 1 - start):
            call = self._layer_call(seq, "draft", count)
            self._bind_rows(call.binding.bind_input, "exit_hidden", seq.exit_states, first,
                            count)
            self._set_lengths(call, first, count)
            if "top_k" in call.host and call.host["top_k"][0] != top:
                self._bind_top(call, 1, top)
            call.run()
        seq.draft_len = position + 1
        if self.device != "cpu":
            call.binding.synchronize_outputs()
        return call

    def prefill(self, seq, first: int, ids):
        """Run `ids` through both halves at positions first.. of `seq` in chunks (a prompt,
        or a plain step's one token); the logits after the last."""
        ids = np.asarray(ids, dtype=np.int64)
        self._check_room(seq, first, len(ids))
        for chunk in _chunks(ids):
            self.lower(seq, first, chunk)
            self.upper(seq, first, len(chunk))
            first += len(chunk)
        return self.head([len(chunk) - 1])[0]

    def round_costs(self, cached=200, repeat=15, rows=COST_ROWS) -> dict:
        """Median ms of one round through lower, upper and head on M rows, for M in `rows`
        (those that fit twice in the context), after `cached` positions: a verify of M - 1
        drafts against a plain step (M = 1). Runs on a sequence of its own."""
        measured = [m for m in rows if 2 * m < self.max_context]
        cached = min(cached, self.max_context - 2 * max(measured))
        ids = [i % self.vocab_size for i in range(cached + max(measured))]
        seq = self.new_sequence(len(ids))
        self.prefill(seq, 0, ids[:cached])
        costs = {}
        for m in measured:
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                self.lower(seq, cached, ids[cached:cached + m])
                self.upper(seq, cached, m)
                self.head(range(m))
                times.append(time.perf_counter() - start)
            costs[m] = 1e3 * statistics.median(times)
        return costs

    # -- several sequences in one call -------------------------------------------------

    def call_rows(self, first: int, count: int) -> int:
        """How many of `count` rows from position `first` one call may run: within CHUNK,
        the context and the GEMM cuts (see gemm_cuts)."""
        limit = min(count, CHUNK, self.max_context - first)
        cut = next((c for c in self.cuts if first < c < first + limit), None)
        return limit if cut is None else cut - first

    def forward(self, parts):
        """Run lower and upper on the rows of several sequences in one call each: `parts` is
        [(sequence, first position, token ids)], at most max(BATCH_SIZES) of them, each
        within call_rows. A sequence forgets what it held from `first` on and holds the ids
        there after; the final states of all rows, packed in the parts' order, are what
        `head` reads (until the next call)."""
        batch = self._batch_graphs()
        slots = next(s for s in BATCH_SIZES if s >= len(parts))
        rows = sum(len(ids) for _, _, ids in parts)
        if rows > CHUNK:
            raise ValueError(f"{rows} rows do not fit one call ({CHUNK} at most)")
        for seq, first, ids in parts:
            if self.call_rows(first, len(ids)) < len(ids) or \
                    first > min(seq.lower_len, seq.upper_len):
                raise ValueError(f"{len(ids)} rows at {first} do not fit one call")
        lower, upper = (batch.call(self, graph, slots, rows) for graph in ("lower", "upper"))
        for call in (lower, upper):
            call.bind_sequences([seq for seq, _, _ in parts])
            for slot in range(slots):  # idle slots run their pad row alone on a scratch cache
                _, first, ids = parts[slot] if slot < len(parts) else (None, 0, [])
                call.host["slot_rows"][slot] = len(ids)
                call.host["seqlens_k"][slot] = first + len(ids) + PAD_ROWS - 1
                call.host["total_seq_len"][slot] = first + len(ids) + PAD_ROWS
        lower.host["input_ids"][0] = [t for _, _, ids in parts for t in ids]
        lower.run()
        upper.run()
        row = 0
        for seq, first, ids in parts:
            seq.rollback(first)
            seq.tokens[first:] = [int(t) for t in ids]
            seq.exit_host[first:first + len(ids)] = batch.exit_host[row:row + len(ids)]
            seq.lower_len = seq.upper_len = first + len(ids)
            row += len(ids)

    def check_batch(self, sequences: int):
        """Refuse, in one line and before any work, to decode several sequences at once off
        the CPU: the batch graphs' calls are bound to host buffers."""
        if sequences > 1 and self.device != "cpu":
            raise EdgespecError(f"decoding {sequences} sequences at once runs on the CPU "
                                "provider only; on the GPU decode one at a time (parallel 1), "
                                "or load with device cpu")

    def _batch_graphs(self) -> "_BatchGraphs":
        self.check_batch(max(BATCH_SIZES))
        if self._batch is None:
            self._batch = _BatchGraphs(self)
        return self._batch


class Sequence:
    """One conversation's state: its KV buffers (every layer of lower, upper and the draft
    graph), the exit state of every position, how many positions each half holds, and the
    engine's calls bound to its buffers."""

    def __init__(self, engine: Engine, positions: int):
        self.positions = positions  # the most it holds
        self.calls = {}  # (graph, rows) -> a single-sequence call bound to these buffers
        kv_shape = engine.kv_shape[:2] + [positions + PAD_ROWS] + engine.kv_shape[3:]
        self.kv = {name: engine._alloc(kv_shape) for name in engine.kv_names}
        shape = [1, positions, engine.hidden_size]
        if engine.device == "cpu":  # a host array the batch graphs' rows are copied into
            self.exit_host = _host_array(shape[1:], engine.state_dtype)
            self.exit_states = ort.OrtValue.ortvalue_from_numpy(self.exit_host[None])
        else:
            self.exit_host, self.exit_states = None, engine._alloc(shape, engine.state_dtype)
        self.lower_len = self.upper_len = 0  # valid positions in each KV cache
        self.draft_len = 0  # positions the draft graph's adapter has seen
        self.tokens = []  # the token at each position lower has run

    def rollback(self, length: int):
        """Forget every position from `length` on, in both halves. Nothing is copied."""
        self.lower_len = min(self.lower_len, length)
        self.upper_len = min(self.upper_len, length)
        self.draft_len = min(self.draft_len, length)

    def cached_tokens(self) -> list:
        """The tokens whose KV both halves hold: a prompt sharing them may skip them."""
        return self.tokens[:min(self.lower_len, self.upper_len)]

    def shared_prefix(self, prompt_ids: list) -> int:
        """How many of the prompt's first tokens the cache holds, short of its last (which
        runs again: its logits start the reply)."""
        cached, n = self.cached_tokens(), 0
        limit = min(len(cached), len(prompt_ids) - 1)
        while n < limit and cached[n] == prompt_ids[n]:
            n += 1
        return n


class _BatchGraphs:
    """The batch graphs' sessions (lower_x{slots} and upper_x{slots}, loaded when a batch
    of that size first runs), their calls by rows, and the packed row buffers."""

    def __init__(self, engine: Engine):
        self.artifact, self.provider = engine.artifact, engine.provider
        self.sessions, self.calls = {}, {}
        shape = [CHUNK, engine.hidden_size]
        self.exit_host = _host_array(shape, engine.state_dtype)
        self.exit = ort.OrtValue.ortvalue_from_numpy(self.exit_host[None])
        self.final = engine.final_states  # the rows `head` reads, as after `upper`
        # idle slots: a cache of two positions, written and never read
        self.scratch = engine._alloc([1] + engine.kv_shape[1:2] + [2] + engine.kv_shape[3:])

    def session(self, engine, graph, slots):
        key = (graph, slots)
        if key not in self.sessions:
            path = self.artifact.batch_graph(graph, slots)
            self.sessions[key] = open_session(str(path), path, self.provider, engine._threads)
        return self.sessions[key]

    def call(self, engine, graph, slots, rows) -> "_BatchCall":
        key = (graph, slots, rows)
        if key not in self.calls:
            self.calls[key] = _BatchCall(self, self.session(engine, graph, slots), graph,
                                         slots, rows, engine.hidden_size,
                                         engine.state_dtype)
        return self.calls[key]


_UNBOUND = object()


class _BatchCall(_Call):
    """A batch graph bound for `rows` packed rows; the slots' KV are bound to the sequences
    in them (rebound when the batch's members change)."""

    def __init__(self, batch, session, graph, slots, rows, hidden, dtype):
        binding = session.io_binding()
        host = {"slot_rows": np.zeros([slots], np.int64),
                "seqlens_k": np.zeros([slots], np.int32),
                "total_seq_len": np.zeros([slots], np.int32)}
        if graph == "lower":
            host["input_ids"] = np.zeros([1, rows], np.int64)
        for name, array in host.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        shape, ptr = [1, rows, hidden], lambda v: v.data_ptr()
        if graph == "lower":
            binding.bind_output("exit_hidden", "cpu", 0, dtype, shape, ptr(batch.exit))
        else:
            binding.bind_input("exit_hidden", "cpu", 0, dtype, shape, ptr(batch.exit))
            binding.bind_output("final_hidden", "cpu", 0, dtype, shape, ptr(batch.final))
        super().__init__(session, binding, host)
        self.scratch, self.slots = batch.scratch, slots
        self.past = {}  # slot -> its past_* input names without the slot suffix
        for i in session.get_inputs():
            if i.name.startswith("past_"):
                name, slot = i.name.rsplit(".", 1)
                self.past.setdefault(int(slot), []).append(name)
        self.members = [_UNBOUND] * slots  # the sequence bound in each slot (None: scratch)

    def bind_sequences(self, sequences: list):
        for slot in range(self.slots):
            seq = sequences[slot] if slot < len(sequences) else None
            if self.members[slot] is seq:
                continue
            for name in self.past[slot]:
                value = self.scratch if seq is None else seq.kv[name]
                self.binding.bind_ortvalue_input(f"{name}.{slot}", value)
                self.binding.bind_ortvalue_output(f"{name.replace('past_', 'present_')}.{slot}",
                                                  value)
            self.members[slot] = seq


def batch_round_costs(engine: Engine, cached=200, repeat=9) -> dict:
    """Median ms of one round of a batch: {slots: {rows: ms}}, each of `slots` sequences
    verifying rows // slots rows after `cached` positions (lower, upper and head on them).
    Each batch size's graphs are loaded, measured and let go in turn: every pair holds its
    own copy of the layers' weights. Empty off the CPU, where batches do not run."""
    if engine.device != "cpu":
        return {}
    cached = min(cached, engine.max_context // 2)
    positions = cached + max(BATCH_ROWS)  # what the measurement needs, not the context
    sequences = [engine.new_sequence(positions) for _ in range(max(BATCH_SIZES))]
    ids = [i % engine.vocab_size for i in range(positions)]
    costs = {}
    for slots in BATCH_SIZES:
        first = 0
        while first < cached:  # the prompt, on this size's own graphs
            count = engine.call_rows(first, min(cached - first, CHUNK // slots))
            engine.forward([(seq, first, ids[first:first + count]) for seq in sequences[:slots]])
            first += count
        costs[slots] = {}
        for each in (r for r in BATCH_ROWS if slots * r <= CHUNK and cached + r < engine.max_context):
            parts = [(seq, cached, ids[cached:cached + each]) for seq in sequences[:slots]]
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                engine.forward(parts)
                engine.head(range(slots * each))
                times.append(time.perf_counter() - start)
            costs[slots][slots * each] = 1e3 * statistics.median(times)
        engine._batch = None  # its sessions and calls: let them go before the next size's
        return_freed_memory()
    return costs


def check_context(wanted, most: int) -> int:
    """A sequence's positions: `wanted` (None: the artifact's `most`) if in 2..most."""
    if wanted is None:
        return most
    if not (isinstance(wanted, int) and 2 <= wanted <= most):
        raise EdgespecError(f"invalid max context {wanted!r}: it must be from 2 to the "
                            f"artifact's {most} (export with a larger --max-context for more)")
    return wanted


def measured_costs(engine: Engine, repeat: int = 9, unload_single=False, seconds=None) -> dict:
    """What a round through lower, upper and head costs on this machine by rows, in plain
    steps, for one sequence (lookup plans its drafts on it) and for batches of sequences
    (the batch planner's, on the CPU only), and at how many threads: the manifest's fields. Medians of
    `repeat` rounds (a single sequence's of more: its rounds are shorter); seconds: about
    the most to spend, fewer repeats where a step is slow (a large model). unload_single:
    an engine used for nothing else lets its own lower and upper go before the batch
    rounds, which run their own graphs: one copy of the layers in memory, not two."""
    if seconds is not None:
        step = engine.round_costs(repeat=3, rows=(1,))[1] / 1e3
        repeat = max(1, min(repeat, int(seconds / (COSTS_STEPS * step))))
    ms = engine.round_costs(repeat=max(1, repeat * 5 // 3))
    if unload_single and engine.device == "cpu":
        engine.unload(("lower", "upper"))
    batches = batch_round_costs(engine, repeat=repeat)
    return {"round_costs": {str(rows): round(cost / ms[1], 3) for rows, cost in ms.items()},
            "batch_round_costs": {str(slots): {str(rows): round(cost / ms[1], 3)
                                               for rows, cost in by_rows.items()}
                                  for slots, by_rows in batches.items()},
            "threads": engine.threads}


def _has_top(session) -> bool:
    """Whether a head graph has top_outputs (export/graph.py): CUDA artifacts' do."""
    return any(i.name == "top_k" for i in session.get_inputs())


def return_freed_memory():
    """Give the heap's freed pages back to the system: glibc keeps them otherwise, and a
    session let go would still count against the next one loaded."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _host_array(shape, dtype, align=64) -> np.ndarray:
    """A zeroed host array aligned as ONNX Runtime aligns its own buffers."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(size + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + size].view(dtype).reshape(shape)


def _chunks(ids):
    """Pieces of at most CHUNK tokens."""
    return [ids[a:a + CHUNK] for a in range(0, len(ids), CHUNK)]


class ContextFull(EdgespecError):
    """The KV cache has no room for more tokens."""
