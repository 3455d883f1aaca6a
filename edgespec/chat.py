"""`edgespec chat`: a streaming terminal chat that keeps the KV cache between turns."""
import contextlib
import signal
import sys
import textwrap
import threading

from .errors import EdgespecError
from .model import stop_reply
from .sampling import SamplingParams
from .options import CATALOGUE, DRAFT, SAMPLING
from .tokenizer import check_utf8

# what /set changes: every option of the catalogue but the per-reply ones (stop, ignore_eos)
SETTINGS = tuple(option.name for option in
                 (*SAMPLING, CATALOGUE["max_new_tokens"], *DRAFT, CATALOGUE["mode"]))
HELP = "\n".join([
    "commands:",
    "  /help                 this list",
    "  /reset                forget the conversation (the system message stays)",
    "  /stats                statistics of the last reply and of the cache",
    "  /set NAME VALUE       change a setting (a flag as 0 or 1):",
    *textwrap.wrap(", ".join(SETTINGS), 70, initial_indent=" " * 24,
                   subsequent_indent=" " * 24),
    "  /exit                 leave (Ctrl-D too); Ctrl-C stops a reply and keeps the "
    "conversation"])
DRAFTED, PLAIN = "\x1b[32m", "\x1b[0m"


class ChatSession:
    """A conversation with a model: messages, settings, and what the last reply did."""

    def __init__(self, model, settings: dict, system: str = None, show_drafts=False,
                 out=sys.stdout):
        self.model, self.settings, self.system = model, settings, system
        self.show_drafts, self.out = show_drafts, out
        self.messages, self.last = self._fresh(), None

    def sampling(self):
        """The settings replies sample with: the model's, with those set here."""
        return self.model.settings(**self.settings).sampling

    def _fresh(self):
        return [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text=""):
        print(text, file=self.out, flush=True)

    # -- commands --------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a /command; False when the user wants to leave."""
        name, *args = line[1:].split()
        if name in ("exit", "quit"):
            return False
        if name == "help":
            self.say(HELP)
        elif name == "reset":
            self.messages = self._fresh()
            self.model.sequence.rollback(0)
            self.say("[conversation cleared]")
        elif name == "stats":
            self.say(self._stats())
        elif name == "set" and len(args) == 2:
            self._set(*args)
        else:
            self.say(f"[unknown command {line}; /help lists them]")
        return True

    def _set(self, name, value):
        if name not in SETTINGS:
            self.say(f"[unknown setting {name}; one of {', '.join(SETTINGS)}]")
            return
        try:
            settings = {**self.settings, name: CATALOGUE[name].read(value)}
            self.model.settings(**settings)
        except EdgespecError as e:
            self.say(f"[not set: {e}]")
            return
        self.settings = settings
        self.say(f"[{name} = {settings[name]}]")

    def _stats(self) -> str:
        engine = self.model.engine
        cache = f"cache {len(self.model.sequence.cached_tokens())}/{engine.max_context} tokens"
        if self.last is None:
            return f"[no reply yet; {cache}]"
        r = self.last
        stopped = " (stopped with Ctrl-C)" if r.finish_reason == "cancelled" else ""
        line = (f"[last reply{stopped}: {r.n_generated} tokens, "
                f"{r.decode_tokens_per_s:.1f} tokens/s, prefilled {r.n_prefilled} of "
                f"{r.n_prompt} prompt tokens, {r.mode}; "
                f"{SamplingParams(**r.sampling).describe()}; {cache}]")
        if r.stats.drafters:
            line += "\n[" + r.stats.line() + "]"
        return line

    # -- a turn ----------------------------------------------------------------------------

    def turn(self, text: str):
        """Add the user's message, stream the reply, keep it in the conversation."""
        self.messages.append({"role": "user", "content": text})
        reply, result = [], None
        try:
            if not self._fit_context():
                return
            result = self._stream(reply)
        except KeyboardInterrupt:  # before the reply began
            pass
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        self.last = result  # what /stats shows: this reply, stopped or not
        if result is None or result.finish_reason == "cancelled":
            self.say("\n[stopped]")
        else:
            self.say()
            self.say(self._summary(result))

    def _stream(self, reply: list):
        """Print the reply as it is generated (appending its pieces); its Generation, with
        finish_reason "cancelled" when Ctrl-C stopped it (None if it had not begun)."""
        pieces = self.model.stream_ids(self.model.codec.encode_chat(self.messages),
                                       self.model.settings(**self.settings), reuse_cache=True)
        with _ctrl_c_as_a_flag() as stopped:
            try:
                while not stopped:
                    try:
                        piece = next(pieces)
                    except StopIteration as done:
                        return done.value
                    reply.append(piece.text)
                    colour = self.show_drafts and piece.drafted
                    self.out.write(f"{DRAFTED}{piece.text}{PLAIN}" if colour else piece.text)
                    self.out.flush()
                return stop_reply(pieces)  # Ctrl-C: end here, keeping what the reply did
            finally:
                pieces.close()

    def _summary(self, r) -> str:
        parts = r.summary()
        note = {"context_full": "; the context is full: the reply stopped, the oldest turns "
                "will be dropped next"}.get(r.finish_reason, "")
        return f"[{', '.join(parts)}{note}]"

    def _fit_context(self) -> bool:
        """Drop the oldest turns until the conversation leaves room for a reply."""
        limit = self.model.engine.max_context
        room = min(self.model.settings(**self.settings).max_new_tokens, limit // 4)
        first = 1 if self.system else 0
        while len(self.model.codec.encode_chat(self.messages)) + room > limit:
            if len(self.messages) - first <= 1:
                self.messages.pop()
                self.say(f"[that message is too long for the context of {limit} tokens]")
                return False
            del self.messages[first:first + 2]  # the oldest user message and its reply
            self.say("[the context is full: the oldest turn was dropped]")
        return True


@contextlib.contextmanager
def _ctrl_c_as_a_flag():
    """While a reply streams, Ctrl-C only marks it stopped (the list becomes non-empty); the
    loop checks the mark between pieces. A KeyboardInterrupt raised at an arbitrary point can
    land in a finalizer, where Python ignores it, and the reply would not stop."""
    stopped = []
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stopped.append(True))
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)


def run(model, settings: dict, system=None, show_drafts=False):
    """The interactive loop: read a line, run a command or a turn."""
    session = ChatSession(model, settings, system, show_drafts)
    session.say(f"edgespec chat: {model.artifact.path.name} (exit layer "
                f"{model.artifact.exit_layer}; {session.sampling().describe()}). /help for "
                "commands, Ctrl-D to leave.")
    while True:
        try:
            line = input("you> ").strip()
            check_utf8(line, "that line")
        except EOFError:
            session.say()
            return
        except KeyboardInterrupt:
            session.say("\n[Ctrl-D or /exit leaves]")
            continue
        except (UnicodeDecodeError, EdgespecError) as e:  # a terminal that is not UTF-8
            reason = e if isinstance(e, EdgespecError) else "that line is not valid UTF-8"
            session.say(f"[{reason}; nothing was sent]")
            continue
        if not line:
            continue
        if line.startswith("/"):
            if not session.command(line):
                return
            continue
        session.turn(line)
