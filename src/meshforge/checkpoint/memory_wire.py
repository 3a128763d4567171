"""Shards as data (checkpoint.memory_interval): tensors as raw bytes under a JSON header that lists
each tensor's key, dtype, shape, offset and byte count; every figure is checked against the others
and the payload's length before a byte becomes a tensor, and against the rank's own tensors before
it is copied in. Nothing is unpickled. The messages that carry them: memory_frame.py.
"""

from __future__ import annotations

from typing import Any

import torch

from meshforge.checkpoint.memory_frame import MemoryShardError

ALIGN = 64
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}
DTYPES |= {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.uint8, torch.bool)}


def encode(tensors: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], list[memoryview], int]:
    """The entries describing ``tensors`` (CPU, contiguous), the byte views to send, and their total size."""
    entries, parts, offset = [], [], 0
    for key, t in tensors.items():
        pad = -offset % ALIGN
        if pad:
            parts.append(memoryview(bytes(pad)))
            offset += pad
        raw = t.reshape(-1).view(torch.uint8).numpy()
        name = str(t.dtype).removeprefix("torch.")
        entries.append({"key": key, "dtype": name, "shape": list(t.shape), "offset": offset, "nbytes": raw.nbytes})
        parts.append(memoryview(raw))
        offset += raw.nbytes
    return entries, parts, offset


def _entry(e: Any, where: str, size: int, end: int) -> tuple[str, torch.dtype, list[int], int, int]:
    """One tensor entry, every figure checked (raises MemoryShardError naming ``where``)."""
    if not isinstance(e, dict) or not isinstance(e.get("key"), str) or e.get("dtype") not in DTYPES:
        raise MemoryShardError(f"{where}: a tensor entry is malformed or has an unknown dtype ({str(e)[:120]})")
    shape, off, nbytes = e.get("shape"), e.get("offset"), e.get("nbytes")
    if not isinstance(shape, list) or len(shape) > 8 or any(type(d) is not int or d < 0 for d in shape):
        raise MemoryShardError(f"{where}: {e['key']} has a bad shape {str(shape)[:80]}")
    dtype = DTYPES[e["dtype"]]
    numel = 1
    for d in shape:
        numel *= d
    want = numel * dtype.itemsize
    if type(off) is not int or type(nbytes) is not int or nbytes != want or off % ALIGN or off < end:
        raise MemoryShardError(f"{where}: {e['key']} declares {nbytes!r} bytes at {off!r}; {shape} {dtype} is {want}")
    if off + nbytes > size:
        raise MemoryShardError(f"{where}: {e['key']} ends at byte {off + nbytes}, past the shard's {size} bytes")
    return e["key"], dtype, shape, off, nbytes


def decode(entries: Any, payload: bytearray, where: str) -> dict[str, torch.Tensor]:
    """The shard's tensors (views of ``payload``), after checking every entry against the payload."""
    if not isinstance(entries, list):
        raise MemoryShardError(f"{where}: the shard's header lists no tensors")
    out, end = {}, 0
    for e in entries:
        key, dtype, shape, off, nbytes = _entry(e, where, len(payload), end)
        if key in out:
            raise MemoryShardError(f"{where}: {key} appears twice")
        flat = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=off) if nbytes else None
        out[key] = torch.empty(shape, dtype=dtype) if flat is None else flat.view(dtype).reshape(shape)
        end = off + nbytes
    return out


def check_against(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a shard whose tensors are not exactly the ones this rank holds (names, dtypes, shapes)."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise MemoryShardError(f"{where}: the shard lacks {missing[:3]} and has {extra[:3]} besides this rank's state")
    for k, t in want.items():
        if got[k].dtype != t.dtype or tuple(got[k].shape) != tuple(t.shape):
            raise MemoryShardError(
                f"{where}: {k} is {tuple(got[k].shape)} {got[k].dtype}, this rank holds {tuple(t.shape)} {t.dtype}"
            )
