"""Training, as parts: see loop.py for how they fit together."""

from meshforge.train.loop import Trainer, train
from meshforge.train.optimizer import lr_at
from meshforge.train.preflight import preflight
from meshforge.train.start import prepare_run_dir

__all__ = ["Trainer", "lr_at", "preflight", "prepare_run_dir", "train"]
