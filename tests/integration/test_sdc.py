"""Silent data corruption: one bit of one weight flipped on one rank (MESHFORGE_FAULT=bitflip) is
caught within one health.sdc_interval, named by rank, host and parameter, and stopped or rolled
back; under HSDP only the replicate groups are compared (FSDP shards differ by design)."""

import json

import pytest
import torch

from conftest import cli_args, run_cli, tiny_overrides
from meshforge.checkpoint.weights import load_weights

STEPS = 8


def events(d, kind):
    return [e for e in map(json.loads, (d / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


def train(d, corpus, nproc, fault="", **extra):
    o = tiny_overrides(d, corpus, **{"train.steps": STEPS, "train.global_batch_size": 12, **extra})
    env = {"MESHFORGE_FAULT": fault}
    return run_cli("train", "--nproc", str(nproc), *cli_args(o), env=env, timeout=300)


@pytest.mark.slow
def test_a_flipped_bit_is_caught_within_one_interval_and_names_its_rank(tmp_path, corpus):
    """Three DDP ranks: the majority names rank 1; on_sdc = stop ends the run with exit 2."""
    d = tmp_path / "run"
    r = train(d, corpus, 3, "bitflip:rank=1:step=3", **{"health.sdc_interval": 2, "health.on_sdc": "stop"})
    assert r.returncode == 2, r.stderr[-3000:]
    (e,) = events(d, "sdc")
    assert e["step"] == 4 and e["ranks"] == [1] and e["decided"] and e["action"] == "stop"
    assert e["params"] == ["tok_embeddings.weight"] and len(e["hosts"]) == 1
    assert "silent data corruption at step 4" in r.stderr and "rank(s) [1]" in r.stderr


@pytest.mark.slow
def test_rollback_redoes_the_steps_and_ends_on_the_clean_weights(tmp_path, corpus):
    """Two DDP ranks cannot say which one flipped (both named); rollback goes back to the step-2
    checkpoint and redoes steps 3-4 on the same batches: the final weights are the clean run's, bit for bit."""
    common = {"health.sdc_interval": 2, "checkpoint.interval": 2}
    bad, clean = tmp_path / "bad", tmp_path / "clean"
    r = train(bad, corpus, 2, "bitflip:rank=1:step=3", **common, **{"health.on_sdc": "rollback"})
    assert r.returncode == 0, r.stderr[-3000:]
    (e,) = events(bad, "sdc")
    assert e["step"] == 4 and e["ranks"] == [0, 1] and not e["decided"] and e["action"] == "rollback"
    (back,) = events(bad, "rollback")
    assert back["to_step"] == 2 and back["batches_skipped"] == 0
    assert train(clean, corpus, 2, **common).returncode == 0
    a, b = (load_weights(x / "final").state_dict() for x in (bad, clean))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (bad / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # the steps redone are logged once


@pytest.mark.slow
def test_hsdp_compares_the_replicate_groups_and_no_false_alarm_without_a_flip(tmp_path, corpus):
    """HSDP (2 groups x 2 shards, ZeRO-3): rank 2 holds the same shard as rank 0, not as rank 3;
    a clean run checks every step and finds nothing."""
    lay = {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero_stage": 3}
    d, clean = tmp_path / "run", tmp_path / "clean"
    r = train(d, corpus, 4, "bitflip:rank=2:step=5", **lay, **{"health.sdc_interval": 3})
    assert r.returncode == 0, r.stderr[-3000:]  # on_sdc = log (the default) keeps going
    (e,) = events(d, "sdc")
    assert e["step"] == 6 and e["ranks"] == [0, 2] and e["action"] == "log"
    r = train(clean, corpus, 4, **lay, **{"health.sdc_interval": 1})
    assert r.returncode == 0, r.stderr[-3000:]
    assert events(clean, "sdc") == []
