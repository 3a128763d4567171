"""A training checkpoint as a Hugging Face directory: gather the shards in one process."""

from __future__ import annotations

from pathlib import Path

from meshforge.checkpoint import sharded, store
from meshforge.checkpoint.store import CheckpointError
from meshforge.models.hf import save_hf_checkpoint
from meshforge.models.llama import ModelShape, build_model


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
    path = resolve_checkpoint(path)
    meta = store.verify(path)
    model = build_model(ModelShape(**meta["model"]), device="cpu", seed=None)
    sharded.load_model_only(model, path)
    save_hf_checkpoint(model, out)
    return path
