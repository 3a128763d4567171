"""One seed, one set of weights: every initial value is a function of (seed, parameter name,
element index) alone, drawn on the CPU, whatever device, layout or shard holds it.

A device's random stream depends on the device (CPU's Mersenne Twister and CUDA's Philox give
different numbers for one seed), so a parameter drawn where it lives — on the GPU, or on the
host under CPU offload — would start a run elsewhere from other weights. Here each parameter,
flattened, is cut into blocks of ``BLOCK`` elements; block k is drawn by a CPU generator seeded
from (seed, name, k) and copied to wherever the parameter lives. A rank that holds a slice
(an FSDP shard: whole rows) draws only the blocks its slice touches, so a sharded 405B model
is not drawn whole on every rank. Block 0 is seeded exactly as the whole parameter was before
blocks existed: a parameter of up to ``BLOCK`` elements (every one of the debug presets') has
the values it always had on a CPU.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK = 1 << 20  # elements per generator (4 MiB of fp32): a multiple of 16, see draw_normal
_THREADS = 8  # blocks drawn side by side (torch's kernels release the GIL)


def param_seed(seed: int, name: str, block: int = 0) -> int:
    """The generator seed of ``block`` of parameter ``name`` (block 0: the parameter's own)."""
    key = f"{seed}/{name}" if block == 0 else f"{seed}/{name}#{block}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _fill_block(buf: torch.Tensor, seed: int, name: str, k: int, std: float) -> None:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(param_seed(seed, name, k))
    buf.normal_(0.0, std, generator=gen)


def draw_normal(
    seed: int,
    name: str,
    shape: tuple[int, ...],
    std: float,
    offset: tuple[int, ...] | None = None,
    local: tuple[int, ...] | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """N(0, std²) values of parameter ``name`` (global ``shape``), fp32 on the CPU: the whole
    tensor, or the box of size ``local`` at ``offset``. The values of an element do not depend
    on which box is asked for. (CPU ``normal_`` fills 16 values at a time from the start, so the
    first n values of a longer draw are a shorter draw's: blocks continue the old whole-tensor
    stream in block 0.)"""
    block = block or BLOCK
    shape = tuple(shape)
    offset = tuple(offset) if offset is not None else (0,) * len(shape)
    local = tuple(local) if local is not None else shape
    if math.prod(local) == 0:
        return torch.empty(local)
    numel, strides = math.prod(shape), _strides(shape)
    first = sum(o * s for o, s in zip(offset, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offset, local, strides, strict=True))
    b0, b1 = first // block, last // block
    buf = torch.empty(min(numel, (b1 + 1) * block) - b0 * block)
    parts = [(buf[(k - b0) * block : (k - b0 + 1) * block], k) for k in range(b0, b1 + 1)]
    if len(parts) == 1:
        _fill_block(parts[0][0], seed, name, parts[0][1], std)
    else:
        with ThreadPoolExecutor(min(_THREADS, len(parts))) as pool:
            list(pool.map(lambda p: _fill_block(p[0], seed, name, p[1], std), parts))
    return buf.as_strided(local, strides, first - b0 * block).clone()
