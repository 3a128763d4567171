"""The hang watchdog: a thread per rank that notices when no step has started for
``health.hang_timeout_s``, and then never waits forever.

The loop's only cost is ``beat(step)`` (two attribute writes). When it fires, each rank posts
its last collectives (flight_recorder.py) to the rendezvous store -- not a collective: the
group is stuck -- waits a short grace for the others' posts, and one rank (the first to
claim it) writes hang_report.json and the ``hang`` event; rank 0 prints one warning line.
Then every rank exits with HANG_EXIT, so the elastic agent restarts the group from the last
checkpoint (``--max-restarts``) or the run ends non-zero.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshforge.health.flight_recorder import last_collectives
from meshforge.health.hang_report import build_report, describe

HANG_EXIT = 3
KEY = "meshforge/health/hang"
FIRED = threading.Event()  # set when this process's watchdog has fired: it will exit with HANG_EXIT


def rendezvous_store() -> Any:
    """The default group's store (private API; wrapped here only)."""
    return dist.distributed_c10d._get_default_store()


class HangWatchdog:
    """Start with ``start()``; the loop calls ``beat(step)`` as each step starts; ``stop()`` at the end."""

    def __init__(self, timeout_s: float, rank: int, world: int, axis_of_group: dict[str, str], run_dir: Path):
        self.timeout_s, self.rank, self.world, self.run_dir = timeout_s, rank, world, run_dir
        self.axis_of_group = axis_of_group
        self.grace_s = min(30.0, max(5.0, timeout_s / 2))
        self.step, self.beats, self.last = 0, 0, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshforge-hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()
        self.beats += 1

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            # armed once the first step is done (it may compile or warm caches for long)
            if self.beats >= 2 and time.monotonic() - self.last > self.timeout_s:
                self.fire()
                return

    def fire(self) -> None:
        """Post, gather, report, exit. Store errors (its host may be gone) do not stop the exit."""
        FIRED.set()
        stalled = time.monotonic() - self.last
        mine = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "step": self.step}
        mine.update(stalled_s=round(stalled, 1), collectives=last_collectives(self.axis_of_group))
        try:
            store = rendezvous_store()
            store.set(f"{KEY}/{self.rank}", json.dumps(mine))
            report = build_report(self._gather(store), self.world)
            report.update(time=time.time(), timeout_s=self.timeout_s, step=self.step, reported_by=self.rank)
            if self.rank == 0:
                print(f"meshforge: {describe(report, self.timeout_s)}", file=sys.stderr, flush=True)
            if store.add(f"{KEY}/writer", 1) == 1:
                self._write(report)
            self._leave_together(store, len(report["ranks"]))
        except Exception as e:  # noqa: BLE001 - whatever happens, do not wait forever
            print(f"meshforge: hang on rank {self.rank} at step {self.step}; report failed: {e}", file=sys.stderr)
        finally:
            os._exit(HANG_EXIT)

    def _leave_together(self, store: Any, posted: int) -> None:
        """Exit when every rank that posted is done (the report written), so that no rank's
        exit tears the connections down under another still writing."""
        store.add(f"{KEY}/done", 1)
        deadline = time.monotonic() + self.grace_s
        while store.add(f"{KEY}/done", 0) < posted and time.monotonic() < deadline:
            time.sleep(0.1)

    def _gather(self, store: Any) -> dict[int, dict[str, Any]]:
        """Every rank's post that arrives within the grace period."""
        posts: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.grace_s
        while True:
            for r in range(self.world):
                if r not in posts and store.check([f"{KEY}/{r}"]):
                    posts[r] = json.loads(store.get(f"{KEY}/{r}"))
            if len(posts) == self.world or time.monotonic() > deadline:
                return posts
            time.sleep(0.2)

    def _write(self, report: dict[str, Any]) -> None:
        (self.run_dir / "hang_report.json").write_text(json.dumps(report, indent=1))
        event = {"time": report["time"], "event": "hang", "step": self.step, "lagging_ranks": report["lagging_ranks"]}
        event.update({k: report[k] for k in ("collective", "axis", "seq", "waiting_ranks", "hosts")})
        with (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps(event) + "\n")
