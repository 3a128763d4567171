"""The train state a checkpoint carries besides the weights and optimizer: how far the run
got (step, tokens seen), where the data order stands (the sampler) and the RNG streams.

step, tokens_seen and the sampler go into the checkpoint's meta.json (rank 0's, shared by
all ranks); the RNG is per rank (rank-NNNNN.json, written by the CheckpointSaver) and is only
put back when the layout is the same, since another layout's ranks draw other streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from meshforge.checkpoint.saver import rng_state, set_rng_state
from meshforge.checkpoint.store import CheckpointError
from meshforge.data.sampler import GlobalBatchSampler

_TRAIN_KEYS = ("step", "tokens_seen", "consumed")


class TrainState:
    """Progress of one run; the same on every rank."""

    def __init__(self, sampler: GlobalBatchSampler, tokens_per_step: int):
        self.sampler = sampler
        self.tokens_per_step = tokens_per_step
        self.step = 0
        self.tokens_seen = 0

    def advance(self) -> None:
        """One optimizer step done."""
        self.step += 1
        self.tokens_seen += self.tokens_per_step

    def state_dict(self) -> dict[str, Any]:
        """What meta.json holds of the train state (JSON-able)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.sampler.load_state_dict(state["sampler"])

    def tensors(self) -> dict[str, torch.Tensor]:
        """step, tokens and the sampler's position as tensors, saved with the shards: meta.json
        is hand-editable, and a resume checks it against these (``check_tensors``)."""
        values = (self.step, self.tokens_seen, self.sampler.consumed)
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in zip(_TRAIN_KEYS, values, strict=True)}

    def check_tensors(self, saved: dict[str, torch.Tensor], meta_path: Path) -> None:
        """Refuse a meta.json whose step, tokens or sampler position differ from the shards'."""
        check_train_state({k: int(v) for k, v in self.tensors().items()}, saved, meta_path)

    @staticmethod
    def rng_state() -> dict[str, Any]:
        """This rank's RNG streams (torch CPU, and CUDA when in use)."""
        return rng_state()

    @staticmethod
    def load_rng_state(state: dict[str, Any]) -> None:
        set_rng_state(state)


def check_train_state(said: dict[str, int], saved: dict[str, torch.Tensor], meta_path: Path) -> None:
    """Refuse a meta.json (``said``: its step, tokens_seen, consumed) that differs from the shards'."""
    diff = [f"{k} {said[k]} (the shards say {int(saved[k])})" for k in _TRAIN_KEYS if said[k] != int(saved[k])]
    if diff:
        raise CheckpointError(
            f"{meta_path} disagrees with the checkpoint's shards: {'; '.join(diff)}. meta.json was edited "
            "after the save; restore it (or use another checkpoint) - a resume must start where the weights are"
        )
