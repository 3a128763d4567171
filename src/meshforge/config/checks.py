"""Values that are wrong whatever the layout and the machine, refused with the key and the fix.

Types are checked as values are read (values.py; floats must be finite), every number against
the range its field declares (``ranged``, meshforge/ranges.py: the one place a range is enforced
for a config; ``meshforge plan`` and the explorer check the same ranges on their own input), then
the rules between keys here. Whether a layout
can run (degrees, divisibility, schedules) is parallel/rules.py's; what depends on the machine
(a GPU for offload, torchao for fp8) is resolve.py's.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from meshforge.config.keys import Key, keys, plain_text, value_of
from meshforge.config.sections import Config
from meshforge.errors import ConfigError
from meshforge.models.presets import check_model_shape
from meshforge.ranges import num

MAX_INT = 2**40  # no count or size meshforge takes comes near it


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_values(cfg: Config) -> None:
    """Refuse values that are wrong whatever the layout, naming the key and the fix: each number
    outside its field's range, then the rules between keys."""
    _check_magnitudes(cfg)
    check_ranges(cfg)
    check_model_shape(cfg.shape)
    _check_train(cfg)
    _check_run(cfg)
    _check_health(cfg)
    _check_optim(cfg)


def check_ranges(cfg: Config) -> None:
    """Refuse the first number outside its field's range, with the key, the range and what the
    number means, before any other check looks at it (a word such as "auto" is the type's business)."""
    for dotted, k in keys().items():
        v = value_of(cfg, dotted)
        if k.span is not None and _number(v) and not k.span.holds(v):
            raise ConfigError(f"{dotted} = {num(v)} is out of range: it must be in {k.span.text()} ({_meaning(k)})")
        if k.each is not None:
            bad = [x for x in v or () if not k.each.holds(x)]
            if bad:
                raise ConfigError(
                    f"{dotted} holds {num(bad[0])}: each entry must be in {k.each.text()} ({_meaning(k)})"
                )


def _meaning(k: Key) -> str:
    return plain_text(k.help).split(";")[0][:100]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_magnitudes(cfg: Config) -> None:
    for dotted in keys():
        v: Any = value_of(cfg, dotted)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
            raise ConfigError(f"{dotted} = {v} is far too large (more than 2^40); check the value")


def _check_train(cfg: Config) -> None:
    t, max_seq = cfg.train, cfg.shape.max_seq_len
    _need(
        t.seq_len <= max_seq,
        f"train.seq_len = {t.seq_len} is above the model's max positions (model.max_seq_len = "
        f"{max_seq}); lower train.seq_len or raise model.max_seq_len",
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


def _check_run(cfg: Config) -> None:
    c = cfg.checkpoint
    _need(
        c.interval in ("auto", "young_daly") or (isinstance(c.interval, int) and c.interval >= 0),
        f'checkpoint.interval = {c.interval!r} must be a number of steps >= 0 (0: no checkpoints) or "auto"',
    )
    _need("\x00" not in cfg.run.dir, "run.dir holds a NUL character; choose a plain directory name")


def _check_health(cfg: Config) -> None:
    h = cfg.health
    for key in ("on_nonfinite", "on_spike", "on_sdc"):
        _need(
            getattr(h, key) != "rollback" or cfg.checkpoint.interval != 0,
            f"health.{key} = 'rollback' needs checkpoints to go back to; set checkpoint.interval > 0 (or 'auto')",
        )


def _check_optim(cfg: Config) -> None:
    o = cfg.optim
    _need(
        o.schedule != "wsd" or not o.decay_steps,
        f"optim.decay_steps = {o.decay_steps} sets where cosine and linear reach the floor; under optim.schedule = "
        '"wsd" the decay is the last optim.decay_fraction of the run (it moves with the end when the run is '
        "extended): set optim.decay_steps = 0 and choose optim.decay_fraction",
    )
