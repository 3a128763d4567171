"""Which steps are logged, and the console's word on a slow step in between.

Step 1 is always logged, so the first progress line comes after the first step rather than
after ``metrics.log_interval`` of them; then every ``log_interval``-th step and the last.
A step that is not logged but took more than ``SLOW_STEP_S`` on the host clock (no device
sync: on a GPU that clock catches up within a step or two) gets a short line of its own.
"""

from __future__ import annotations

SLOW_STEP_S = 5.0


def is_logged(n: int, log_interval: int, steps: int) -> bool:
    """Whether step ``n`` (1-based) is measured and logged: the first, every ``log_interval``-th, the last."""
    return n == 1 or n % log_interval == 0 or n == steps


def slow_step_line(n: int, steps: int, dt: float, log_interval: int) -> str | None:
    """A line for an unlogged step ``n`` that took ``dt`` seconds, or None when it was quick."""
    if dt <= SLOW_STEP_S:
        return None
    nxt = min(steps, (n // log_interval + 1) * log_interval)
    return f"  step {n}/{steps} took {dt:.1f}s (the next logged step, with its loss, is {nxt})"
