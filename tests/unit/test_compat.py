"""Version differences that compat.py gates: what the run does on each side of the gate."""

import os
import subprocess
import sys

import pytest

from meshforge import compat
from meshforge.config import load_config
from meshforge.config.run_plan import World
from meshforge.resolve import resolve


def _plan(schedule: str, able: bool, pp: int = 2):
    over = {"parallel.pp": pp, "parallel.pp_schedule": schedule, "model.layers": 4, "train.loss_chunk_size": 512}
    if schedule in ("zbv", "dualpipev"):
        over["parallel.pp_virtual_stages"] = 2
    world = World(size=pp, device="cpu", split_backward_custom_functions=able)
    return resolve(load_config(None, over), world=world)


@pytest.mark.parametrize("able", [True, False])
@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev", "1f1b", "gpipe"])
def test_the_chunked_loss_yields_to_a_split_backward_only_where_torch_needs_it(schedule, able):
    from meshforge.parallel.pipeline.schedules import SCHEDULES

    if schedule not in SCHEDULES:
        pytest.skip(f"{schedule} is not in this torch")
    split = schedule in ("zero_bubble", "zbv", "dualpipev")
    plan = _plan(schedule, able)
    assert plan.train.loss_chunk_size == (512 if able or not split else 0)
    changed = [c.key for c in plan.changes]
    assert changed == ([] if able or not split else ["train.loss_chunk_size"])  # recorded, with its reason
    assert _plan(schedule, able, pp=1).train.loss_chunk_size == 512  # no pipeline: no weight pass


def test_the_gate_follows_the_installed_torch():
    assert compat.split_backward_through_custom_functions() == (compat.TORCH_VERSION >= (2, 13))


@pytest.mark.parametrize(
    "env, want",
    [
        ({"ATEN_CPU_CAPABILITY": "avx2"}, "_avx2"),  # a forced capability: its own cache
        ({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/x/mine"}, "/x/mine"),  # the user's kept
        ({}, None),  # the CPU's own: torch's default cache
    ],
)
def test_inductor_cache_is_kept_apart_per_forced_capability(env, want):
    """torch keys its inductor cache by neither; code cached under one capability crashed under another."""
    base = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    code = "import os, meshforge; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    got = out.stdout.strip()
    assert (got == "None") if want is None else got.endswith(want), got
