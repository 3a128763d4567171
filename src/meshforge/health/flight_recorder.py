"""PyTorch's flight recorder, wrapped in one place (its dump functions are private).

With ``TORCH_FR_BUFFER_SIZE`` set before the process group starts, c10d keeps a ring buffer
of the last collectives of every group, gloo and NCCL alike, with a per-group sequence
number and, per group, the last one enqueued (entered) and completed. That is the hang
watchdog's always-on bookkeeping: kept in C++, nothing on the Python hot path.
"""

from __future__ import annotations

import json
from typing import Any

ENV = ("TORCH_FR_BUFFER_SIZE", "2000")  # set (if unset) before the process group starts


def last_collectives(axis_of_group: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per process group (by its mesh axis, else its name): the last collective this rank
    entered and completed (sequence numbers) and the entered one's operation."""
    try:
        import torch._C._distributed_c10d as c10d  # private: read here only

        dump = json.loads(c10d._dump_fr_trace_json(True, True))
    except Exception as e:  # noqa: BLE001 - a hang report without this is still a report
        return {"error": {"message": f"flight recorder unavailable: {type(e).__name__}: {e}"}}
    ops: dict[str, dict[int, str]] = {}
    for e in dump.get("entries", []):
        name = str(e["process_group"][0])
        ops.setdefault(name, {})[int(e["collective_seq_id"])] = str(e["profiling_name"]).split(":")[-1]
    out: dict[str, dict[str, Any]] = {}
    for name, st in dump.get("pg_status", {}).items():
        entered, completed = int(st["last_enqueued_collective"]), int(st["last_completed_collective"])
        axis = axis_of_group.get(name, "world" if name == "0" else f"group {name}")
        out[axis] = {"entered": entered, "completed": completed, "op": ops.get(name, {}).get(entered)}
    return out
