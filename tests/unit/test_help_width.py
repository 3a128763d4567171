"""Every ``--help`` fits the terminal it is printed on: ``meshforge train --help`` once had
lines of 500 characters (its key listing, one key per line), which a terminal folds in the
middle of words and a pager cuts off. The width is the terminal's (``COLUMNS`` respected)."""

from __future__ import annotations

import argparse
import re

import pytest

from meshforge.cli.help_text import fit, terminal_width
from meshforge.cli.main import build_parser, main
from meshforge.config import keys
from meshforge.config.keys import plain_text
from meshforge.config.reference import describe_keys


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command line that has a --help of its own, found from the parser (a command added
    later is checked without touching this test)."""
    out = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())


def _help(argv: list[str], capsys) -> str:
    """What ``meshforge ARGV --help`` prints (argparse leaves with SystemExit(0); train returns 0)."""
    try:
        code = main([*argv, "--help"])
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    return capsys.readouterr().out


def test_the_walk_finds_every_command():
    names = {" ".join(c) for c in COMMANDS}
    assert {"", "train", "data", "data prepare", "convert", "plan", "calibrate", "report", "explore"} <= names


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda c: " ".join(c) or "meshforge")
def test_no_help_line_is_wider_than_the_terminal(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    out = _help(list(argv), capsys)
    assert out.count("\n") > 3
    wide = [line for line in out.splitlines() if len(line) > 100]
    assert not wide, f"meshforge {' '.join(argv)} --help: {len(wide)} lines over 100 columns, e.g. {wide[0]!r}"


@pytest.mark.parametrize("columns", ["60", "80", "200"])
def test_train_help_follows_the_width(columns, capsys, monkeypatch):
    """The key listing and the usage wrap to any width (COLUMNS - 2, like argparse), and use it:
    at 200 columns the lines are longer than at 80."""
    monkeypatch.setenv("COLUMNS", columns)
    out = _help(["train"], capsys)
    longest = max(len(line) for line in out.splitlines())
    assert longest <= int(columns) - 2
    if columns == "200":
        assert longest > 100


def test_train_help_keeps_every_key_and_its_whole_help(capsys, monkeypatch):
    """Wrapping loses nothing: each key's help, rejoined, is there in full under its key."""
    monkeypatch.setenv("COLUMNS", "70")
    out = _help(["train"], capsys)
    entries = re.split(r"\n(?=  --)", out.split("config keys (type, default):", 1)[1])
    by_key = {e.split()[0]: " ".join(e.split()) for e in entries if e.startswith("  --")}
    for k in keys().values():
        entry = by_key[f"--{k.dotted}"]
        assert " ".join(plain_text(k.help).split()) in entry


@pytest.mark.parametrize("value", ["abc", "0", "-5", "3", "99999999999999999999"])
def test_a_hostile_columns_value_still_gives_readable_help(value, capsys, monkeypatch):
    """COLUMNS is the environment's: nonsense is ignored or bounded, never a crash or one
    character per line."""
    monkeypatch.setenv("COLUMNS", value)
    width = terminal_width()
    assert 40 <= width <= 1000
    out = _help(["train"], capsys)
    assert "--train.steps" in out and max(len(line) for line in out.splitlines()) <= max(width, 100)


def test_fit_wraps_a_line_under_its_own_indent():
    text = "usage: meshforge train [--a A] [--bb BB] [--ccc CCC]\n\n  --flag X     what the flag does, in words"
    assert fit(text, 34).splitlines() == [
        "usage: meshforge train [--a A]",
        "                       [--bb BB]",
        "                       [--ccc CCC]",
        "",
        "  --flag X     what the flag does,",
        "               in words",
    ]


def test_describe_keys_wraps_under_the_key():
    lines = describe_keys(60).splitlines()
    assert max(len(line) for line in lines) <= 60
    steps = lines.index(next(x for x in lines if x.startswith("  --train.steps ")))
    assert lines[steps + 1].startswith("      ") and not lines[steps + 1].startswith("       ")
