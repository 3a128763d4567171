"""Training, as parts: see loop.py for how they fit together.

Only ``preflight`` is imported with the package: the launcher of ``train --nproc N`` needs it
and nothing else, and loop.py brings in DCP, DTensor and the models (~2 s of CPU per launch).
The other names load on first use (PEP 562)."""

from meshforge.guards.preflight import preflight

__all__ = ["Trainer", "lr_at", "preflight", "prepare_run_dir", "train"]

_LAZY = {"Trainer": "loop", "train": "loop", "lr_at": "optimizer", "prepare_run_dir": "start"}


def __getattr__(name: str):  # noqa: ANN202
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"meshforge.train.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
