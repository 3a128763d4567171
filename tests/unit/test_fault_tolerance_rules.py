"""Fault tolerance without ranks: its keys are checked (and what it does not compose with refused by
key), each group's batch is its slice of the global one, healing copies a peer's state exactly and
refuses a peer of another config before it changes anything, the lighthouse's --bind is read."""

import types

import pytest
import torch
from torch import nn

from conftest import ADAM_EPS
from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.parallel.fault_tolerance.heal import HealState, differences
from meshforge.parallel.fault_tolerance.lighthouse import parse_bind, reachable
from meshforge.resolve import resolve

FT = {"fault_tolerance.enabled": True, "fault_tolerance.lighthouse": "http://10.0.0.1:29510"}


def refusal(world: int = 1, **o) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(load_config(None, o), world)
    return str(e.value)


def test_the_keys_are_checked_and_what_does_not_compose_is_refused_by_key():
    assert refusal(**{"fault_tolerance.replicas": 2}).startswith("fault_tolerance.replicas = 2 plans 2")
    assert "is not a lighthouse URL" in refusal(**{**FT, "fault_tolerance.lighthouse": "10.0.0.1:29510"})
    more = {**FT, "fault_tolerance.replicas": 2}
    assert "replica_id = 2 is not below" in refusal(**more, **{"fault_tolerance.replica_id": 2})
    assert "min_replicas = 3 is more than" in refusal(**more, **{"fault_tolerance.min_replicas": 3})
    assert refusal(2, **more, **{"diloco.islands": 2}).startswith("diloco.islands = 2 under fault tolerance")
    for key in ("on_nonfinite", "on_spike", "on_sdc"):
        msg = refusal(**more, **{f"health.{key}": "rollback", "checkpoint.interval": 5})
        assert msg.startswith(f"health.{key} = 'rollback' under fault tolerance")
    with pytest.raises(ConfigError, match="bf16 ZeRO-1"):
        resolve(load_config(None, {**more, "train.precision": "bf16", "parallel.zero_stage": 1}), 2)
    assert "global_batch_size = 9 is not divisible" in refusal(**more, **{"train.global_batch_size": 9})


def test_each_group_takes_its_slice_of_the_global_batch():
    plan = resolve(load_config(None, {**FT, "fault_tolerance.replicas": 4, "train.global_batch_size": 16}), 2)
    assert plan.batch.local == 2 and plan.layout.data_ranks == 8
    assert resolve(load_config(None, {"train.global_batch_size": 16}), 2).batch.local == 8


class _State:
    def __init__(self):
        self.step, self.tokens_seen = 0, 0
        self.sampler = types.SimpleNamespace(consumed=0, batch=4)

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen, "sampler": {"consumed": self.sampler.consumed}}

    def load_state_dict(self, s):
        self.step, self.tokens_seen, self.sampler.consumed = s["step"], s["tokens_seen"], s["sampler"]["consumed"]


def _trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAM_EPS, fused=True)
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_healing_takes_the_peers_state_exactly_and_refuses_another_config_first():
    src_model, src_opt = _trained(0, 3)
    src_state = _State()
    src_state.step, src_state.tokens_seen, src_state.sampler.consumed = 3, 300, 12
    items = {"model.hidden": 64}
    sent = HealState(model=src_model, optimizer=src_opt, state=src_state, items=items, me={"replica": 0, "host": "h"})
    sent.snapshot(live={0}, lost_since={1: 2})  # at the start of step 4, the step under way
    src_state.sampler.consumed += 4  # (the peer's own step 4 has taken its batch: the snapshot holds)
    sd = sent.state_dict()
    dst_model, dst_opt = _trained(1, 0)  # a fresh group: other weights, no optimizer state yet
    before = [p.detach().clone() for p in dst_model.parameters()]
    wrong = HealState(model=dst_model, optimizer=dst_opt, state=_State(), items={"model.hidden": 32}, me={})
    with pytest.raises(ConfigError, match=r"model.hidden = 32 here, 64 there"):
        wrong.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(before, dst_model.parameters(), strict=True))
    state = _State()
    got = HealState(model=dst_model, optimizer=dst_opt, state=state, items=items, me={})
    got.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(src_model.parameters(), dst_model.parameters(), strict=True))
    for p, q in zip(src_model.parameters(), dst_model.parameters(), strict=True):
        assert all(torch.equal(src_opt.state[p][k], dst_opt.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    # the state at step 3 with step 4's batch taken (the joiner applies step 4's update without its slice)
    assert (state.step, state.sampler.consumed) == (3, 16) and got.healed["replica"] == 0
    assert got.take_loaded() and not got.take_loaded() and got.view() == ({0}, {1: 2})
    x = torch.randn(4, 6)  # and they step alike from here
    for model, opt in ((src_model, src_opt), (dst_model, dst_opt)):
        model(x).square().mean().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(src_model.parameters(), dst_model.parameters(), strict=True))
    assert differences({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b = 2 here, 3 there", "c = None here, 4 there"]


def test_lighthouse_bind_and_a_closed_port():
    assert parse_bind("0.0.0.0:29510") == ("0.0.0.0", 29510) and parse_bind("[::]:7") == ("::", 7)
    for bad in ("29510", "host:", "host:99999", ":80"):
        with pytest.raises(ConfigError, match="expected HOST:PORT"):
            parse_bind(bad)
    assert not reachable("http://127.0.0.1:9", timeout_s=1)
