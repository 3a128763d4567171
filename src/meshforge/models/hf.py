"""Hugging Face Llama and dense Qwen3 checkpoints: read ``config.json`` + safetensors,
write what ``transformers`` loads.

meshforge's RoPE uses the same rotate-half layout as HF Llama, so weights map one to
one by name; only the names differ. Dense Qwen3 is the Llama layout plus QK-norm and an
explicit head_dim; a model with QK-norm is written as Qwen3, any other as Llama.
Tensors go through safetensors only (never pickle).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from meshforge.errors import MeshforgeError
from meshforge.models.hf_moe import (
    check_exportable,
    hf_moe_family,
    moe_from_hf,
    moe_hf_config,
    moe_shape_from_hf,
    moe_to_hf,
)
from meshforge.models.llama import ModelShape, Transformer, build_model
from meshforge.models.presets import check_model_shape
from meshforge.safeio.files import regular_size
from meshforge.safeio.parse import read_json
from meshforge.safeio.schema import Any_, Bool, Int, ListOf, MapOf, Null, Num, Obj, OneOf, Str, check

_LAYER_MAP = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


class HFCheckpointError(MeshforgeError):
    pass


_COUNT, _OR_NULL = Int(0, 2**40), Null()
_REAL = Num(-1e300, 1e300)
HF_CONFIG = Obj(  # the fields of a config.json meshforge reads: their types (what is missing is named later)
    {
        **dict.fromkeys(("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), _COUNT),
        **dict.fromkeys(("vocab_size", "max_position_embeddings"), _COUNT),
        **dict.fromkeys(("num_key_value_heads", "head_dim"), OneOf((_COUNT, _OR_NULL), "a whole number or null")),
        **dict.fromkeys(("rms_norm_eps", "rope_theta", "initializer_range"), _REAL),
        "tie_word_embeddings": Bool(),
        "model_type": Str(most=200),
        "architectures": OneOf((ListOf(Str(most=200), 64), _OR_NULL), "a list of names"),
        "rope_scaling": OneOf((MapOf(Str(most=200), Any_(), 64), _OR_NULL), "an object or null"),
    },
    optional=frozenset(
        {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"}
        | {"max_position_embeddings", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta"}
        | {"initializer_range", "tie_word_embeddings", "model_type", "architectures", "rope_scaling"}
    ),
)


def to_hf_name(name: str) -> str:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in _LAYER_MAP:
        raise KeyError(f"no Hugging Face name for parameter {name}")
    return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.weight"


def from_hf_name(name: str) -> str | None:
    """meshforge name for an HF tensor name; None for tensors meshforge does not use (e.g. rotary caches)."""
    for ours, theirs in _TOP_MAP.items():
        if name == theirs:
            return ours
    m = _HF_LAYER_RE.match(name)
    if m:
        for ours, theirs in _LAYER_MAP.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}.weight"
    return None


def _check_hf_family(cfg: dict, source: str) -> bool:
    """Refuse what meshforge cannot represent; returns whether it is a Qwen3 (QK-norm) model."""
    arch = cfg.get("architectures") or []
    qwen3 = cfg.get("model_type") == "qwen3" or "Qwen3ForCausalLM" in arch
    moe = hf_moe_family(cfg) is not None
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in arch and not qwen3 and not moe:
        raise HFCheckpointError(
            f"{source} describes a '{cfg.get('model_type')}' model ({', '.join(arch) or 'no architectures'}); "
            "meshforge reads Llama-family checkpoints (model_type 'llama', LlamaForCausalLM; 'qwen3', "
            "Qwen3ForCausalLM; 'mixtral', MixtralForCausalLM; 'qwen3_moe', Qwen3MoeForCausalLM) only"
        )
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise HFCheckpointError(f"{source}: only SwiGLU (silu) Llama models without biases are supported")
    if cfg.get("use_sliding_window"):
        raise HFCheckpointError(f"{source}: sliding-window attention (use_sliding_window) is not supported")
    return qwen3


def shape_from_hf_config(cfg: dict, source: str = "config.json") -> ModelShape:
    """The model shape a Hugging Face config.json describes; a missing key or a value of the wrong
    type is named (a hand-made or damaged config.json), not a traceback."""
    try:
        return _args_from_hf_config(cfg, source)
    except KeyError as e:
        raise HFCheckpointError(f"{source} lacks {e}, which a Llama-family config.json holds") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise HFCheckpointError(f"{source} holds a value of the wrong type ({e}); the file is damaged") from None


def _args_from_hf_config(cfg: dict, source: str) -> ModelShape:
    qwen3 = _check_hf_family(cfg, source)
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or rope
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rtype = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rtype not in ("default", "llama3"):
        raise HFCheckpointError(f"{source}: rope type '{rtype}' is not supported (only default and llama3)")
    heads = cfg["num_attention_heads"]
    shape = ModelShape(
        hidden=cfg["hidden_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        ffn_hidden=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(theta),
        rope_scaling="llama3" if rtype == "llama3" else "none",
        init_std=float(cfg.get("initializer_range", 0.02)),
        head_dim=cfg.get("head_dim") or 0,
        qk_norm=qwen3,
    )
    if rtype == "llama3":
        shape.rope_factor = float(scaling["factor"])
        shape.rope_low_freq_factor = float(scaling["low_freq_factor"])
        shape.rope_high_freq_factor = float(scaling["high_freq_factor"])
        shape.rope_original_max_seq_len = int(scaling["original_max_position_embeddings"])
    family = hf_moe_family(cfg)
    if family:  # Mixtral / Qwen3-MoE: the expert fields (models/hf_moe.py)
        for key, value in moe_shape_from_hf(cfg, family, shape.layers, source).items():
            setattr(shape, key, value)
    check_model_shape(shape)
    return shape


def hf_config_from_args(a: ModelShape, dtype: torch.dtype) -> dict:
    """config.json for ``a``: Qwen3 when it has QK-norm, else Llama."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if a.qk_norm else "LlamaForCausalLM"],
        "model_type": "qwen3" if a.qk_norm else "llama",
        "hidden_size": a.hidden,
        "intermediate_size": a.ffn_hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": a.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if a.rope_scaling == "llama3":
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": a.rope_factor,
            "low_freq_factor": a.rope_low_freq_factor,
            "high_freq_factor": a.rope_high_freq_factor,
            "original_max_position_embeddings": a.rope_original_max_seq_len,
        }
    if a.num_experts > 0:
        cfg.update(moe_hf_config(a, "qwen3_moe" if a.qk_norm else "mixtral"))
    return cfg


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the Hugging Face model at ``path`` (its index's, or model.safetensors)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = read_json(index, HFCheckpointError, "the index is damaged")["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as e:
            raise HFCheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in (".", "..")]
        if bad:
            raise HFCheckpointError(f"{index} names {bad[0]!r}, not a file beside it; the index is damaged or crafted")
        return [path / f for f in names]
    single = path / "model.safetensors"
    if single.exists() or single.is_symlink():  # (a FIFO or device there: check_weights_hold names it)
        return [single]
    raise HFCheckpointError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json; meshforge reads "
        "safetensors checkpoints only (save with safe_serialization=True)"
    )


def check_weights_hold(shape: ModelShape, files: list[Path], described_by: Path) -> None:
    """Refuse a description (config.json, meshforge.json) of a model larger than its weight files
    could hold at one byte per parameter, before memory is taken for what it claims."""
    fix = "give a directory of regular weight files"  # (a FIFO or device, even behind a link, is refused)
    have = sum(regular_size(f, HFCheckpointError, fix) for f in files)
    need = shape.num_params()
    if need > have:
        raise HFCheckpointError(
            f"{described_by} describes a model of {need:,} parameters, but its weight files hold {have:,} bytes; "
            "the description is damaged, edited or belongs to other weights"
        )


def read_hf_config(path: str | Path) -> dict:
    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise HFCheckpointError(f"{p} is not a Hugging Face model directory (no config.json)")
    cfg = read_json(cfg_file, HFCheckpointError, "fix or replace it (a Hugging Face config.json)")
    if not isinstance(cfg, dict):
        raise HFCheckpointError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not a model config object")
    check(cfg, HF_CONFIG, str(cfg_file), HFCheckpointError, "the file is damaged or not a Llama-family config")
    return cfg


def load_hf_checkpoint(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """A meshforge model with the weights of the Hugging Face Llama checkpoint at ``path``."""
    p = Path(path)
    shape = shape_from_hf_config(read_hf_config(p), str(p / "config.json"))
    files = weight_files(p)
    check_weights_hold(shape, files, p / "config.json")
    model = build_model(shape, device=device, seed=None).to(dtype)
    expected = dict(model.state_dict())
    loaded: set[str] = set()
    for f in files:
        if not f.is_file():
            raise HFCheckpointError(f"weight file {f} listed in the index is missing")
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    _load_tensor(expected, loaded, name, lambda name=name: st.get_tensor(name), f)
        except HFCheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise HFCheckpointError(f"cannot read {f}: {e}") from None
    if shape.tie_embeddings:
        loaded.add("output.weight") if "tok_embeddings.weight" in loaded else None
    for name, t in expected.items():  # stacked experts: complete once every expert's slice came
        if t.dim() == 3 and all((name, e) in loaded for e in range(t.shape[0])):
            loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise HFCheckpointError(f"{p} lacks {len(missing)} tensors meshforge needs, e.g. {missing[:3]}")
    return model


def _load_tensor(
    expected: dict[str, torch.Tensor], loaded: set, name: str, get: Callable[[], torch.Tensor], f: Path
) -> None:
    """Copy HF tensor ``name`` (read by ``get()`` only if meshforge uses it) into ``expected``;
    records the meshforge name (or (name, expert) for one expert's slice) in ``loaded``."""
    ours = from_hf_name(name)
    if ours is not None:
        targets = [(ours, None, None)]
    else:
        targets = moe_from_hf(name, get()) or []  # Mixtral / Qwen3-MoE experts and router
    for ours, expert, t in targets:
        if ours not in expected:
            continue
        t = get() if t is None else t
        dest = expected[ours] if expert is None else expected[ours][expert]
        if expert is not None and expert >= expected[ours].shape[0]:
            raise HFCheckpointError(f"{f}: {name} names expert {expert}, config.json has {expected[ours].shape[0]}")
        if t.shape != dest.shape:
            raise HFCheckpointError(f"{f}: {name} has shape {tuple(t.shape)}, config.json implies {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(t)
        loaded.add(ours if expert is None else (ours, expert))


def unwrap(model: nn.Module) -> Transformer:
    """The plain Transformer under DDP / compile wrappers."""
    while not isinstance(model, Transformer):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"expected a meshforge Transformer, got {type(model).__name__}")
        model = inner
    return model


def save_hf_checkpoint(
    model: nn.Module, path: str | Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30
) -> Path:
    """Write ``model`` as a Hugging Face Llama directory (config.json + safetensors)."""
    m = unwrap(model)
    return save_hf_state(m.shape, m.state_dict(), path, dtype, max_shard_bytes)


def save_hf_state(
    shape: ModelShape,
    state_dict: dict[str, torch.Tensor],
    path: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write full meshforge weights as a Hugging Face Llama directory."""
    family = check_exportable(shape, state_dict) if shape.num_experts > 0 else ""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name == "output.weight" and shape.tie_embeddings:
            continue  # HF re-ties lm_head to embed_tokens
        t = t.detach().to("cpu")
        parts = moe_to_hf(name, t, family) if family else None  # experts and router; None: not MoE
        if parts is None:
            parts = [(to_hf_name(name), t)]
        for hf_name, part in parts:
            tensors[hf_name] = (part.to(dtype) if dtype else part).contiguous().clone()
    out_dtype = dtype or next(iter(tensors.values())).dtype
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    (out / "config.json").write_text(json.dumps(hf_config_from_args(shape, out_dtype), indent=2))
    return out
