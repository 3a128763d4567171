"""Train several tiny layouts one after another in the same 2 ranks (one launch, one torch
import: the memory-equality test's runs cost seconds, not a launch each).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/memory_runs_worker.py OUT CORPUS NAME=K=V,K=V ...

Each NAME trains the debug preset for 2 steps (logging each) into OUT/NAME with its overrides.
"""

import json
import os
import sys

from conftest import train
from meshforge.config import load_config

COMMON = {
    "model.preset": "debug",
    "train.steps": 2,
    "train.seq_len": 32,
    "train.global_batch_size": 4,
    "train.eval_batches": 0,
    "metrics.log_interval": 1,
    "metrics.console": False,
    "metrics.tensorboard": False,
    "metrics.report": False,
    "checkpoint.save_final": False,
}


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(out: str, corpus: str, runs: list[str]) -> None:
    base = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    for spec in runs:
        name, _, rest = spec.partition("=")
        overrides = {k: _value(v) for k, v in (kv.split("=", 1) for kv in rest.split(",") if kv)}
        # a fresh store prefix per run: the previous run's group keys must not be read back
        os.environ["TORCHELASTIC_RUN_ID"] = f"{base}-{name}"
        cfg = load_config(None, {**COMMON, **overrides, "data.path": corpus, "run.dir": os.path.join(out, name)})
        train(cfg)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
