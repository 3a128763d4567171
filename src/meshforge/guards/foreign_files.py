"""What meshforge writes into a run directory, so that it never writes over what it did not.

A run directory holds config.toml, metrics.jsonl, events.jsonl, summary.json, report.html,
hang_report.json, pipeline_timeline.json, run.lock and the folders checkpoints/, tensorboard/,
profile/, final/, final-hf/, wandb/ and memory/ (docs/running.md). A directory that is not already one of
meshforge's runs and holds anything else -- or a config.toml meshforge did not write -- belongs
to someone else: ``meshforge train`` refuses it as run.dir unless run.overwrite is set. Files
added to a run afterwards are left alone (meshforge writes and removes only its own names), and
``report``/``convert``/``calibrate``/``plan`` never write over a run's own files.
"""

from __future__ import annotations

import re
from pathlib import Path

from meshforge.safeio.links import check_entry, refuse_links

RUN_FILES = frozenset(
    {
        *("config.toml", "metrics.jsonl", "events.jsonl", "summary.json", "report.html"),
        *("hang_report.json", "pipeline_timeline.json", "run.lock"),
    }
)
RUN_DIRS = frozenset({"checkpoints", "tensorboard", "profile", "final", "final-hf", "wandb", "memory"})
# leftovers of a write cut short: the disk probe, the report's and meta.json's temporary files
_LEFTOVER = re.compile(r"^\.(meshforge-write-probe-[^/]*|report\.html\.part)$")
_CHECKPOINT = re.compile(r"^(\.tmp-)?step-\d+$")
CONFIG_HEAD = "# resolved by meshforge"  # config.toml's first line (run_plan.RunPlan.to_toml)


def foreign_entries(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` meshforge did not write (relative names, sorted); [] for a
    directory that does not exist, is empty, or holds only a run's files."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    out = []
    for entry in run_dir.iterdir():
        name = entry.name
        if name in RUN_DIRS and entry.is_dir() and not entry.is_symlink():
            if name == "checkpoints":
                out += [f"checkpoints/{c.name}" for c in entry.iterdir() if not _CHECKPOINT.match(c.name)]
        elif name == "config.toml" and entry.is_file() and not entry.is_symlink():
            if not _is_runs_config(entry):
                out.append(name)
        elif not ((name in RUN_FILES and entry.is_file() and not entry.is_symlink()) or _LEFTOVER.match(name)):
            out.append(name + ("/" if entry.is_dir() else ""))
    return sorted(out)


def refuse_links_in_run(run_dir: Path) -> None:
    """Refuse (LinkRefused, exit 2, naming it) a symbolic link, FIFO, device or socket at any name
    meshforge writes or removes in ``run_dir`` or below its folders (``checkpoints/.tmp-step-4 ->
    /elsewhere`` would have the next save write there; ``config.toml -> ~/notes`` would be
    overwritten): before anything is written. wandb/ is wandb's own (its runs hold links)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    names = (RUN_FILES - {"run.lock"}) | RUN_DIRS | {e.name for e in run_dir.iterdir() if _LEFTOVER.match(e.name)}
    fix = "remove it (or move it away) and run again, or choose another run.dir"
    refuse_links(run_dir, names - {"wandb"}, fix)
    check_entry(run_dir / "wandb", fix)  # (run.lock: guards/run_lock.py refuses a link there itself)


def _is_runs_config(path: Path) -> bool:
    """A config.toml meshforge wrote: its first line says so (older versions wrote none, but
    always beside events.jsonl)."""
    try:
        with path.open("rb") as f:
            head = f.read(len(CONFIG_HEAD))
    except OSError:
        return False
    return head == CONFIG_HEAD.encode() or (path.parent / "events.jsonl").is_file()


def is_meshforge_run(path: Path) -> bool:
    """Whether ``path`` holds a run meshforge wrote (its config.toml): files added there later are
    left alone, never refused (a resume must not be turned away by a README beside it)."""
    cfg = Path(path) / "config.toml"
    return cfg.is_file() and not cfg.is_symlink() and _is_runs_config(cfg)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a directory holding a run (its metrics or events)."""
    return Path(path).is_dir() and any((Path(path) / n).is_file() for n in ("events.jsonl", "metrics.jsonl"))


def owning_run(path: Path) -> Path | None:
    """The run directory ``path`` belongs to as one of the run's own files (config.toml,
    metrics.jsonl, a checkpoint ...), else None; the run's report.html is not counted."""
    path = Path(path).absolute()
    for parent in path.parents:
        if is_run_dir(parent):
            first = path.relative_to(parent).parts[0]
            if first in RUN_DIRS or (first in RUN_FILES and first != "report.html"):
                return parent
            return None
    return None
