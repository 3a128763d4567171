"""Kernel-level diff of two one-step torch.profiler traces (Chrome trace JSON): where side A's
step spends its time that side B's does not, kernel by kernel, plus the host gaps.

    python bench/gpu/kernel_diff.py mf.json peer.json --labels meshforge torchtitan \
        --step-a 1.203 --step-b 1.003 --out kdiff.md

The step: the span of the ``meshforge step N`` / ``peer step`` annotation (``--mark``), up to the
end of the last kernel that overlaps it (GPU work runs behind the host); the whole trace when
no annotation matches. In that window the step time splits exactly into the kernels' time
(by normalized kernel name, and for GEMMs the input dims of the launching aten op, which
``record_shapes=True`` records), minus the time two kernels ran at once, plus the host gaps
(no kernel running). So the rows' differences add up to the traced step-time difference;
``--step-a/--step-b`` (the measured seconds per step) check that the traced steps stand for
the measured ones: the sum must be within 5% of the measured difference.

On a trace without GPU kernels (a CPU run) the CPU ops stand in for kernels, each with its own
time (its span less its child ops'), and the gaps are the time in no op at all (Python, the
framework between ops); ``--mode cpu`` forces this on any trace: how the tool is tested
without a GPU.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import GPU_CATS, busy_time, classify  # noqa: E402

STEP_MARK = r"^(meshforge step \d+|peer step)$"
HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm", "addmm_", "mm_out")
TOLERANCE = 0.05  # the sum of differences against the measured step-time difference


class TraceError(Exception):
    """A trace that cannot be read as one profiled step (its message names the file and the fix)."""


@dataclass
class Side:
    """One trace read as one step: work items (start, end, key) clipped to the window, gaps."""

    label: str
    mode: str  # gpu | cpu
    t0: float
    t1: float
    items: list[tuple[float, float, str, int]]  # start, end, row key, calls (0: another piece of an op)
    gaps: list[dict] = field(default_factory=list)
    marked: bool = True

    @property
    def span_us(self) -> float:
        return self.t1 - self.t0


def load_events(path: str | Path) -> list[dict]:
    """The trace's complete ('X') events; a file that is not a Chrome trace is refused."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(
            f"{p}: not a readable Chrome trace ({type(e).__name__}: {e}); pass the .json "
            "that torch.profiler's export_chrome_trace wrote"
        ) from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceError(f"{p}: no traceEvents list; pass a torch.profiler Chrome trace")
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)):
            if isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0:
                out.append(e)
    return out


def normalize(name: str) -> str:
    """A kernel name without its argument list, namespaces, void and the numeric suffix inductor
    gives each generated kernel, so the same kernel matches across runs and sides."""
    n = name.strip().replace("(anonymous namespace)::", "")
    n = n[5:] if n.startswith("void ") else n
    depth = 0
    for i, ch in enumerate(n):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0 and i > 0:
            n = n[:i]
            break
    n = re.sub(r"\b[A-Za-z_]\w*::", "", n)
    n = re.sub(r",?\s*Array<char\*, \d+>", "", n)
    n = re.sub(r"^(triton_\w+?)_\d+$", r"\1", n)
    return re.sub(r"\s+", " ", n).strip()


def dims_text(op: dict | None) -> str:
    """'aten::mm 8192x2048 2048x8192' from an op's recorded input dims ('' without them)."""
    if not op:
        return ""
    dims = (op.get("args") or {}).get("Input Dims") or []
    shapes = ["x".join(str(d) for d in s) for s in dims if isinstance(s, list) and s]
    return f"{op.get('name', '?')} {' '.join(shapes)}".strip()


def is_gemm_op(name: str) -> bool:
    return name.split("::")[-1] in GEMM_OPS


def exclusive_pieces(ops: list[dict]) -> list[tuple[float, float, dict, int]]:
    """Each CPU op's own time as intervals (its span less its child ops', per thread), as
    (start, end, op, 1 for the op's first piece else 0): on a CPU the work is in the ops, and
    what is left between them (Python, the framework) is the gaps."""
    by_tid: dict[tuple, list[dict]] = {}
    for e in ops:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    pieces: list[tuple[float, float, dict, int]] = []
    for evs in by_tid.values():
        stack: list[list] = []  # open ops: [op, end, accounted up to, first piece still to come]
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            _close_until(stack, e["ts"], pieces)
            stack.append([e, e["ts"] + e["dur"], e["ts"], 1])
        _close_until(stack, float("inf"), pieces)
    return pieces


def _close_until(stack: list[list], t: float, pieces: list) -> None:
    """Give the innermost open op its own time up to ``t``; close the ops that end by then (their
    span is their parent's child time)."""
    while stack:
        top = stack[-1]
        upto = min(t, top[1])
        if upto > top[2]:
            pieces.append((top[2], upto, top[0], top[3]))
            top[3] = 0
        top[2] = max(top[2], upto)
        if top[1] > t:
            return
        stack.pop()
        if top[3]:  # no time of its own (all in children, or zero length): still one call
            pieces.append((top[1], top[1], top[0], 1))
        if stack:
            stack[-1][2] = max(stack[-1][2], top[1])


def step_window(events: list[dict], mark: str, work: list[tuple[float, float, float]]) -> tuple[float, float, bool]:
    """The marked step's [start, end], the end extended to the last work item launched in it
    (``work``: start, end, launch time; a kernel queued by the step may start after its host
    side ended), or the whole trace's span when no annotation matches ``mark``."""
    rx = re.compile(mark)
    marks = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and rx.search(e.get("name", ""))]
    if marks:
        m = max(marks, key=lambda e: e["dur"])
        t0, t1 = float(m["ts"]), float(m["ts"] + m["dur"])
        ends = [f for s, f, launch in work if t0 <= launch <= t1 or t0 <= s <= t1]
        return t0, max([t1, *ends]), True
    host = [e for e in events if e.get("cat") in HOST_CATS]
    starts = [e["ts"] for e in host] or [s for s, *_ in work]
    ends = [e["ts"] + e["dur"] for e in host] + [f for _, f, _ in work]
    if not starts:
        raise TraceError("the trace has no CPU ops and no kernels: profile with ProfilerActivity.CPU (and CUDA)")
    return float(min(starts)), float(max(ends)), False


def launch_times(events: list[dict]) -> dict:
    """Host time of each launch by correlation id (cuda_runtime / cuda_driver events)."""
    out = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                out[corr] = float(e["ts"])
    return out


class HostIndex:
    """Host ops per thread (the innermost one running at a time) and by External id (the aten op
    that launched a kernel: the kernel's args carry the op's External id)."""

    def __init__(self, events: list[dict]):
        self.threads: dict[tuple, tuple[list[float], list[dict]]] = {}
        self.by_ext: dict = {}
        for e in sorted((e for e in events if e.get("cat") in HOST_CATS), key=lambda e: (e["ts"], -e["dur"])):
            starts, evs = self.threads.setdefault((e.get("pid"), e.get("tid")), ([], []))
            starts.append(e["ts"])
            evs.append(e)
            ext = (e.get("args") or {}).get("External id")
            if e.get("cat") == "cpu_op" and ext is not None:
                self.by_ext.setdefault(ext, e)

    def launcher(self, kernel: dict) -> dict | None:
        return self.by_ext.get((kernel.get("args") or {}).get("External id"))

    def at(self, t: float) -> str:
        """The innermost host op running at time ``t`` (the shortest over the threads); '-' if none."""
        best = None
        for starts, evs in self.threads.values():
            i = bisect.bisect_right(starts, t) - 1
            while i >= 0 and evs[i]["ts"] + evs[i]["dur"] <= t:  # ended before t: its parent may not have
                i -= 1
            if i >= 0 and (best is None or evs[i]["dur"] < best["dur"]):
                best = evs[i]
        return best.get("name", "?") if best else "-"


def work_items(events: list[dict], mode: str, host: HostIndex) -> tuple[list[tuple], list[str]]:
    """The intervals that stand for kernels, as (start, end, event, calls): GPU events, or each CPU
    op's own time; and each one's row key: its normalized name, with the input dims of the
    launching op for a GEMM (``record_shapes``)."""
    if mode == "gpu":
        work = [(e["ts"], e["ts"] + e["dur"], e, 1) for e in events if e.get("cat") in GPU_CATS]
        keys = []
        for _, _, e, _ in work:
            key = normalize(e.get("name", "?"))
            if e.get("cat") == "kernel" and classify(key) == "GEMM":
                shape = dims_text(host.launcher(e))
                key = f"{key} [{shape}]" if shape else key
            keys.append(key)
        return work, keys
    work = exclusive_pieces([e for e in events if e.get("cat") == "cpu_op"])
    keys = [
        f"{e.get('name', '?')} [{dims_text(e)}]" if is_gemm_op(e.get("name", "")) else e.get("name", "?")
        for *_, e, _ in work
    ]
    return work, keys


def read_side(path: str | Path, label: str, mode: str = "auto", mark: str = STEP_MARK, top_gaps: int = 10) -> Side:
    """One trace as one step: its work items clipped to the step's window and its host gaps."""
    events = load_events(path)
    if mode == "auto":
        mode = "gpu" if any(e.get("cat") == "kernel" for e in events) else "cpu"
    host = HostIndex(events)
    work, keys = work_items(events, mode, host)
    if not work:
        raise TraceError(f"{path}: no {'kernels' if mode == 'gpu' else 'CPU ops'} in the trace")
    launched = launch_times(events) if mode == "gpu" else {}
    spans = [(s, f, launched.get((e.get("args") or {}).get("correlation"), s)) for s, f, e, _ in work]
    t0, t1, marked = step_window(events, mark, spans)
    items, kept = [], []
    for (s, f, e, n), k in zip(work, keys, strict=True):
        s, f = max(float(s), t0), min(float(f), t1)
        if f > s or (t0 <= s <= t1 and n):  # clipped to the window; a zero-length op still counts as a call
            items.append((s, max(s, f), k, n))
            kept.append(e)
    side = Side(label, mode, t0, t1, items, marked=marked)
    side.gaps = find_gaps(side, kept, host, top_gaps)
    return side


def find_gaps(side: Side, kept: list[dict], host: HostIndex, top: int) -> list[dict]:
    """The window's idle intervals (no work item running), longest first, the first ``top`` with
    the op whose kernel ran before, the host op running at the gap's start and the next kernel's op."""
    order = sorted(range(len(kept)), key=lambda i: side.items[i][0])
    gaps, cursor, prev = [], side.t0, None
    for i in order:
        s, f, *_ = side.items[i]
        if s > cursor:
            gaps.append({"start": cursor, "us": s - cursor, "prev": prev, "next": kept[i]})
        if f > cursor:
            cursor, prev = f, kept[i]
    if side.t1 > cursor:
        gaps.append({"start": cursor, "us": side.t1 - cursor, "prev": prev, "next": None})
    gaps.sort(key=lambda g: -g["us"])
    for g in gaps[:top]:
        g["prev"], g["next"] = op_name(g["prev"], side.mode, host), op_name(g["next"], side.mode, host)
        g["host"] = host.at(g["start"] + min(1.0, g["us"] / 2))
    return gaps


def op_name(e: dict | None, mode: str, host: HostIndex) -> str:
    """The aten op behind a work item (a kernel's launcher; a CPU op itself)."""
    if e is None:
        return "-"
    if mode == "cpu":
        return e.get("name", "?")
    op = host.launcher(e)
    return op.get("name", "?") if op else normalize(e.get("name", "?"))[:40]


def totals(side: Side) -> dict[str, list[float]]:
    """Per row key: [calls, total µs]; plus the gap and overlap rows, so the rows sum to the span."""
    rows: dict[str, list[float]] = {}
    for s, f, k, n in side.items:
        r = rows.setdefault(k, [0, 0.0])
        r[0] += n
        r[1] += f - s
    busy = busy_time([(s, f) for s, f, *_ in side.items])
    summed = sum(r[1] for r in rows.values())
    rows[GAPS] = [sum(1 for g in side.gaps if g["us"] > 0), side.span_us - busy]
    rows[OVERLAP] = [0, -(summed - busy)]
    return rows


GAPS = "(host gaps: nothing running)"
OVERLAP = "(kernels running at once: counted twice above)"


def row_class(key: str, mode: str) -> str:
    if key in (GAPS, OVERLAP):
        return "gaps" if key == GAPS else "overlap"
    name = key.split(" [")[0]
    if mode == "cpu":
        return "GEMM" if is_gemm_op(name) else classify(name) if name.startswith("aten::") else "framework"
    return classify(name)


def diff_rows(a: Side, b: Side) -> list[dict]:
    """Every row key of either side with both sides' calls and times, largest A - B first."""
    ta, tb = totals(a), totals(b)
    rows = []
    for k in {*ta, *tb}:
        ca, ua = ta.get(k, [0, 0.0])
        cb, ub = tb.get(k, [0, 0.0])
        rows.append(
            {"key": k, "class": row_class(k, a.mode), "calls": (int(ca), int(cb)), "us": (ua, ub), "diff_us": ua - ub}
        )
    rows.sort(key=lambda r: -r["diff_us"])
    return rows


def check(a: Side, b: Side, rows: list[dict], step_a: float | None, step_b: float | None) -> tuple[list[str], bool]:
    """The rows' differences against the traced and (when given) the measured step-time difference."""
    total = sum(r["diff_us"] for r in rows) / 1e3
    traced = (a.span_us - b.span_us) / 1e3
    lines = [
        f"sum of differences {total:+.3f} ms = traced step difference {traced:+.3f} ms "
        f"({a.label} {a.span_us / 1e3:.3f} ms, {b.label} {b.span_us / 1e3:.3f} ms)"
    ]
    ok = abs(total - traced) <= 1e-6 * max(1.0, abs(traced))
    if step_a is None or step_b is None:
        lines.append("no measured step times given (--step-a/--step-b): only the traced steps are compared")
        return lines, ok
    measured = (step_a - step_b) * 1e3
    off = abs(total - measured)
    rel = off / abs(measured) if measured else float("inf")
    good = rel <= TOLERANCE
    lines.append(
        f"measured step difference {measured:+.3f} ms ({a.label} {step_a * 1e3:.3f}, {b.label} {step_b * 1e3:.3f}); "
        f"off by {off:.3f} ms = {100 * rel:.1f}% of it: {'OK' if good else 'NOT MET'} (within {100 * TOLERANCE:.0f}%)"
    )
    lines.append(
        f"traced / measured step: {a.label} {a.span_us / 1e3 / (step_a * 1e3):.3f}, "
        f"{b.label} {b.span_us / 1e3 / (step_b * 1e3):.3f}"
    )
    return lines, ok and good


def fmt_row(r: dict, width: int = 90) -> str:
    (ca, cb), (ua, ub) = r["calls"], r["us"]
    mean = lambda u, c: f"{u / c:,.1f}" if c else "-"  # noqa: E731
    key = r["key"] if len(r["key"]) <= width else r["key"][: width - 1] + "…"
    key = key.replace("|", "/")
    return (
        f"| {key} | {r['class']} | {ca:,} | {ua / 1e3:,.3f} | {mean(ua, ca)} | {cb:,} | {ub / 1e3:,.3f} | "
        f"{mean(ub, cb)} | {r['diff_us'] / 1e3:+,.3f} |"
    )


def table(rows: list[dict], mode: str, top: int) -> list[str]:
    """The kernel rows with the ``top`` largest differences and the gap and overlap rows, sorted by
    A - B, the rest summed in one row."""
    unit = (
        "kernel (normalized name [GEMM: launching op, input dims])"
        if mode == "gpu"
        else "CPU op, own time [GEMM: input dims]"
    )
    out = [f"| {unit} | class | A calls | A ms | A mean µs | B calls | B ms | B mean µs | A - B ms |", "|---" * 9 + "|"]
    largest = sorted(rows, key=lambda r: -abs(r["diff_us"]))[:top]
    shown = sorted(
        {id(r): r for r in largest + [r for r in rows if r["key"] in (GAPS, OVERLAP)]}.values(),
        key=lambda r: -r["diff_us"],
    )
    picked = {id(r) for r in shown}
    rest = [r for r in rows if id(r) not in picked]
    out += [fmt_row(r) for r in shown]
    if rest:
        calls = tuple(sum(r["calls"][i] for r in rest) for i in (0, 1))
        us = tuple(sum(r["us"][i] for r in rest) for i in (0, 1))
        agg = {"key": f"({len(rest)} other rows)", "class": "", "calls": calls, "us": us, "diff_us": us[0] - us[1]}
        out.append(fmt_row(agg))
    return out


def class_table(rows: list[dict]) -> list[str]:
    """The same times summed per kernel class (trace_summary.py's classes, gaps, overlap)."""
    out = ["| class | A ms | B ms | A - B ms |", "|---|---|---|---|"]
    classes: dict[str, list[float]] = {}
    for r in rows:
        c = classes.setdefault(r["class"] or "other", [0.0, 0.0])
        c[0], c[1] = c[0] + r["us"][0], c[1] + r["us"][1]
    for c, (ua, ub) in sorted(classes.items(), key=lambda kv: kv[1][1] - kv[1][0]):
        out.append(f"| {c} | {ua / 1e3:,.3f} | {ub / 1e3:,.3f} | {(ua - ub) / 1e3:+,.3f} |")
    return out


def gap_table(s: Side) -> list[str]:
    """One side's longest host gaps with what ran before, what the host was in, what came next."""
    total = sum(g["us"] for g in s.gaps) / 1e3
    out = [f"Longest host gaps, {s.label} ({len(s.gaps):,} gaps, {total:,.3f} ms in all):", ""]
    out += ["| gap µs | at ms | after (op of the work before) | host was in | next (op of the work after) |"]
    out += ["|---|---|---|---|---|"]
    for g in (g for g in s.gaps if "host" in g):
        out.append(f"| {g['us']:,.1f} | {(g['start'] - s.t0) / 1e3:,.3f} | {g['prev']} | {g['host']} | {g['next']} |")
    return out


def render(a: Side, b: Side, rows: list[dict], check_lines: list[str], top: int = 40) -> str:
    """The markdown report: both sides, the check, the kernel table, the classes, the gaps."""
    out = [f"## Kernel diff: {a.label} (A) vs {b.label} (B)", ""]
    for s in (a, b):
        whole = "" if s.marked else " (no step mark: the whole trace)"
        what = "kernels" if s.mode == "gpu" else "CPU ops"
        calls = sum(n for *_, n in s.items)
        out.append(f"- {s.label}: {s.mode} trace, step window {s.span_us / 1e3:.3f} ms{whole}, {calls:,} {what}")
    out += ["", *[f"- check: {x}" for x in check_lines], "", *table(rows, a.mode, top)]
    step = (a.span_us - b.span_us) / 1e3
    out.append(f"| **step** | | | {a.span_us / 1e3:,.3f} | | | {b.span_us / 1e3:,.3f} | | {step:+,.3f} |")
    out += ["", *class_table(rows), "", *gap_table(a), "", *gap_table(b)]
    return "\n".join(out) + "\n"


def compare(
    path_a: str | Path,
    path_b: str | Path,
    labels: tuple[str, str] = ("A", "B"),
    mode: str = "auto",
    step_a: float | None = None,
    step_b: float | None = None,
    top: int = 40,
    gaps: int = 10,
    mark: str = STEP_MARK,
) -> tuple[str, dict]:
    """Both traces read and diffed: the markdown report and the data (rows, check, spans)."""
    a = read_side(path_a, labels[0], mode, mark, gaps)
    b = read_side(path_b, labels[1], a.mode if mode == "auto" else mode, mark, gaps)
    rows = diff_rows(a, b)
    lines, ok = check(a, b, rows, step_a, step_b)
    data = {"rows": rows, "check": lines, "ok": ok, "span_ms": (a.span_us / 1e3, b.span_us / 1e3), "mode": a.mode}
    return render(a, b, rows, lines, top), data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_a")
    p.add_argument("trace_b")
    p.add_argument("--labels", nargs=2, default=["A", "B"])
    p.add_argument("--mode", choices=["auto", "gpu", "cpu"], default="auto", help="cpu: CPU ops stand in for kernels")
    p.add_argument("--step-a", type=float, help="A's measured seconds per step (the check's reference)")
    p.add_argument("--step-b", type=float, help="B's measured seconds per step")
    p.add_argument("--top", type=int, default=40, help="rows shown (the rest are summed in one line)")
    p.add_argument("--gaps", type=int, default=10, help="longest host gaps listed per side")
    p.add_argument("--mark", default=STEP_MARK, help="regex naming the traced step's annotation")
    p.add_argument("--out", type=Path, help="also write the report here (an existing file is refused)")
    p.add_argument("--json", type=Path, help="also write every row as JSON here (an existing file is refused)")
    a = p.parse_args(argv)
    try:
        for dest in (a.out, a.json):
            if dest is not None and dest.exists():
                raise TraceError(f"{dest} exists; kernel_diff never overwrites a file: pass a new path")
        text, data = compare(a.trace_a, a.trace_b, tuple(a.labels), a.mode, a.step_a, a.step_b, a.top, a.gaps, a.mark)
    except TraceError as e:
        print(f"kernel_diff: error: {e}", file=sys.stderr)
        return 2
    print(text, end="")
    if a.out:
        a.out.write_text(text)
    if a.json:
        a.json.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
