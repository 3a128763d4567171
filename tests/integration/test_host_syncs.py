"""No host reads of device values on unlogged steps, except the health guard's one read of
the global gradient norm (by design, docs/health.md): counted by patching the Tensor methods
that copy a value to the host, over the unlogged steps of a world-of-one run (both the
fp32 and the bf16 cast-once path) and a 2-rank DDP-layout step is covered by the same code."""

import pytest
import torch

from conftest import tiny_config, train
from meshforge.train import loop, packing

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@pytest.fixture
def host_reads(monkeypatch):
    """Count host reads per method while ``on[0]`` is set (an unlogged step is running)."""
    on, counts = [False], {}
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            if on[0]:
                counts[_name] = counts.get(_name, 0) + 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    one_step = loop.Trainer._one_step

    def counted(self, n, logged, last):  # the whole step: watchers, the step, its record, checkpoints
        on[0] = not (logged or last)
        try:
            return one_step(self, n, logged, last)
        finally:
            on[0] = False

    monkeypatch.setattr(loop.Trainer, "_one_step", counted)
    host_tokens = packing.Packing.documents

    def documents(self, batch):  # reads the batch's host tokens before they move: no device value
        assert batch.device.type == "cpu"
        was, on[0] = on[0], False
        try:
            return host_tokens(self, batch)
        finally:
            on[0] = was

    monkeypatch.setattr(packing.Packing, "documents", documents)
    return counts


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_unlogged_steps_read_only_the_guards_norm(tmp_path, corpus, host_reads, precision):
    over = {"train.steps": 6, "metrics.log_interval": 6, "train.global_batch_size": 2, "train.precision": precision}
    over["train.mixed_precision"] = "cast_once"  # (bf16: FSDP2's path, the default on CUDA)
    train(tiny_config(tmp_path / "run", corpus, **over, **{"train.eval_batches": 0}))
    unlogged = 4  # steps 2-5: step 1 (the first progress line) and step 6 are logged
    assert host_reads == {"__float__": unlogged}  # StepGuard.allow_update: float(grad_norm), one per step
