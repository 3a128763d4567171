"""Seconds per step, recent and on average: the recent pace is an exponential moving average, so
an ETA follows the machine as it is now (a slow start, a neighbour's job come or gone) instead of
the average since the start, which a slow start keeps high for the rest of the run."""

from __future__ import annotations

import math

HALF_LIFE_STEPS = 20  # a step this many steps ago weighs half as much as the newest


class Pace:
    """Fed (steps, seconds) intervals: ``recent`` weighs each step by 2^(-age / HALF_LIFE_STEPS);
    the first interval (start-up, compilation, first-touch allocations) only stands in until a
    second one comes, then it is dropped from ``recent`` (``average`` keeps it)."""

    def __init__(self, half_life_steps: float = HALF_LIFE_STEPS):
        self.keep = 0.5 ** (1 / half_life_steps)  # the weight an old value keeps per new step
        self.recent = math.nan
        self.steps, self.seconds, self.intervals = 0, 0.0, 0

    def add(self, steps: int, seconds: float) -> None:
        """``steps`` steps took ``seconds`` (wall-clock time, or one step's measured time)."""
        if steps <= 0:
            return
        per_step = seconds / steps
        if self.intervals < 2:  # the first interval stands in; the second replaces it
            self.recent = per_step
        else:
            self.recent += (1 - self.keep**steps) * (per_step - self.recent)
        self.intervals += 1
        self.steps += steps
        self.seconds += seconds

    @property
    def average(self) -> float:
        return self.seconds / self.steps if self.steps else math.nan

    def eta(self, remaining: int) -> float:
        """Seconds left for ``remaining`` steps at the recent pace."""
        return self.recent * remaining
