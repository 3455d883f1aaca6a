"""Read a GGUF file directly: its header first, then each tensor on demand, memory-mapped.

`GGUFFile` parses the metadata and the tensor table (a second or two, no tensor data read),
so `check()` can refuse an unsupported architecture or tensor type before any minutes are
spent. `GGUFWeights` is a mapping from Hugging Face parameter names to float32 arrays that
dequantizes a tensor when it is looked up (export/gguf_quants.py) and keeps nothing: the
export holds one float32 tensor group at a time, never the whole model. Tensor bytes are
read with pread, not through a mapping: the file's pages stay in the system's cache instead
of adding the whole file to the export's resident memory.
"""
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError

from . import gguf_quants

GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")
# llama.cpp's hyperparameters of Gemma 3 that the file does not carry
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_SLIDING_PATTERN = 6  # every sixth layer attends globally
GEMMA3_END_OF_TURN = "<end_of_turn>"
# Gemma 3 GGUFs carry no chat template; this is the model's own (Google's, text only)
GEMMA3_CHAT_TEMPLATE = Path(__file__).parent / "data" / "gemma3_chat_template.jinja"

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9

# GGUF tensor names -> Hugging Face parameter names ("blk.N." -> "model.layers.N.")
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma normalizes after attention itself (post_attention_norm); its ffn_norm comes before the MLP
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}


class GGUFFile:
    """A GGUF file's metadata and tensor table; tensor data stays on disk until read."""

    def __init__(self, path):
        self.path = Path(path)
        self._data = np.memmap(self.path, np.uint8, mode="r")  # the header only
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise EdgespecError(f"{self.path} is not a readable GGUF file ({e}); "
                                "check that it was downloaded whole") from e
        finally:
            del self._data

    def _parse(self):
        buf = self._data
        if bytes(buf[:4]) != b"GGUF":
            raise EdgespecError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise EdgespecError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self._pos, self.metadata = 24, {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        self.tensors = {}  # name -> (ggml type, shape in numpy order, offset in the data section)
        for _ in range(n_tensors):
            name = self._string()
            dims = struct.unpack_from(f"<{self._u32()}Q", buf, self._pos)
            self._pos += 8 * len(dims)
            kind, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            self.tensors[name] = (kind, tuple(int(d) for d in reversed(dims)), offset)
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = -(-self._pos // align) * align

    def _u32(self):
        self._pos += 4
        return struct.unpack_from("<I", self._data, self._pos - 4)[0]

    def _string(self):
        (n,) = struct.unpack_from("<Q", self._data, self._pos)
        self._pos += 8 + n
        return bytes(self._data[self._pos - n:self._pos]).decode("utf-8")

    def _value(self, kind):
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, (n,) = self._u32(), struct.unpack_from("<Q", self._data, self._pos)
            self._pos += 8
            if item in _NUMPY:
                values = np.frombuffer(self._data, _NUMPY[item], n, self._pos).copy()
                self._pos += values.nbytes
                return values
            return [self._value(item) for _ in range(n)]
        (value,) = struct.unpack_from(_SCALARS[kind], self._data, self._pos)
        self._pos += struct.calcsize(_SCALARS[kind])
        return value

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "?")

    def field(self, key, default=None):
        """An architecture field, e.g. field("block_count") reads "qwen2.block_count"."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name, rows=None) -> np.ndarray:
        """The tensor's bytes as stored; rows: a range of its rows (all by default)."""
        kind, shape, offset = self.tensors[name]
        row_bytes = gguf_quants.nbytes(kind, int(np.prod(shape[1:])))
        first, stop = (0, shape[0]) if rows is None else (rows.start, rows.stop)
        return self._read(self.data_start + offset + first * row_bytes, (stop - first) * row_bytes)

    def _read(self, start, size) -> np.ndarray:
        out = np.empty(size, np.uint8)
        view = memoryview(out)
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < size:  # one read returns at most about 2 GB
                n = os.preadv(f.fileno(), [view[done:]], start + done)
                if n == 0:
                    raise EdgespecError(f"{self.path} ends inside its tensor data; check that "
                                        "it was downloaded whole")
                done += n
        return out

    def array(self, name, rows=None) -> np.ndarray:
        """The tensor as float32, in numpy order ([rows, columns] = [out, in] for weights);
        rows: a range of its rows (all by default)."""
        kind, shape, _ = self.tensors[name]
        if rows is not None:
            shape = (len(rows), *shape[1:])
        return gguf_quants.dequantize(self.raw(name, rows), kind, shape)

    def check(self):
        """Refuse, in one line, an architecture or tensor type this exporter cannot read."""
        if self.architecture not in GGUF_ARCHITECTURES:
            raise EdgespecError(f"unsupported architecture {self.architecture} in {self.path.name}; "
                                f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        for name, (kind, _, _) in self.tensors.items():
            if not gguf_quants.supported(kind):
                raise EdgespecError(
                    f"unsupported GGUF tensor type {gguf_quants.type_name(kind)} ({name}) in "
                    f"{self.path.name}; supported: {', '.join(gguf_quants.TYPE_NAMES.values())}")
        unknown = [n for n in self.tensors if hf_name(n, self.architecture) is None]
        if unknown:
            raise EdgespecError(f"unsupported tensor {unknown[0]} in {self.path.name} "
                                f"({self.architecture}); this exporter does not know where it goes")

    def type_counts(self) -> dict:
        counts = {}
        for kind, _, _ in self.tensors.values():
            counts[gguf_quants.type_name(kind)] = counts.get(gguf_quants.type_name(kind), 0) + 1
        return counts


def hf_name(gguf_name: str, model_type: str):
    """The Hugging Face parameter name of a GGUF tensor (None: not one this exporter reads)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _GEMMA3_NAMES if model_type == "gemma3" else _LAYER_NAMES
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


class GGUFWeights(Mapping):
    """Hugging Face name -> float32 array, dequantized from the file at each lookup.

    What llama.cpp's converter changed is undone here, as transformers does: Llama's q/k rows
    are permuted back to halves rotary, and Gemma's norm weights lose the 1 added to them."""

    def __init__(self, gguf: GGUFFile, arch):
        self.gguf, self.arch = gguf, arch
        self._names = {hf_name(n, arch.model_type): n for n in gguf.tensors}

    def __getitem__(self, name):
        array = self.gguf.array(self._names[name])
        a = self.arch
        order = self._row_order(name, len(array))
        if order is not None:
            array = array[order]
        if a.model_type == "gemma3" and name.endswith("norm.weight"):
            array = array - np.float32(1)
        return np.ascontiguousarray(array)

    def rows(self, name, rows: range) -> np.ndarray:
        """Rows of a vocabulary table (embedding or lm_head) as float32, the rest unread."""
        return np.ascontiguousarray(self.gguf.array(self._names[name], rows))

    def quantized(self, name):
        """The tensor's own grid (export/quantize.py: SourceWeight), or None for a float one
        or a name the file does not hold."""
        from .quantize import SourceWeight
        gguf_name = self._names.get(name)
        if gguf_name is None or self.gguf.tensors[gguf_name][0] not in gguf_quants.AFFINE:
            return None
        kind, shape, _ = self.gguf.tensors[gguf_name]
        codes, scales, minima, block, bits = gguf_quants.affine(self.gguf.raw(gguf_name), kind, shape)
        order = self._row_order(name, shape[0])
        if order is not None:
            codes, scales, minima = codes[order], scales[order], minima[order]
        return SourceWeight.from_affine(codes, scales, minima, block, bits)

    def quantized_types(self) -> list:
        """Names of the quantized types among the tensors this exporter reads."""
        kinds = {self.gguf.tensors[n][0] for h, n in self._names.items() if h}
        return sorted(gguf_quants.type_name(k) for k in kinds if k in gguf_quants.AFFINE)

    def _row_order(self, name, rows):
        """Llama's q/k rows as transformers orders them (the converter's permutation undone)."""
        a = self.arch
        if a.model_type != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        heads = a.num_heads if "q_proj" in name else a.num_kv_heads
        return np.arange(rows).reshape(heads, -1, 2).swapaxes(1, 2).reshape(-1)

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)

    def type_name(self, name) -> str:
        """A tensor's GGUF type, without reading it."""
        return gguf_quants.type_name(self.gguf.tensors[self._names[name]][0])

    def shape(self, name) -> tuple:
        """A tensor's shape (numpy order), without reading it."""
        return self.gguf.tensors[self._names[name]][1]

    def nbytes(self, name) -> int:
        """The float32 size of a tensor, without reading it."""
        return 4 * int(np.prod(self.gguf.tensors[self._names[name]][1]))


def architecture(gguf: GGUFFile):
    """The Architecture of a (checked) GGUF file, from its metadata."""
    from .source import Architecture
    f, model_type = gguf.field, gguf.architecture
    heads = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    layers = int(f("block_count"))
    head_dim = int(f("attention.key_length", 0)) or hidden // heads
    vocab = f("vocab_size") or gguf.tensors["token_embd.weight"][1][0]
    kv_heads = f("attention.head_count_kv", heads)
    fields = dict(
        model_type=model_type, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=int(np.max(kv_heads)), head_dim=head_dim,
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        max_position_embeddings=int(f("context_length", 2048)))
    scaling = f("rope.scaling.type")
    if scaling not in (None, "none"):
        raise EdgespecError(f"unsupported rope scaling {scaling} in {gguf.path.name}; "
                            "supported: none")
    if model_type == "gemma3":
        window = int(f("attention.sliding_window", 0))
        fields.update(
            sliding_window=window, hidden_act="gelu_tanh", qk_norm=True, sandwich_norms=True,
            embedding_scale=float(np.float32(hidden ** 0.5)), norm_offset=1.0,
            local_rope_theta=GEMMA3_LOCAL_ROPE_THETA, query_pre_attn_scalar=float(head_dim),
            layer_types=["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0
                         else "sliding_attention" for i in range(layers)])
    return Architecture(**fields)


def tokenizer(gguf: GGUFFile):
    """(a transformers fast tokenizer, chat template, eos ids, bos id) from the metadata."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    arch_name, tokenizer_dict, config = get_gguf_tokenizer(str(gguf.path))
    backend, extra = convert_gguf_tokenizer(arch_name, tokenizer_dict)
    template = config.pop("chat_template", None)
    if template is None and gguf.architecture == "gemma3":
        template = GEMMA3_CHAT_TEMPLATE.read_text()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **{**config, **extra})
    fast.chat_template = template
    meta = gguf.metadata
    eos = [int(meta["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in meta else []
    if gguf.architecture == "gemma3":  # chat turns end with <end_of_turn>, not <eos>
        turn_end = fast.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
        if turn_end is not None and turn_end not in eos:
            eos.append(int(turn_end))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return fast, template or "", eos, None if bos is None else int(bos)
