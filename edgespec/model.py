"""The embedding API: a loaded artifact that turns prompts into text."""
import time
from dataclasses import asdict, dataclass, field

from .artifact import open_artifact
from .decode import plain_rounds
from .engine import ContextFull, Engine
from .errors import EdgespecError
from .sampling import Sampler
from .speculative import DraftPolicy, SpecStats, SpeculativeDecoder, new_scheduler
from .tokenizer import StreamDecoder, TextCodec

MODES = ("speculative", "plain")


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
    # "stop" (end of turn), "length" (max_new_tokens), "context_full", or "cancelled" (the
    # caller ended it with stop_reply)
    finish_reason: str
    stats: dict = field(default_factory=dict)
    n_prefilled: int = 0  # prompt tokens run through the model (the rest came from the cache)
    sampling: dict = field(default_factory=dict)  # the settings it sampled with, seed included

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.n_generated - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "n_generated": self.n_generated,
                "decode_tokens_per_s": self.decode_tokens_per_s}


@dataclass
class Piece:
    """A piece of streamed text. drafted: a token of it came from an accepted draft;
    generated: tokens generated so far (for usage counts when a client stops early)."""
    text: str
    drafted: bool = False
    generated: int = 0


class StopReply(Exception):
    """Thrown into a stream_ids generator (see stop_reply): end the reply here."""


def stop_reply(pieces):
    """End a stream_ids generator at the piece it last yielded; its Generation so far
    (finish_reason "cancelled"), or None when it had not begun. Unlike close(), this keeps
    the reply's statistics. The cache stays consistent either way."""
    try:
        pieces.throw(StopReply())
    except StopIteration as done:
        return done.value
    except StopReply:  # not started (or already finished): nothing was generated
        return None
    raise RuntimeError("a stopped generator yielded again")


class TextStream:
    """Iterates over the text pieces of a reply; `result` is its Generation once done."""

    def __init__(self, pieces):
        self._pieces, self.result = pieces, None

    def __iter__(self):
        while True:
            try:
                piece = next(self._pieces)
            except StopIteration as done:
                self.result = done.value
                return
            yield piece.text

    def close(self):
        """Stop the generation early (the cache stays consistent)."""
        self._pieces.close()

    def stop(self):
        """Stop the generation early and keep what it did: `result` becomes its Generation
        so far (finish_reason "cancelled"; None if it had not begun)."""
        if self.result is None:
            self.result = stop_reply(self._pieces)
        return self.result


class Model:
    """An artifact loaded for generation. Not thread-safe: one generation at a time."""

    def __init__(self, path, device: str = "auto", threads: int = None, verify: bool = True):
        self.artifact = open_artifact(path, verify=verify)
        self.engine = Engine(self.artifact, device=device, threads=threads)
        self.codec = TextCodec.for_artifact(self.artifact)
        self.stop_ids = set(self.artifact.eos_token_ids)
        self.sampling = self.artifact.sampling  # settings a call does not give come from here
        self._schedulers = {}  # draft policy -> its scheduler, kept across generations

    def encode(self, prompt: str, raw: bool = False, system: str = None) -> list:
        if raw:
            return self.codec.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        return self.codec.encode_chat(messages)

    def generate(self, prompt: str, max_new_tokens: int = 256, raw: bool = False,
                 system: str = None, mode: str = "speculative", on_text=None,
                 **options) -> Generation:
        """Reply to `prompt` (chat template applied unless raw). `on_text` gets text pieces as
        they are decoded. Options: temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, frequency_penalty, seed (see SamplingParams; those not given, or
        None, are the model's `sampling`); draft_k, draft_threshold, lookup_k, adaptive (see
        DraftPolicy)."""
        return self.generate_ids(self.encode(prompt, raw, system), max_new_tokens, mode,
                                 on_text, **options)

    def chat(self, messages: list, stream: bool = False, max_new_tokens: int = 256,
             mode: str = "speculative", **options):
        """Reply to a conversation ([{"role", "content"}, ...]) through the chat template.

        The KV cache of the previous call is reused for the longest common prefix, so a new
        turn prefills only its new tokens. stream=False: a Generation; stream=True: a
        TextStream yielding text pieces, its `result` set once it is exhausted."""
        pieces = self.stream_ids(self.codec.encode_chat(messages), max_new_tokens, mode,
                                 reuse_cache=True, **options)
        text = TextStream(pieces)
        if stream:
            return text
        for _ in text:
            pass
        return text.result

    def generate_ids(self, prompt_ids: list, max_new_tokens: int = 256,
                     mode: str = "speculative", on_text=None, **options) -> Generation:
        stream = TextStream(self.stream_ids(prompt_ids, max_new_tokens, mode, **options))
        for text in stream:
            if on_text:
                on_text(text)
        return stream.result

    def draft_policy(self, draft_k=None, draft_threshold=None, lookup_k=None,
                     adaptive=None) -> DraftPolicy:
        """The artifact's default draft policy (chosen by export's calibration), with any of
        its values overridden."""
        default = self.artifact.manifest.get("draft", {})
        given = {"k": draft_k, "threshold": draft_threshold, "lookup_k": lookup_k,
                 "adaptive": adaptive}
        return DraftPolicy(**{name: default.get(name, getattr(DraftPolicy, name))
                              if value is None else value for name, value in given.items()})

    def stream_ids(self, prompt_ids: list, max_new_tokens: int = 256,
                   mode: str = "speculative", draft_k=None, draft_threshold=None,
                   lookup_k=None, adaptive=None, reuse_cache: bool = False,
                   ignore_eos: bool = False, **sampling):
        """Generate from token ids: yields Pieces of text, returns the Generation.

        reuse_cache keeps the cached prefix shared with the previous call (chat): a turn
        prefills only its new tokens. Decode steps cache the same bits a prefill would (no
        graph runs a single row, see engine.py), so a continued conversation answers as the
        same conversation sent afresh. Without reuse_cache every call starts from an empty
        cache.
        ignore_eos generates max_new_tokens even past end-of-turn tokens (for load tests)."""
        params = self.sampling.with_options(**sampling)
        policy = self.draft_policy(draft_k, draft_threshold, lookup_k, adaptive)
        if mode not in MODES:
            raise EdgespecError(f"unknown mode {mode}; available: {', '.join(MODES)}")
        if max_new_tokens < 1:
            raise EdgespecError(f"invalid max-new-tokens {max_new_tokens}: it must be >= 1")
        self._check_prompt(prompt_ids)
        start = time.perf_counter()
        first_logits, reused = self._prefill(prompt_ids, reuse_cache)
        prefill_s = time.perf_counter() - start
        history, stream, stats = list(prompt_ids), StreamDecoder(self.codec), SpecStats()
        if mode == "plain":
            sampler = Sampler(params)
            rounds = plain_rounds(self.engine, sampler, first_logits, history, max_new_tokens)
        else:
            decoder = SpeculativeDecoder(self.engine, params, policy, stats,
                                         self._scheduler(policy))
            sampler = decoder.sampler
            rounds = decoder.rounds(first_logits, history, max_new_tokens)
        tokens, finish, stop_ids = [], None, set() if ignore_eos else self.stop_ids
        drafted = False  # of the tokens whose text is still held (an incomplete character)
        try:
            for committed in rounds:
                for i, token in enumerate(committed):
                    tokens.append(token)
                    if token in stop_ids:
                        finish = "stop"
                        break
                    drafted |= i < len(committed) - 1  # all but a round's last were drafts
                    text = stream.push(token)
                    if text:
                        yield Piece(text, drafted=drafted, generated=len(tokens))
                        drafted = False
                    if len(tokens) == max_new_tokens:
                        finish = "length"
                        break
                if finish:
                    break
        except ContextFull:
            finish = "context_full"
        except StopReply:
            finish = "cancelled"
        decode_s = time.perf_counter() - start - prefill_s
        return Generation(self.codec.decode(tokens), tokens, len(prompt_ids), prefill_s,
                          decode_s, mode, finish or "length",
                          stats.to_dict() if mode == "speculative" else {},
                          n_prefilled=len(prompt_ids) - reused,
                          sampling={**asdict(params), "seed": sampler.seed})

    def _scheduler(self, policy):
        """The scheduler of earlier generations with this policy: what it measured of the
        drafters carries over (see schedule.py)."""
        if policy not in self._schedulers:
            self._schedulers[policy] = new_scheduler(policy,
                                                     self.artifact.manifest.get("round_costs"))
        return self._schedulers[policy]

    def _prefill(self, prompt_ids, reuse_cache):
        """Logits after the prompt, and how many of its tokens the cache already held."""
        reused = 0
        if reuse_cache:
            cached = self.engine.cached_tokens()
            # prefill at least one token: its logits start the reply
            limit = min(len(cached), len(prompt_ids) - 1)
            while reused < limit and cached[reused] == prompt_ids[reused]:
                reused += 1
        self.engine.rollback(reused)
        return self.engine.prefill(prompt_ids[reused:]), reused

    def _check_prompt(self, prompt_ids):
        limit = self.engine.max_context
        if not prompt_ids:
            raise EdgespecError("the prompt is empty")
        vocab = self.engine.vocab_size  # the embedding lookup does not check its ids
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EdgespecError(f"the prompt holds token id {bad}; this model's ids are "
                                f"0..{vocab - 1}")
        if len(prompt_ids) >= limit:
            raise EdgespecError(f"the prompt has {len(prompt_ids)} tokens but the artifact's "
                                f"context is {limit}; shorten the prompt or export with a "
                                "larger --max-context")


def load(path, device: str = "auto", threads: int = None, verify: bool = True) -> Model:
    """Open an exported artifact directory for generation (checks its files first)."""
    return Model(path, device=device, threads=threads, verify=verify)
