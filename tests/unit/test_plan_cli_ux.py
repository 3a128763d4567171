"""``meshforge plan``'s flags: every number checked with its name and range, every flag
documented, the table's columns aligned, and only faster refused layouts listed as faster."""

from __future__ import annotations

import argparse

import pytest

from meshforge.cli.main import build_parser, main
from meshforge.errors import ConfigError
from meshforge.planner import output
from meshforge.planner.candidates import divisors as _divisors
from meshforge.planner.plan import parse_plan_args, plan_from_args

BASE = ["--model", "debug", "--gpu", "cpu", "--gpus", "2", "--gpus-per-node", "2"]


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--seq-len", "0", "--seq-len: must be a positive integer up to 16,777,216, got 0"),
        ("--seq-len", "-1", "--seq-len: must be a positive integer up to 16,777,216, got -1"),
        ("--global-batch", "0", "--global-batch: must be a positive integer up to 16,777,216, got 0"),
        ("--global-batch", "-4", "--global-batch: must be a positive integer up to 16,777,216, got -4"),
        ("--gpus", "0", "--gpus: must be a positive integer up to 1,048,576, got 0"),
        ("--inter-node-bw", "-5", "--inter-node-bw: must be a number > 0, got -5"),
        ("--inter-node-bw", "nan", "--inter-node-bw: must be a number > 0, got nan"),
        ("--comm-overlap", "1.5", "--comm-overlap: must be a number in 0..1, got 1.5"),
        ("--zero", "4", "--zero: must be an integer in 0..3, got 4"),
        ("--tp", "0", "--tp: must be a positive integer up to 1,048,576 or -1, got 0"),  # -1: inferred, as in a config
        ("--top", "0", "--top: must be a positive integer, got 0"),
        ("--layers", "x", "--layers: must be a whole number, got 'x'"),
        ("--experts", "-1", "--experts: must be an integer in 0..1,048,576, got -1"),
    ],
)
def test_bad_number_is_refused_with_flag_and_range(capsys, flag, value, want):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plan", *BASE, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "meshforge plan: error: argument " + want in err


def test_zero_is_not_replaced_by_a_default():
    """0 used to fall through `or` to the default; now it never reaches the planner."""
    with pytest.raises(SystemExit):
        parse_plan_args([*BASE, "--seq-len", "0"])
    args = parse_plan_args([*BASE, "--seq-len", "32", "--global-batch", "2"])
    assert (args.seq_len, args.global_batch) == (32, 2)


def _actions(parser: argparse.ArgumentParser, prog: str = "meshforge"):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, f"{prog} {name}")
        else:
            yield prog, a


def test_every_flag_has_help():
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in _actions(build_parser()) if not a.help]
    assert not missing, f"flags without help text: {missing}"


def test_the_walk_sees_a_flag_without_help():
    p = argparse.ArgumentParser()
    p.add_argument("--bare")
    assert [a.dest for _, a in _actions(p) if not a.help] == ["bare"]


def test_table_columns_stay_aligned_with_long_schedules():
    # interleaving needs pp > 2 and chunks dividing the blocks per stage: a 16-block model on pp 4
    args = parse_plan_args(
        ["--model", "llama3.2-1b", "--gpus", "8", "--pp", "4", "--schedule", "interleaved_1f1b", "--seq-len", "512"]
    )
    pl = plan_from_args(args)
    out = output.table(pl.results, 5, pl.results.refused).splitlines()
    head, rows = out[0], [r for r in out[2:] if r[:3].strip().isdigit()]
    assert rows and any("interleaved_1f1b v=" in r for r in rows)
    for col in ("schedule", "mem GiB", "tok/s/gpu", "HFU"):
        end = head.index(col) + len(col)  # right-aligned: every cell ends where its heading ends
        assert all(r[end - 1] != " " and (len(r) == end or r[end] == " ") for r in rows), (col, out[:8])


def test_faster_list_holds_only_faster_layouts():
    pl = plan_from_args(parse_plan_args([*BASE, "--seq-len", "64"]))
    best = pl.results[0]
    tie_tok = round(best.tokens_per_s_per_gpu) + 0.49  # faster by a fraction: the same number as printed
    assert tie_tok > best.tokens_per_s_per_gpu
    tie = type(best)(**{**best.__dict__, "not_runnable": "a rule", "tokens_per_s_per_gpu": tie_tok})
    faster = type(best)(
        **{**best.__dict__, "not_runnable": "a rule", "tokens_per_s_per_gpu": best.tokens_per_s_per_gpu + 10}
    )
    out = output.table(pl.results, 3, [faster, tie])
    listed = [line for line in out.splitlines() if line.startswith("  tp ")]
    assert len(listed) == 1 and f"{faster.tokens_per_s_per_gpu:,.0f} tok/s/gpu" in listed[0]
    lay = faster.layout  # the whole layout, so two listed layouts never read the same
    assert f" mb {lay.micro_batch_size} recompute {lay.activation_checkpoint} " in listed[0]
    assert "faster layouts" not in output.table(pl.results, 3, [tie])


def _plan_parser() -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]


# a huge value of these is a sensible what-if (rows: all of them; links: unlimited)
UNBOUNDED = {"--top", "--inter-node-bw", "--inter-island-gbps"}


def test_every_numeric_flag_refuses_negative_nan_inf_and_huge(capsys):
    """Every plan flag that takes a number, not a hand-kept list: a typo is refused by name with
    the range, before anything is searched (a 99999999999 used to search for minutes)."""
    numeric = [a.option_strings[0] for a in _plan_parser()._actions if a.type is not None]
    assert len(numeric) >= 30 and "--gpus" in numeric and "--fragments" in numeric
    for flag in numeric:
        for value in ("-5", "nan", "inf", *([] if flag in UNBOUNDED else ["99999999999"])):
            with pytest.raises(SystemExit):
                build_parser().parse_args(["plan", *BASE, f"{flag}={value}"])
            err = capsys.readouterr().err
            assert f"argument {flag}: must be " in err and ("got" in err), (flag, value, err)


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--gpus", "99999999999", "--gpus: must be a positive integer up to 1,048,576, got 99999999999"),
        ("--layers", "16385", "--layers: must be a positive integer up to 16,384, got 16385"),  # model.layers's range
        ("--experts", "1048577", "--experts: must be an integer in 0..1,048,576, got 1048577"),
        ("--gpus-per-node", "2000", "--gpus-per-node: must be a positive integer up to 1,024, got 2000"),
    ],
)
def test_huge_counts_name_the_range(capsys, flag, value, want):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", *BASE, flag, value])
    assert want in capsys.readouterr().err


def test_shape_flags_with_a_preset_are_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"--layers, --vocab describe\(s\) an explicit shape, which --model"):
        plan_from_args(parse_plan_args([*BASE, "--layers", "4", "--vocab", "300"]))


def test_diloco_flags_without_islands_are_refused(capsys):
    assert main(["plan", *BASE, "--fragments", "2", "--sync-dtype", "bf16"]) == 2
    assert "--fragments, --sync-dtype compare(s) DDP and DiLoCo across islands: add --islands M" in (
        capsys.readouterr().err
    )


def test_divisors_of_a_large_count_at_once():
    assert _divisors(1) == [1] and _divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert _divisors(2**20) == [2**k for k in range(21)]
    assert _divisors(1_000_003) == [1, 1_000_003]  # a prime: sqrt(n) trials, not n


def test_parameter_counts_in_sensible_units(capsys):
    assert [output.count(n) for n in (8.03e9, 918_656, 12_345, 500)] == ["8.03B", "0.92M", "12.35K", "500"]
    assert main(["plan", *BASE, "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith("debug: 0.92M parameters |")  # was "0.00B"


def test_a_config_value_means_in_plan_what_it_means_in_a_config():
    """The values a config key takes mean the same on plan's flag: a -1 degree is inferred (the
    search finds it), micro-batch 0 is the whole per-rank batch, precision auto the device's."""
    base = [*BASE, "--seq-len", "64", "--global-batch", "8"]
    searched = plan_from_args(parse_plan_args(base))
    inferred = plan_from_args(parse_plan_args([*base, "--tp", "-1", "--dp", "-1"]))
    assert [e.layout for e in inferred.results] == [e.layout for e in searched.results]
    whole = plan_from_args(parse_plan_args([*base, "--micro-batch", "0", "--dp", "2"]))
    assert {(e.layout.micro_batch_size, e.layout.num_microbatches) for e in whole.results} == {(4, 1)}
    assert plan_from_args(parse_plan_args([*base, "--precision", "auto"])).precision == "fp32"  # --gpu cpu
