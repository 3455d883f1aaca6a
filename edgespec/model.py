"""The embedding API: a loaded artifact that turns prompts into text."""
import time
from dataclasses import asdict, dataclass, field

from .artifact import open_artifact
from .decode import plain_decode
from .engine import ContextFull, Engine
from .errors import EdgespecError
from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder, TextCodec

MODES = ("plain",)


@dataclass
class Generation:
    """One reply and what it cost. Decode time starts after prefill (which yields the first
    token's logits), so decode_tokens_per_s counts the tokens after the first."""
    text: str
    tokens: list
    n_prompt: int
    prefill_s: float
    decode_s: float
    mode: str
    finish_reason: str  # "stop" (end of turn), "length" (max_new_tokens) or "context_full"
    stats: dict = field(default_factory=dict)

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.n_generated - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "n_generated": self.n_generated,
                "decode_tokens_per_s": self.decode_tokens_per_s}


class Model:
    """An artifact loaded for generation. Not thread-safe: one generation at a time."""

    def __init__(self, path, device: str = "auto", threads: int = None, verify: bool = True):
        self.artifact = open_artifact(path, verify=verify)
        self.engine = Engine(self.artifact, device=device, threads=threads)
        template_file = self.artifact.path / self.artifact.manifest["chat_template"]
        template = template_file.read_text() if template_file.is_file() else None
        self.codec = TextCodec(self.artifact.path, template)
        self.stop_ids = set(self.artifact.eos_token_ids)

    def encode(self, prompt: str, raw: bool = False, system: str = None) -> list:
        if raw:
            return self.codec.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        return self.codec.encode_chat(messages)

    def generate(self, prompt: str, max_new_tokens: int = 256, raw: bool = False,
                 system: str = None, mode: str = "plain", on_text=None, **sampling) -> Generation:
        """Reply to `prompt` (chat template applied unless raw). `on_text` gets text pieces as
        they are decoded. Sampling keywords: temperature, top_k, top_p, min_p,
        repetition_penalty, seed (see SamplingParams)."""
        return self.generate_ids(self.encode(prompt, raw, system), max_new_tokens, mode,
                                 on_text, **sampling)

    def generate_ids(self, prompt_ids: list, max_new_tokens: int = 256, mode: str = "plain",
                     on_text=None, **sampling) -> Generation:
        params = SamplingParams(**sampling)
        if mode not in MODES:
            raise EdgespecError(f"unknown mode {mode}; available: {', '.join(MODES)}")
        if max_new_tokens < 1:
            raise EdgespecError(f"invalid max-new-tokens {max_new_tokens}: it must be >= 1")
        self._check_prompt(prompt_ids)
        start = time.perf_counter()
        self.engine.reset()
        first_logits = self.engine.prefill(prompt_ids)
        prefill_s = time.perf_counter() - start
        history, stream = list(prompt_ids), StreamDecoder(self.codec)
        tokens, finish = [], "length"
        try:
            for token in plain_decode(self.engine, first_logits, history, max_new_tokens,
                                      Sampler(params), self.stop_ids):
                tokens.append(token)
                piece = stream.push(token)
                if on_text and piece and token not in self.stop_ids:
                    on_text(piece)
                if token in self.stop_ids:
                    finish = "stop"
        except ContextFull:
            finish = "context_full"
        decode_s = time.perf_counter() - start - prefill_s
        return Generation(self.codec.decode(tokens), tokens, len(prompt_ids), prefill_s,
                          decode_s, mode, finish)

    def _check_prompt(self, prompt_ids):
        limit = self.engine.max_context
        if not prompt_ids:
            raise EdgespecError("the prompt is empty")
        if len(prompt_ids) >= limit:
            raise EdgespecError(f"the prompt has {len(prompt_ids)} tokens but the artifact's "
                                f"context is {limit}; shorten the prompt or export with a "
                                "larger --max-context")


def load(path, device: str = "auto", threads: int = None, verify: bool = True) -> Model:
    """Open an exported artifact directory for generation (checks its files first)."""
    return Model(path, device=device, threads=threads, verify=verify)
