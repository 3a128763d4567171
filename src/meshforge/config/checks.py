"""Values that are wrong whatever the layout and the machine, refused with the key and the fix.

Types are checked as values are read (values.py; floats must be finite). Whether a layout
can run (degrees, divisibility, schedules) is parallel/dims/'s; what depends on the machine
(a GPU for offload, torchao for fp8) is resolve.py's.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from meshforge.config.keys import keys, value_of
from meshforge.config.sections import Config
from meshforge.errors import ConfigError
from meshforge.models.presets import check_model_args

MAX_STEPS = 10**9  # a billion steps: years of training at any step time
MAX_INT = 2**40  # no count or size meshforge takes comes near it


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_values(cfg: Config) -> None:
    """Refuse values that are wrong whatever the layout, naming the key and the fix."""
    _check_magnitudes(cfg)
    check_model_args(cfg.shape)
    _check_train(cfg)
    _check_optim(cfg)
    _check_layout(cfg)
    _check_run(cfg)
    _check_health(cfg)


def _check_magnitudes(cfg: Config) -> None:
    for dotted in keys():
        v: Any = value_of(cfg, dotted)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
            raise ConfigError(f"{dotted} = {v} is far too large (more than 2^40); check the value")


def _check_train(cfg: Config) -> None:
    t, max_seq = cfg.train, cfg.shape.max_seq_len
    _need(0 < t.steps <= MAX_STEPS, f"train.steps = {t.steps} must be between 1 and {MAX_STEPS:,}")
    _need(t.seq_len > 0, f"train.seq_len = {t.seq_len} must be > 0")
    _need(
        t.seq_len <= max_seq,
        f"train.seq_len = {t.seq_len} is above the model's max positions (model.max_seq_len = "
        f"{max_seq}); lower train.seq_len or raise model.max_seq_len",
    )
    _need(t.global_batch_size > 0, f"train.global_batch_size = {t.global_batch_size} must be > 0")
    _need(t.grad_clip >= 0, f"train.grad_clip = {t.grad_clip} must be >= 0 (0 turns clipping off)")
    _need(t.eval_interval >= 0, f"train.eval_interval = {t.eval_interval} must be >= 0 (0: only at the end)")
    _need(t.eval_batches >= 0, f"train.eval_batches = {t.eval_batches} must be >= 0")
    _need(
        t.loss_chunk_size >= 0,
        f"train.loss_chunk_size = {t.loss_chunk_size} must be >= 0 (tokens per loss chunk; 0: full logits)",
    )
    _need(
        not t.loss_chunk_size or t.precision != "fp8" or any(fnmatch.fnmatch("output", p) for p in t.fp8_exclude),
        f'train.loss_chunk_size = {t.loss_chunk_size} needs the head out of fp8: add "output" to '
        "train.fp8_exclude or set train.loss_chunk_size = 0",
    )
    _need(
        t.mixed_precision != "none" or t.precision in ("fp32", "auto"),
        f'train.mixed_precision = "none" is for fp32 runs; train.precision = "{t.precision}" needs "cast_once", '
        '"autocast" or "auto"',
    )


def _check_optim(cfg: Config) -> None:
    o = cfg.optim
    _need(0 < o.lr <= 10, f"optim.lr = {o.lr} must be in (0, 10] (a learning rate; e.g. 3e-4)")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]")
    _need(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay} must be >= 0")
    _need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _need(o.eps > 0, f"optim.eps = {o.eps} must be > 0")
    _need(o.warmup_steps >= -1, f"optim.warmup_steps = {o.warmup_steps} must be >= 0 (or -1 for automatic)")
    _need(o.decay_steps >= 0, f"optim.decay_steps = {o.decay_steps} must be >= 0 (0: the whole run)")


def _check_layout(cfg: Config) -> None:
    p = cfg.layout
    _need(p.micro_batch_size >= 0, f"train.micro_batch_size = {p.micro_batch_size} must be >= 0 (0: no accumulation)")
    _need(p.ep >= 1 and p.pp_virtual_stages >= 1, "parallel.ep and parallel.pp_virtual_stages must be >= 1")
    _need(0 <= p.zero_stage <= 3, f"parallel.zero_stage = {p.zero_stage} must be 0, 1, 2 or 3")
    _need(p.ddp_bucket_mb > 0, f"parallel.ddp_bucket_mb = {p.ddp_bucket_mb} must be > 0")
    _need(p.ep_chunks >= 1, f"parallel.ep_chunks = {p.ep_chunks} must be >= 1 (1: no overlap)")
    _need(p.num_microbatches >= 0, f"parallel.num_microbatches = {p.num_microbatches} must be >= 0 (0: automatic)")
    _need(p.islands >= 1, f"diloco.islands = {p.islands} must be >= 1 (1: no DiLoCo)")


def _check_run(cfg: Config) -> None:
    d, c = cfg.data, cfg.checkpoint
    _need(0 <= d.val_fraction < 1, f"data.val_fraction = {d.val_fraction} must be in [0, 1)")
    _need(cfg.metrics.log_interval > 0, f"metrics.log_interval = {cfg.metrics.log_interval} must be > 0")
    _need(c.keep >= 1, f"checkpoint.keep = {c.keep} must be >= 1")
    _need(
        c.interval in ("auto", "young_daly") or (isinstance(c.interval, int) and c.interval >= 0),
        f'checkpoint.interval = {c.interval!r} must be a number of steps >= 0 (0: no checkpoints) or "auto"',
    )
    _need(c.mtbf_hours > 0, f"checkpoint.mtbf_hours = {c.mtbf_hours} must be > 0")
    _need("\x00" not in cfg.run.dir, "run.dir holds a NUL character; choose a plain directory name")


def _check_health(cfg: Config) -> None:
    h, pr = cfg.health, cfg.profile
    _need(h.max_skipped >= 0, f"health.max_skipped = {h.max_skipped} must be >= 0")
    _need(h.spike_threshold >= 0, f"health.spike_threshold = {h.spike_threshold} must be >= 0 (0: off)")
    _need(h.spike_window >= 5, f"health.spike_window = {h.spike_window} must be >= 5 steps")
    _need(h.hang_timeout_s >= 0, f"health.hang_timeout_s = {h.hang_timeout_s} must be >= 0 (0: off)")
    _need(
        h.straggler_factor == 0 or h.straggler_factor > 1,
        f"health.straggler_factor = {h.straggler_factor} must be > 1 (e.g. 1.5) or 0 (off)",
    )
    _need(0 < h.text_warn_fraction <= 1, f"health.text_warn_fraction = {h.text_warn_fraction} must be in (0, 1]")
    for key in ("on_nonfinite", "on_spike"):
        _need(
            getattr(h, key) != "rollback" or cfg.checkpoint.interval != 0,
            f"health.{key} = 'rollback' needs checkpoints to go back to; set checkpoint.interval > 0 (or 'auto')",
        )
    _need(pr.start_step >= 0 and pr.steps >= 0, "profile.start_step and profile.steps must be >= 0")
