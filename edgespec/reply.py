"""A reply: its text as its tokens arrive (the pieces to stream, where it ends and why), and
once it ended, its Generation."""
from dataclasses import asdict, dataclass, field

from .stats import DecodeStats
from .stops import StopScanner
from .tokenizer import StreamDecoder


@dataclass
class Piece:
    """A piece of streamed text. drafted: a token of it came from an accepted draft;
    generated: tokens generated so far (for usage counts when a client stops early)."""
    text: str
    drafted: bool = False
    generated: int = 0


class ReplyText:
    """Turns a reply's committed tokens into text pieces, cut at an end-of-turn token, a
    stop string or max_new_tokens. `finish` says why it ended ("stop", "length"), None
    while it goes on; the caller sets "context_full" or "cancelled"."""

    def __init__(self, codec, settings, stop_ids):
        self.codec, self.max_new_tokens = codec, settings.max_new_tokens
        self.stream, self.stops = StreamDecoder(codec), StopScanner(settings.stop)
        self.stop_ids = set() if settings.ignore_eos else set(stop_ids)
        self.tokens, self.texts, self.finish = [], [], None
        self.drafted = False  # of the tokens whose text is still held (an incomplete character)

    def add(self, committed: list) -> list:
        """The pieces a round's tokens complete (all but a round's last token are drafts);
        stops at the reply's end."""
        pieces = []
        for i, token in enumerate(committed):
            self.tokens.append(token)
            if token in self.stop_ids:
                self.finish = "stop"
                break
            self.drafted |= i < len(committed) - 1
            text = self.stops.feed(self.stream.push(token))
            if text:
                self.texts.append(text)
                pieces.append(Piece(text, drafted=self.drafted, generated=len(self.tokens)))
                self.drafted = False
            if self.stops.stopped:
                self.finish = "stop"
                break
            if len(self.tokens) == self.max_new_tokens:
                self.finish = "length"
                break
        return pieces

    def close(self, finish: str = None) -> list:
        """End the reply (with `finish` if it had not ended): the text held back because it
        began like a stop string but was not one."""
        self.finish = self.finish or finish or "length"
        held = self.stops.flush() if not self.stops.stopped and self.finish != "cancelled" \
            else ""
        return [Piece(held, generated=len(self.tokens))] if held else []

    @property
    def text(self) -> str:
        return "".join(self.texts) if self.stops.stopped else self.codec.decode(self.tokens)


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
