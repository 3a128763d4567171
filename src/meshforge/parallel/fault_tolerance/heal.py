"""What a joining replica group takes from a live peer, and how it is carried.

torchft's manager asks a live group for its state when another needs healing and hands it to the
joiner, whose group ranks each fetch the same group rank's part over HTTP. Each rank sends plain
tensors only: its local shard of every parameter and of the optimizer's state, in the model's
order, with the train state (step, tokens seen, the sampler's position), its RNG and the config
items that must match (the model's shape, the layout, the batch). The joiner refuses a peer whose
items differ before it touches a weight (``ConfigError``, exit 2), copies the rest into its own
tensors (DTensor shards stay in place) and reads nothing that could run code: the transfer is
loaded with ``weights_only`` (torchft's own transport unpickles anything).
"""

from __future__ import annotations

import dataclasses
import socket
import time
import urllib.request
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from meshforge.config.run_plan import RunPlan
from meshforge.errors import ConfigError


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def must_match(plan: RunPlan, train_sequences: int) -> dict[str, Any]:
    """The config items every replica group must share: what a step computes and which data it reads."""
    t, lay = plan.train, plan.layout
    items = {f"model.{k}": v for k, v in dataclasses.asdict(plan.shape).items()}
    items |= {f"parallel.{k}": getattr(lay, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")}
    items |= {"parallel.zero_stage": lay.zero_stage, "fault_tolerance.replicas": lay.replicas}
    items |= {f"train.{k}": getattr(t, k) for k in ("seq_len", "global_batch_size", "seed", "precision", "steps")}
    items |= {f"optim.{k}": v for k, v in dataclasses.asdict(plan.optim).items()}
    items["data (training sequences)"] = train_sequences
    return {k: list(v) if isinstance(v, tuple) else v for k, v in items.items()}


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """``key here vs there`` for every item that differs."""
    keys = sorted(set(mine) | set(theirs))
    return [f"{k} = {mine.get(k)!r} here, {theirs.get(k)!r} there" for k in keys if mine.get(k) != theirs.get(k)]


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer over this rank's own parameters (ZeRO-1's local shard optimizer)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in _inner(optimizer).param_groups for p in g["params"]]


class HealState:
    """This rank's side of healing: ``state_dict`` for a peer, ``load_state_dict`` from one.

    Healing happens inside a step (torchft's asynchronous quorum): the peer serves the state it had
    when the step under way began (``snapshot``: step, tokens, sampler position, RNG, and its view of
    the groups; its weights and optimizer state do not change before that step commits), and the
    joiner loads it in ``should_commit``, then applies the live groups' update of that step. So the
    joiner's sampler moves on by that step's batch, as the peer's did; its RNG is the peer's at the
    step's start, which is the peer's after it (a step draws no random numbers: no dropout)."""

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any, items: dict, me: dict):
        """``state``: the TrainState; ``items``: ``must_match``'s; ``me``: who sends (replica, host)."""
        self.model, self.optimizer, self.state, self.items, self.me = model, optimizer, state, items, me
        # the parameters as they are between steps (FSDP's shards: during a forward, which the peer's
        # serving and the joiner's load overlap, model.parameters() may be the gathered ones)
        self.params = list(model.parameters())
        self.healed: dict[str, Any] | None = None  # set by a load: whom this group healed from
        self.at_start: dict[str, Any] = {}  # this rank's train state and view when the step under way began
        self.loaded = False  # a load since ``take_loaded`` last asked
        self.groups: dict[str, Any] = {}  # the peer's view of the groups, from the last load

    def snapshot(self, live: set[int] | None, lost_since: dict[int, int]) -> None:
        """Fix what a peer healing in the step about to start receives (called before its quorum)."""
        view = {"live": sorted(live) if live is not None else None, "lost_since": sorted(lost_since.items())}
        self.at_start = {"train": {**self.state.state_dict(), "rng": _rng()}, "groups": view}

    def state_dict(self) -> dict[str, Any]:
        """What a joining peer receives (references to this rank's tensors: torchft serves them
        until the step commits, and nothing changes them before)."""
        inner = _inner(self.optimizer)
        optim = [
            {k: local(v) if torch.is_tensor(v) else v for k, v in inner.state.get(p, {}).items()}
            for p in _params(self.optimizer)
        ]
        params = [local(p).detach() for p in self.params]
        return {"items": self.items, "from": self.me, **self.at_start, "params": params, "optim": optim}

    def check(self, sd: dict[str, Any]) -> None:
        """Refuse a peer of another config (``ConfigError``) before anything is changed."""
        diff = differences(self.items, sd["items"])
        if diff:
            peer = sd["from"]
            raise ConfigError(
                f"this replica group's config differs from the live groups' (replica {peer['replica']} on "
                f"{peer['host']}): {'; '.join(diff[:6])}; every replica group must train the same model with the same "
                "layout, batch and data: start it with the same config"
            )

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Take a peer's state at the start of the step under way; refuse one of another config first."""
        t0 = time.perf_counter()
        self.check(sd)
        self._load_optimizer(sd["optim"])  # first: a fresh optimizer's state is made by a step that moves weights
        for p, v in zip(self.params, sd["params"], strict=True):
            local(p).copy_(v)
        train = sd["train"]
        self.state.load_state_dict(train)
        self.state.sampler.consumed += self.state.sampler.batch  # the step under way's batch, as the peer's
        _set_rng(train["rng"])
        self.groups, self.loaded = sd["groups"], True
        nbytes = sum(v.numel() * v.element_size() for v in sd["params"])
        self.healed = {**sd["from"], "step": self.state.step, "bytes": nbytes, "load_s": time.perf_counter() - t0}

    def take_loaded(self) -> bool:
        """Whether a peer's state was loaded since the last call."""
        loaded, self.loaded = self.loaded, False
        return loaded

    def view(self) -> tuple[set[int] | None, dict[int, int]]:
        """The peer's view of the groups when the step began: who took part, since when one is missing."""
        live = self.groups["live"]
        return (set(live) if live is not None else None), {int(r): int(s) for r, s in self.groups["lost_since"]}

    def _load_optimizer(self, received: list[dict[str, Any]]) -> None:
        inner, params = _inner(self.optimizer), _params(self.optimizer)
        if any(p not in inner.state for p, r in zip(params, received, strict=True) if r):
            _create_state(inner, params)
        for p, r in zip(params, received, strict=True):
            for k, v in r.items():
                held = inner.state[p].get(k)
                if torch.is_tensor(v) and torch.is_tensor(held):
                    local(held).copy_(v)
                else:
                    inner.state[p][k] = v


def _create_state(inner: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """A fresh optimizer's state, made by one step on zero gradients (its tensors in the parameters'
    layouts, DTensor or not); the parameters it moved are overwritten by the peer's right after."""
    for p in params:
        p.grad = torch.zeros_like(p)
    inner.step()
    inner.zero_grad(set_to_none=True)


def _rng() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def this_host(lighthouse: str, timeout_s: float = 5.0) -> str:
    """This machine's address on the route to the lighthouse: where the other groups reach this one
    (its hostname may resolve to a loopback or container address they cannot)."""
    from urllib.parse import urlsplit

    url = urlsplit(lighthouse)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        s.connect((socket.gethostbyname(url.hostname or "127.0.0.1"), url.port or 80))
        return s.getsockname()[0]


def transport(timeout: timedelta, host: str) -> Any:
    """torchft's HTTP checkpoint transport, serving at ``host`` and loading data only (``weights_only``)."""
    from torch.distributed._serialization import _streaming_load  # private: used here only
    from torchft.checkpointing import HTTPTransport

    class DataOnlyTransport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return DataOnlyTransport(timeout=timeout, num_chunks=0)
