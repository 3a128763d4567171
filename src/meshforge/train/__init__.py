"""Training, as parts: see loop.py for how they fit together.

Nothing is imported with the package: loop.py brings in DCP, DTensor and the models (~2 s of
CPU). The names load on first use (PEP 562)."""

__all__ = ["Trainer", "lr_at", "prepare_run_dir", "train"]

_LAZY = {"Trainer": "loop", "train": "loop", "lr_at": "optimizer", "prepare_run_dir": "run_dir"}


def __getattr__(name: str):  # noqa: ANN202
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"meshforge.train.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
