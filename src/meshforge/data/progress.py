"""The preparation's progress line: input read, MB/s, tokens/s and the time left.

On a terminal the line is rewritten in place twice a second; in a log it is a new line every
30 s. Rates count only this process's work (a resumed preparation's earlier part is not
in them); the time left is the rest of the input at the rate so far. Updating costs one
clock read per batch, so it never slows the preparation.
"""

from __future__ import annotations

import time
from typing import TextIO


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    def __init__(
        self, total_bytes: int, stream: TextIO | None, done: int = 0, tokens: int = 0, interval: float | None = None
    ):
        self.stream, self.total = stream, max(1, total_bytes)
        self.done0, self.tokens0 = self.done, self.tokens = done, tokens
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.5 if self.tty else 30.0)
        self.t0 = self.last = time.monotonic()
        self.printed = False

    def update(self, done: int, tokens: int) -> None:
        """``done``: input bytes read so far; ``tokens``: tokens written by this batch."""
        self.done, self.tokens = max(self.done, done), self.tokens + tokens
        now = time.monotonic()
        if self.stream is not None and now - self.last >= self.interval:
            self.last = now
            self._print(now)

    def line(self, now: float | None = None) -> str:
        elapsed = max(1e-9, (now or time.monotonic()) - self.t0)
        rate = (self.done - self.done0) / elapsed
        left = self.total - self.done
        eta = _duration(left / rate) if rate > 0 and left > 0 else "0:00" if left <= 0 else "?"
        return (
            f"meshforge: prepare {min(100, 100 * self.done // self.total):3d}% | "
            f"{self.done / 1e6:,.1f} / {self.total / 1e6:,.1f} MB | {rate / 1e6:,.2f} MB/s | "
            f"{(self.tokens - self.tokens0) / elapsed:,.0f} tokens/s | {self.tokens:,} tokens | ETA {eta}"
        )

    def _print(self, now: float) -> None:
        assert self.stream is not None
        if self.tty:
            self.stream.write("\r" + self.line(now) + "\x1b[K")
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()
        self.printed = True

    def finish(self) -> None:
        """The final figures, when a line was shown (a short preparation stays quiet)."""
        if self.stream is not None and self.printed:
            self._print(time.monotonic())
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()
