"""Loss spikes: a step's loss far above a robust running estimate of the recent ones.

The estimate is the median of the last ``window`` losses and their median absolute
deviation (MAD, scaled by 1.4826 to match a standard deviation); a loss more than
``threshold`` such deviations above the median is a spike. Median and MAD ignore the
spikes themselves, which an EMA and a standard deviation would not. Spikes (and skipped
steps) do not enter the window.
"""

from __future__ import annotations

import statistics
from collections import deque

MAD_TO_STD = 1.4826
MIN_SAMPLES = 5


class SpikeDetector:
    def __init__(self, threshold: float, window: int):
        self.threshold = threshold
        self.losses: deque[float] = deque(maxlen=window)

    def score(self, loss: float) -> float | None:
        """Robust deviations of ``loss`` above the median (None: too few samples yet)."""
        if len(self.losses) < MIN_SAMPLES:
            return None
        med = statistics.median(self.losses)
        mad = statistics.median(abs(x - med) for x in self.losses) * MAD_TO_STD
        scale = max(mad, 1e-3 * abs(med), 1e-8)  # a flat window must not make every wiggle a spike
        return (loss - med) / scale

    def check(self, loss: float) -> float | None:
        """The deviation score when ``loss`` is a spike, else None (and the loss joins the window)."""
        s = self.score(loss)
        if s is not None and s > self.threshold:
            return s
        self.losses.append(loss)
        return None

    def median(self) -> float | None:
        return statistics.median(self.losses) if self.losses else None
