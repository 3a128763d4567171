"""TensorBoard scalar event files, written without the ``tensorboard`` package.

Scalars need only a few bytes of protobuf in TFRecord framing; writing them by hand
saves a dependency tree (grpcio, protobuf, ...) that training does not otherwise use.
The format: each record is ``len:u64 | masked_crc32c(len):u32 | data | masked_crc32c(data):u32``,
and data is an ``Event`` message {1: wall_time double, 2: step int64, 3: file_version
string, 5: Summary {1: Value {1: tag string, 2: simple_value float}}}.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_event(step: int, wall_time: float, scalars: dict[str, float] | None = None, version: str = "") -> bytes:
    msg = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if version:
        msg += _len_field(3, version.encode())
    if scalars:
        values = b"".join(
            _len_field(1, _len_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", float(v)))
            for tag, v in scalars.items()
        )
        msg += _len_field(5, values)
    return msg


def frame(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked(crc32c(header))) + data + struct.pack("<I", _masked(crc32c(data)))


class TensorBoardWriter:
    """Appends scalar events to ``events.out.tfevents.<time>.<host>`` in ``log_dir``."""

    def __init__(self, log_dir: str | Path):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self._f = self.path.open("ab")
        self._f.write(frame(encode_event(0, time.time(), version="brain.Event:2")))
        self._f.flush()

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._f.write(frame(encode_event(step, time.time(), scalars)))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_scalars(path: str | Path) -> list[tuple[int, str, float]]:
    """Decode (step, tag, value) triples, checking every CRC (used by tests and reports)."""
    data = Path(path).read_bytes()
    out: list[tuple[int, str, float]] = []
    pos = 0

    def varint(buf: bytes, i: int) -> tuple[int, int]:
        shift = n = 0
        while True:
            b = buf[i]
            n |= (b & 0x7F) << shift
            i += 1
            if not b & 0x80:
                return n, i
            shift += 7

    def fields(buf: bytes):
        i = 0
        while i < len(buf):
            key, i = varint(buf, i)
            num, wire = key >> 3, key & 7
            if wire == 0:
                v, i = varint(buf, i)
            elif wire == 1:
                v, i = buf[i : i + 8], i + 8
            elif wire == 5:
                v, i = buf[i : i + 4], i + 4
            elif wire == 2:
                n, i = varint(buf, i)
                v, i = buf[i : i + n], i + n
            else:
                raise ValueError(f"unsupported wire type {wire}")
            yield num, v

    while pos < len(data):
        header = data[pos : pos + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[pos + 8 : pos + 12])[0] != _masked(crc32c(header)):
            raise ValueError(f"{path}: bad length CRC at byte {pos}")
        rec = data[pos + 12 : pos + 12 + n]
        if struct.unpack("<I", data[pos + 12 + n : pos + 16 + n])[0] != _masked(crc32c(rec)):
            raise ValueError(f"{path}: bad data CRC at byte {pos}")
        pos += 16 + n
        step = 0
        for num, v in fields(rec):
            if num == 2:
                step = v
            elif num == 5:
                for _, value in fields(v):
                    tag, val = "", 0.0
                    for vn, vv in fields(value):
                        if vn == 1:
                            tag = vv.decode()
                        elif vn == 2:
                            val = struct.unpack("<f", vv)[0]
                    out.append((step, tag, val))
    return out
