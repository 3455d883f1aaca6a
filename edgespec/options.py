"""The generation options, each defined once: its flat name, type, default, range and help.

The flat name is the Python keyword (`model.generate(top_p=0.9)`), the server's field, chat's
/set NAME and, with dashes, the command line's flag (--top-p). SamplingParams, DraftPolicy
and Settings take their defaults from here and check every value with `Option.check`, so
every entry point refuses a bad value with the same message: "invalid top-p 1.5: it must be
in (0, 1]"."""
import math
from dataclasses import dataclass

from .errors import SettingError, is_int, is_number

MODES = ("speculative", "plain")
MAX_DRAFT_K = 32
MAX_STOPS, MAX_STOP_CHARS = 4, 1000  # stop strings cost per character of reply and of stop


@dataclass(frozen=True)
class Option:
    """A generation option. Its range: numbers from low to high (None: unbounded), each end
    closed unless open_low or open_high, or one of `choices`; a bool option is true or false.
    A default of None is a value too (seed: none given). default_text says the default in
    words where an entry point does not use `default` itself (the model's own settings)."""
    name: str
    kind: type  # int, float, bool or str
    default: object
    help: str
    low: float = None
    high: float = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple = ()
    default_text: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def expected(self) -> str:
        """The range in words: "in (0, 1]", "an integer >= 1", "one of speculative, plain"."""
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return "one of " + ", ".join(self.choices) if self.choices else "a string"
        what = "an integer" if self.kind is int else "a number"
        low, high = _bound(self.low), _bound(self.high)
        if self.low is not None and self.high is not None:
            interval = f"{'[('[self.open_low]}{low}, {high}{'])'[self.open_high]}"
            return f"an integer in {interval}" if self.kind is int else f"in {interval}"
        if self.low is not None:
            return f"{what} {'>' if self.open_low else '>='} {low}"
        if self.high is not None:
            return f"{what} {'<' if self.open_high else '<='} {high}"
        return what

    def check(self, value, called: str = None):
        """`value` when the option takes it, else a SettingError naming the option (as
        `called`: an entry point's own name for it; default: the flag's, top-p)."""
        if (value is None and self.default is None) or self._takes(value):
            return value
        raise SettingError(f"invalid {called or self.flag[2:]} {_shown(value)}: it must be "
                           f"{self.expected}", self.name)

    def read(self, text: str):
        """The value a text gives (a flag's, chat's /set): read as the option's kind, or the
        text itself where it is none (which `check` then refuses with the range)."""
        if self.kind is bool:
            return {"1": True, "true": True, "0": False, "false": False}.get(text.lower(), text)
        try:
            return self.kind(text)
        except ValueError:
            return text

    def _takes(self, value) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is str:
            return isinstance(value, str) and (not self.choices or value in self.choices)
        if not (is_int(value) if self.kind is int else is_number(value) and _finite(value)):
            return False
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too long for a float
        return False


def _bound(x) -> str:
    if isinstance(x, int) and x >= 2**32 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


def _shown(value) -> str:
    text = str(value) if is_number(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


MODEL, ARTIFACT = "the model's", "the artifact's"
SAMPLING = (
    Option("temperature", float, 0.0, "divide the logits by this before sampling, 0 is "
           "greedy", low=0, default_text=MODEL),
    Option("top_k", int, 0, "keep the k likeliest tokens (0: off)", low=0, default_text=MODEL),
    Option("top_p", float, 1.0, "keep the likeliest tokens whose mass reaches this (1: off)",
           low=0, high=1, open_low=True, default_text=MODEL),
    Option("min_p", float, 0.0, "drop tokens below min-p times the likeliest (0: off)", low=0,
           high=1, open_high=True, default_text=MODEL),
    Option("repetition_penalty", float, 1.0, "divide the logits of tokens already in the "
           "conversation (1: off)", low=0, open_low=True, default_text=MODEL),
    Option("presence_penalty", float, 0.0, "subtract from the logits of tokens already in the "
           "conversation (0: off)", low=-2, high=2, default_text=MODEL),
    Option("frequency_penalty", float, 0.0, "subtract this times a token's count so far "
           "(0: off)", low=-2, high=2, default_text=MODEL),
    Option("seed", int, None, "the same seed gives the same reply, speculative or plain",
           low=0, high=2**63, open_high=True, default_text="a fresh one each reply"),
)
DRAFT = (
    Option("draft_k", int, 4, "the most early-exit drafts per round, 0 for none", low=0,
           high=MAX_DRAFT_K, default_text=f"{ARTIFACT} calibrated value"),
    Option("draft_threshold", float, 0.0, "stop drafting when the draft's top probability "
           "falls below this (0: off)", low=0, high=1, open_high=True, default_text=ARTIFACT),
    Option("lookup_k", int, 0, "the most lookup drafts per round (copied from the prompt, the "
           "reply or recent replies), 0 for none", low=0, high=MAX_DRAFT_K,
           default_text=ARTIFACT),
    Option("adaptive", bool, False, "choose each round's k: lookup's from its expected tokens "
           "per measured round cost, the early exit's from timing (paused while slower than "
           "plain decoding); without it every round drafts k",
           default_text=f"{ARTIFACT}, normally on"),
)
REPLY = (
    Option("max_new_tokens", int, 256, "the most tokens a reply has", low=1),
    Option("mode", str, "speculative", "how to decode: speculative (drafts verified in one "
           "pass) and plain give the same output", choices=MODES),
    Option("stop", str, (), f"end the reply where this text first appears, leaving it out "
           f"(up to {MAX_STOPS}, each of 1 to {MAX_STOP_CHARS} characters)"),
    Option("ignore_eos", bool, False, "go on past the end of the turn, to max_new_tokens"),
)
CATALOGUE = {option.name: option for option in (*SAMPLING, *DRAFT, *REPLY)}
DEFAULT = {name: option.default for name, option in CATALOGUE.items()}
