"""Replica groups that keep training through a failure, through torchft's lighthouse and manager.

Each group is one ``meshforge train`` (its own world, its own ``[parallel]`` layout); its rank 0
hosts a store for torchft and a manager server that asks the lighthouse for a quorum at the start
of every step (``begin``), in the background while the group runs forward and backward: the live
groups, and whether this one must heal (a group that starts while the others train takes a live
peer's state from the start of the step under way: heal.py). After each group's own gradient
reduction, ``sync`` waits for that quorum and averages every rank's gradient shard with the same
rank of the other live groups in one all-reduce through torchft's reconfigurable gloo group
(watch.py: it gives up as soon as any group saw a failure), which carries two more things: the
step's loss (the global one on measured steps) and one slot per planned group, so every group
learns from the data itself who took part. torchft's ``should_commit`` then says whether the step
holds (a group that died mid-step fails the all-reduce: nobody commits, the survivors take the same
step again in the next quorum, without the dead group's slice, which is recorded as skipped). A
healing group loads its peer's state in ``should_commit``, adds zeros to that step's average and
applies the live groups' update, so its own slice of the step is skipped too (recorded by its
peers, and by itself from the view it took over). Quorum changes are checked with a fixed-size
handshake: the config items (a hash) and each replica id's count, so a duplicate id or a group of
another config is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshforge.config.run_plan import RunPlan
from meshforge.errors import ConfigError, MeshforgeError
from meshforge.parallel.fault_tolerance.heal import HealState, local, must_match, this_host, transport
from meshforge.parallel.fault_tolerance.lighthouse import reachable
from meshforge.parallel.fault_tolerance.watch import allreduce, watched_gloo
from meshforge.parallel.mesh import Mesh

HASH_WORDS = 3  # the handshake's config hash: 3 x 20 bits
MAX_REPLICAS = 1 << 10  # the handshake's id slots (fault_tolerance.replicas' range)


class LighthouseLost(MeshforgeError):
    """The lighthouse stopped answering: the groups save and stop (resume once it is back)."""

    every_rank = True


def _torchft() -> Any:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    try:
        import torchft
    except ImportError:
        raise ConfigError(
            "fault_tolerance.enabled = true needs torchft: pip install 'meshforge[ft]' (or set it false)"
        ) from None
    import logging

    logging.getLogger("torchft").setLevel(logging.ERROR)
    return torchft


class ReplicaGroups:
    """One per rank of a fault-tolerant group: ``begin`` before a step, ``sync`` before its update."""

    def __init__(
        self, plan: RunPlan, mesh: Mesh, *, model: nn.Module, optimizer: Any, state: Any, train_sequences: int
    ):
        ft = plan.fault_tolerance
        self.plan, self.mesh, self.state = plan, mesh, state
        self.replica_id, self.count, self.min = ft.replica_id, plan.layout.replicas, ft.min_replicas
        self.params = list(model.parameters())
        host = this_host(ft.lighthouse)
        items = must_match(plan, train_sequences)
        self.hash = _hash(items)
        me = {"replica": ft.replica_id, "host": socket.gethostname()}
        self.heal = HealState(model=model, optimizer=optimizer, state=state, items=items, me=me)
        self.manager = _manager(plan, mesh, host, self.heal)
        self.quorum_id: int | None = None
        self.first = True  # before this process's first committed step
        self.live: set[int] | None = None  # the groups in the last committed step
        self.lost_since: dict[int, int] = {}  # a group not in the steps since: its slices are skipped
        self.participants = 0
        self.failed: Exception | None = None  # the last quorum's error, raised at the next ``begin``
        self.short_since: float | None = None  # since when quorums had fewer than min_replicas groups
        self.event: Callable[..., None] = lambda *a, **k: None
        self.on_heal: Callable[[], None] = lambda: None  # the trainer's: the LR schedule at the healed step

    def begin(self, event: Callable[..., None]) -> None:
        """Ask for the quorum of the next step in the background (torchft's asynchronous quorum: it
        overlaps the forward and backward; ``sync`` waits for it). What a joining peer would take from
        this group is fixed here, at the step's start (heal.py)."""
        self.event = event
        if self.failed is not None:  # the last quorum failed: the lighthouse is gone, or never formed one
            self._quorum_failed(self.failed)
        self.heal.snapshot(live=self.live, lost_since=self.lost_since)
        self.manager.start_quorum()

    def _quorum_failed(self, e: Exception) -> None:
        ft = self.plan.fault_tolerance
        if not reachable(ft.lighthouse):
            raise LighthouseLost(
                f"the lighthouse at fault_tolerance.lighthouse = {ft.lighthouse} stopped answering at step "
                f"{self.state.step}; this group saved a checkpoint to resume from: start the lighthouse again "
                "(meshforge lighthouse) and rerun the same command"
            ) from e
        if self.first:
            self._too_few()
        raise e

    def _too_few(self) -> None:
        ft = self.plan.fault_tolerance
        raise ConfigError(
            f"no quorum of fault_tolerance.min_replicas = {ft.min_replicas} live replica group(s) within "
            f"fault_tolerance.quorum_timeout_s = {ft.quorum_timeout_s:g} s (the lighthouse at {ft.lighthouse} "
            "forms one once its own --min-replicas groups ask): start the other groups, or lower min_replicas"
        )

    def _handshake(self) -> None:
        """One fixed-size all-reduce when the quorum changed: every group's config hash and replica id
        (a healing group's too: torchft's own all-reduce would zero its part)."""
        vec = torch.zeros(2 * HASH_WORDS + MAX_REPLICAS, dtype=torch.int64)
        vec[:HASH_WORDS] = self.hash
        vec[HASH_WORDS : 2 * HASH_WORDS] = self.hash * self.hash
        vec[2 * HASH_WORDS + self.replica_id] = 1
        if not allreduce(self.manager, vec, everyone=True):  # a peer left during it: the step fails
            return
        n = int(vec[2 * HASH_WORDS :].sum())  # the groups in the quorum
        same = bool((n * vec[HASH_WORDS : 2 * HASH_WORDS] == vec[:HASH_WORDS] ** 2).all())
        twice = int(vec[2 * HASH_WORDS + self.replica_id]) > 1
        if not (same and not twice):
            why = (
                f"another live group also has fault_tolerance.replica_id = {self.replica_id}; give each group its own"
                if twice
                else "the live groups' configs differ (model shape, layout, batch, optimizer or data); start every "
                "group with the same config"
            )
            if self.first:  # the newcomer leaves; the groups that were training go on
                raise ConfigError(f"replica group {self.replica_id} refused by the quorum: {why}")
            self.event("warning", key="fault_tolerance", message=f"a joining group was refused: {why}")

    def sync(self, loss: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """Average this rank's gradients (and ``loss``) with the same rank of every live group, and ask
        whether the step commits; on False nothing may be applied (the step is taken again). A group
        that heals in this step takes its peer's state here (in ``should_commit``), adds zeros to the
        average and applies the live groups' update: its own slice of this step is skipped."""
        if not self._quorum():
            if self.heal.take_loaded():  # (healed in a step too few groups took part in)
                self._adopt_view()
            return False, loss
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat_grads = [local(g).reshape(-1) for g in grads]
        slots = torch.zeros(self.count, device=loss.device)
        slots[self.replica_id] = 1.0
        buf = torch.cat([*(g.float() for g in flat_grads), loss.detach().reshape(1).float(), slots])
        allreduce(self.manager, buf, dist.ReduceOp.AVG)  # over the participants (a failure: no commit)
        committed = self.manager.should_commit()  # (a healing group loads its peer's state in it)
        if self.heal.take_loaded():
            self._adopt_view()
        if not committed:
            return False, loss
        self.first = False
        at = 0
        for p, g, flat in zip(self.params, grads, flat_grads, strict=True):
            flat.copy_(buf[at : at + flat.numel()])
            at += flat.numel()
            if p.grad is None:
                p.grad = g
        shares = buf[at + 1 :].tolist()
        self._live = {r for r, s in enumerate(shares) if round(s * self.participants) == 1}
        return True, buf[at]

    def _quorum(self) -> bool:
        """Wait for the step's quorum; a joiner of another config is refused, a changed quorum checked.
        False when this step cannot commit (the error, if any, is raised at the next ``begin``)."""
        try:
            self.manager.wait_quorum()
        except Exception as e:  # noqa: BLE001 - torchft raises what its RPC client raised
            self.failed = e
            return False
        if self.manager._healing and self.manager._pending_state_dict is not None:  # private: the peer's state
            self.heal.check(self.manager._pending_state_dict["user"]["meshforge"])
        if self.manager._quorum_id != self.quorum_id:  # private: the quorum's id, new when its members change
            self.quorum_id = self.manager._quorum_id
            self._handshake()
        self.participants = self.manager.num_participants()
        if self.participants >= self.min:
            self.short_since = None
            return True
        self.short_since = self.short_since or time.monotonic()
        if time.monotonic() - self.short_since > self.plan.fault_tolerance.quorum_timeout_s:
            self._too_few()
        self.manager.should_commit()  # (False: too few groups; every rank of the group calls it)
        time.sleep(0.2)
        return False

    def _adopt_view(self) -> None:
        """After healing: the peer's view of which groups took part and since when a group is missing
        (the events this group writes from now on match its peers')."""
        self.live, self.lost_since = self.heal.view()
        self.on_heal()

    def committed(self, step: int, event: Callable[..., None]) -> None:
        """Step ``step`` committed with the groups ``sync`` saw: their changes as events."""
        healed, self.heal.healed = self.heal.healed, None
        if healed:
            event("healed_from", replica=healed["replica"], host=healed["host"], step=healed["step"],
                  bytes=healed["bytes"], load_s=round(healed["load_s"], 4))  # fmt: skip
        live, before = self._live, self.live
        if before is None:
            before = set(range(self.count))
        for r in sorted(before - live):
            event("replica_lost", replica=r, step=step, replicas=len(live))
            self.lost_since.setdefault(r, step)
        for r in sorted(live - before):
            event("replica_joined", replica=r, step=step, replicas=len(live))
            self._skipped(r, step - 1, event)
        self.live = live

    def _skipped(self, r: int, last: int, event: Callable[..., None]) -> None:
        first = self.lost_since.pop(r, None)
        if first is not None and last >= first:
            per = self.plan.train.global_batch_size // self.count
            event("skipped_batches", replica=r, steps=[first, last], batches=last - first + 1, sequences_each=per)

    def fingerprints(self, mine: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
        """The silent-corruption check across the groups (health/sdc.py): every live group's parameter
        fingerprints as rows (one all-reduce of a one-row-per-group matrix), their replica ids, and ours."""
        rows = torch.zeros(self.count, mine.numel(), dtype=torch.int64)
        rows[self.replica_id] = mine.cpu()
        live = sorted((self.live or set()) | {self.replica_id})  # (a group that healed this step: with them)
        if not allreduce(self.manager, rows, everyone=True):  # a group left during it: nothing to compare
            return mine.cpu()[None], [self.replica_id], 0
        return rows[live], live, live.index(self.replica_id)

    def writes_checkpoints(self) -> bool:
        """The one group that writes the periodic checkpoints: the lowest live replica id."""
        return self.live is None or self.replica_id == min(self.live)

    def close(self, event: Callable[..., None]) -> None:
        """The run is over: the slices still skipped, and torchft's servers shut."""
        for r in sorted(self.lost_since):
            self._skipped(r, self.state.step, event)
        self.manager.shutdown(wait=False)


def build_replicas(
    plan: RunPlan, mesh: Mesh, model: nn.Module, optimizer: Any, state: Any, train_sequences: int
) -> ReplicaGroups | None:
    """This rank's part of the replica groups (None without fault tolerance), at the step it resumed."""
    if not plan.fault_tolerance.enabled:
        return None
    groups = ReplicaGroups(plan, mesh, model=model, optimizer=optimizer, state=state, train_sequences=train_sequences)
    groups.manager.load_state_dict({"step": state.step, "batches_committed": 0})
    return groups


def _hash(items: dict[str, Any]) -> torch.Tensor:
    digest = hashlib.sha256(json.dumps(items, sort_keys=True).encode()).digest()
    words = [int.from_bytes(digest[3 * i : 3 * i + 3], "big") >> 4 for i in range(HASH_WORDS)]  # 20 bits each
    return torch.tensor(words, dtype=torch.int64)


def _manager(plan: RunPlan, mesh: Mesh, host: str, heal: HealState) -> Any:
    """torchft's manager for this rank: group rank 0 hosts the store and the manager server."""
    torchft = _torchft()
    ft = plan.fault_tolerance
    addr = [host, 0]
    if mesh.is_main:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        addr[1] = store.port
        _keep.append(store)
    if mesh.distributed:
        dist.broadcast_object_list(addr, src=0)
    timeout = timedelta(seconds=ft.timeout_s)
    manager = torchft.Manager(
        pg=watched_gloo(timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=ft.min_replicas,
        use_async_quorum=True,  # the quorum overlaps forward and backward; a joiner heals at should_commit
        timeout=timeout,
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
        connect_timeout=timedelta(seconds=min(ft.timeout_s, 10.0)),
        rank=mesh.rank,
        world_size=mesh.world_size,
        store_addr=addr[0],
        store_port=addr[1],
        lighthouse_addr=ft.lighthouse,
        replica_id=str(ft.replica_id),
        hostname=host,
        checkpoint_transport=transport(timeout, host),
        init_sync=False,  # every group starts from the same seed's weights
    )
    manager.register_state_dict_fn("meshforge", heal.load_state_dict, heal.state_dict)
    return manager


_keep: list[Any] = []  # the store lives as long as the process (torchft's clients hold its address)
