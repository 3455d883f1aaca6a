"""Write the three graphs of an artifact directly from float weights.

lower: token ids -> embeddings -> layers [0, E)  -> exit hidden h_E  (+ KV of layers < E)
upper: h_E                     -> layers [E, N)  -> final hidden h_N (+ KV of layers >= E)
head:  hidden rows             -> final norm -> lm_head -> logits
draft: h_E -> exit adapter (optional) -> final norm -> shortlisted lm_head -> draft logits

The hidden states passed between graphs are the residual stream (before any norm), so the
draft (head on h_E) and the verifier (head on h_N) share one head. Blocks use ONNX Runtime's
LLM ops: GroupQueryAttention (rotary inside; past and present bound to one preallocated
buffer), MatMulNBits (int4), SimplifiedLayerNormalization and its Skip variant.

A graph computes in one float type (its dtype: the KV cache, attention, linear layers,
logits); the residual stream may be kept in another (residual_dtype: float32 around float16
layers, for models whose stream passes float16's range). The norms convert between them.
"""
import hashlib

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgespec.artifact import PAD_ROWS, batch_name

from .gptq import gptq_int4
from .quantize import BLOCK, SourceWeight, quantize_int4, quantize_int8, residual_columns

MS = "com.microsoft"
OPSET = 21
ACCURACY_LEVEL = 4  # MatMulNBits with int8 activations: the fast CPU kernel (DESIGN.md)
# head_bits "mixed": the vocabulary table's first ids keep 8 bits. BPE vocabularies number
# their tokens in merge order, most used first, so the first ids hold most of what a model
# writes while the table reads far fewer bytes than at 8 bits (DESIGN.md).
FREQUENT_TOKENS = 8192
ONNX_DTYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64,
              np.dtype(np.int32): TensorProto.INT32}


class Graph:
    """Nodes, inputs, outputs and initializers of one ONNX graph under construction."""

    def __init__(self, name: str, dtype=np.float32, files=None, residual_dtype=None):
        """files: the artifact's WeightFiles (export/writer.py), which take each weight to
        disk as it is named; without them the graph keeps its weights in memory.
        residual_dtype: the residual stream's float type (default: dtype)."""
        self.name, self.dtype, self.files = name, np.dtype(dtype), files
        self.residual_dtype = np.dtype(residual_dtype or dtype)
        self.nodes, self.inputs, self.outputs = [], [], []
        # name -> numpy array, or (Stored, shape) once on disk (names are shared across graphs)
        self.initializers = {}
        self.block_sums = {}  # (input name, block) -> its block sums, for residual minima
        self.shares_weights = False  # a batch graph: every weight is another graph's
        self._count = 0

    def input(self, name, elem, shape):
        self.inputs.append(helper.make_tensor_value_info(name, ONNX_DTYPE[np.dtype(elem)], shape))
        return name

    def output(self, value, name, elem, shape):
        self.op("Identity", [value], outputs=[name])
        self.outputs.append(helper.make_tensor_value_info(name, ONNX_DTYPE[np.dtype(elem)], shape))

    def weight(self, name, array, cast=True, dtype=None):
        """An initializer; float weights stored in another dtype than `dtype` (default: the
        graph's) get a Cast (folded at load). Shape constants (int64) stay in the graph, for
        shape inference."""
        if self.files is None or array.dtype == np.int64:
            self.initializers[name] = np.ascontiguousarray(array)
        else:
            self.initializers[name] = (self.files.put(name, array, f"{self.name}.data"),
                                       array.shape)
        dtype = np.dtype(dtype or self.dtype)
        if cast and array.dtype.kind == "f" and array.dtype != dtype:
            return self.op("Cast", [name], to=ONNX_DTYPE[dtype])
        return name

    def to_residual(self, x):
        """x, computed in the graph's dtype, in the residual stream's."""
        return self._cast(x, self.dtype, self.residual_dtype)

    def from_residual(self, x):
        """x, in the residual stream's dtype, in the graph's."""
        return self._cast(x, self.residual_dtype, self.dtype)

    def _cast(self, x, have, want):
        return x if have == want else self.op("Cast", [x], to=ONNX_DTYPE[want])

    def op(self, op_type, inputs, outputs=None, n_out=1, domain=None, **attrs):
        self._count += 1
        if outputs is None:
            outputs = [f"{op_type.lower()}_{self._count}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=f"{op_type}_{self._count}",
                                           domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def as_rows(self, name):
        """View a weight [N, ...] as [N, rest] (a table two ops read, each its own way)."""
        w = self.initializers[name]
        shape = w.shape if isinstance(w, np.ndarray) else w[1]
        shape = (shape[0], int(np.prod(shape[1:])))
        self.initializers[name] = w.reshape(shape) if isinstance(w, np.ndarray) else (w[0], shape)

    def model(self, initializers) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                       helper.make_opsetid(MS, 1)],
                                 producer_name="edgespec")


def by_block(g, x, k, block):
    """[1, rows, K] -> [1, rows, K/block, block]: x viewed block by block."""
    return g.op("Reshape", [x, g.weight(f"by_block_{k // block}_{block}", np.array(
        [0, 0, k // block, block]))])


class Blocks:
    """The model's math, one method per block, for a given architecture and precision."""

    def __init__(self, arch, weights, precision, max_context, head_bits=8, source_grid=None,
                 residual_dtype=None):
        """source_grid: name -> the source's own quantized weight (SourceWeight) or None
        (int4 scheme "source"): those weights keep the file's grid; the others, and every
        weight without it, are rounded to zero points (int4) or 8 bits. residual_dtype: the
        residual stream's float type, if not the graphs' own (Graph)."""
        self.arch, self.w, self.precision, self.max_context = arch, weights, precision, max_context
        self.residual_dtype = residual_dtype
        self.head_bits, self.source_grid = head_bits, source_grid
        self.store = np.float16 if precision == "fp16" else np.float32
        # MatMulNBits weights: 4 bits (int4) or 8 (int8: every linear layer and the table)
        self.nbits = {"int4": 4, "int8": 8}.get(precision)
        self.on_layer = lambda: None  # progress callback, once per layer built
        self.head_gram = None  # X'X of the lm_head's inputs, when GPTQ gathered it
        # (name, bits, weight digest) -> GPTQ's weight: made once, kept for rebuilds
        self._gptq = {}
        # other weights made, while the graphs that share them are built (lockstep)
        self._made = {}

    def release(self):
        """Forget the weights kept for building and rebuilding graphs."""
        self._gptq.clear()
        self._made.clear()

    def linear(self, g, x, name, w, bias=None):
        """x @ w.T (+ bias); w is [out, in] as in Hugging Face checkpoints."""
        if not self.nbits:
            y = g.op("MatMul", [x, g.weight(f"{name}.weight", w.T.astype(self.store))])
            if bias is not None:
                y = g.op("Add", [y, g.weight(f"{name}.bias", bias.astype(self.store))])
            return y
        if isinstance(w, list):  # source grids of their own: one op each, outputs side by side
            ends = np.cumsum([part.shape[0] for part in w])[:-1]
            biases = [None] * len(w) if bias is None else np.split(bias, ends)
            return g.op("Concat", [self.matmul_nbits(g, x, f"{name}.{i}", part, b)
                                   for i, (part, b) in enumerate(zip(w, biases))], axis=-1)
        q = w if isinstance(w, SourceWeight) else self.quantized(name, w, self.nbits)
        return self.matmul_nbits(g, x, name, q, bias)

    def matmul_nbits(self, g, x, name, q, bias=None):
        """x @ q.T in one MatMulNBits. A source grid's residual minima multiply x's block
        sums, appended to x (quantize.residual_columns), rather than in a MatMul and an Add
        of their own: fewer ops a layer (DESIGN.md)."""
        n, k = q.shape
        if q.residual is not None:
            x = g.op("Concat", [x, self.block_sums(g, x, k, q.block)], axis=-1)
            k, q = k + k // q.block, self.with_residual_columns(name, q)
        inputs = [x, *self.nbits_inputs(g, name, q)]
        if bias is not None:
            inputs += ["", g.weight(f"{name}.bias", bias.astype(g.dtype))]
        return g.op("MatMulNBits", inputs, domain=MS, K=k, N=n, bits=q.bits, block_size=q.block,
                    accuracy_level=ACCURACY_LEVEL)

    def with_residual_columns(self, name, q):
        # keyed by the scales too: a draft head's shortlist changes during calibration
        digest = hashlib.sha1(np.ascontiguousarray(q.scales)).hexdigest()
        return self.cached((name, "columns", digest), lambda: residual_columns(q))

    def cached(self, key, make, kept=None):
        """make(), once for the graphs built side by side (lockstep); kept: a dict that
        keeps it for the whole export instead (GPTQ: too slow to make twice)."""
        made = self._made if kept is None else kept
        if key not in made:
            made[key] = make()
        return made[key]

    def quantized(self, name, w, bits, gram=None):
        """Float weights w at `bits` (4: zero points; 8: symmetric), once per export:
        calibration rebuilds the graphs at other exit layers. gram: X'X of the layer's
        inputs, for GPTQ (export/gptq.py) instead of rounding each weight on its own."""
        key = (name, bits, hashlib.sha1(np.ascontiguousarray(w)).hexdigest())
        if bits == 8:
            return self.cached(key, lambda: quantize_int8(w))
        if gram is not None:  # export passes grams only for the zp scheme
            return self.cached(key, lambda: gptq_int4(w, gram), self._gptq)
        if key in self._gptq:  # GPTQ made it before the graphs were built
            return self._gptq[key]
        return self.cached(key, lambda: quantize_int4(w))

    LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
               "down": ("mlp.down_proj",)}

    def linear_weight(self, layer, name):
        """One of a layer's LINEARS as the graph multiplies by it: q, k and v packed into one
        weight, gate and up into one; the source's grid where it is kept (a SourceWeight, or
        a list of them when the parts' grids differ)."""
        names = [f"model.layers.{layer}.{m}.weight" for m in self.LINEARS[name]]
        source = self.source_weight(f"layers.{layer}.{name}", names)
        if source is not None:
            return source
        parts = [self.w[n] for n in names]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def source_weight(self, key, names):
        """The source's own grid of the tensors `names`, joined; None when not kept (a float
        tensor among them, or another scheme)."""
        if not self.source_grid or self.precision != "int4":
            return None
        return self.cached((key, "source"), lambda: self._joined_source(names))

    def _joined_source(self, names):
        parts = [self.source_grid(n) for n in names]
        if any(p is None for p in parts):
            return None
        groups = SourceWeight.grouped(parts)
        return groups[0] if len(groups) == 1 else groups

    @staticmethod
    def nbits_inputs(g, name, q):
        """MatMulNBits' weight, scales and zero points ("" when the default) inputs."""
        return [g.weight(f"{name}.qweight", q.packed),
                g.weight(f"{name}.scales", q.scales.astype(g.dtype)),
                "" if q.zero_points is None else g.weight(f"{name}.zero_points", q.zero_points)]

    def block_sums(self, g, x, k, block):
        """[1, rows, K] -> [1, rows, K/block]: the sum of each block of x (once per input).
        A ReduceSum sums each row alone; with a MatMul by ones, Gemma 3's seeded speculative
        output left its plain output, and a row must get the same bits alone and among
        others (Losslessness)."""
        if (x, block) not in g.block_sums:
            g.block_sums[x, block] = g.op("ReduceSum", [by_block(g, x, k, block), g.weight(
                "axis_minus_1", np.array([-1]))], keepdims=0)
        return g.block_sums[x, block]

    def norm_weight(self, name):
        """The scale a norm multiplies by: its weight, plus 1 for Gemma's (1 + w) norms."""
        w = self.w[name + ".weight"]
        return w + np.float32(self.arch.norm_offset) if self.arch.norm_offset else w

    def rms_norm(self, g, x, name, out=None):
        """norm(x) in the float type `out` (default: the graph's dtype), whatever x's."""
        scale = g.weight(name, self.norm_weight(name), dtype=out)  # the op's output type
        return g.op("SimplifiedLayerNormalization", [x, scale], axis=-1,
                    epsilon=self.arch.rms_norm_eps, stash_type=1)

    def skip_rms_norm(self, g, x, residual, name):
        """(norm(x + residual), x + residual) in one op, on the residual stream; the norm
        comes back in the graph's dtype."""
        normed, _, _, total = g.op(
            "SkipSimplifiedLayerNormalization",
            [x, residual, g.weight(name, self.norm_weight(name), dtype=g.residual_dtype)],
            n_out=4, domain=MS, epsilon=self.arch.rms_norm_eps)
        return g.from_residual(normed), total

    def head_norms(self, g, qkv, layer):
        """Gemma's RMSNorm over each head's q and k (before rotary), on the packed QKV."""
        a, p = self.arch, f"model.layers.{layer}.self_attn."
        q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q, k, v = g.op("Split", [qkv, g.weight(f"qkv_split_{q_width}_{kv_width}", np.array(
            [q_width, kv_width, kv_width]))], n_out=3, axis=-1)
        by_head = g.weight("by_head", np.array([0, 0, -1, a.head_dim]))
        packed = g.weight("packed", np.array([0, 0, -1]))
        q, k = (g.op("Reshape", [self.rms_norm(g, g.op("Reshape", [x, by_head]), p + name),
                                 packed]) for x, name in ((q, "q_norm"), (k, "k_norm")))
        return g.op("Concat", [q, k, v], axis=-1)

    def attention(self, g, x, layer, lengths, cos, sin):
        """Self-attention of each sequence's rows (`lengths.slots` of them, packed in x in
        slot order): one GroupQueryAttention per sequence on its own KV cache."""
        a, p = self.arch, f"model.layers.{layer}.self_attn."
        qkv_w = self.linear_weight(layer, "qkv")
        qkv_b = (np.concatenate([self.w[p + f"{m}_proj.bias"] for m in "qkv"])
                 if a.attention_bias else None)
        qkv = self.linear(g, x, f"layers.{layer}.qkv", qkv_w, qkv_b)
        if a.qk_norm:
            qkv = self.head_norms(g, qkv, layer)
        # Gemma scales scores by query_pre_attn_scalar^-1/2; the others by GQA's default
        scale = {"scale": a.query_pre_attn_scalar ** -0.5} if a.query_pre_attn_scalar else {}
        # zero rows after the new ones: attention never runs a single query row, so a token
        # gets the same bits alone as among others (see edgespec/engine.py); their KV lands
        # past the valid length, where the next call overwrites it
        width = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        pad = g.weight(f"pad_row_{width}", np.zeros([1, PAD_ROWS, width], g.dtype))
        kv_shape = [1, a.num_kv_heads, "cache_len", a.head_dim]
        pieces = [qkv] if lengths.slots == 1 else \
            g.op("Split", [qkv, lengths.rows], n_out=lengths.slots, axis=1)
        outs = []
        for slot, piece in enumerate(pieces):
            suffix = lengths.suffix(slot)
            past_k = g.input(f"past_key.{layer}{suffix}", g.dtype, kv_shape)
            past_v = g.input(f"past_value.{layer}{suffix}", g.dtype, kv_shape)
            out, present_k, present_v = g.op(
                "GroupQueryAttention", [g.op("Concat", [piece, pad], axis=1), "", "", past_k,
                                        past_v, *lengths.each[slot], cos, sin],
                outputs=[f"attn_{layer}{suffix}", f"present_key.{layer}{suffix}",
                         f"present_value.{layer}{suffix}"],
                domain=MS, num_heads=a.num_heads, kv_num_heads=a.num_kv_heads, do_rotary=1,
                rotary_interleaved=0, local_window_size=self._window(layer), **scale)
            g.outputs += [helper.make_tensor_value_info(name, ONNX_DTYPE[g.dtype], kv_shape)
                          for name in (present_k, present_v)]
            outs.append(g.op("Slice", [out, g.weight("zero", np.array([0])),
                                       g.weight("minus_pad", np.array([-PAD_ROWS])),
                                       g.weight("axis_1", np.array([1]))]))
        unpadded = outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1)
        return self.linear(g, unpadded, f"layers.{layer}.o", self.linear_weight(layer, "o"))

    def sliding(self, layer) -> bool:
        """Whether `layer` attends through the sliding window (Gemma: its local layers)."""
        types = self.arch.layer_types
        return self.arch.sliding_window > 0 and (not types or types[layer] == "sliding_attention")

    def _window(self, layer):
        window = self.arch.sliding_window
        return window if self.sliding(layer) and window < self.max_context else -1

    def mlp(self, g, x, layer):
        gate_up = self.linear(g, x, f"layers.{layer}.gate_up", self.linear_weight(layer, "gate_up"))
        gate, up = g.op("Split", [gate_up], n_out=2, axis=-1, num_outputs=2)
        if self.arch.hidden_act == "gelu_tanh":  # GeGLU
            act = g.op("Gelu", [gate], approximate="tanh")
        else:
            act = g.op("QuickGelu", [gate], domain=MS, alpha=1.0)  # x * sigmoid(x) in one op
        return self.linear(g, g.op("Mul", [act, up]), f"layers.{layer}.down",
                           self.linear_weight(layer, "down"))

    def layers(self, g, hidden, first, last, lengths):
        """Decoder layers [first, last) on the residual stream; returns the new stream."""
        return self.lockstep([self.layer_steps(g, hidden, first, last, lengths)])[0]

    def lockstep(self, builds) -> list:
        """Run several graphs' layer_steps side by side, a layer at a time: each layer's
        weights are made once for all of them and forgotten after, so building never holds
        more than a layer's. Returns each graph's output stream."""
        outputs, pending = [None] * len(builds), dict(enumerate(builds))
        while pending:
            for i, build in list(pending.items()):
                try:
                    next(build)
                except StopIteration as done:
                    outputs[i] = done.value
                    del pending[i]
            self._made.clear()
            if pending:
                self.on_layer()
        return outputs

    def layer_steps(self, g, hidden, first, last, lengths):
        """Decoder layers [first, last) on the residual stream, a layer per step (a
        generator: see lockstep); returns the new stream."""
        a, rotary = self.arch, {}
        for layer in range(first, last):  # Gemma's local layers have a rotary base of their own
            local = self.local_rope(layer)
            if local not in rotary:
                names = ("cos_cache_local", "sin_cache_local") if local else ("cos_cache", "sin_cache")
                tables = self.rotary_tables(g.dtype, a.local_rope_theta if local else a.rope_theta)
                rotary[local] = [g.weight(name, table) for name, table in zip(names, tables)]
        x = self.rms_norm(g, hidden, f"model.layers.{first}.input_layernorm")
        residual, mlp_out = hidden, None
        for layer in range(first, last):
            p = f"model.layers.{layer}."
            if mlp_out is not None:
                x, residual = self.skip_rms_norm(g, mlp_out, residual, p + "input_layernorm")
            attn = self.attention(g, x, layer, lengths, *rotary[self.local_rope(layer)])
            if a.sandwich_norms:  # Gemma: norm after attention, then before and after the MLP
                attn = self.rms_norm(g, attn, p + "post_attention_layernorm", g.residual_dtype)
            else:
                attn = g.to_residual(attn)
            x, residual = self.skip_rms_norm(g, attn, residual, p + (
                "pre_feedforward_layernorm" if a.sandwich_norms else "post_attention_layernorm"))
            mlp_out = self.mlp(g, x, layer)
            if a.sandwich_norms:
                mlp_out = self.rms_norm(g, mlp_out, p + "post_feedforward_layernorm",
                                        g.residual_dtype)
            else:
                mlp_out = g.to_residual(mlp_out)
            yield
        return g.op("Add", [mlp_out, residual])

    def local_rope(self, layer) -> bool:
        return bool(self.arch.local_rope_theta) and self.sliding(layer)

    def rotary_tables(self, dtype, theta=None):
        a = self.arch
        theta = theta or a.rope_theta
        inv_freq = 1.0 / theta ** (np.arange(0, a.head_dim, 2, dtype=np.float64) / a.head_dim)
        if a.rope_scaling.get("rope_type") == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, a.rope_scaling)
        positions = np.arange(self.max_context + PAD_ROWS, dtype=np.float64)
        angles = np.outer(positions, inv_freq)
        return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)

    def vocab_parts(self, name, table, source=None):
        """The int4 artifact's vocabulary table as [(name, quantized rows, bits)]: the
        source's grid when kept (`source`); else one part at head_bits 8 or 4; "mixed": the
        first FREQUENT_TOKENS ids at 8 bits, the rest at 4."""
        if source is not None:
            return [(name, source, source.bits)]
        # GPTQ's 4-bit rows for a table the lm_head multiplies by (tied: the embedding too)
        gram = self.head_gram if name != "embed_tokens" or self.arch.tie_word_embeddings else None
        if self.head_bits != "mixed" or len(table) <= FREQUENT_TOKENS:
            bits = 8 if self.head_bits == "mixed" else self.head_bits
            return [(name, self.quantized(name, table, bits, gram), bits)]
        frequent, rare = table[:FREQUENT_TOKENS], table[FREQUENT_TOKENS:]
        return [(f"{name}.frequent", self.quantized(f"{name}.frequent", frequent, 8), 8),
                (f"{name}.rare", self.quantized(f"{name}.rare", rare, 4, gram), 4)]

    def table(self, tensor, name) -> tuple:
        """(float table, None) or (None, the source's grid of it): a table dequantized to
        float32 only where it is quantized anew (a large vocabulary's takes gigabytes)."""
        source = self.source_weight(name, [tensor])
        return (None, source) if source is not None else (self.w[tensor], None)

    def embedding(self, g, ids):
        """The residual stream's first values: the embedding rows of `ids`."""
        rows = g.to_residual(self._embedding_rows(g, ids))
        if not self.arch.embedding_scale:
            return rows
        # Gemma scales embeddings by sqrt(hidden), rounded to float32 as transformers does
        scale = np.array(self.arch.embedding_scale, np.float32).astype(g.residual_dtype)
        return g.op("Mul", [rows, g.weight("embedding_scale", scale, cast=False)])

    def _embedding_rows(self, g, ids):
        if not self.nbits:
            table = self.w["model.embed_tokens.weight"]
            return g.op("Gather", [g.weight("embed_tokens", table.astype(self.store)), ids], axis=0)
        parts = self.vocab_parts("embed_tokens", *self.table("model.embed_tokens.weight",
                                                             "embed_tokens"))
        if len(parts) == 1:
            return self._lookup(g, ids, *parts[0])
        # mixed: each id looked up in both parts (clamped into range), the right one kept
        first_rare = g.weight("first_rare_token", np.array(FREQUENT_TOKENS))
        frequent = self._lookup(g, g.op("Min", [ids, g.weight("last_frequent_token", np.array(
            FREQUENT_TOKENS - 1))]), *parts[0])
        rare = self._lookup(g, g.op("Max", [g.op("Sub", [ids, first_rare]), g.weight(
            "zero", np.array([0]))]), *parts[1])
        is_frequent = g.op("Unsqueeze", [g.op("Less", [ids, first_rare]),
                                         g.weight("axis_minus_1", np.array([-1]))])
        return g.op("Where", [is_frequent, frequent, rare])

    def _lookup(self, g, ids, name, q, bits):
        """Rows of a quantized vocabulary table, dequantized (a source grid's residual
        minima added)."""
        residual, (_, k) = q.residual, q.shape
        if residual is not None:  # stored after each row's K columns, as for the lm_head
            q = self.with_residual_columns(name, q)
        qweight, scales, zero_points = self.nbits_inputs(g, name, q)
        # the same bytes as the lm_head's MatMulNBits weight, viewed as [vocab, hidden bytes]
        g.as_rows(qweight)
        rows = g.op("GatherBlockQuantized", [qweight, ids, scales, zero_points], domain=MS,
                    bits=bits, block_size=q.block, gather_axis=0, quantize_axis=1)
        if residual is None:
            return rows
        blocks = k // q.block
        last_axis = g.weight("axis_minus_1", np.array([-1]))
        minima = g.op("Slice", [rows, g.weight(f"int_{k}", np.array([k])),
                                g.weight(f"int_{k + blocks}", np.array([k + blocks])), last_axis])
        rows = g.op("Slice", [rows, g.weight("zero", np.array([0])),
                              g.weight(f"int_{k}", np.array([k])), last_axis])
        with_minima = g.op("Add", [by_block(g, rows, k, q.block),
                                   g.op("Unsqueeze", [minima, last_axis])])
        return g.op("Reshape", [with_minima, g.weight(f"by_row_{k}", np.array([0, 0, k]))])

    def lm_head(self, g, x, vocab=None):
        """Logits from normed hidden states, for all tokens or for the ids in `vocab` (a
        shortlist, stored as its own table). In int4 artifacts the vocabulary table has
        head_bits (8, 4 or mixed, see vocab_parts): it decides the top token."""
        tied = self.arch.tie_word_embeddings
        name = "embed_tokens" if tied else "lm_head"
        tensor = "model.embed_tokens.weight" if tied else "lm_head.weight"
        table, source = self.table(tensor, name)
        if vocab is not None:
            name = "draft_head"
            table, source = ((None, source.take(vocab)) if source is not None
                             else (table[vocab], None))
        if self.nbits:
            logits = [self.matmul_nbits(g, x, part, q)
                      for part, q, _ in self.vocab_parts(name, table, source)]
            return logits[0] if len(logits) == 1 else g.op("Concat", logits, axis=-1)
        # Gemm with transB reads the table as stored: one copy for lookup and lm_head
        rows = g.op("Reshape", [x, g.weight("rows_by_hidden", np.array([-1, table.shape[1]]))])
        logits = g.op("Gemm", [rows, g.weight(name, table.astype(self.store))], transB=1)
        return g.op("Unsqueeze", [logits, g.weight("axis_0", np.array([0]))])


def llama3_inv_freq(inv_freq, scaling):
    """Llama 3.1's frequency-dependent rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return np.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class Lengths:
    """The inputs that say where each sequence's rows are. One sequence: seqlens_k [1] and
    total_seq_len [] as GroupQueryAttention takes them. Several (a batch graph): the rows,
    packed in slot order, and both lengths per slot ([slots] each); each slot has its own
    KV inputs (past_key.{layer}.{slot})."""

    def __init__(self, g, slots=1):
        self.slots = slots
        if slots == 1:
            self.each = [(g.input("seqlens_k", np.int32, [1]),
                          g.input("total_seq_len", np.int32, []))]
            return
        self.rows = g.input("slot_rows", np.int64, [slots])
        seqlens_k = g.input("seqlens_k", np.int32, [slots])
        total = g.input("total_seq_len", np.int32, [slots])
        self.each = [(g.op("Slice", [seqlens_k, g.weight(f"slot_{s}", np.array([s])),
                                     g.weight(f"slot_{s + 1}", np.array([s + 1]))]),
                      g.op("Gather", [total, g.weight(f"slot_index_{s}", np.array(s))], axis=0))
                     for s in range(slots)]

    def suffix(self, slot) -> str:
        return "" if self.slots == 1 else f".{slot}"


def build_lower(blocks: Blocks, exit_layer: int, dtype, slot_counts=(1,), files=None) -> list:
    """lower.onnx (one slot) and its batch graphs (several), built side by side."""
    def embedded(g):
        return blocks.embedding(g, g.input("input_ids", np.int64, [1, "seq"]))
    return _side_by_side(blocks, "lower", slot_counts, dtype, files, embedded, 0, exit_layer,
                         "exit_hidden")


def build_upper(blocks: Blocks, exit_layer: int, dtype, slot_counts=(1,), files=None) -> list:
    """upper.onnx (one slot) and its batch graphs (several), built side by side."""
    def exit_states(g):
        return g.input("exit_hidden", g.residual_dtype, [1, "seq", blocks.arch.hidden_size])
    return _side_by_side(blocks, "upper", slot_counts, dtype, files, exit_states, exit_layer,
                         blocks.arch.num_layers, "final_hidden")


def _side_by_side(blocks, name, slot_counts, dtype, files, stream, first, last, output) -> list:
    """The graphs `name` for each count of slots, layers [first, last) on `stream(g)`, built
    in lockstep so that each layer's weights are made once for all of them."""
    graphs, builds = [], []
    for slots in slot_counts:
        g = Graph(batch_name(name, slots), dtype, files, blocks.residual_dtype)
        g.shares_weights = slots > 1
        graphs.append(g)
        builds.append(blocks.layer_steps(g, stream(g), first, last, Lengths(g, slots)))
    for g, out in zip(graphs, blocks.lockstep(builds)):
        g.output(out, output, g.residual_dtype, [1, "seq", blocks.arch.hidden_size])
    return graphs


def top_outputs(g, logits, rows):
    """Outputs beside the logits, computed where the graph runs: each row's `top_k` largest
    logits (input [1]) as float32 with their ids, and its likeliest token's probability.
    CUDA artifacts have them, so that a round copies a few candidates per row to the host,
    not the rows' logits."""
    z = g.op("Cast", [logits], to=TensorProto.FLOAT)
    k = g.input("top_k", np.int64, [1])
    values, ids = g.op("TopK", [z, k], n_out=2, axis=-1, largest=1, sorted=1)
    g.output(values, "top_values", np.float32, [1, rows, "k"])
    g.output(ids, "top_ids", np.int64, [1, rows, "k"])
    last = g.weight("axis_minus_1", np.array([-1]))
    # the row's max is TopK's first value (ReduceMax's opset-20 schema has no CUDA kernel)
    best = g.op("Slice", [values, g.weight("zero", np.array([0])), g.weight("one", np.array([1])),
                          last])
    total = g.op("ReduceSum", [g.op("Exp", [g.op("Sub", [z, best])]), last], keepdims=0)
    g.output(g.op("Reciprocal", [total]), "top1_probability", np.float32, [1, rows])


def build_draft(blocks: Blocks, adapter: bool, vocab, dtype, files=None) -> Graph:
    """Draft logits for the last of the given exit states: through the exit adapter (stored
    in `blocks` as decoder layer N, with its own KV cache) when there is one, then the
    final norm and the lm_head rows of `vocab` (None: all); on CUDA its top_outputs too."""
    g = Graph("draft", dtype, files, blocks.residual_dtype)
    hidden = g.input("exit_hidden", g.residual_dtype, [1, "seq", blocks.arch.hidden_size])
    if adapter:
        n = blocks.arch.num_layers
        hidden = blocks.layers(g, hidden, n, n + 1, Lengths(g))
    last = g.op("Gather", [hidden, g.weight("last_row", np.array([-1]))], axis=1)
    logits = blocks.lm_head(g, blocks.rms_norm(g, last, "model.norm"), vocab)
    size = blocks.arch.vocab_size if vocab is None else len(vocab)
    g.output(logits, "logits", g.dtype, [1, 1, size])
    if on_device(dtype):
        top_outputs(g, logits, 1)
    return g


def build_head(blocks: Blocks, dtype, files=None) -> Graph:
    """Logits for the chosen rows of a hidden sequence (prefill needs only the last); on
    CUDA their top_outputs too."""
    g = Graph("head", dtype, files, blocks.residual_dtype)
    hidden = g.input("hidden", g.residual_dtype, [1, "seq", blocks.arch.hidden_size])
    rows = g.input("rows", np.int64, ["rows"])
    picked = g.op("Gather", [hidden, rows], axis=1)
    logits = blocks.lm_head(g, blocks.rms_norm(g, picked, "model.norm"))
    g.output(logits, "logits", g.dtype, [1, "rows", blocks.arch.vocab_size])
    if on_device(dtype):
        top_outputs(g, logits, "rows")
    return g


def on_device(dtype) -> bool:
    """Whether graphs of these activations are for a GPU (CUDA artifacts are float16)."""
    return np.dtype(dtype) != np.float32
