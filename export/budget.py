"""The calibration plan: how much measuring and training fits a time budget.

Calibration's work is priced in seconds of plain decoding on the machine at hand (measured
first, with one short generation): measuring a policy costs its prompts x tokens at plain
speed (a fixed-k early exit FIXED_K_COST times that: it runs slower than plain), a training
reply its tokens, another exit layer its graph build. In that order, while it fits: the
final choice of the shipped policy (at most half the budget, on fewer prompts if need be);
an exit adapter, if one is to be trained, with the k and shortlist screens that make it
count and the other exit-layer candidates, the rest of the budget split between its
replies and its training; without one, the k and shortlist screens. The screens compare
drafts with each other, on half the final choice's prompts.
"""
from dataclasses import dataclass, field

OVERHEAD = 1.5             # prefill, session loading, graph rewrites, longer replies
FIXED_K_COST = 2.5         # a fixed-k early exit's time, in plain decoding's
FINAL_SHARE = 0.5          # of the budget, at most, for the final choice (if it can)
MIN_PROMPTS = 4            # fewer held-out prompts measure noise
MIN_REPLIES = 48           # an adapter trained on fewer does not beat the raw exit
MIN_ADAPTER_MINUTES = 1.0


@dataclass
class Sizes:
    """What there is to measure and train on (calibrate.py's constants and prompts)."""
    held_out: int          # held-out prompts that fit the context
    measure_tokens: int
    train_prompts: int     # training prompts that fit the context
    train_tokens: int
    k_candidates: int      # fixed k values screened
    shortlist_sizes: int   # shortlist sizes measured, the full vocabulary included
    final_policies: int    # adaptive policies measured against plain at the end


@dataclass
class Plan:
    sizes: Sizes
    token_s: float
    prompts: int = 0                  # held-out prompts the final choice runs (0: none)
    screen_prompts: int = 0           # and each screen: half as many
    screen_k: bool = False            # fixed-k early exit measured, for k and the exit layer
    shortlist: bool = False           # shortlist sizes measured
    exit_layers: list = field(default_factory=list)
    replies: int = 0                  # training replies collected (0: no adapter trained)
    adapter_minutes: float = 0.0
    seconds: float = 0.0              # the estimate

    def describe(self, budget_s, drafter) -> str:
        """One line: what calibration will do. drafter: the draft's exit when no adapter
        is trained (a shipped adapter, or the raw exit and why)."""
        adapter = (f"an exit adapter trained on {self.replies} replies, up to "
                   f"{self.adapter_minutes:.1f} min" if self.replies else drafter)
        screens = [name for name, on in (("fixed k 1-" + str(self.sizes.k_candidates),
                                          self.screen_k),
                                         ("shortlist sizes", self.shortlist)) if on]
        screens = f"{', '.join(screens)} on {self.screen_prompts} prompts" if screens else "none"
        final = (f"plain vs {self.sizes.final_policies} adaptive policies on {self.prompts} "
                 f"held-out prompts x {self.sizes.measure_tokens} tokens" if self.prompts
                 else "nothing measured, the default adaptive policy ships")
        return (f"calibration budget {budget_s / 60:g} min (plain decoding "
                f"{1 / self.token_s:.0f} tok/s here): exit layer"
                f"{'s' if len(self.exit_layers) > 1 else ''} "
                f"{', '.join(map(str, self.exit_layers))}, {adapter}; screens: {screens}; "
                f"final choice: {final}; estimated "
                f"{self.seconds / 60:.1f} min")


def plan(budget_s, token_s, build_s, sizes: Sizes, candidates, train, counts,
         shortlist_auto, adapter_minutes) -> Plan:
    """What calibration does within `budget_s` seconds.

    token_s: seconds per plain token; build_s: seconds to build another exit layer's graphs;
    candidates: exit layers to choose from, the default (used alone) first; train: None (no
    adapter to train), "auto" (if it fits) or "train" (always); counts: token counts for
    the shortlist exist without training; adapter_minutes: the most training wanted."""
    unit = lambda prompts: prompts * sizes.measure_tokens * token_s * OVERHEAD  # noqa: E731
    final = lambda prompts: (1 + sizes.final_policies) * unit(prompts)  # noqa: E731
    floor = min(MIN_PROMPTS, sizes.held_out)
    prompts = next((p for p in range(sizes.held_out, floor - 1, -1)
                    if final(p) <= budget_s * FINAL_SHARE), floor)
    if final(prompts) > budget_s:
        prompts = 0
    screen = max(floor, prompts // 2) if prompts else 0
    p = Plan(sizes, token_s, prompts, screen, exit_layers=candidates[:1])
    left = budget_s - final(prompts)
    screen_k = (1 + FIXED_K_COST * sizes.k_candidates) * unit(screen) if screen else None
    screen_shortlist = (sizes.shortlist_sizes * (1 + FIXED_K_COST) * unit(screen)
                        if screen and shortlist_auto else None)
    reply_s = sizes.train_tokens * token_s * OVERHEAD
    least = min(MIN_REPLIES, sizes.train_prompts) * reply_s + \
        min(MIN_ADAPTER_MINUTES, adapter_minutes) * 60  # the smallest adapter worth training
    screens = (screen_k or 0) + (screen_shortlist or 0)
    if train == "train" or train == "auto" and screens + least <= left:
        p.screen_k, p.shortlist = screen_k is not None, screen_shortlist is not None
        left -= screens
        others = (len(candidates) - 1) * (build_s + (screen_k or 0))
        if len(candidates) > 1 and others + least <= left:
            p.exit_layers = sorted(candidates)
            left -= others
        # what is left: half to replies, the rest to training (within its bounds)
        p.replies = max(min(MIN_REPLIES, sizes.train_prompts),
                        min(sizes.train_prompts, int(left / 2 / reply_s)))
        p.adapter_minutes = max(min(MIN_ADAPTER_MINUTES, adapter_minutes),
                                min(adapter_minutes, (left - p.replies * reply_s) / 60))
        left -= p.replies * reply_s + p.adapter_minutes * 60
    else:
        for name, cost in (("screen_k", screen_k), ("shortlist", counts and screen_shortlist)):
            if cost and cost <= left:
                setattr(p, name, True)
                left -= cost
    p.seconds = budget_s - left
    return p
