"""A Gantt chart of one pipeline step as a PNG: ranks as rows, each forward (F), backward
(B) and weight-gradient (W) action as a box labelled with its micro-batch, idle time grey.

Written by hand (a PNG encoder and a 3x5 pixel font, ~100 lines) rather than pulling in a
plotting library for one picture.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# 3x5 glyphs: five rows of three bits (4 = left pixel), one digit per row
FONT = {
    "0": "75557", "1": "26227", "2": "71747", "3": "71717", "4": "55711", "5": "74717", "6": "74757",
    "7": "71111", "8": "75757", "9": "75717", "A": "25755", "B": "65656", "C": "34443", "D": "65556",
    "E": "74647", "F": "74644", "G": "34553", "H": "55755", "I": "72227", "J": "11157", "K": "55655",
    "L": "44447", "M": "57755", "N": "65555", "O": "25552", "P": "65644", "Q": "25563", "R": "65655",
    "S": "34216", "T": "72222", "U": "55557", "V": "55552", "W": "55775", "X": "55255", "Y": "55222",
    "Z": "71247", " ": "00000", ".": "00002", ",": "00024", "=": "07070", "(": "12221", ")": "42224",
    ":": "02020", "-": "00700", "/": "11244", "%": "51245",
}  # fmt: skip
SCALE = 2  # screen pixels per font pixel
CHAR_W = 4 * SCALE

COLORS = {  # (first chunk on a rank, later chunks)
    "F": ((66, 133, 244), (25, 80, 170)),
    "B": ((52, 168, 83), (20, 110, 50)),
    "W": ((251, 140, 0), (190, 95, 0)),
}
IDLE, BACKGROUND, INK, WHITE = (215, 215, 215), (255, 255, 255), (30, 30, 30), (255, 255, 255)


class Canvas:
    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(bytes(BACKGROUND) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, x0), min(self.w, x1)
        row = bytes(color) * max(0, x1 - x0)
        for y in range(max(0, y0), min(self.h, y1)):
            i = 3 * (y * self.w + x0)
            self.px[i : i + len(row)] = row

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int] = INK) -> None:
        for ch in s.upper():
            glyph = FONT.get(ch, FONT[" "])
            for r, bits in enumerate(glyph):
                for c in range(3):
                    if int(bits) & (4 >> c):
                        px, py = x + c * SCALE, y + r * SCALE
                        self.rect(px, py, px + SCALE, py + SCALE, color)
            x += CHAR_W

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w : 3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        )


def draw_gantt(rows: Sequence[Any], path: Path, title: str, width: int = 1400) -> Path:
    """``rows``: one timeline per pipeline rank (``.actions`` with kind, chunk, microbatch,
    start, end in seconds; ``.span``), in pipeline order."""
    left, top, row_h, gap = 90, 40, 34, 8
    height = top + len(rows) * (row_h + gap) + 60
    cv = Canvas(width, height)
    cv.text(10, 10, title)
    span = max((r.span for r in rows), default=1e-9) or 1e-9
    scale = (width - left - 20) / span
    first_chunk = {i: min((a.chunk for a in r.actions), default=0) for i, r in enumerate(rows)}
    for i, r in enumerate(rows):
        y = top + i * (row_h + gap)
        cv.text(10, y + row_h // 2 - 5, f"rank {i}")
        cv.rect(left, y, left + int(r.span * scale), y + row_h, IDLE)
        for a in r.actions:
            x0, x1 = left + int(a.start * scale), left + max(int(a.end * scale), int(a.start * scale) + 1)
            color = COLORS.get(a.kind, COLORS["F"])[0 if a.chunk == first_chunk[i] else 1]
            cv.rect(x0, y, x1, y + row_h, color)
            cv.rect(x1 - 1, y, x1, y + row_h, WHITE)  # a thin separator between adjacent boxes
            label = f"{a.kind}{a.microbatch}"
            if x1 - x0 >= len(label) * CHAR_W + 2:
                cv.text(x0 + (x1 - x0 - len(label) * CHAR_W) // 2 + 1, y + row_h // 2 - 5, label, WHITE)
    y = top + len(rows) * (row_h + gap)
    for k in range(6):  # time axis
        t = span * k / 5
        x = left + int(t * scale)
        cv.rect(x, y - gap, x + 1, y - 2, INK)
        cv.text(max(0, x - 12), y, f"{t * 1000:.0f}")
    cv.text(10, y, "time, ms")
    legend = y + 24
    x = left
    for kind, name in (("F", "forward"), ("B", "backward"), ("W", "weight grad")):
        cv.rect(x, legend, x + 14, legend + 12, COLORS[kind][0])
        cv.text(x + 20, legend + 1, name)
        x += 20 + (len(name) + 3) * CHAR_W
    cv.rect(x, legend, x + 14, legend + 12, IDLE)
    cv.text(x + 20, legend + 1, "idle (bubble)")
    x += 20 + 16 * CHAR_W
    cv.text(x, legend + 1, "darker: a rank's later chunk")
    path.write_bytes(cv.png())
    return path
