"""The embedding API: a loaded artifact that turns prompts into text."""
import contextlib
import functools
import json
import sys

from .artifact import open_artifact
from .batch import Batch
from .drafter import RoundCosts
from .engine import CHUNK, Engine, measured_costs
from .reply import Generation, ReplyText
from .rounds import Drafting
from .settings import DraftPolicy, Settings
from .tokenizer import TextCodec


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
        self.sequence = self.engine.new_sequence()  # the single replies' (chat's cache)
        self.codec = TextCodec.for_artifact(self.artifact)
        self.stop_ids = set(self.artifact.eos_token_ids)
        self.sampling = self.artifact.sampling  # settings a call does not give come from here
        self.defaults = Settings(self.sampling,
                                 DraftPolicy.from_manifest(self.artifact.manifest.get("draft", {})))
        self.drafting = Drafting()  # each draft policy's drafters, kept across replies
        # what rounds cost here: the planner weighs drafts by it
        self.costs = RoundCosts(self._measured_costs(), CHUNK)

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
        cache. The reply is a batch of one on the model's own sequence."""
        if not reuse_cache:
            self.sequence.rollback(0)
        batch = self._batch(1, [self.sequence])
        request = batch.add(prompt_ids, settings)
        try:
            while batch.busy:
                for _, piece in batch.step():
                    yield piece
        except StopReply:
            batch.cancel(request)
            while batch.busy:
                batch.step()
        return request.result

    def forget(self):
        """Forget the earlier replies that drafting copies from (each draft policy keeps the
        latest ones): for a benchmark that repeats a prompt, or before another user's turn.
        Output never depends on them; speed does."""
        self.drafting.forget()

    def batch(self, parallel: int) -> Batch:
        """Replies decoded together, `parallel` at a time (1 to 8), each bit for bit the
        reply it gets alone: add token ids with their Settings (`settings(...)`), then
        iterate `run()` for (request, Piece) pairs; each Request's `result` is its
        Generation. Its KV caches (engine.sequence_bytes each) are allocated now, the first
        being the model's own."""
        return self._batch(parallel, [self.sequence])

    def _batch(self, parallel, sequences) -> Batch:
        make_text = functools.partial(ReplyText, self.codec, stop_ids=self.stop_ids)
        return Batch(self.engine, self.drafting, self.costs, make_text, parallel,
                     sequences)

    def generate_many(self, prompts: list, parallel: int = 4, raw: bool = False,
                      system: str = None, on_text=None, **options) -> list:
        """Reply to several prompts, `parallel` at a time: their Generations, in order.
        on_text(index, text) gets each reply's text pieces as they are decoded."""
        settings = self.settings(**options)
        batch = self.batch(parallel)
        requests = [batch.add(self.encode(prompt, raw, system), settings) for prompt in prompts]
        for request, piece in batch.run():
            if on_text:
                on_text(request.index, piece.text)
        return [r.result for r in requests]

    def _measured_costs(self) -> dict:
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

def load(path, device: str = "auto", threads: int = None, verify: bool = True,
         max_context: int = None) -> Model:
    """Open an exported artifact directory for generation (checks its files first).
    max_context: the positions each conversation holds (default: the artifact's context;
    less holds less memory)."""
    return Model(path, device=device, threads=threads, verify=verify, max_context=max_context)
