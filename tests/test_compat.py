"""Version differences that compat.py gates: what the run does on each side of the gate."""

import pytest

from meshforge import compat
from meshforge.config import load_config
from meshforge.parallel import parallelize


def _cfg(schedule: str, pp: int = 2):
    overrides = {"parallel.pp": pp, "parallel.pp_schedule": schedule, "model.layers": 4, "train.loss_chunk_size": 512}
    return load_config(None, overrides)


@pytest.mark.parametrize("able", [True, False])
@pytest.mark.parametrize("schedule", ["zero_bubble", "zb", "zbv", "dualpipev", "1f1b", "gpipe"])
def test_the_chunked_loss_yields_to_a_split_backward_only_where_torch_needs_it(monkeypatch, schedule, able):
    monkeypatch.setattr(parallelize, "split_backward_through_custom_functions", lambda: able)
    split = schedule in ("zero_bubble", "zb", "zbv", "dualpipev")
    assert parallelize.loss_chunk_size(_cfg(schedule)) == (512 if able or not split else 0)
    assert parallelize.loss_chunk_size(_cfg(schedule, pp=1)) == 512  # no pipeline: no weight pass


def test_the_gate_follows_the_installed_torch():
    assert compat.split_backward_through_custom_functions() == (compat.TORCH_VERSION >= (2, 13))
