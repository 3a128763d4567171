"""Seeded, bounded mutations of the four manifests meshforge reads -- a config, a prepared corpus's
``index.json``, a checkpoint's ``meta.json`` and its DCP ``.metadata`` -- each run through the real
command in this process (``cli.main``), and every outcome tallied (issue 50).

An outcome is good when it is exit 0, or exit 2 with exactly one ``meshforge: error:`` paragraph.
Anything else is a failure: an exception out of the command (a traceback), another exit code, a
second paragraph, a run past LIMIT_S (a hang), or a write outside the run or output directory
(the case's directory is compared before and after, and so is the workspace around it).

Mutations (drawn by Hypothesis from a seed, so a run repeats itself): a value anywhere in the
document replaced by another of any type (huge and negative numbers, NaN, paths such as
``../x`` and ``/dev/zero``, lists, objects), a key removed or added, a value nested 100,000
deep, and the serialized bytes cut short, flipped or spliced; a ``.metadata`` is mutated as
the objects DCP pickles (sizes, dtypes, chunks, offsets, file names), then pickled again. What a
tamperer can do is done too: a changed file's size and sha256 are recorded again in meta.json.

The commands: ``train --config C`` (1 step; the run directory, the data and the model's and
batch's sizes pinned on the command line, so that a run stays seconds long) for
a config; ``train`` of one step on the mutated corpus for ``index.json``; ``convert
--from-checkpoint`` (verify, the full DCP load, the export) for ``meta.json`` and ``.metadata``.

Used by tests/integration/test_manifest_fuzz.py (a small budget) and
bench/bench_manifest_fuzz.py (>= 10,000 inputs).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

LIMIT_S = 120  # a hang never ends; the slowest input is reported against the 30 s target
TARGETS = ("config", "index", "meta", "metadata")
TINY = {
    "model": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 128},
    "train": {"seq_len": 32, "global_batch_size": 8, "eval_batches": 0, "seed": 0},
    "optim": {"lr": 3e-3, "warmup_steps": 1, "eps": 1e-4},
    "checkpoint": {"interval": 2, "keep": 2},
    "metrics": {"console": False, "log_interval": 1},
}
# bounded work: one step of the tiny model (a mutated config could otherwise ask for a 1B model
# that fits this machine's memory and takes minutes a step: slow, not hung, but not this test's)
PINNED = ["--train.steps=1"]
PINNED_SIZE = [f"--{s}.{k}={v}" for s in ("model", "train") for k, v in TINY[s].items() if k != "eval_batches"]
ODD = ["../x", "/dev/zero", "", "a/b", "uint8", "float64", "nan", "\x00", "é" * 3, "9" * 30, ".metadata"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 2**31 - 1, 2**32, 2**63, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(ODD)
)
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)


# --- the workspace --------------------------------------------------------------------------------------


@dataclass
class Workspace:
    """What every case starts from, made once: a trained run (checkpoints at steps 2 and 4) and a
    prepared corpus; each case works in a fresh directory under ``root / 'cases'``."""

    root: Path
    run: Path
    data: Path
    base: dict[str, bytes] = field(default_factory=dict)

    @property
    def ckpt(self) -> Path:
        return self.run / "checkpoints" / "step-00000004"


def make_workspace(root: Path, corpus: Path) -> Workspace:
    from meshforge.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        data = root / "data"
        assert main(["data", "prepare", "--input", str(corpus), "--out", str(data)]) == 0
        run = root / "run"
        args = [f"--{s}.{k}={_cli(v)}" for s, kv in TINY.items() for k, v in kv.items()]
        assert main(["train", *args, f"--data.path={data}", f"--run.dir={run}", "--train.steps=4"]) == 0
    ws = Workspace(root, run, data)
    ws.base = {
        "config": _toml(TINY).encode(),
        "index": (data / "index.json").read_bytes(),
        "meta": (ws.ckpt / "meta.json").read_bytes(),
        "metadata": (ws.ckpt / ".metadata").read_bytes(),
    }
    (root / "cases").mkdir()
    return ws


def _cli(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _toml(doc: dict) -> str:
    from meshforge.config.values import toml_value

    out = []
    for section, kv in doc.items():
        if not isinstance(kv, dict):
            out.append(f"{_key(section)} = {_value(kv, toml_value)}")
            continue
        out.append(f"[{_key(section)}]")
        out += [f"{_key(k)} = {_value(v, toml_value)}" for k, v in kv.items()]
    return "\n".join(out) + "\n"


def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def _value(v: Any, toml_value: Callable[[Any], str]) -> str:
    if v is None:
        return '""'
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x, toml_value)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x, toml_value) for x in v) + "]"
    return toml_value(v)


# --- mutations -----------------------------------------------------------------------------------------


def mutate_doc(doc: Any, draw: Callable) -> Any:
    """``doc`` (JSON-like) with one to three structural mutations at drawn places."""
    for _ in range(draw(st.integers(1, 3))):
        doc = _mutate_at(doc, draw)
    return doc


def _mutate_at(node: Any, draw: Callable) -> Any:
    children = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
    if children and draw(st.integers(0, 3)):  # go deeper three times in four
        k = draw(st.sampled_from(children))
        node[k] = _mutate_at(node[k], draw)
        return node
    op = draw(st.sampled_from(["replace", "replace", "drop", "add", "nest"]))
    if op == "replace" or not children and op == "drop":
        return draw(values)
    if op == "nest":
        return _nest(node, draw(st.sampled_from([70, 1000, 100_000])))
    if op == "drop":
        del node[draw(st.sampled_from(children))]
        return node
    if isinstance(node, dict):
        node[draw(st.text(max_size=8))] = draw(values)
    elif isinstance(node, list):
        node.append(draw(values))
    return node


def _nest(v: Any, depth: int) -> str:
    """A placeholder that ``_expand`` writes as ``depth`` nested arrays (json.dumps would recurse)."""
    return f"__DEEP_{depth}__"


def _expand(text: str) -> str:
    return re.sub(r'"__DEEP_(\d+)__"', lambda m: "[" * int(m.group(1)) + "0" + "]" * int(m.group(1)), text)


def mutate_bytes(raw: bytes, draw: Callable) -> bytes:
    """``raw`` cut short, with bytes flipped, or with a drawn run of bytes spliced in."""
    op = draw(st.sampled_from(["cut", "flip", "splice"]))
    at = draw(st.integers(0, max(0, len(raw) - 1)))
    if op == "cut":
        return raw[:at]
    if op == "flip":
        return raw[:at] + bytes([raw[at] ^ draw(st.integers(1, 255))]) + raw[at + 1 :] if raw else raw
    return raw[:at] + draw(st.binary(max_size=16) | st.sampled_from([b"[" * 100_000, b"\xff\xfe", b"\x80"])) + raw[at:]


def _json_dumps(doc: Any) -> bytes:
    return _expand(json.dumps(doc)).encode("utf-8", "surrogatepass")


def mutated(target: str, base: bytes, draw: Callable) -> bytes:
    """One mutated file of ``target`` kind from ``base`` (a byte mutation one time in four)."""
    if draw(st.integers(0, 3)) == 0:
        return mutate_bytes(base, draw)
    if target == "metadata":
        return _mutated_metadata(base, draw)
    if target == "config":
        import tomllib

        doc = mutate_doc(tomllib.loads(base.decode()), draw)
        return _expand(_toml(doc if isinstance(doc, dict) else {"x": doc})).encode("utf-8", "surrogatepass")
    return _json_dumps(mutate_doc(json.loads(base), draw))


def _mutated_metadata(base: bytes, draw: Callable) -> bytes:
    md = pickle.loads(base)  # (the workspace's own file: trusted here)
    entries = md.state_dict_metadata
    key = draw(st.sampled_from(sorted(entries)))
    entry = entries[key]
    chunk = entry.chunks[0]
    info_key = draw(st.sampled_from(list(md.storage_data)))
    info = md.storage_data[info_key]
    sizes = st.lists(st.integers(-(2**41), 2**41) | st.sampled_from([0, 1, 64, 128, 512]), max_size=4)
    op = draw(st.integers(0, 11))
    if op == 0:
        object.__setattr__(entry, "size", _size(draw(sizes)))
    elif op == 1:
        object.__setattr__(chunk, "offsets", _size(draw(sizes)))
    elif op == 2:
        object.__setattr__(chunk, "sizes", _size(draw(sizes)))
    elif op == 3:
        object.__setattr__(entry, "chunks", draw(values))
    elif op == 4:
        del entries[key]
    elif op == 5:
        entries[key + draw(st.text(max_size=4))] = entries.pop(key)
    elif op == 6:
        object.__setattr__(info, "offset", draw(st.integers(-(2**40), 2**40)))
    elif op == 7:
        object.__setattr__(info, "length", draw(st.integers(-(2**40), 2**40)))
    elif op == 8:
        object.__setattr__(info, "relative_path", draw(st.sampled_from(ODD) | st.text(max_size=8)))
    elif op == 9:
        del md.storage_data[info_key]
    elif op == 10:
        import torch

        dtype = draw(st.sampled_from([torch.int8, torch.bool, torch.float16, torch.complex64, torch.int64, None]))
        object.__setattr__(entry.properties, "dtype", dtype)
    else:
        object.__setattr__(
            md,
            draw(st.sampled_from(["state_dict_metadata", "storage_data", "planner_data", "storage_meta"])),
            draw(values),
        )
    return pickle.dumps(md)


def _size(v: list[int]) -> Any:
    import torch

    try:
        return torch.Size(v)
    except (RuntimeError, OverflowError):
        return tuple(v)


# --- one case ------------------------------------------------------------------------------------------


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    slowest: float = 0.0

    def add(self, target: str, kind: str, detail: str) -> None:
        self.counts[(target, kind)] += 1
        if kind not in ("exit 0", "exit 2"):
            self.failures.append(f"{target}: {kind}: {detail}")

    def total(self, kind: str | None = None) -> int:
        return sum(n for (_, k), n in self.counts.items() if kind is None or k == kind)


def run_case(ws: Workspace, target: str, raw: bytes, index: int) -> tuple[str, str]:
    """Write ``raw`` as ``target`` in a fresh case directory, run its command; (kind, detail)."""
    case = ws.root / "cases" / f"{target}-{index:06d}"
    argv, allowed = _prepare(ws, case, target, raw)
    before, around = _snapshot(case, allowed), sorted(os.listdir(ws.root))
    out, cwd = io.StringIO(), os.getcwd()
    os.chdir(case)  # (a relative path a mutation names lands in the case, where it is seen)
    try:
        kind, detail = _run(argv, out)
    finally:
        os.chdir(cwd)
    if kind in ("exit 0", "exit 2") and (_snapshot(case, allowed) != before or sorted(os.listdir(ws.root)) != around):
        kind, detail = "wrote outside", f"{case}: {sorted(set(os.listdir(case)) - set(allowed))}"
    if kind in ("exit 0", "exit 2"):
        shutil.rmtree(case, ignore_errors=True)
        return kind, detail
    return kind, f"{detail} | input: {raw[:300]!r}"


def _prepare(ws: Workspace, case: Path, target: str, raw: bytes) -> tuple[list[str], list[str]]:
    case.mkdir()
    if target == "config":
        (case / "c.toml").write_bytes(raw)
        args = ["train", "--config", str(case / "c.toml"), f"--data.path={ws.data}", f"--run.dir={case / 'run'}"]
        return [*args, *PINNED, *PINNED_SIZE], ["run"]
    if target == "index":
        shutil.copytree(ws.data, case / "data")
        (case / "data" / "index.json").write_bytes(raw)
        args = [f"--{s}.{k}={_cli(v)}" for s, kv in TINY.items() for k, v in kv.items()]
        return ["train", *args, f"--data.path={case / 'data'}", f"--run.dir={case / 'run'}", *PINNED], ["run"]
    ckpt = case / "step-00000004"
    shutil.copytree(ws.ckpt, ckpt)
    name = "meta.json" if target == "meta" else ".metadata"
    (ckpt / name).write_bytes(raw)
    if target == "metadata":
        _rehash(ckpt, name)
    return ["convert", "--from-checkpoint", str(ckpt), "--out", str(case / "out")], ["out"]


def _rehash(ckpt: Path, name: str) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    data = (ckpt / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _run(argv: list[str], out: io.StringIO) -> tuple[str, str]:
    from meshforge.cli.main import main

    def ring(signum, frame):
        raise TimeoutError

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(LIMIT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except TimeoutError:
        return "hang", f"over {LIMIT_S} s"
    except BaseException as e:  # noqa: BLE001 - any exception out of a command is a traceback
        return "traceback", f"{type(e).__name__}: {str(e)[-800:]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    text = out.getvalue()
    if "Traceback" in text:
        return "traceback", text[-1500:]
    if code == 2 and text.count("meshforge: error:") != 1:
        return "paragraphs", text[-1500:]
    return f"exit {code}", "" if code in (0, 2) else text[-1500:]


def _snapshot(case: Path, allowed: list[str]) -> dict[str, Any]:
    """What is in ``case`` but its allowed outputs: names, sizes and mtimes."""
    out = {}
    for p in sorted(case.rglob("*")):
        rel = p.relative_to(case)
        if rel.parts[0] in allowed:
            continue
        st_ = p.lstat()
        out[str(rel)] = (st_.st_mode, st_.st_size, st_.st_mtime_ns)
    return out


# --- the loop ------------------------------------------------------------------------------------------


def fuzz(ws: Workspace, target: str, examples: int, seed_: int, tally: Tally) -> None:
    """``examples`` mutated inputs of ``target`` through its command, drawn from ``seed_``."""
    counter = iter(range(10**9))

    @seed(seed_)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one(data: st.DataObject) -> None:
        raw = mutated(target, ws.base[target], data.draw)
        t0 = time.perf_counter()
        kind, detail = run_case(ws, target, raw, next(counter))
        took = time.perf_counter() - t0
        tally.seconds, tally.slowest = tally.seconds + took, max(tally.slowest, took)
        tally.add(target, kind, detail)

    one()
