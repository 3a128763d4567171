"""One vocabulary (DESIGN.md principle 7): a config key that `meshforge plan` or the explorer
also takes is accepted and refused alike by every front end that takes it -- `train` (config
loading), `plan` (its argument parser) and the explorer (its parameter parser) -- because each
reads the key's range and words from the key's field. The walk below puts each shared key's
boundary values (accepted) and the values just outside them (refused) to every front end, and
the drift tests show it fails when one front end keeps a limit of its own."""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import pytest

from meshforge.config import checks as config_checks
from meshforge.config import load_config
from meshforge.config.keys import keys
from meshforge.errors import ConfigError
from meshforge.explore import params
from meshforge.explore.params import SHARED, BadRequest, Spec, parse_value
from meshforge.planner import plan_args
from meshforge.planner.candidates import KEY_FLAGS
from meshforge.planner.plan import parse_plan_args
from meshforge.ranges import Span, whole

EXPLORE = {key: name for name, key in SHARED.items()}  # config key -> explorer parameter
SHARED_KEYS = sorted(set(KEY_FLAGS) | set(EXPLORE))
BOGUS = "bogus-word"


def _train(dotted: str, value: Any) -> bool:
    """Whether config loading takes the value for this key: refused only by the key's own range
    or words (a rule between keys -- heads dividing hidden -- is another matter)."""
    try:
        load_config(None, {dotted: value})
    except ConfigError as e:
        msg = str(e)
        own = ("is out of range", "is not one of", "each entry must be", "must be an integer", "must be a number")
        return not (msg.startswith(dotted) and any(s in msg for s in own))
    return True


def _plan(dotted: str, value: Any) -> bool:
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parse_plan_args([f"{KEY_FLAGS[dotted]}={text}"])
        except SystemExit:
            return False
    return True


def _explore(dotted: str, value: Any) -> bool:
    try:
        parse_value(EXPLORE[dotted], str(value))
    except BadRequest:
        return False
    return True


def verdicts(dotted: str, value: Any) -> dict[str, bool]:
    """Each front end that takes the key: whether it accepts the value."""
    out = {"train": _train(dotted, value)}
    if dotted in KEY_FLAGS:
        out["plan"] = _plan(dotted, value)
    if dotted in EXPLORE:
        out["explore"] = _explore(dotted, value)
    return out


def _inside(span: Span, kind: type) -> list[Any]:
    lo = span.lo if not span.lo_open else (span.lo + 1 if kind is int else math.nextafter(span.lo, math.inf))
    hi = span.hi if not span.hi_open else (span.hi - 1 if kind is int else math.nextafter(span.hi, -math.inf))
    return [kind(lo), kind(hi), *(kind(a) for a in span.also)]


def _outside(span: Span, kind: type) -> list[Any]:
    lo = span.lo if span.lo_open else (span.lo - 1 if kind is int else math.nextafter(span.lo, -math.inf))
    hi = span.hi if span.hi_open else (span.hi + 1 if kind is int else math.nextafter(span.hi, math.inf))
    while lo in span.also:
        lo -= 1
    return [kind(lo), kind(hi)]


def walk(dotted: str) -> list[str]:
    """Every value of this key whose verdicts are not the key's own (accepted inside its range or
    words, refused outside), as 'key value: verdicts'."""
    k = keys()[dotted]
    if k.span is not None:
        cases = [(v, True) for v in _inside(k.span, k.type)] + [(v, False) for v in _outside(k.span, k.type)]
    elif k.each is not None:
        cases = [([v], True) for v in _inside(k.each, int)] + [([v], False) for v in _outside(k.each, int)]
    elif k.choices:
        cases = [(word, True) for word in k.choices] + [(BOGUS, False)]
    else:  # a flag without a value (bool), or words the layout rules judge (pp_schedule): below
        cases = []
    out = []
    for value, want in cases:
        got = verdicts(dotted, value)
        if set(got.values()) != {want}:
            out.append(f"{dotted} {value!r}: {got}")
    return out


def test_the_shared_keys_are_config_keys_and_the_walk_covers_them():
    assert set(SHARED_KEYS) <= set(keys()), set(SHARED_KEYS) - set(keys())
    walked = [k for k in SHARED_KEYS if keys()[k].span or keys()[k].each or keys()[k].choices]
    assert len(walked) >= 25 and {"model.layers", "model.hidden", "parallel.tp", "train.precision"} <= set(walked)
    assert {"model.layers", "train.seq_len", "parallel.pp"} <= set(EXPLORE) & set(KEY_FLAGS)


@pytest.mark.parametrize("dotted", SHARED_KEYS)
def test_every_front_end_accepts_and_refuses_the_same_values(dotted):
    assert walk(dotted) == []


def test_the_words_each_front_end_adds_are_declared():
    """plan's words beyond a key's are only those that leave a setting to the search; the words of
    a key the config types as a plain string (the schedule) are the same list in plan and explore."""
    for dotted in KEY_FLAGS:
        words = keys()[dotted].choices
        if words:
            assert plan_args.choices(dotted) == (*plan_args.SEARCHED_WORDS.get(dotted, ()), *words), dotted
    for name, dotted in SHARED.items():
        if keys()[dotted].choices:
            assert params.SPECS[name].choices == keys()[dotted].choices, name
    assert params.SPECS["schedule"].choices == plan_args.choices("parallel.pp_schedule")
    assert _plan("parallel.pp_schedule", "zbv") and not _plan("parallel.pp_schedule", BOGUS)


def test_the_walk_fails_when_the_explorer_keeps_its_own_limit(monkeypatch):
    monkeypatch.setitem(params.SPECS, "layers", Spec("int", None, 1, 1024, key="model.layers"))  # its old cap
    assert walk("model.layers") == ["model.layers 16384: {'train': True, 'plan': True, 'explore': False}"]


def test_the_walk_fails_when_plan_keeps_its_own_limit(monkeypatch):
    own = plan_args.bounded

    def old_cap(span: Span, kind: type):  # --layers' old cap, on every key of model.layers' range
        return plan_args.whole(1, 4096) if span.hi == keys()["model.layers"].span.hi else own(span, kind)

    monkeypatch.setattr(plan_args, "bounded", old_cap)
    assert "model.layers 16384: {'train': True, 'plan': False, 'explore': True}" in walk("model.layers")


def test_the_walk_fails_when_the_config_keeps_its_own_limit(monkeypatch):
    table = dict(keys())
    table["model.hidden"] = table["model.hidden"].__class__(**{**vars(table["model.hidden"]), "span": whole(1, 2**22)})
    monkeypatch.setattr(config_checks, "keys", lambda: table)
    assert walk("model.hidden") == ["model.hidden 1048577: {'train': True, 'plan': False, 'explore': False}"]
