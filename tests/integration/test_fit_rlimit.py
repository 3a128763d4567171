"""The fit check against a real memory limit: ``meshforge train`` in a child process whose
RLIMIT_DATA (or RLIMIT_AS) is set just below and just above what the check asks for.

Below, the run is refused with exit 2, naming the limit and the ``ulimit`` that would let it
through; above, it trains to the end with no allocation failure. The model (about 68M
parameters, ~1.0 GiB of fp32 weights, gradients and Adam state) makes the estimate, not the
process's Python and torch, the bulk of the limit. RLIMIT_DATA is the limit that counts memory
(what a process allocates); RLIMIT_AS counts address space (libraries, each thread's malloc
arena), so the check asks more of it. Without the check reading the limit, the level below is
not refused: the run trains (RLIMIT_DATA: measured to need 1.43-1.45 GiB of a 1.53 GiB limit)
or dies of the allocation failure.
"""

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from conftest import cli_args, tiny_config, tiny_overrides
from meshforge.guards import memory_fit as fit
from meshforge.resolve import resolve

GIB = 2**30
MODEL = {
    "model.hidden": 1024,
    "model.layers": 4,
    "model.heads": 8,
    "model.kv_heads": 8,
    "model.ffn_hidden": 4096,
    "train.seq_len": 32,
    "train.global_batch_size": 1,
    "train.steps": 2,
    "train.eval_batches": 1,
}
OOM = ("can't allocate memory", "MemoryError", "Cannot allocate memory")

pytestmark = pytest.mark.slow


def _train_under(which: str, limit: int, run_dir, corpus) -> subprocess.CompletedProcess:
    """``meshforge train`` of MODEL with the rlimit ``which`` set to ``limit`` bytes in the child only."""

    def bound() -> None:
        resource.setrlimit(getattr(resource, which), (limit, limit))

    env = {k: v for k, v in os.environ.items() if k != fit.AVAILABLE_ENV}
    env["OMP_NUM_THREADS"] = "2"  # what the limit counts of torch's threads, the same on every machine
    args = [sys.executable, "-m", "meshforge", "train", *cli_args(tiny_overrides(run_dir, corpus, **MODEL))]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, preexec_fn=bound)


@pytest.mark.parametrize(("which", "shell"), [("RLIMIT_DATA", "ulimit -d"), ("RLIMIT_AS", "ulimit -v")])
def test_a_limit_just_above_the_check_trains_and_just_below_it_is_refused(tmp_path, corpus, which, shell):
    plan = resolve(tiny_config(tmp_path / "x", corpus, **MODEL), 1)
    estimate = fit.estimate_run(plan, fit.device_memory(False)).estimate.memory["total"] * GIB
    assert estimate > 1.2 * GIB  # the model, not the interpreter, fills the limit

    refused = _train_under(which, int(0.98 * estimate), tmp_path / "refused", corpus)
    assert refused.returncode == 2, refused.stderr[-3000:]
    err = refused.stderr
    assert "cannot fit" in err and f"a rank may use under {which} ({shell})" in err, err[-3000:]
    assert not (tmp_path / "refused").exists() and not any(m in err for m in OOM)
    # the fix names the smallest limit the check lets through: never less than the estimate
    (kib,) = re.findall(rf"`{shell} (\d+)`", err)
    passes = int(kib) * 1024
    assert passes >= estimate
    if which == "RLIMIT_DATA":  # Python and torch hold less than the estimate's reserve for them
        assert passes == pytest.approx(estimate, rel=0.01)

    ran = _train_under(which, int(1.02 * passes), tmp_path / "run", corpus)
    assert ran.returncode == 0 and not any(m in ran.stderr for m in OOM), ran.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
