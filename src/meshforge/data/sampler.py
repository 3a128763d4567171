"""A deterministic, resumable sampler whose order does not depend on the layout.

The global order is a permutation of all sequences drawn from (seed, epoch); epochs
follow each other without a gap. Step t's global batch is positions [t*B, (t+1)*B)
of that endless order, and a data-parallel rank takes a contiguous slice of it. So what
a step sees is a function of (seed, step, B) alone — not of how many ranks share it —
and the only state to save is how many samples were consumed.
"""

from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    def __init__(self, num_sequences: int, global_batch_size: int, seed: int, shuffle: bool = True):
        if num_sequences <= 0:
            raise ValueError("no sequences to sample from")
        self.n = num_sequences
        self.batch = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
                self._perms[epoch] = rng.permutation(self.n)
            else:
                self._perms[epoch] = np.arange(self.n)
        return self._perms[epoch]

    @property
    def epoch(self) -> int:
        return self.consumed // self.n

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sequence indices at global positions [start, start + count)."""
        pos = np.arange(start, start + count, dtype=np.int64)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(pos // self.n):
            sel = pos // self.n == epoch
            out[sel] = self._perm(int(epoch))[pos[sel] % self.n]
        return out

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        """This rank's contiguous slice of the next global batch; advances the state."""
        if self.batch % dp_size:
            raise ValueError(f"global batch {self.batch} not divisible by dp size {dp_size}")
        per = self.batch // dp_size
        idx = self.indices(self.consumed + dp_rank * per, per)
        self.consumed += self.batch
        return idx

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "num_sequences": self.n, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_sequences"] != self.n:
            raise ValueError(
                f"sampler state is for seed {state['seed']} over {state['num_sequences']} sequences, "
                f"not seed {self.seed} over {self.n}: the data or train.seed changed"
            )
        self.consumed = int(state["consumed"])
