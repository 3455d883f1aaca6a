"""What one generation is asked to do, as one typed object validated once: how many tokens,
plain or speculative, the sampling settings, the draft policy and the stop strings.

Every entry point (the Python API, the command line, chat, the server, the desktop app)
gives its options by the same flat names (temperature, draft_k, stop, ...) to
`Settings.with_options`; an invalid one raises a SettingError that names it. Each option's
type, default, range and help are defined once, in options.CATALOGUE."""
import dataclasses
from dataclasses import dataclass

from .errors import SettingError
from .options import CATALOGUE, DEFAULT, DRAFT, MAX_STOP_CHARS, MAX_STOPS, SAMPLING
from .sampling import SAMPLING_FIELDS, SamplingParams


@dataclass(frozen=True)
class DraftPolicy:
    """draft_k: the most early-exit drafts a round (0: no early-exit drafting);
    draft_threshold: stop drafting when the draft's top probability falls below it (0:
    always draft k); lookup_k: the most prompt-lookup drafts a round (0: no lookup);
    adaptive: let each drafter choose its k every round (lookup by expected value, the early
    exit by timing, paused while slower than plain decoding)."""
    draft_k: int = DEFAULT["draft_k"]
    draft_threshold: float = DEFAULT["draft_threshold"]
    lookup_k: int = DEFAULT["lookup_k"]
    adaptive: bool = DEFAULT["adaptive"]

    def __post_init__(self):
        for option in DRAFT:
            option.check(getattr(self, option.name))

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
    max_new_tokens: int = DEFAULT["max_new_tokens"]
    mode: str = DEFAULT["mode"]
    stop: tuple = DEFAULT["stop"]  # strings that end the reply (not included in its text)
    ignore_eos: bool = DEFAULT["ignore_eos"]

    def __post_init__(self):
        for name in ("max_new_tokens", "mode", "ignore_eos"):
            CATALOGUE[name].check(getattr(self, name))
        # stop is a list: its shape is checked here, not by a range
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
