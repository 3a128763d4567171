import math

import pytest

from meshforge.config import load_config
from meshforge.config.schedule import decay_start
from meshforge.errors import ConfigError
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


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor_over_the_last_fifth():
    c = cfg("wsd")  # 100 steps: warmup 10, stable to step 80, decay over steps 81-100
    assert [lr_at(c, s) for s in range(10)] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    assert all(lr_at(c, s) == pytest.approx(1e-3) for s in range(10, 80))
    assert lr_at(c, 80) == pytest.approx(1e-3 - 0.9e-3 / 20) and lr_at(c, 99) == pytest.approx(1e-4)
    assert decay_start(c.optim, 100) == 80 and decay_start(cfg("wsd", **{"optim.decay_fraction": 0.5}).optim, 100) == 50
    lrs = [lr_at(c, s) for s in range(80, 100)]
    assert all(a - b == pytest.approx(0.9e-3 / 20) for a, b in zip(lrs, lrs[1:], strict=False))


def test_a_longer_wsd_run_takes_the_same_steps_until_the_shorter_ones_decay():
    """What makes extending a wsd run exact: its steps before the decay do not depend on the end."""
    short, long = cfg("wsd"), cfg("wsd", **{"train.steps": 250})
    assert [lr_at(short, s) for s in range(80)] == [lr_at(long, s) for s in range(80)]
    assert lr_at(short, 80) < lr_at(long, 80) == pytest.approx(1e-3)
    cos_short, cos_long = cfg("cosine"), cfg("cosine", **{"train.steps": 250})  # a cosine's depends on it
    assert lr_at(cos_short, 11) < lr_at(cos_long, 11)


def test_wsd_refuses_decay_steps_which_would_pin_its_decay():
    with pytest.raises(ConfigError, match=r"optim.decay_steps = 50 sets where cosine and linear.*decay_fraction"):
        cfg("wsd", **{"optim.decay_steps": 50})
    with pytest.raises(ConfigError, match=r"optim.decay_fraction = 0 is out of range"):
        cfg("wsd", **{"optim.decay_fraction": 0})
