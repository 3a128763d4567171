import math

import pytest

from meshforge.config import load_config
from meshforge.resolve import resolve
from meshforge.train import lr_at


def cfg(schedule, **extra):
    return resolve(
        load_config(
            None,
            {
                "train.steps": 100,
                "optim.lr": 1e-3,
                "optim.warmup_steps": 10,
                "optim.min_lr_ratio": 0.1,
                "optim.schedule": schedule,
                **extra,
            },
        )
    )


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_linear_warmup_reaches_peak(schedule):
    c = cfg(schedule)
    assert [lr_at(c, s) for s in range(10)] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert lr_at(c, 10) == pytest.approx(1e-3)


def test_cosine_and_linear_decay_to_the_floor():
    c, lin = cfg("cosine"), cfg("linear")
    mid = 10 + 45
    assert lr_at(c, mid) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(lin, mid) == pytest.approx(1e-3 - 0.9e-3 * 0.5)
    for sched in (c, lin):
        assert lr_at(sched, 100) == pytest.approx(1e-4)
        assert lr_at(sched, 500) == pytest.approx(1e-4)  # stays at the floor past the end
        lrs = [lr_at(sched, s) for s in range(10, 101)]
        assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lr_at(cfg("constant"), 99) == pytest.approx(1e-3)


def test_decay_steps_shorter_than_the_run():
    c = cfg("linear", **{"optim.decay_steps": 50})
    assert lr_at(c, 50) == pytest.approx(1e-4) and lr_at(c, 80) == pytest.approx(1e-4)
