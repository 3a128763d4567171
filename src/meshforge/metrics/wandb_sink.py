"""Optional Weights & Biases sink (``metrics.wandb = true``): the same grouped scalars as
TensorBoard, logged offline into run.dir/wandb (``wandb sync`` uploads them later; no
network during training). ``wandb`` is imported only when this sink is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError


class WandbSink:
    def __init__(self, run_dir: Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "metrics.wandb = true needs the wandb package; pip install wandb, or set metrics.wandb = false"
            ) from None
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project="meshforge", name=run_dir.name, dir=str(run_dir), config=config, mode="offline", reinit=True
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
