"""A training checkpoint as a Hugging Face directory: gather the shards in one process."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from meshforge.checkpoint import sharded, store
from meshforge.checkpoint.safe_metadata import read_metadata
from meshforge.checkpoint.store import CheckpointError
from meshforge.checkpoint.validate import checkpoint_shape
from meshforge.models.hf import save_hf_checkpoint
from meshforge.models.llama import Transformer, build_model


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one inside it."""
    if (path / store.COMPLETE).exists() or (path / "meta.json").exists():
        return path
    complete = store.list_complete(path)
    if not complete:
        raise CheckpointError(f"{path} is neither a complete checkpoint nor a folder holding one")
    return complete[-1].path


def checkpoint_to_hf(path: Path, out: Path) -> Path:
    """Verify a checkpoint, load its full weights on CPU and write them as a Hugging Face Llama."""
    model, path = load_checkpoint_model(path)
    save_hf_checkpoint(model, out)
    return path


def load_checkpoint_model(path: Path) -> tuple[Transformer, Path]:
    """A checkpoint's (or a checkpoints/ folder's newest) full weights in one CPU model, verified;
    and the checkpoint it read (``convert --from-checkpoint``, ``generate``)."""
    path = resolve_checkpoint(path)
    meta = store.verify(path, optimizer=False)  # (the weights only: Adam's state is not read)
    shape = checkpoint_shape(meta, path)
    check_sizes(build_model(shape, device="meta"), path)  # before any memory is taken for what meta.json claims
    model = build_model(shape, device="cpu", seed=None)
    sharded.load_model_only(model, path)
    return model, path


def check_sizes(model: nn.Module, path: Path) -> None:
    """Refuse a checkpoint whose shards do not hold ``model``'s parameters at their sizes (a
    meta.json edited to another shape would otherwise allocate whatever it claims)."""
    saved = read_metadata(path / ".metadata").state_dict_metadata
    for name, p in model.named_parameters():
        entry = saved.get(f"model.{name}")
        if entry is None or tuple(entry.size) != tuple(p.shape):
            has = "nothing" if entry is None else f"{tuple(entry.size)}"
            raise CheckpointError(
                f"{path / 'meta.json'} describes a model whose {name} is {tuple(p.shape)}, but the shards hold {has}; "
                "meta.json was edited or belongs to another checkpoint"
            )
