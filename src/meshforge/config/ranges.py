"""Every number a config can hold, and the range it must fall in.

One row per int or float key (tests/test_hostile_inputs.py fails when a numeric key has none):
a value outside is refused with the key, the range and what the number means, before any
other check looks at it. The bounds are generous -- a model 10x the largest trained today
fits, a step count reaches years at any step time -- and exist to catch a typo or a unit
slip (1e23 steps, a learning rate of 3e4, a negative seed) before it trains into nonsense.
Rules between keys (heads divide hidden, degrees divide the world) stay in checks.py,
models/presets.py and parallel/rules.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshforge.errors import ConfigError

MAX_STEPS = 10**9  # a billion steps: years of training at any step time


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
        ends = f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        return ends + "".join(f" or {_num(a)}" for a in self.also)


def _num(x: float) -> str:
    if isinstance(x, int) or (math.isfinite(x) and x == int(x) and abs(x) < 1e15):
        return f"{int(x):,}"
    return f"{x:g}"


def whole(lo: int, hi: int, *also: int) -> Span:
    return Span(lo, hi, also=also)


def unit(hi: float = 1.0, *, lo_open: bool = False, hi_open: bool = False) -> Span:
    """[0, hi] (or with open ends)."""
    return Span(0.0, hi, lo_open=lo_open, hi_open=hi_open)


DEGREE = whole(1, 2**20, -1)  # a parallel degree; -1: inferred from the world size
BLOCKS = 2**14  # layers, heads: 10x beyond today's largest models
WIDTH = 2**20  # hidden, FFN widths
TOKENS = 2**24  # sequence lengths and batch sizes, in tokens or sequences

RANGES: dict[str, Span] = {
    "model.hidden": whole(1, WIDTH),
    "model.layers": whole(1, BLOCKS),
    "model.heads": whole(1, BLOCKS),
    "model.kv_heads": whole(1, BLOCKS),
    "model.ffn_hidden": whole(1, WIDTH),
    "model.vocab_size": whole(1, 2**25),
    "model.max_seq_len": whole(1, TOKENS),
    "model.norm_eps": unit(lo_open=True),
    "model.rope_theta": Span(1.0, 1e12),
    "model.rope_factor": Span(0.0, 1e4, lo_open=True),
    "model.rope_low_freq_factor": Span(0.0, 1e4, lo_open=True),
    "model.rope_high_freq_factor": Span(0.0, 1e4, lo_open=True),
    "model.rope_original_max_seq_len": whole(1, TOKENS),
    "model.init_std": unit(lo_open=True),
    "model.head_dim": whole(0, 2**16),
    "model.num_experts": whole(0, 2**20),
    "model.experts_per_token": whole(1, 2**20),
    "model.num_shared_experts": whole(0, 2**10),
    "model.moe_ffn_hidden": whole(0, WIDTH),
    "model.moe_interval": whole(1, BLOCKS),
    "model.first_dense_layers": whole(0, BLOCKS),
    "model.capacity_factor": unit(1e3),
    "model.aux_loss_coeff": unit(1e3),
    "model.bias_update_rate": unit(1.0),
    "model.z_loss_coeff": unit(1e3),
    **{f"parallel.{k}": DEGREE for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp")},
    "parallel.ep": whole(1, 2**20),
    "parallel.zero_stage": whole(0, 3),
    "parallel.ddp_bucket_mb": whole(1, 2**16),
    "parallel.ep_chunks": whole(0, 1024),
    "parallel.pp_virtual_stages": whole(1, BLOCKS),
    "parallel.num_microbatches": whole(0, TOKENS),
    "train.steps": whole(1, MAX_STEPS),
    "train.seq_len": whole(1, TOKENS),
    "train.global_batch_size": whole(1, TOKENS),
    "train.seed": whole(0, 2**32 - 1),
    "train.loss_chunk_size": whole(0, TOKENS),
    "train.grad_clip": unit(1e6),
    "train.eval_interval": whole(0, MAX_STEPS),
    "train.eval_batches": whole(0, 2**20),
    "train.micro_batch_size": whole(0, TOKENS),
    "optim.lr": unit(10.0, lo_open=True),
    "optim.min_lr_ratio": unit(),
    "optim.warmup_steps": whole(0, MAX_STEPS, -1),
    "optim.decay_steps": whole(0, MAX_STEPS),
    "optim.weight_decay": unit(10.0),
    "optim.beta1": unit(hi_open=True),
    "optim.beta2": unit(hi_open=True),
    "optim.eps": unit(lo_open=True),
    "data.val_fraction": unit(hi_open=True),
    "checkpoint.keep": whole(1, 10**6),
    "checkpoint.mtbf_hours": Span(0.0, 1e6, lo_open=True),
    "metrics.log_interval": whole(1, MAX_STEPS),
    "health.max_skipped": whole(0, MAX_STEPS),
    "health.spike_threshold": unit(1e6),
    "health.spike_window": whole(5, 10**6),
    "health.hang_timeout_s": Span(1.0, 1e7, also=(0,)),
    "health.straggler_factor": Span(1.0, 1e6, lo_open=True, also=(0,)),
    "health.text_warn_fraction": unit(lo_open=True),
    "profile.start_step": whole(0, MAX_STEPS),
    "profile.steps": whole(0, 10**4),
    "diloco.inner_steps": whole(1, MAX_STEPS),
    "diloco.outer_lr": unit(10.0, lo_open=True),
    "diloco.outer_momentum": unit(hi_open=True),
    "diloco.fragments": whole(1, BLOCKS),
    "diloco.delay": whole(0, MAX_STEPS),
    "diloco.warmup_steps": whole(0, MAX_STEPS),
    "diloco.islands": whole(1, 2**20),
}
LIST_RANGES: dict[str, Span] = {"parallel.pp_layers": whole(0, BLOCKS)}  # each element
STEP_KEYS = {"checkpoint.interval": whole(0, MAX_STEPS)}  # a number of steps beside a word ("auto")


def check_ranges(value_of: Any, help_of: Any) -> None:
    """Refuse the first value outside its range: ``value_of(key)`` reads a key, ``help_of(key)``
    its one-line meaning."""
    for key, span in {**RANGES, **STEP_KEYS}.items():
        v = value_of(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or span.holds(v):
            continue
        raise ConfigError(f"{key} = {_num(v)} is out of range: it must be in {span.text()} ({help_of(key)})")
    for key, span in LIST_RANGES.items():
        bad = [x for x in value_of(key) or () if not span.holds(x)]
        if bad:
            raise ConfigError(f"{key} holds {_num(bad[0])}: each entry must be in {span.text()} ({help_of(key)})")


def range_text(dotted: str) -> str:
    """The range of key ``dotted`` as the reference shows it ("" for a key without a number)."""
    span = RANGES.get(dotted) or STEP_KEYS.get(dotted)
    if span is not None:
        return f"range {span.text()}"
    span = LIST_RANGES.get(dotted)
    return f"each in {span.text()}" if span is not None else ""
