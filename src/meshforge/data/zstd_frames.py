"""A zstd stream read frame by frame, so that a cut-off file is an error, as gzip's is.

``zstandard``'s ``stream_reader`` ends quietly where a truncated file ends: half of a
``.txt.zst`` prepared to exit 0 with half of its tokens. Here every frame is decompressed by a
``decompressobj``, which says when its frame is complete (``eof``); input that ends inside a
frame raises EOFError, which the corpus reader names as a truncated or damaged file. Input is
fed a little at a time, so a small file that decompresses to a great deal (a zstd "bomb") is
held in memory a slice at a time, never whole.
"""

from __future__ import annotations

import io
from typing import IO, Any

FEED = 1 << 12  # compressed bytes per call: at most ~32,768x this comes out of one (RLE blocks)


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame in ``raw``, in order; EOFError when ``raw`` ends
    inside a frame (a truncated file)."""

    def __init__(self, raw: IO[bytes], dctx: Any):
        self.raw, self.dctx = raw, dctx
        self.frame: Any = None  # the current frame's decompressor (None: between frames)
        self.pending, self.pos = b"", 0  # decompressed bytes not yet handed out: pending[pos:]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self.pos == len(self.pending):
            data = self.raw.read(FEED)
            if not data:
                if self.frame is not None:
                    raise EOFError("the compressed file ended inside a zstd frame (truncated)")
                return 0
            self.pending, self.pos = self._feed(data), 0
        n = min(len(buffer), len(self.pending) - self.pos)
        buffer[:n] = self.pending[self.pos : self.pos + n]
        self.pos += n
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            if self.frame is None:
                self.frame = self.dctx.decompressobj()
            out.append(self.frame.decompress(data))
            if not self.frame.eof:
                break
            data, self.frame = self.frame.unused_data, None
        return b"".join(out)
