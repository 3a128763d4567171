"""Who is holding the others up: the hang report from every rank's last collectives.

Each rank posts (through the rendezvous store) the last collective it entered and completed
on every mesh axis. On an axis where some ranks entered collective number N and others did
not, the ones that did not are lagging: the others wait for them inside N. Ranks that did
not answer at all are lagging too. When every rank entered the same collective, none is
behind in the collective order; then the ranks on the oldest step are named.
"""

from __future__ import annotations

from typing import Any


def build_report(posts: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    """The ``hang`` event / hang_report.json from ``posts`` (rank -> what it posted)."""
    silent = [r for r in range(world) if r not in posts]
    behind: dict[int, dict[str, Any]] = {}
    for axis in sorted({a for p in posts.values() for a in p.get("collectives", {})}):
        seen = {r: p["collectives"][axis] for r, p in posts.items() if axis in p.get("collectives", {})}
        if "entered" not in next(iter(seen.values())):
            continue
        top = max(s["entered"] for s in seen.values())
        waiting = sorted(r for r, s in seen.items() if s["entered"] == top and s["completed"] < top)
        for r, s in seen.items():
            if s["entered"] < top and waiting and r not in behind:
                op = seen[waiting[0]]["op"]
                behind[r] = {"axis": axis, "op": op, "seq": top, "entered": s["entered"], "waiting_ranks": waiting}
    lagging = sorted(set(behind) | set(silent))
    if not lagging and posts:
        oldest = min(p["step"] for p in posts.values())
        lagging = sorted(r for r, p in posts.items() if p["step"] == oldest)
    first = behind[min(behind)] if behind else {}
    return {
        "lagging_ranks": lagging,
        "silent_ranks": silent,
        "collective": first.get("op"),
        "axis": first.get("axis"),
        "seq": first.get("seq"),
        "waiting_ranks": first.get("waiting_ranks", []),
        "hosts": {r: posts[r]["host"] for r in lagging if r in posts},
        "behind": {str(r): b for r, b in behind.items()},
        "ranks": {str(r): p for r, p in sorted(posts.items())},
    }


def describe(report: dict[str, Any], timeout_s: float) -> str:
    """The one console line."""
    where = (
        f" (not in {report['collective']} #{report['seq']} on axis {report['axis']})" if report["collective"] else ""
    )
    return (
        f"warning: hang: no step finished for {timeout_s:g}s; lagging rank(s) {report['lagging_ranks']}{where}; "
        "wrote hang_report.json, exiting so --max-restarts can restart from the last checkpoint"
    )
