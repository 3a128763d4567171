"""ZeRO-1 at the ZeRO paper's bytes, for bf16 and fp8 runs: 4Ψ + 12Ψ/N per rank.

Every rank holds bf16 working parameters (2Ψ) and bf16 gradients (2Ψ); the fp32 master
weights and Adam's two moments (12Ψ/N) exist only for this rank's 1/N of the parameters.
Parameters and gradients of each optimizer parameter group are views into one flat buffer,
padded to a multiple of N and cut into buckets of about ``parallel.ddp_bucket_mb`` (each a
multiple of N elements); rank r owns the r-th 1/N of every bucket, S = ceil(numel / N)
elements in all (one bucket: the contiguous slice [r S, (r+1) S)). One step:

1. backward accumulates bf16 gradients into the flat gradient buffer; on the last
   micro-batch, as soon as every parameter of a bucket has its gradient (a post-accumulate
   hook per parameter), that bucket is reduce-scattered asynchronously (in
   ``parallel.grad_reduce_dtype``; fp32 by default, cast chunk by chunk so the fp32 copies in
   flight stay near ``CHUNK_BYTES``) into this rank's fp32 shard, while backward goes on
   through the layers in front of it, as DDP's bucketed all-reduce does;
2. after backward the last buckets are waited for (and any bucket whose parameters got no
   gradient is reduced then), and the shard averaged;
3. the global norm (for clipping) is summed over the shards: one scalar all-reduce;
4. AdamW updates the fp32 master shard; the bf16 cast of every rank's pieces is all-gathered
   bucket by bucket into the flat parameter buffer.

Reduce-scatter plus all-gather move the elements of one all-reduce: DDP's volume, as the
paper says (in bytes, fp32 reduction + bf16 gather is 3/4 of an fp32 DDP all-reduce; with
``grad_reduce_dtype = "bf16"`` it is exactly a bf16 all-reduce); buckets change where the
elements sit, not how many move. The parameter all-gather after the step is not overlapped.

Checkpoints keep meshforge's layout-free format (full fp32 tensors by parameter name, see
checkpoint/sharded.py): the fp32 master and the moments are all-gathered for a save and
sliced after a load, so such a checkpoint loads under any layout and vice versa; the full
state exists on every rank while that happens (16Ψ transient).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from meshforge.compat import all_gather_flat, reduce_scatter_flat
from meshforge.parallel import comm_stats
from meshforge.parallel.data.flat_group import FlatGroup

CHUNK_BYTES = 32 * 2**20  # the largest fp32 copy of gradients made for one reduce-scatter
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class FlatZero1(torch.optim.Optimizer):
    """ZeRO-1 over ``group``: bf16 working state everywhere, fp32 master + Adam on the shard.

    ``optim`` is the inner optimizer (over the master shards); ``param_groups`` and ``state``
    are its, so the LR schedule and the state counters see them. ``microbatches``: backward
    passes per step (a bucket is reduced once its parameters' gradients have all arrived on
    the last one); ``bucket_mb``: bucket size in MiB of working-dtype gradients."""

    def __init__(
        self,
        groups: list[dict],
        cls: type[torch.optim.Optimizer],
        kwargs: dict,
        group: dist.ProcessGroup,
        reduce_dtype: str = "fp32",
        dtype: torch.dtype = torch.bfloat16,
        bucket_mb: float = 25,
        microbatches: int = 1,
    ):
        self.group, self.n, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.reduce_dtype = REDUCE_DTYPES[reduce_dtype]
        elems = int(bucket_mb * 2**20) // torch.empty((), dtype=dtype).element_size()
        used = [g for g in groups if g["params"]]
        self.flats = [FlatGroup(g["params"], self.n, self.rank, dtype, elems) for g in used]
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [f.master]}
            for g, f in zip(used, self.flats, strict=True)
        ]
        self.optim = cls(inner_groups, **kwargs)
        super().__init__([f.master for f in self.flats], dict(self.optim.defaults))
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self.microbatches = microbatches
        for i, f in enumerate(self.flats):
            for j, p in enumerate(f.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._arrived, i, j))
        self._start_step()

    @property
    def master_shards(self) -> list[torch.Tensor]:
        return [f.master for f in self.flats]

    def _start_step(self) -> None:
        """Nothing reduced yet: every bucket waits for its parameters' gradients of every micro-batch."""
        self._reduced = False
        self._left = [[0] * len(f.buckets) for f in self.flats]
        for left, f in zip(self._left, self.flats, strict=True):
            for touched in f.touches:
                for k in touched:
                    left[k] += self.microbatches
        self._out: list[torch.Tensor | None] = [None] * len(self.flats)
        self._launched: list[set[int]] = [set() for _ in self.flats]
        self._inflight: collections.deque = collections.deque()  # (work, the fp32 copy it reads)

    def _arrived(self, i: int, j: int, _: torch.Tensor) -> None:
        """Parameter j of group i has its gradient: reduce the buckets it completes."""
        for k in self.flats[i].touches[j]:
            self._left[i][k] -= 1
            if self._left[i][k] < 0:
                raise RuntimeError(
                    f"bf16 ZeRO-1 got more gradients than its {self.microbatches} micro-batch(es) per step: a "
                    "bucket was reduced before its last gradient arrived"
                )
            if self._left[i][k] == 0:
                self._launch(i, k)

    @torch.no_grad()
    def _launch(self, i: int, k: int) -> None:
        """Start bucket k's reduce-scatter into this rank's piece of the reduced shard."""
        f = self.flats[i]
        if self._out[i] is None:
            self._out[i] = torch.empty(f.shard, dtype=self.reduce_dtype, device=f.master.device)
        out, grads = f.piece(self._out[i], k), f.bucket(f.grad_flat, k)
        self._launched[i].add(k)
        if self.reduce_dtype == grads.dtype:
            self._inflight.append((reduce_scatter_flat(out, grads, self.group, async_op=True), None))
            return
        rows = grads.view(self.n, -1)
        step = max(1, CHUNK_BYTES // (self.n * out.element_size()))
        for c in range(0, out.numel(), step):
            piece = rows[:, c : c + step].to(self.reduce_dtype).reshape(-1)
            self._inflight.append((reduce_scatter_flat(out[c : c + step], piece, self.group, async_op=True), piece))
            while sum(x.numel() * x.element_size() for _, x in self._inflight if x is not None) > 2 * CHUNK_BYTES:
                comm_stats.wait(self._inflight.popleft()[0], self.group)  # bound the fp32 copies in flight

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce what backward has not (buckets whose parameters got no gradient), wait for every
        bucket, and average: this rank's fp32 shard of the gradients, summed over the group / N."""
        for i, f in enumerate(self.flats):
            for k in range(len(f.buckets)):
                if k not in self._launched[i]:
                    self._launch(i, k)
        while self._inflight:
            comm_stats.wait(self._inflight.popleft()[0], self.group)
        for f, out in zip(self.flats, self._out, strict=True):
            f.master.grad = out.float().div_(self.n)
        self._reduced = True

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Reduce the gradients, then the global-norm clip of global_norm's contract
        (parallel/grad_clip.py): returns the pre-clip norm, equal on every rank."""
        if not self._reduced:
            self.reduce_gradients()
        grads = [f.master.grad for f in self.flats]
        sq = torch.stack([g.square().sum() for g in grads]).sum()
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        if max_norm != float("inf"):
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if not self._reduced:
            self.reduce_gradients()
        self.optim.step()
        for f in self.flats:
            f.master.grad = None
            mine = f.master.to(f.param_flat.dtype)
            for k in range(len(f.buckets)):
                all_gather_flat(f.bucket(f.param_flat, k), f.piece(mine, k), self.group)
        self._start_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (they stay allocated: 2Ψ, as DDP's buckets)."""
        if self._inflight:  # (a step that never reduced: let its reduce-scatters finish first)
            self.reduce_gradients()
        for f in self.flats:
            f.grad_flat.zero_()
            f.attach_grads()
        self._start_step()

    # ------------------------------------------------------------------ checkpoints

    def _adam_state(self, f: FlatGroup, init: bool) -> dict[str, torch.Tensor]:
        st = self.optim.state.get(f.master)
        if init or not st:
            fused = bool(self.optim.defaults.get("fused"))  # fused AdamW keeps its step on the device
            st = {
                "step": torch.zeros((), dtype=torch.float32, device=f.master.device if fused else "cpu"),
                "exp_avg": torch.zeros_like(f.master),
                "exp_avg_sq": torch.zeros_like(f.master),
            }
            self.optim.state[f.master] = st
        return st

    def _gather(self, f: FlatGroup, shard: torch.Tensor) -> torch.Tensor:
        """The full flat tensor of ``f``'s layout from every rank's shard."""
        gathered = torch.empty(shard.numel() * self.n, dtype=shard.dtype, device=shard.device)
        all_gather_flat(gathered, shard.contiguous(), self.group)
        return f.unshard(gathered)

    def full_training_state(self, model: nn.Module, init: bool = False) -> dict[str, Any]:
        """``{"model": {fqn: fp32}, "optim": {fqn: {step, exp_avg, exp_avg_sq}}}`` with full
        tensors on every rank (gathered; ``init``: zeros to load into, no communication)."""
        param_of = dict(model.named_parameters(remove_duplicate=False))
        by_id: dict[int, dict[str, torch.Tensor]] = {}
        for f in self.flats:
            st = self._adam_state(f, init)
            fulls = {}
            for k in ("master", "exp_avg", "exp_avg_sq"):
                shard = f.master if k == "master" else st[k]
                fulls[k] = torch.zeros(f.shard * self.n, device=shard.device) if init else self._gather(f, shard)
            views = {k: f.pieces(v) for k, v in fulls.items()}
            for p in f.params:
                by_id[id(p)] = {k: views[k][id(p)] for k in fulls} | {"step": st["step"].clone()}
        msd, osd = {}, {}
        for name in get_model_state_dict(model):
            t = by_id[id(param_of[name])]
            msd[name] = t["master"]
            osd[name] = {"step": t["step"], "exp_avg": t["exp_avg"], "exp_avg_sq": t["exp_avg_sq"]}
        return {"model": msd, "optim": osd}

    @torch.no_grad()
    def load_full_training_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take this rank's slices of full tensors (as ``full_training_state`` returns them, filled)."""
        param_of = dict(model.named_parameters(remove_duplicate=False))
        by_id = {id(param_of[name]): name for name in state["model"]}
        for f in self.flats:
            st = self._adam_state(f, init=False)
            names = [by_id[id(p)] for p in f.params]
            for key, target in (("master", f.master), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
                src = [state["model"][n] if key == "master" else state["optim"][n][key] for n in names]
                full = torch.zeros(f.shard * self.n, device=target.device)
                full[: f.numel].copy_(torch.cat([s.reshape(-1).float() for s in src]))
                target.copy_(f.own(full))
                if key == "master":
                    f.param_flat.copy_(full)
            st["step"].copy_(state["optim"][names[0]]["step"])
