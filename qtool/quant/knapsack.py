"""Choosing one option per group under a size budget: the multiple-choice knapsack behind ``--target-bpw``.

Each group (a layer, or layers a runtime fuses) has options, each with a cost in bytes and a damage (the measured
loss increase of that option alone). :func:`choose` picks one option per group minimizing the summed damage with
the summed cost at most the budget, by dynamic programming over the cost above each group's cheapest option.
Costs are counted in units of ``ceil(slack / resolution)`` bytes, each option's extra cost rounded *up* to whole
units, so a choice never exceeds the budget in bytes; with unit 1 (small problems) it is the exact optimum.
:func:`frontier` gives the best damage at every size the same table reaches (the Pareto curve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Choice", "choose", "frontier", "RESOLUTION"]

RESOLUTION = 20000  # cost units between the cheapest assignment and the budget


@dataclass(frozen=True)
class Choice:
    options: Tuple[int, ...]  # the chosen option of each group
    cost: int  # bytes, exact
    damage: float  # summed damage of the chosen options


def _check(damage: Sequence[Sequence[float]], cost: Sequence[Sequence[int]]) -> None:
    if len(damage) != len(cost):
        raise ValueError(f"{len(damage)} damage rows for {len(cost)} cost rows")
    for g, (d, c) in enumerate(zip(damage, cost)):
        if not d or len(d) != len(c):
            raise ValueError(f"group {g}: {len(d)} damages for {len(c)} costs (at least one option each)")
        if any(int(x) != x or x < 0 for x in c):
            raise ValueError(f"group {g}: costs are whole, non-negative byte counts (got {list(c)})")
        if any(not np.isfinite(x) for x in d):
            raise ValueError(f"group {g}: damages must be finite (got {list(d)})")


def _units(extra: int, unit: int) -> int:
    return -(-extra // unit)  # rounded up: a choice that fits in units fits in bytes


def _table(damage, cost, unit: int, cap: int):
    """The DP: ``best[u]`` the least damage whose extra cost fits ``u`` units, and each group's choice table."""
    base = [min(c) for c in cost]
    best = np.zeros(cap + 1, dtype=np.float64)
    picks = []
    for d, c, b in zip(damage, cost, base):
        # options in (cost, index) order: on equal damage the cheaper (then the earlier) option wins
        order = sorted(range(len(c)), key=lambda k: (c[k], k))
        new = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, dtype=np.int32)
        for k in order:
            units = _units(int(c[k]) - b, unit)
            if units > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[units:] = best[: cap + 1 - units] + float(d[k])
            better = cand < new
            new[better] = cand[better]
            pick[better] = k
        best = new
        picks.append(pick)
    return best, picks, unit, base


def _trace(picks, cost, unit: int, base, u: int) -> List[int]:
    chosen = [0] * len(picks)
    for g in range(len(picks) - 1, -1, -1):
        k = int(picks[g][u])
        chosen[g] = k
        u -= _units(int(cost[g][k]) - base[g], unit)
    return chosen


def choose(damage: Sequence[Sequence[float]], cost: Sequence[Sequence[int]], budget: int,
           resolution: int = RESOLUTION) -> Optional[Choice]:
    """The options (one per group) of least summed damage whose summed cost is at most ``budget`` bytes; None when
    even the cheapest option of every group exceeds it."""
    _check(damage, cost)
    floor = sum(min(c) for c in cost)
    if floor > budget:
        return None
    slack = int(budget) - floor
    unit = max(1, _units(slack, resolution))
    best, picks, unit, base = _table(damage, cost, unit, slack // unit)
    options = _trace(picks, cost, unit, base, len(best) - 1)
    return Choice(tuple(options), sum(int(cost[g][k]) for g, k in enumerate(options)),
                  float(sum(damage[g][k] for g, k in enumerate(options))))


def frontier(damage: Sequence[Sequence[float]], cost: Sequence[Sequence[int]], points: int = 60,
             resolution: int = RESOLUTION) -> List[Choice]:
    """Up to ``points`` choices along the Pareto curve, from the cheapest assignment to the least damaging one:
    each the least damage at its size, sizes increasing, damages strictly decreasing."""
    _check(damage, cost)
    floor = sum(min(c) for c in cost)
    unit = max(1, _units(sum(max(c) for c in cost) - floor, resolution))
    cap = sum(max(_units(int(x) - min(c), unit) for x in c) for c in cost)  # every assignment fits
    best, picks, unit, base = _table(damage, cost, unit, cap)
    steps = sorted({round(i * (len(best) - 1) / max(points - 1, 1)) for i in range(points)})
    out: List[Choice] = []
    for u in steps:
        options = _trace(picks, cost, unit, base, u)
        c = sum(int(cost[g][k]) for g, k in enumerate(options))
        d = float(sum(damage[g][k] for g, k in enumerate(options)))
        if not out or d < out[-1].damage:
            out.append(Choice(tuple(options), c, d))
    return out
