"""Facts of a GRPO step that the login node and the trainer share (torch-free).

When a group's completions all earn the same reward, their advantages are 0 and the group teaches nothing.
A stage in which no group of the first K steps had any variance stops (train/grpo.py ZeroVarianceStop): a
model that never writes a rewarded completion burns GPU-hours for nothing. K is chosen from the chance of a
false stop. A model right a share p of the time gives a group of G completions no variance with probability
q = p^G + (1-p)^G; a step of n groups has none in any group with probability q^n, and K such steps in a row
happen with probability q^(nK). K is the smallest whole number with q^(nK) < `false_stop` for p = 5 %:

    K = floor(ln(false_stop) / (n ln q)) + 1

e.g. G = 4, n = 1: q = 0.05^4 + 0.95^4 = 0.8145, K = floor(4.605 / 0.2051) + 1 = 23; n = 4: K = 6.
"""

from __future__ import annotations

import math

RIGHT_SHARE = 0.05  # the weakest model that should not be stopped: right 5 % of the time
FALSE_STOP = 0.01  # the chance of stopping such a model by mistake


def no_variance_chance(generations: int, right_share: float = RIGHT_SHARE) -> float:
    """q: the probability that a group of `generations` completions all earn the same 0/1 reward."""
    return right_share**generations + (1 - right_share) ** generations


def zero_variance_steps(
    generations: int, groups_per_step: int, right_share: float = RIGHT_SHARE, false_stop: float = FALSE_STOP
) -> int:
    """K: the steps without reward variance in any group after which a stage stops (module docstring)."""
    per_step = math.log(no_variance_chance(generations, right_share)) * groups_per_step
    return math.floor(math.log(false_stop) / per_step) + 1
