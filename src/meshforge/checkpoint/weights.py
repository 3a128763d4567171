"""A meshforge weights directory: ``model.safetensors`` + ``meshforge.json`` (the model shape).

This is what a finished (or interrupted) run leaves in ``run.dir/final`` and what
``meshforge convert --from-hf`` writes; ``model.init_from`` and ``convert --to-hf``
read it. It holds full, unsharded weights — the portable form of a model, not a
resumable training checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from meshforge.data.manifest import read_manifest
from meshforge.errors import ConfigError, MeshforgeError
from meshforge.models.presets import check_model_shape
from meshforge.models.shape import ANALYSIS_ONLY, ModelShape

if TYPE_CHECKING:
    from meshforge.models.llama import Transformer

# models.hf and models.llama are imported where weights are built or read: the launcher's
# pre-flight imports this module for shape checks only, and they pull in DTensor (~1.5 s CPU).

FORMAT = "meshforge-weights"
VERSION = 1


def save_weights(args: ModelShape, state_dict: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write full (unsharded) weights and the model shape."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu").contiguous().clone()
        for k, v in state_dict.items()
        if not (k == "output.weight" and args.tie_embeddings)
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    meta = {"format": FORMAT, "version": VERSION, "model": dataclasses.asdict(args)}
    (out / "meshforge.json").write_text(json.dumps(meta, indent=1))
    return out


def save_model_weights(model: nn.Module, path: str | Path) -> Path:
    """``save_weights`` for an unsharded model (or a DDP/compile wrapper around one)."""
    from meshforge.models.hf import unwrap

    m = unwrap(model)
    return save_weights(m.shape, m.state_dict(), path)


def _weights_shape(p: Path) -> ModelShape:
    """The model shape meshforge.json describes (checked: a hand-edited file is named, not a traceback)."""
    meta = read_manifest(p / "meshforge.json", FORMAT, VERSION, MeshforgeError, "re-export the weights")
    try:
        shape = ModelShape(**meta["model"])
        check_model_shape(shape)
        return shape
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise MeshforgeError(
            f"{p / 'meshforge.json'} holds no readable model shape ({e}); re-export the weights"
        ) from None


def pretrained_shape(path: str | Path) -> ModelShape:
    """The shape of the weights at ``path`` (meshforge or Hugging Face), read without the weights."""
    from meshforge.models.hf import read_hf_config, shape_from_hf_config

    p = Path(path)
    if (p / "meshforge.json").is_file():
        return _weights_shape(p)
    if (p / "config.json").is_file():
        return shape_from_hf_config(read_hf_config(p), str(p / "config.json"))
    raise MeshforgeError(f"{p} holds neither meshforge.json nor a Hugging Face config.json")


def check_pretrained_files(path: str | Path, shape: ModelShape) -> None:
    """The weight files at ``path`` are regular files that could hold ``shape``'s parameters (the
    pre-flight's look at model.init_from, before a run directory is written)."""
    from meshforge.models.hf import check_weights_hold, weight_files

    p = Path(path)
    if (p / "meshforge.json").is_file():
        check_weights_hold(shape, [p / "model.safetensors"], p / "meshforge.json")
    else:
        check_weights_hold(shape, weight_files(p), p / "config.json")


def load_weights(path: str | Path, device: torch.device | str = "cpu") -> Transformer:
    from meshforge.models.hf import check_weights_hold
    from meshforge.models.llama import build_model

    p = Path(path)
    args = _weights_shape(p)
    check_weights_hold(args, [p / "model.safetensors"], p / "meshforge.json")
    model = build_model(args, device=device, seed=None)
    try:
        tensors = load_file(str(p / "model.safetensors"), device=str(device))
    except Exception as e:  # safetensors raises its own types for truncated/corrupt files
        raise MeshforgeError(f"cannot read {p / 'model.safetensors'}: {e}") from None
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # tensors of other sizes than meshforge.json's shape gives
        first = str(e).split("\n\t")[1:2] or [str(e)]
        raise MeshforgeError(f"{p / 'model.safetensors'} does not match meshforge.json: {first[0][:300]}") from None
    missing = [k for k in missing if not (k == "output.weight" and args.tie_embeddings)]
    if missing or unexpected:
        raise MeshforgeError(
            f"{p / 'model.safetensors'} does not match meshforge.json: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.tie_weights()
    return model


def load_pretrained(path: str | Path, device: torch.device | str = "cpu") -> Transformer:
    """Weights from a meshforge weights directory or a Hugging Face Llama directory."""
    from meshforge.models.hf import load_hf_checkpoint, read_hf_config

    p = Path(path)
    if not p.is_dir():
        raise MeshforgeError(f"{p} does not exist or is not a directory of weights")
    if (p / "meshforge.json").is_file():
        return load_weights(p, device)
    if (p / "config.json").is_file():
        read_hf_config(p)
        return load_hf_checkpoint(p, device=device)
    raise MeshforgeError(f"{p} holds neither meshforge.json nor a Hugging Face config.json")


def shape_mismatch(a: ModelShape, b: ModelShape) -> list[str]:
    """Shape fields where two model descriptions differ (ignoring init-only fields)."""
    skip = {"init_std", "max_seq_len", *ANALYSIS_ONLY}
    return [
        f"{f.name}: {getattr(a, f.name)} vs {getattr(b, f.name)}"
        for f in dataclasses.fields(ModelShape)
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)
    ]


def load_pretrained_into(model: nn.Module, shape: ModelShape, path: str) -> None:
    """model.init_from: overwrite ``model``'s parameters (this rank's shards, under the whole
    model's names) with the pretrained weights at ``path``, which must have ``shape``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    pre = load_pretrained(path, device="cpu")
    diff = shape_mismatch(pre.shape, shape)
    if diff:
        raise ConfigError(f"model.init_from = {path} has another shape than [model]: " + "; ".join(diff))
    mine = dict(model.named_parameters())
    full = {k: v for k, v in pre.state_dict().items() if k in mine}  # a pipeline rank holds some
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
