"""Test helpers: a tiny random Llama-family checkpoint made on the fly, and the CLI runner."""
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts and verifies",
        "hello world, how are you today?", "numbers 0 1 2 3 4 5 6 7 8 9 and symbols !?.,"] * 20


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>",
                                  "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    return fast


def make_checkpoint(path: Path, arch: str = "llama", tie: bool = True, layers: int = 4,
                    seed: int = 0, max_positions: int = 512, rope: dict = None) -> Path:
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(384)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init is too tame to tell implementations apart: widen it
        for p in model.parameters():
            p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def quiet(*args, **kwargs):
    """A log function that prints nothing."""


def run_cli(*args, timeout=600):
    """Run `python -m edgespec ARGS`; the completed process, with text output."""
    return subprocess.run([sys.executable, "-m", "edgespec", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(stderr: str) -> str:
    """The single `error: ...` line a failed command printed (fails if there is not exactly one)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]
