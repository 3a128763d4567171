"""A number's range, declared in the field that holds it: ``ranged(span, default)`` is a dataclass
field whose metadata carries a ``Span``. The config loader's value checks (config/checks.py),
``meshforge plan``'s flags (planner/plan_args.py) and the explorer's parameters
(explore/params.py) all read a key's range from there, so the three front ends accept the same
values (tests/unit/test_one_vocabulary.py walks them).

A leaf that imports nothing of meshforge: models/shape.py declares [model]'s ranges with it
without importing config/. The bounds are generous -- a model 10x the largest trained today
fits, a step count reaches years at any step time -- and exist to catch a typo or a unit slip
(1e23 steps, a learning rate of 3e4, a negative seed) before it trains into nonsense. Rules
between keys (heads divide hidden, degrees divide the world) stay in config/checks.py,
models/presets.py and parallel/rules.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

RANGE = "range"  # field metadata: the Span a number must fall in
EACH = "each"  # field metadata: the Span each element of a list must fall in
WORDS = "words"  # field metadata: words a number's key takes beside its range (resolved before a run)


@dataclass(frozen=True)
class Span:
    """[lo, hi] (``lo_open``/``hi_open``: that end excluded); ``also``: values allowed outside
    it with a meaning of their own (-1: inferred, 0: off)."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[float, ...] = ()

    def holds(self, v: float) -> bool:
        if v in self.also:
            return True
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def text(self) -> str:
        """The range as the reference and the loader's refusals show it: ``[1, 16,384] or -1``."""
        ends = f"{'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"
        return ends + "".join(f" or {num(a)}" for a in self.also)


def num(x: float) -> str:
    """A bound as people read it: whole numbers with thousands separators, else ``%g``."""
    if isinstance(x, int) or (math.isfinite(x) and x == int(x) and abs(x) < 1e15):
        return f"{int(x):,}"
    return f"{x:g}"


def whole(lo: int, hi: int, *also: int) -> Span:
    return Span(lo, hi, also=also)


def unit(hi: float = 1.0, *, lo_open: bool = False, hi_open: bool = False) -> Span:
    """[0, hi] (or with open ends)."""
    return Span(0.0, hi, lo_open=lo_open, hi_open=hi_open)


MAX_STEPS = 10**9  # a billion steps: years of training at any step time
DEGREE = whole(1, 2**20, -1)  # a parallel degree; -1: inferred from the world size
BLOCKS = 2**14  # layers, heads: 10x beyond today's largest models
WIDTH = 2**20  # hidden, FFN widths
TOKENS = 2**24  # sequence lengths and batch sizes, in tokens or sequences


def ranged(span: Span, default: Any = dataclasses.MISSING, *, each: bool = False, **metadata: Any) -> Any:
    """A dataclass field holding a number in ``span`` (``each``: a list whose every element is);
    other ``metadata`` (``section``, ``key``) passes through."""
    return dataclasses.field(default=default, metadata={**metadata, (EACH if each else RANGE): span})
