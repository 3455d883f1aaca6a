"""What one generation is asked to do, as one typed object validated once: how many tokens,
plain or speculative, the sampling settings, the draft policy and the stop strings.

Every entry point (the Python API, the command line, chat, the server, the desktop app)
gives its options by the same flat names (temperature, draft_k, stop, ...) to
`Settings.with_options`; an invalid one raises a SettingError that names it. The options
are listed once, in CATALOGUE, with their type and what they do: the command line's flags,
chat's /set and the server's fields are made from it."""
import dataclasses
from dataclasses import dataclass

from .errors import SettingError, is_int, is_number
from .sampling import SAMPLING_FIELDS, SamplingParams

MODES = ("speculative", "plain")
MAX_STOPS, MAX_STOP_CHARS = 4, 1000  # stop strings cost per character of reply and of stop
MAX_DRAFT_K = 32


@dataclass(frozen=True)
class Option:
    """A generation option: its flat name (the Python keyword, the API's field, chat's /set;
    the command line's flag is --name-with-dashes), its type, and what it does. Its range
    and default belong to the object that holds it (SamplingParams, DraftPolicy, Settings),
    which checks them."""
    name: str
    kind: type  # int, float, bool or str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SAMPLING = (
    Option("temperature", float, "0 is greedy"),
    Option("top_k", int, "keep the k likeliest tokens (0: off)"),
    Option("top_p", float, "keep the likeliest tokens whose mass reaches this, in (0, 1] "
           "(1: off)"),
    Option("min_p", float, "drop tokens below min-p times the likeliest (0: off)"),
    Option("repetition_penalty", float, "divide the logits of tokens already in the "
           "conversation (1: off)"),
    Option("presence_penalty", float, "subtract from the logits of tokens already in it, in "
           "[-2, 2] (0: off)"),
    Option("frequency_penalty", float, "subtract this times a token's count so far, in "
           "[-2, 2] (0: off)"),
    Option("seed", int, "the same seed gives the same reply, speculative or plain (default: "
           "a fresh one each reply)"),
)
DRAFT = (
    Option("draft_k", int, "the most early-exit drafts per round, 0 for none (default: the "
           "artifact's calibrated value)"),
    Option("draft_threshold", float, "stop drafting when the draft's top probability falls "
           "below this (default: the artifact's, 0 is off)"),
    Option("lookup_k", int, "the most lookup drafts per round (copied from the prompt, the "
           "reply or recent replies), 0 to 32, 0 for none (default: the artifact's)"),
    Option("adaptive", bool, "choose each round's k: lookup's from its expected tokens per "
           "measured round cost, the early exit's from timing (paused while slower than "
           "plain decoding); without it every round drafts k (default: the artifact's, "
           "normally on)"),
)
REPLY = (
    Option("max_new_tokens", int, "the most tokens a reply has"),
    Option("mode", str, "speculative (default) or plain: the same output"),
    Option("stop", str, "end the reply where this text first appears, leaving it out (up "
           "to 4)"),
    Option("ignore_eos", bool, "go on past the end of the turn, to max_new_tokens"),
)
CATALOGUE = {option.name: option for option in (*SAMPLING, *DRAFT, *REPLY)}


@dataclass(frozen=True)
class DraftPolicy:
    """draft_k: the most early-exit drafts a round (0: no early-exit drafting);
    draft_threshold: stop drafting when the draft's top probability falls below it (0:
    always draft k); lookup_k: the most prompt-lookup drafts a round (0: no lookup);
    adaptive: let each drafter choose its k every round (lookup by expected value, the early
    exit by timing, paused while slower than plain decoding)."""
    draft_k: int = 4
    draft_threshold: float = 0.0
    lookup_k: int = 0
    adaptive: bool = False

    def __post_init__(self):
        for name in ("draft_k", "lookup_k"):
            value = getattr(self, name)
            if not is_int(value, 0, MAX_DRAFT_K + 1):
                raise SettingError(f"invalid {name.replace('_', '-')} {value}: it must be an "
                                   f"integer in 0..{MAX_DRAFT_K}", name)
        if not (is_number(self.draft_threshold) and 0 <= self.draft_threshold < 1):
            raise SettingError(f"invalid draft-threshold {self.draft_threshold}: it must be "
                               "in [0, 1)", "draft_threshold")
        if not isinstance(self.adaptive, bool):
            raise SettingError(f"invalid adaptive {self.adaptive}: it must be true or false",
                               "adaptive")

    # the manifest's "draft" object names them without the prefix
    MANIFEST_KEYS = {"k": "draft_k", "threshold": "draft_threshold", "lookup_k": "lookup_k",
                     "adaptive": "adaptive"}

    @classmethod
    def from_manifest(cls, draft: dict) -> "DraftPolicy":
        return cls(**{cls.MANIFEST_KEYS[key]: value for key, value in draft.items()
                      if key in cls.MANIFEST_KEYS})

    def to_manifest(self) -> dict:
        return {key: getattr(self, name) for key, name in self.MANIFEST_KEYS.items()}

    def describe(self) -> str:
        return (f"draft k {self.draft_k}, threshold {self.draft_threshold}, lookup k "
                f"{self.lookup_k}, {'adaptive' if self.adaptive else 'fixed'}")


DRAFT_FIELDS = tuple(f.name for f in dataclasses.fields(DraftPolicy))


@dataclass(frozen=True)
class Settings:
    sampling: SamplingParams = SamplingParams()
    draft: DraftPolicy = DraftPolicy()
    max_new_tokens: int = 256
    mode: str = "speculative"
    stop: tuple = ()            # strings that end the reply (not included in its text)
    ignore_eos: bool = False    # generate max_new_tokens even past end-of-turn tokens

    def __post_init__(self):
        if not is_int(self.max_new_tokens, 1):
            raise SettingError(f"invalid max-new-tokens {self.max_new_tokens}: it must be an "
                               "integer >= 1", "max_new_tokens")
        if self.mode not in MODES:
            raise SettingError(f"unknown mode {self.mode}; available: {', '.join(MODES)}",
                               "mode")
        stop = self.stop
        if not (isinstance(stop, tuple) and len(stop) <= MAX_STOPS and all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
            raise SettingError(f"stop must be a string or a list of up to {MAX_STOPS} "
                               f"strings, each of 1 to {MAX_STOP_CHARS} characters", "stop")

    def with_options(self, **options) -> "Settings":
        """These settings with the given options replaced, by their flat names (None: not
        given, keep ours): the sampling fields and seed, the draft policy's fields,
        max_new_tokens, mode, stop (a string or a list), ignore_eos."""
        given = {name: value for name, value in options.items() if value is not None}
        unknown = set(given) - set(OPTIONS)
        if unknown:
            name = sorted(unknown)[0]
            raise SettingError(f"unknown option {name}; the options are "
                               f"{', '.join(OPTIONS)}", name)
        sampling = {k: v for k, v in given.items() if k in SAMPLING_OPTIONS}
        draft = {k: v for k, v in given.items() if k in DRAFT_FIELDS}
        own = {k: v for k, v in given.items() if k not in sampling and k not in draft}
        if isinstance(own.get("stop"), (list, str)):
            own["stop"] = (own["stop"],) if isinstance(own["stop"], str) else tuple(own["stop"])
        return dataclasses.replace(self, sampling=self.sampling.with_options(**sampling),
                                   draft=dataclasses.replace(self.draft, **draft), **own)


SAMPLING_OPTIONS = tuple(option.name for option in SAMPLING)
OPTIONS = tuple(CATALOGUE)
assert SAMPLING_OPTIONS == (*SAMPLING_FIELDS, "seed") and \
    tuple(option.name for option in DRAFT) == DRAFT_FIELDS, "CATALOGUE lists every field"
