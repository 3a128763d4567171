"""``meshforge plan`` answers "what would this layout need?": with every degree fixed, a layout
that overflows is shown with its memory breakdown, ``fits: false`` and what overflows (table and
JSON, exit 0), while an open search that fits nothing is still refused. Plus the help and the
table's legend."""

import json

import pytest

from meshforge.config.layout import open_layout
from meshforge.errors import ConfigError
from meshforge.planner.hardware import PRESETS, get_hardware
from meshforge.planner.model_flags import from_preset
from meshforge.planner.plan import parse_plan_args, run
from meshforge.planner.search import search

FIXED_70B = ["--model", "llama3.1-70b", "--gpus", "8", "--tp", "8", "--pp", "1", "--dp", "1", "--zero", "0"]
FIXED_70B += ["--micro-batch", "1", "--global-batch", "8", "--seq-len", "4096", "--recompute", "full"]


def test_fixed_overflowing_layout_is_shown_with_its_memory():
    """70B under tp 8 with DDP: 16 bytes x 70.6e9 / 8 = 131 GiB of model states on an 80 GiB GPU."""
    fixed = open_layout(tp=8, pp=1, dp_shard=1, zero_stage=0, micro_batch_size=1, activation_checkpoint="full")
    results, considered = search(from_preset("llama3.1-70b"), get_hardware("h100-sxm"), 8, 8, 8, 4096, "bf16", fixed)
    assert results.fits_nothing and considered == 1 and len(results) == 1
    e = results[0]
    assert not e.fits and e.memory["total"] > 80
    states = e.memory["params"] + e.memory["grads"] + e.memory["optimizer"]
    assert states == pytest.approx(16 * from_preset("llama3.1-70b").num_params() / 8 / 2**30, rel=0.02)
    assert f"needs {e.memory['total']:.1f} GiB of 80 GiB" in e.overflow
    assert "model states alone" in e.overflow and "optimizer" in e.overflow
    # a fixed layout that fits (8B, ZeRO-3 over 8 ranks: 16 GiB of states) is an ordinary answer
    ok = open_layout(tp=1, pp=1, dp_shard=8, zero_stage=3, micro_batch_size=1, activation_checkpoint="full")
    fits, _ = search(from_preset("llama3.1-8b"), get_hardware("h100-sxm"), 8, 8, 8, 4096, "bf16", ok)
    assert not fits.fits_nothing and fits[0].fits


def test_open_search_that_fits_nothing_is_still_refused():
    with pytest.raises(ConfigError, match="fits no layout on 2 x a100-40g"):
        search(from_preset("llama3.1-70b"), get_hardware("a100-40g"), 2, 8, 16, 4096, "bf16", open_layout(zero_stage=3))


def test_plan_table_and_json_show_the_overflow(capsys, tmp_path):
    assert run(parse_plan_args(FIXED_70B)) == 0
    out = capsys.readouterr().out
    assert "0 fit" in out and "fits: false" in out and "the fixed layout, explained" in out
    assert "optimizer 65.7" in out  # Adam's fp32 m and v: 8 bytes x 70.6e9 / 8 in GiB (fp32 weights: params 4)
    assert "mb: micro-batch size" in out and "m: micro-batches per step" in out  # the legend
    assert run(parse_plan_args(FIXED_70B + ["--json"])) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["fits"] is False and len(got["layouts"]) == 1
    lay = got["layouts"][0]
    assert lay["fits"] is False and "needs" in lay["overflow"] and lay["memory_gib"]["total"] > 80
    assert {"params", "grads", "optimizer", "activations", "buffers", "reserve"} <= set(lay["memory_gib"])
    with pytest.raises(ConfigError, match="the fixed layout does not fit"):
        run(parse_plan_args(FIXED_70B + ["--emit-config", str(tmp_path / "x.toml")]))


def test_help_lists_gpu_presets_and_the_default_batch(capsys):
    with pytest.raises(SystemExit):
        parse_plan_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in PRESETS:
        assert name in out
    assert "default: the --config's, else one per GPU" in out
