"""One reply's text as its tokens arrive: the pieces to stream, where it ends and why."""
from dataclasses import dataclass

from .stops import StopScanner
from .tokenizer import StreamDecoder


@dataclass
class Piece:
    """A piece of streamed text. drafted: a token of it came from an accepted draft;
    generated: tokens generated so far (for usage counts when a client stops early)."""
    text: str
    drafted: bool = False
    generated: int = 0


class Reply:
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
