"""What decoding did: rounds, drafts made and accepted by each drafter, where the time went;
formatted for people here and only here."""
import dataclasses
from dataclasses import dataclass, field

TIMES = ("draft", "verify", "head", "sampling")  # lower runs, upper runs, head runs, host side


@dataclass
class DrafterStats:
    rounds: int = 0     # rounds it drafted (a round it began but cut to no draft counts)
    drafted: int = 0
    accepted: int = 0


@dataclass
class DecodeStats:
    drafters: dict = field(default_factory=dict)  # name -> DrafterStats
    plain_steps: int = 0  # rounds without a drafter (none offered, or plain decoding)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(TIMES, 0.0))

    def record(self, drafter, drafted: int, accepted: int):
        """One round: `drafter` the name of the one that drafted, None for a plain step."""
        if drafter is None:
            self.plain_steps += 1
            return
        s = self.drafters.setdefault(drafter, DrafterStats())
        s.rounds, s.drafted, s.accepted = s.rounds + 1, s.drafted + drafted, s.accepted + accepted

    @property
    def rounds(self) -> int:
        return self.plain_steps + sum(s.rounds for s in self.drafters.values())

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.drafters.values())

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.drafters.values())

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per verify round: accepted drafts plus the verifier's token."""
        return self.accepted_per_round + 1 if self.rounds else 0.0

    def time_shares(self) -> dict:
        total = sum(self.seconds.values()) or 1.0
        return {name: s / total for name, s in self.seconds.items()}

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "plain_steps": self.plain_steps,
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "accepted_per_round": self.accepted_per_round,
                "tokens_per_round": self.tokens_per_round,
                "drafters": {name: dataclasses.asdict(s) for name, s in self.drafters.items()},
                **{f"{name}_s": seconds for name, seconds in self.seconds.items()}}

    # -- for people ------------------------------------------------------------------------

    def brief(self) -> list:
        """The headline numbers, as phrases (nothing when nothing was drafted)."""
        if not self.drafters:
            return []
        return [f"accepted {self.accepted}/{self.drafted} ({100 * self.acceptance:.0f}%)",
                f"{self.tokens_per_round:.2f} tokens/round"]

    def line(self) -> str:
        """Everything, in one line: acceptance by drafter, tokens a round, time shares."""
        by_drafter = "".join(f"{name} {s.accepted}/{s.drafted} in {s.rounds} rounds; "
                             for name, s in self.drafters.items())
        shares = " ".join(f"{name} {100 * share:.0f}%"
                          for name, share in self.time_shares().items())
        return (f"accepted {self.accepted}/{self.drafted} ({100 * self.acceptance:.1f}%; "
                f"{by_drafter}{self.plain_steps} plain steps), "
                f"{self.tokens_per_round:.1f} tokens/round, {shares}")
