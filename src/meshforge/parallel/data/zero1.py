"""ZeRO-1 at the ZeRO paper's bytes, for bf16 and fp8 runs: 4Ψ + 12Ψ/N per rank.

Every rank holds bf16 working parameters (2Ψ) and bf16 gradients (2Ψ); the fp32 master
weights and Adam's two moments (12Ψ/N) exist only for this rank's 1/N of the parameters.
Parameters and gradients of each optimizer parameter group are views into one flat buffer,
padded to a multiple of N, so that rank r owns the contiguous slice [r S, (r+1) S) of it,
S = ceil(numel / N). One step:

1. backward accumulates bf16 gradients into the flat gradient buffer (no hooks, no
   communication: gradient accumulation over micro-batches is free);
2. the flat gradients are reduce-scattered (in ``parallel.grad_reduce_dtype``; fp32 by
   default, cast chunk by chunk so the fp32 copy never exceeds ``CHUNK_BYTES``) into this
   rank's fp32 shard, and averaged;
3. the global norm (for clipping) is summed over the shards: one scalar all-reduce;
4. AdamW updates the fp32 master shard; the bf16 cast of every rank's shard is
   all-gathered into the flat parameter buffer.

Reduce-scatter plus all-gather move the elements of one all-reduce: DDP's volume, as the
paper says (in bytes, fp32 reduction + bf16 gather is 3/4 of an fp32 DDP all-reduce; with
``grad_reduce_dtype = "bf16"`` it is exactly a bf16 all-reduce). The reduction runs after
backward, not overlapped with it.

Checkpoints keep meshforge's layout-free format (full fp32 tensors by parameter name, see
checkpoint/sharded.py): the fp32 master and the moments are all-gathered for a save and
sliced after a load, so such a checkpoint loads under any layout and vice versa; the full
state exists on every rank while that happens (16Ψ transient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from meshforge.compat import all_gather_flat, reduce_scatter_flat

CHUNK_BYTES = 32 * 2**20  # the largest fp32 copy of gradients made for one reduce-scatter
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _FlatGroup:
    """One parameter group's parameters and gradients as views into flat working-dtype
    buffers, and this rank's fp32 master shard of them."""

    def __init__(self, params: list[nn.Parameter], n: int, rank: int, dtype: torch.dtype):
        self.params = params
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel, self.shard = numel, -(-numel // n)
        self.lo = rank * self.shard
        device = params[0].device
        full = torch.zeros(self.shard * n, dtype=torch.float32, device=device)
        for p, o in zip(params, self.offsets, strict=True):
            full[o : o + p.numel()].copy_(p.detach().reshape(-1))
        self.master = full[self.lo : self.lo + self.shard].clone()
        self.param_flat = full.to(dtype)
        del full
        self.grad_flat = torch.zeros_like(self.param_flat)
        for p, o in zip(params, self.offsets, strict=True):
            p.grad = None
            p.data = self.param_flat[o : o + p.numel()].view(p.shape)
        self.attach_grads()

    def attach_grads(self) -> None:
        """Point every .grad at its slice of the flat gradient buffer (autograd then accumulates in place)."""
        for p, o in zip(self.params, self.offsets, strict=True):
            p.grad = self.grad_flat[o : o + p.numel()].view(p.shape)

    def pieces(self, full: torch.Tensor) -> dict[int, torch.Tensor]:
        """Per parameter (by id), its view in a full flat tensor of this group's layout."""
        return {id(p): full[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets, strict=True)}


class FlatZero1(torch.optim.Optimizer):
    """ZeRO-1 over ``group``: bf16 working state everywhere, fp32 master + Adam on the shard.

    ``optim`` is the inner optimizer (over the master shards); ``param_groups`` and ``state``
    are its, so the LR schedule and the state counters see them."""

    def __init__(
        self,
        groups: list[dict],
        cls: type[torch.optim.Optimizer],
        kwargs: dict,
        group: dist.ProcessGroup,
        reduce_dtype: str = "fp32",
        dtype: torch.dtype = torch.bfloat16,
    ):
        self.group, self.n, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.reduce_dtype = REDUCE_DTYPES[reduce_dtype]
        self.flats = [_FlatGroup(g["params"], self.n, self.rank, dtype) for g in groups if g["params"]]
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [f.master]}
            for g, f in zip([g for g in groups if g["params"]], self.flats, strict=True)
        ]
        self.optim = cls(inner_groups, **kwargs)
        super().__init__([f.master for f in self.flats], dict(self.optim.defaults))
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._reduced = False

    @property
    def master_shards(self) -> list[torch.Tensor]:
        return [f.master for f in self.flats]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the flat gradients into this rank's fp32 shard, averaged over the group."""
        for f in self.flats:
            out = torch.empty(f.shard, dtype=self.reduce_dtype, device=f.master.device)
            rows = f.grad_flat.view(self.n, f.shard)
            if self.reduce_dtype == f.grad_flat.dtype:
                reduce_scatter_flat(out, f.grad_flat, self.group)
            else:
                step = max(1, CHUNK_BYTES // (self.n * out.element_size()))
                for c in range(0, f.shard, step):
                    piece = rows[:, c : c + step].to(self.reduce_dtype).reshape(-1)
                    reduce_scatter_flat(out[c : c + step], piece, self.group)
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
            all_gather_flat(f.param_flat, f.master.to(f.param_flat.dtype), self.group)
        self._reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (they stay allocated: 2Ψ, as DDP's buckets)."""
        for f in self.flats:
            f.grad_flat.zero_()
            f.attach_grads()
        self._reduced = False

    # ------------------------------------------------------------------ checkpoints

    def _adam_state(self, f: _FlatGroup, init: bool) -> dict[str, torch.Tensor]:
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

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(shard.numel() * self.n, dtype=shard.dtype, device=shard.device)
        all_gather_flat(full, shard.contiguous(), self.group)
        return full

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
                fulls[k] = torch.zeros(f.shard * self.n, device=shard.device) if init else self._gather(shard)
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
                target.copy_(full[f.lo : f.lo + f.shard])
                if key == "master":
                    f.param_flat.copy_(full)
            st["step"].copy_(state["optim"][names[0]]["step"])
