"""The embedding API: a loaded artifact that turns prompts into text."""
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field

from .artifact import open_artifact
from .batch import Batch
from .decoder import Decoder, drafters_for
from .drafter import Pace
from .engine import ContextFull, Engine, measured_costs
from .errors import EdgespecError
from .sampling import Sampler
from .settings import DraftPolicy, Settings
from .stats import DecodeStats
from .reply import Reply
from .tokenizer import TextCodec


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
    # "stop" (end of turn or a stop string), "length" (max_new_tokens), "context_full", or
    # "cancelled" (the caller ended it with stop_reply)
    finish_reason: str
    stats: DecodeStats = field(default_factory=DecodeStats)
    n_prefilled: int = 0  # prompt tokens run through the model (the rest came from the cache)
    sampling: dict = field(default_factory=dict)  # the settings it sampled with, seed included

    @property
    def n_generated(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.n_generated - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "stats": self.stats.to_dict(), "n_generated": self.n_generated,
                "decode_tokens_per_s": self.decode_tokens_per_s}

    def summary(self) -> list:
        """Its headline numbers, as phrases (chat, the desktop app)."""
        return [f"{self.n_generated} tokens", f"{self.decode_tokens_per_s:.1f} tokens/s",
                *(self.stats.brief() or [self.mode])]


COSTS_THREADS = 2  # the threads an artifact that does not record them was measured at


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
    """An artifact loaded for generation. Not thread-safe: one generation at a time.

    Options, by name, wherever a method takes **options: max_new_tokens (default 256), mode
    ("speculative" or "plain"), stop (a string or a list of up to 4: the reply ends before
    the first), the sampling settings temperature, top_k, top_p, min_p,
    repetition_penalty, presence_penalty, frequency_penalty and seed (see SamplingParams;
    those not given, or None, are the model's `sampling`), and the draft policy draft_k,
    draft_threshold, lookup_k, adaptive (see DraftPolicy; not given: the artifact's)."""

    def __init__(self, path, device: str = "auto", threads: int = None, verify: bool = True,
                 max_context: int = None):
        self.artifact = open_artifact(path, verify=verify)
        self.engine = Engine(self.artifact, device=device, threads=threads,
                             max_context=max_context)
        self.sequence = self.engine.seq  # the one the single-reply methods use (chat's cache)
        self.codec = TextCodec.for_artifact(self.artifact)
        self.stop_ids = set(self.artifact.eos_token_ids)
        self.sampling = self.artifact.sampling  # settings a call does not give come from here
        self.defaults = Settings(self.sampling,
                                 DraftPolicy.from_manifest(self.artifact.manifest.get("draft", {})))
        self._by_policy = {}  # draft policy -> its Pace and drafters, kept across generations
        self.costs = self._round_costs()  # what rounds cost here: the plans weigh drafts by it

    def settings(self, **options) -> Settings:
        """The model's defaults with these options (validated: a SettingError names a bad one)."""
        return self.defaults.with_options(**options)

    def encode(self, prompt: str, raw: bool = False, system: str = None) -> list:
        if raw:
            return self.codec.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        return self.codec.encode_chat(messages)

    def generate(self, prompt: str, max_new_tokens: int = None, raw: bool = False,
                 system: str = None, on_text=None, **options) -> Generation:
        """Reply to `prompt` (chat template applied unless raw). `on_text` gets text pieces as
        they are decoded."""
        settings = self.settings(max_new_tokens=max_new_tokens, **options)
        return self.generate_ids(self.encode(prompt, raw, system), on_text=on_text,
                                 settings=settings)

    def chat(self, messages: list, stream: bool = False, **options):
        """Reply to a conversation ([{"role", "content"}, ...]) through the chat template.

        The KV cache of the previous call is reused for the longest common prefix, so a new
        turn prefills only its new tokens. stream=False: a Generation; stream=True: a
        TextStream yielding text pieces, its `result` set once it is exhausted."""
        settings = self.settings(**options)
        text = TextStream(self.stream_ids(self.codec.encode_chat(messages), settings,
                                          reuse_cache=True))
        if stream:
            return text
        for _ in text:
            pass
        return text.result

    def generate_ids(self, prompt_ids: list, max_new_tokens: int = None, on_text=None,
                     settings: Settings = None, **options) -> Generation:
        """Reply to token ids (no template) with `settings` (default: the model's) and
        these options over them."""
        settings = (settings or self.defaults).with_options(max_new_tokens=max_new_tokens,
                                                            **options)
        stream = TextStream(self.stream_ids(prompt_ids, settings))
        for text in stream:
            if on_text:
                on_text(text)
        return stream.result

    def stream_ids(self, prompt_ids: list, settings: Settings, reuse_cache: bool = False):
        """Generate from token ids: yields Pieces of text, returns the Generation.

        reuse_cache keeps the cached prefix shared with the previous call (chat): a turn
        prefills only its new tokens. Decode steps cache the same bits a prefill would (no
        graph runs a single row, see engine.py), so a continued conversation answers as the
        same conversation sent afresh. Without reuse_cache every call starts from an empty
        cache."""
        self._check_prompt(prompt_ids)
        self.engine.use(self.sequence)
        start = time.perf_counter()
        first_logits, reused = self._prefill(prompt_ids, reuse_cache)
        prefill_s = time.perf_counter() - start
        decoder = self._decoder(settings)
        history, reply = list(prompt_ids), self._reply(settings)
        try:
            for committed in decoder.rounds(first_logits, history, settings.max_new_tokens):
                for piece in reply.add(committed):
                    yield piece
                if reply.finish:
                    break
        except ContextFull:
            reply.finish = "context_full"
        except StopReply:
            reply.finish = "cancelled"
        yield from reply.close()
        decode_s = time.perf_counter() - start - prefill_s
        return Generation(reply.text, reply.tokens, len(prompt_ids), prefill_s, decode_s,
                          settings.mode, reply.finish, decoder.stats,
                          n_prefilled=len(prompt_ids) - reused,
                          sampling={**asdict(settings.sampling), "seed": decoder.sampler.seed})

    def forget(self):
        """Forget the earlier replies that drafting copies from (each draft policy keeps the
        latest ones): for a benchmark that repeats a prompt, or before another user's turn.
        Output never depends on them; speed does."""
        for _, drafters in self._by_policy.values():
            for drafter in drafters:
                drafter.forget()

    def batch(self, parallel: int) -> Batch:
        """Replies decoded together, `parallel` at a time (1 to 8), each bit for bit the
        reply it gets alone: add token ids with their Settings (`settings(...)`), then
        iterate `run()` for (member, Piece) pairs; each Member's `result` is its Generation.
        Its KV caches (engine.sequence_bytes each) are allocated now."""
        self.engine.check_batch(parallel)
        return Batch(self, parallel)

    def generate_many(self, prompts: list, parallel: int = 4, raw: bool = False,
                      system: str = None, on_text=None, **options) -> list:
        """Reply to several prompts, `parallel` at a time: their Generations, in order.
        on_text(index, text) gets each reply's text pieces as they are decoded."""
        settings = self.settings(**options)
        batch = self.batch(parallel)
        members = [batch.add(self.encode(prompt, raw, system), settings) for prompt in prompts]
        for member, piece in batch.run():
            if on_text:
                on_text(member.index, piece.text)
        return [m.result for m in members]

    def _decoder(self, settings, own_text: bool = False, owner=None) -> Decoder:
        """The decode loop for these settings: the draft policy's drafters (none for plain
        decoding), those of earlier generations with this policy, so that what they measured
        of the model carries over. own_text: for a reply decoded beside others, with
        drafters that keep its text's state apart, and what they remember of earlier
        replies shared only with the same `owner`'s."""
        policy = settings.draft
        if policy not in self._by_policy:
            pace = Pace(self.costs["round_costs"] or None)
            self._by_policy[policy] = pace, drafters_for(policy, self.engine, pace)
        pace, drafters = self._by_policy[policy]
        if settings.mode != "speculative":
            drafters = []
        elif own_text:
            drafters = [d.for_text(owner) for d in drafters]
        return Decoder(self.engine, Sampler(settings.sampling),
                       drafters, pace)

    def _reply(self, settings) -> Reply:
        return Reply(self.codec, settings, self.stop_ids)

    def _generation(self, member, finish) -> Generation:
        """A batch member's Generation: prefill is its time from taking a place to its first
        token, decode the rest."""
        now, began = time.perf_counter(), member.started_at or member.queued_at
        first = member.first_token_at or now
        settings, decoder = member.settings, member.decoder
        return Generation(member.reply.text, member.reply.tokens, len(member.prompt),
                          first - began, now - first, settings.mode, finish, decoder.stats,
                          n_prefilled=len(member.prompt) - member.reused,
                          sampling={**asdict(settings.sampling), "seed": decoder.sampler.seed})

    def _prefill(self, prompt_ids, reuse_cache):
        """Logits after the prompt, and how many of its tokens the cache already held."""
        reused = self.sequence.shared_prefix(prompt_ids) if reuse_cache else 0
        self.engine.rollback(reused)
        return self.engine.prefill(prompt_ids[reused:]), reused

    def _round_costs(self) -> dict:
        """round_costs and batch_round_costs as in the manifest: its own when it measured
        them at the threads this engine runs with, else measured now (once, said in a
        line) and kept beside the artifact for the next load."""
        manifest, threads = self.artifact.manifest, self.engine.threads
        costs = {name: manifest.get(name, {}) for name in ("round_costs", "batch_round_costs")}
        measured_at = manifest.get("threads", COSTS_THREADS)
        if measured_at == threads or self.engine.device != "cpu" or not costs["round_costs"]:
            return costs
        kept = self.artifact.path / f"round_costs.{threads}-threads.json"
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(kept.read_text())
            if isinstance(known, dict) and known.get("threads") == threads and all(
                    isinstance(known.get(name), dict) for name in costs):
                return known
        print(f"{self.artifact.path.name}: its round costs were measured at {measured_at} "
              f"threads and this runtime uses {threads}; measuring them at {threads} (once: "
              f"kept in {kept.name})", file=sys.stderr, flush=True)
        costs = measured_costs(self.engine, repeat=3)  # a load's quick look, not an export's
        with contextlib.suppress(OSError):  # a read-only artifact measures at every load
            kept.write_text(json.dumps(costs))
        return costs

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


def load(path, device: str = "auto", threads: int = None, verify: bool = True,
         max_context: int = None) -> Model:
    """Open an exported artifact directory for generation (checks its files first).
    max_context: the positions each conversation holds (default: the artifact's context;
    less holds less memory)."""
    return Model(path, device=device, threads=threads, verify=verify, max_context=max_context)
