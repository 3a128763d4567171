"""Training a mixture of experts on one process: the auxiliary losses are logged apart from
the language-model loss, expert load and drops are in metrics.jsonl on logged steps only,
and the balance bias survives a checkpoint resume."""

import json

import pytest

from conftest import tiny_config, train
from meshforge.checkpoint.weights import load_weights

MOE = {
    "model.preset": "debug-moe",
    "model.hidden": 64,
    "model.layers": 2,
    "model.moe_ffn_hidden": 64,
    "train.seq_len": 32,
    "train.global_batch_size": 4,
    "train.eval_batches": 1,
}


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_moe_run_logs_aux_losses_and_expert_load(tmp_path, corpus):
    d = tmp_path / "run"
    over = {"train.steps": 4, "metrics.log_interval": 2, "model.z_loss_coeff": 1e-3, "model.capacity_factor": 1.0}
    train(tiny_config(d, corpus, **MOE, **over))
    recs = records(d)
    assert [r["step"] for r in recs] == [1, 2, 4]  # logged steps only: the first, every 2nd, the last
    for r in recs:
        assert r["aux_loss"] > 0 and r["z_loss"] > 0
        assert r["loss"] == pytest.approx(r["lm_loss"] + r["aux_loss"] + r["z_loss"], rel=1e-5)
        assert list(r["expert_load"]) == ["1"]  # block 0 is dense (first_dense_layers = 1)
        layer = r["expert_load"]["1"]
        assert layer["max_mean"] >= 1 and layer["cv"] >= 0 and 0 <= layer["dropped"] < 1
        assert r["dropped_fraction"] == pytest.approx(layer["dropped"])
        assert r["expert_load_max_mean"] == layer["max_mean"]


@pytest.mark.slow
def test_balance_bias_survives_a_checkpoint_resume(tmp_path, corpus):
    """A run resumed from step 3 continues with the bias it had there: the same losses and
    the same final bias as the uninterrupted run (a bias reset to zero routes otherwise)."""
    over = {
        **MOE,
        "model.load_balance": "bias",
        "model.bias_update_rate": 0.05,
        "train.steps": 6,
        "checkpoint.interval": 3,
    }
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(tiny_config(whole, corpus, **over))
    train(tiny_config(resumed, corpus, **over, **{"checkpoint.load": str(whole / "checkpoints/step-00000003")}))
    a, b = records(whole), records(resumed)
    assert [r["step"] for r in b] == [4, 5, 6]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a[3:]], rel=1e-6)
    bias = [load_weights(d / "final").state_dict()["layers.1.feed_forward.expert_bias"] for d in (whole, resumed)]
    assert bias[0].abs().sum() > 0 and bias[1].tolist() == pytest.approx(bias[0].tolist(), abs=1e-7)


def test_activation_checkpointing_counts_and_reports_once(tmp_path, corpus):
    """Full recomputation re-runs each MoE forward in backward: the losses (LM, aux, z), grad
    norms and loads equal the run without it (nothing counted or reported twice)."""
    over = {**MOE, "train.steps": 2, "metrics.log_interval": 1, "model.z_loss_coeff": 1e-3}
    runs = []
    for ac in ("none", "full"):
        train(tiny_config(tmp_path / ac, corpus, **over, **{"train.activation_checkpoint": ac}))
        runs.append(records(tmp_path / ac))
    for a, b in zip(*runs, strict=True):
        for k in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "expert_load_max_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-6), k
