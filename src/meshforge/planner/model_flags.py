"""The planner's model: a ``ModelShape`` (models/shape.py) from a preset or from flags,
checked with messages that name the ``meshforge plan`` flags."""

from __future__ import annotations

import copy

from meshforge.errors import ConfigError
from meshforge.models.presets import get_preset
from meshforge.models.shape import ModelShape


def from_preset(name: str) -> ModelShape:
    """A named preset (models/presets.py), named for reports; an unknown name is refused there."""
    shape = get_preset(name)
    shape.name = name
    return shape


def named(shape: ModelShape, name: str) -> ModelShape:
    """A copy carrying a display name (a derived head_dim stays derived)."""
    out = copy.copy(shape)
    out.name = name
    return out


def check_flags(s: ModelShape) -> ModelShape:
    """Refuse a shape given by flags that cannot exist, naming the flag; returns it."""
    if s.attention not in ("flash", "materialized"):
        raise ConfigError(f"--attention {s.attention!r} must be flash or materialized")
    if s.mlp not in ("swiglu", "gelu"):
        raise ConfigError(f"--mlp {s.mlp!r} must be swiglu or gelu")
    for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size"):
        if getattr(s, k) <= 0:
            raise ConfigError(f"--{k.replace('_size', '').replace('_', '-')} must be > 0")
    if (not s.explicit_head_dim and s.hidden % s.heads) or s.heads % s.kv_heads:
        raise ConfigError(
            f"hidden {s.hidden} must be a multiple of heads {s.heads} (or head_dim given), and heads of "
            f"kv_heads {s.kv_heads}"
        )
    _check_experts(s)
    return s


def _check_experts(s: ModelShape) -> None:
    """Refuse an MoE shape that cannot exist, naming the flag."""
    if s.num_experts < 0 or s.num_shared_experts < 0 or s.moe_ffn_hidden < 0:
        raise ConfigError("--experts, --shared-experts and --moe-ffn-hidden must be >= 0")
    if s.capacity_factor < 0:
        raise ConfigError(f"--capacity-factor {s.capacity_factor} must be >= 0 (0: dropless, e.g. 1.25)")
    if s.num_experts and not 1 <= s.experts_per_token <= s.num_experts:
        raise ConfigError(
            f"--top-k {s.experts_per_token} must be between 1 and --experts {s.num_experts} (experts per token)"
        )
