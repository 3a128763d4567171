"""``meshforge plan``'s flags: every number checked with its name and range, every flag
documented, the table's columns aligned, and only faster refused layouts listed as faster."""

from __future__ import annotations

import argparse

import pytest

from meshforge.cli import build_parser
from meshforge.planner import output
from meshforge.planner.plan import parse_plan_args, plan_from_args

BASE = ["--model", "debug", "--gpu", "cpu", "--gpus", "2", "--gpus-per-node", "2"]


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--seq-len", "0", "--seq-len: must be a positive integer, got 0"),
        ("--seq-len", "-1", "--seq-len: must be a positive integer, got -1"),
        ("--global-batch", "0", "--global-batch: must be a positive integer, got 0"),
        ("--global-batch", "-4", "--global-batch: must be a positive integer, got -4"),
        ("--gpus", "0", "--gpus: must be a positive integer, got 0"),
        ("--inter-node-bw", "-5", "--inter-node-bw: must be a number > 0, got -5"),
        ("--inter-node-bw", "nan", "--inter-node-bw: must be a number > 0, got nan"),
        ("--comm-overlap", "1.5", "--comm-overlap: must be a number in 0..1, got 1.5"),
        ("--zero", "4", "--zero: must be an integer in 0..3, got 4"),
        ("--tp", "0", "--tp: must be a positive integer, got 0"),
        ("--top", "0", "--top: must be a positive integer, got 0"),
        ("--layers", "x", "--layers: must be a whole number, got 'x'"),
        ("--experts", "-1", "--experts: must be an integer >= 0, got -1"),
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
    assert "faster layouts" not in output.table(pl.results, 3, [tie])
