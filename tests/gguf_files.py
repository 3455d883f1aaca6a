"""Tiny GGUF files for tests, written with the gguf package from a tiny checkpoint, the way
llama.cpp's converter lays them out (its tensor names, Llama's q/k row permutation, Gemma's
norms stored as 1 + w, 2-D weights quantized)."""
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from edgespec.export.gguf import _GEMMA3_NAMES, _GLOBAL_NAMES, _LAYER_NAMES


def gguf_name(hf_name: str, model_type: str) -> str:
    for theirs, ours in _GLOBAL_NAMES.items():
        if hf_name == ours:
            return theirs
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = _GEMMA3_NAMES if model_type == "gemma3" else _LAYER_NAMES
    short = next(k for k, v in names.items() if v == module)
    return f"blk.{layer}.{short}.{kind}"


def _permute(w, heads):
    """llama.cpp's permutation of Llama's q/k rows (interleaved rotary pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_gguf(checkpoint: Path, path: Path, qtype=gguf.GGMLQuantizationType.Q8_0,
              arch_name=None, types=None) -> Path:
    """types: {part of a tensor's name: its type} over qtype (a mix like Q4_K_M's)."""
    config = AutoConfig.from_pretrained(checkpoint)
    model_type = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    arch_name = arch_name or model_type
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    writer = gguf.GGUFWriter(str(path), arch_name)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope["full_attention"] if model_type == "gemma3" else rope)["rope_theta"])
    if model_type == "gemma3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_sliding_window(config.sliding_window)
    _add_tokenizer(writer, checkpoint, config)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, heads if "q_proj" in name else kv_heads)
        if model_type == "gemma3" and name.endswith("norm.weight"):
            w = w + 1
        if w.ndim == 2:
            t = next((t for part, t in (types or {}).items() if part in name), qtype)
            writer.add_tensor(gguf_name(name, model_type), gguf.quants.quantize(w, t),
                              raw_dtype=t)
        else:
            writer.add_tensor(gguf_name(name, model_type), w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, checkpoint, config):
    model = json.loads((Path(checkpoint) / "tokenizer.json").read_text())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in json.loads((Path(checkpoint) / "tokenizer.json")
                                                .read_text())["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_chat_template((Path(checkpoint) / "chat_template.jinja").read_text()
                             if (Path(checkpoint) / "chat_template.jinja").is_file() else "")
