"""Named model shapes: a tiny ``debug`` model and the public Llama 3 shapes."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from meshforge.errors import ConfigError, suggest
from meshforge.models.llama import ModelArgs

_LLAMA3 = dict(
    norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling="llama3",
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_seq_len=8192,
    vocab_size=128256,
    max_seq_len=131072,
)

PRESETS: dict[str, ModelArgs] = {
    # Trains on a laptop CPU in seconds; vocab 512 holds the byte tokenizer's 258 ids
    # and divides by every tensor-parallel degree up to 512.
    "debug": ModelArgs(
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn_hidden=384,
        vocab_size=512,
        max_seq_len=1024,
        rope_theta=10000.0,
    ),
    "llama3.2-1b": ModelArgs(
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        ffn_hidden=8192,
        tie_embeddings=True,
        rope_factor=32.0,
        **_LLAMA3,
    ),
    "llama3.2-3b": ModelArgs(
        hidden=3072,
        layers=28,
        heads=24,
        kv_heads=8,
        ffn_hidden=8192,
        tie_embeddings=True,
        rope_factor=32.0,
        **_LLAMA3,
    ),
    "llama3.1-8b": ModelArgs(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336, rope_factor=8.0, **_LLAMA3
    ),
    "llama3.1-70b": ModelArgs(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, rope_factor=8.0, **_LLAMA3
    ),
    "llama3.1-405b": ModelArgs(
        hidden=16384, layers=126, heads=128, kv_heads=8, ffn_hidden=53248, rope_factor=8.0, **_LLAMA3
    ),
}


def get_preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        hint = suggest(name, PRESETS, cutoff=0.4)
        hint = f"{hint} " if hint.startswith("did you mean") else ""
        raise ConfigError(f"unknown model preset '{name}' (model.preset); {hint}known presets: {', '.join(PRESETS)}")
    return copy.copy(PRESETS[name])  # not dataclasses.replace: that would pin a derived head_dim


def model_args_from_config(model_cfg: Any) -> ModelArgs:
    """A preset with the config's explicit shape fields laid over it, checked for consistency.

    A head_dim the preset derives (0) stays derived, so it follows hidden/heads overrides;
    an explicit ``model.head_dim`` wins."""
    args = get_preset(model_cfg.preset)
    for f in dataclasses.fields(ModelArgs):
        v = getattr(model_cfg, f.name, None)
        if v is not None:
            setattr(args, f.name, v)
    check_model_args(args)
    return args


def check_model_args(a: ModelArgs) -> None:
    for k in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
        if getattr(a, k) <= 0:
            raise ConfigError(f"model.{k} = {getattr(a, k)} must be > 0")
    if a.head_dim < 0:
        raise ConfigError(f"model.head_dim = {a.head_dim} must be > 0 (or 0: hidden / heads)")
    if not a.explicit_head_dim and a.hidden % a.heads:
        raise ConfigError(
            f"model.hidden = {a.hidden} must be divisible by model.heads = {a.heads}, or set model.head_dim explicitly"
        )
    if a.heads % a.kv_heads:
        raise ConfigError(f"model.heads = {a.heads} must be divisible by model.kv_heads = {a.kv_heads}")
    if a.head_dim % 2:
        what = "model.head_dim" if a.explicit_head_dim else "head dim hidden/heads"
        raise ConfigError(f"{what} = {a.head_dim} must be even for rotary embeddings")
    if a.norm_eps <= 0 or a.rope_theta <= 0 or a.init_std <= 0:
        raise ConfigError("model.norm_eps, model.rope_theta and model.init_std must be > 0")
    if a.rope_scaling == "llama3" and a.rope_high_freq_factor <= a.rope_low_freq_factor:
        raise ConfigError("model.rope_high_freq_factor must be greater than model.rope_low_freq_factor")
