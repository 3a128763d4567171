import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from meshforge.config import load_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def pytest_collection_modifyitems(config, items):
    """CUDA tests run on a GPU machine (bench/gpu/run.sh); elsewhere they are skipped, saying why.
    Under pytest-xdist (README's ``-n 2 --dist loadfile``) the files with the most slow tests go
    first, so that the workers end together instead of one idling while the other runs a heavy
    file it was handed last."""
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow: dict[str, int] = {}
        for item in items:
            slow[str(item.path)] = slow.get(str(item.path), 0) + ("slow" in item.keywords)
        items.sort(key=lambda item: -slow[str(item.path)])  # stable: each file's own order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); run bench/gpu/run.sh on one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Where ATEN_CPU_CAPABILITY forces a capability (scripts/every_cpu.py), torch's inductor still
# generates code for the CPU it runs on, and some of it cannot run or compile under the forced
# one: the limits of the emulation, not meshforge's. A test failing with one of these is skipped
# under that emulation only, with the reason; on a CPU's own capability it stays a failure.
EMULATION_LIMITS = (
    "pack_vnni2 is only supported when avx512 is supported",  # AMX GEMM code under avx2 / default
    "CppCompileError",  # vector C++ for the real CPU under `default`
    "C++ compile error",
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").strip()
    if forced and report.failed and call.excinfo is not None:
        text = str(report.longrepr)
        limit = next((s for s in EMULATION_LIMITS if s in text), None)
        if limit:
            report.outcome = "skipped"
            reason = f"torch's emulation limit under ATEN_CPU_CAPABILITY={forced}: {limit}"
            report.longrepr = (str(item.path), item.location[1] or 0, reason)
    return report


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
    """Keep corpora and the CPU calibration out of the user's ~/.cache."""
    cache = tmp_path_factory.mktemp("meshforge-cache")
    old = os.environ.get("MESHFORGE_CACHE")
    os.environ["MESHFORGE_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("MESHFORGE_CACHE", None)
    else:
        os.environ["MESHFORGE_CACHE"] = old


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small text corpus: a few real Python sources (about 300 KB)."""
    d = tmp_path_factory.mktemp("corpus")
    for name in ("argparse.py", "dataclasses.py", "difflib.py", "textwrap.py", "json/decoder.py"):
        src = STDLIB / name
        shutil.copy(src, d / src.name)
    return d


U32 = 2.0**-24  # fp32's unit round-off


def reorder_bound(terms: int, magnitude: float) -> float:
    """How far apart two fp32 sums of the same ``terms`` terms can land when added in different
    orders (another layout, another CPU's kernels): each is within γ_n·Σ|x| ≈ n·u·Σ|x| of the
    exact sum (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2), so the two are
    within twice that. ``magnitude`` is Σ|x|, the sum of the terms' absolute values."""
    return 2 * terms * U32 * magnitude


def assert_as_exact_as(got, ref, exact, margin: float = 4.0, msg: str = "") -> None:
    """``got`` (an fp32 path under test) is within ``margin`` × the fp32 reference's own error of
    the exact (fp64) result. Both compute one function with fp32 sums in their own orders, so
    their errors are of one size on any CPU; the margin covers the largest of many elements. A
    path that computes something else is off by far more than round-off."""
    ref_err = float((ref.double() - exact).abs().max())
    bound = margin * ref_err + 4 * U32 * float(exact.abs().max())  # a floor for a bit-exact ref
    err = float((got.double() - exact).abs().max())
    assert err <= bound, f"{msg} off the exact result by {err:.2e}; the fp32 reference by {ref_err:.2e}"


# Adam's ε for the test runs. A layout sums fp32 gradients in another order than the single
# process, and so does another CPU: each gradient element differs by δg (here at most 7.5e-9 for
# gradients up to 2e-2, about 6 ulp of the largest). Adam's first update lr·g/(|g|+ε) has slope
# lr·ε/(|g|+ε)² ≤ lr/ε at g = 0, so with torch's ε = 1e-8 an element whose true gradient is ~0
# (a sum that cancels) moves by up to ±lr on one side and not the other: weights then differ
# by ~lr in single elements and the later losses and gradient norms by ~1e-5 relative, which is
# what failed on an AVX-512 Xeon. With ε = 1e-4 the same δg moves one step's update by at most
# 3.8e-8 at lr 3e-3 (tests/unit/test_tolerances.py measures it), so S steps differ by ≲ S·4e-8 per
# element: far inside the 1e-6 / 1e-5 the equivalence tests allow. The gradients of the tiny
# model are 1e-4 to 2e-2, so Adam still normalises them and a wrong gradient still shows.
ADAM_EPS = 1e-4


def tiny_overrides(run_dir: Path, corpus: Path, **extra) -> dict:
    """A run that takes a second or two on CPU."""
    o = {
        "optim.eps": ADAM_EPS,
        "model.hidden": 64,
        "model.layers": 2,
        "model.heads": 4,
        "model.kv_heads": 2,
        "model.ffn_hidden": 128,
        "train.steps": 8,
        "train.seq_len": 32,
        "train.global_batch_size": 8,
        "train.eval_batches": 2,
        "data.path": str(corpus),
        "run.dir": str(run_dir),
        "metrics.log_interval": 1,
        "metrics.console": False,
    }
    o.update(extra)
    return o


def tiny_config(run_dir: Path, corpus: Path, **extra):
    return load_config(None, tiny_overrides(run_dir, corpus, **extra))


def rank_plan(cfg):
    """This rank's run plan as ``meshforge train`` gives it, without the command line around it
    (no run lock, no report): rank 0's pre-flight, with run.dir prepared; a plain-torchrun
    follower's plan on the other ranks (rank 0 tells them run.dir and the checkpoint)."""
    from meshforge.guards.preflight import follower_plan, preflight
    from meshforge.launch import env
    from meshforge.train.run_dir import prepare_run_dir

    if env.rank() != 0:
        return follower_plan(cfg, env.world_size())
    plan = preflight(cfg, env.world_size())
    prepare_run_dir(plan)
    return plan


def train(cfg, stream=None) -> dict:
    """Train ``cfg`` on this rank as one rank of ``meshforge train`` does (``rank_plan``, then
    train/loop.py's ``train``, which takes only a plan); returns the summary."""
    from meshforge.train.loop import train as train_plan

    return train_plan(rank_plan(cfg), stream)


def cli_args(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        v = str(v).lower() if isinstance(v, bool) else v
        out.append(f"--{k}={v}")
    return out


# Failures of the local rendezvous itself (a port taken between being picked and bound),
# not of meshforge: a multi-rank launch that dies of one of these is started once more.
_LAUNCH_ERRORS = (
    "EADDRINUSE",
    "Address already in use",
    "DistNetworkError",
    "RendezvousConnectionError",
    "RendezvousTimeoutError",
)


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    cmd = [sys.executable, "-m", "meshforge", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    if r.returncode and "--nproc" in args and any(m in r.stderr for m in _LAUNCH_ERRORS):
        print(f"rendezvous failure, launching once more:\n{r.stderr[-2000:]}", file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    return r


def assert_run_matches(reference: Path, run: Path, steps: int) -> None:
    """A parallel run against the single-process one from the same weights and data:
    losses, grad norms (with clipping active), val loss and final weights to 1e-5."""
    import json

    def metrics(d: Path) -> list[dict]:
        return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]

    ref, got = metrics(reference), metrics(run)
    assert len(got) == steps
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [g["grad_norm"] for g in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5)
    assert all(r["grad_norm"] > 0.5 for r in ref)  # clipping was active
    val = [json.loads((d / "summary.json").read_text())["val_loss"] for d in (reference, run)]
    assert val[0] is not None and val[1] == pytest.approx(val[0], rel=1e-5)
    assert_same_weights(reference, run)  # per tensor, norm-relative (see its docstring)


def assert_same_weights(ref_dir: Path, got_dir: Path, rtol: float = 1e-5) -> None:
    """The final weights of two runs agree per tensor as ||w_got - w_ref|| / ||w_ref|| < rtol.

    Not per element: a layout changes the order of fp32 sums, so a gradient whose true value
    is ~0 can come out with either sign, and Adam turns it into a full step of size lr in
    either direction. A few single elements then differ by ~lr even though the runs agree
    everywhere else (this made a per-element test fail at random). A real error -- a wrong
    gradient scale, a missing reduction, a rank on other data -- moves whole tensors.
    """
    from meshforge.checkpoint.weights import load_weights

    a = load_weights(ref_dir / "final").state_dict()
    b = load_weights(got_dir / "final").state_dict()
    assert a.keys() == b.keys()
    for k in a:
        err = float((b[k] - a[k]).norm() / a[k].norm())
        assert err < rtol, f"{k}: relative error {err:.2e} >= {rtol:.0e}"


def layout_runner(tmp_path_factory, corpus: Path, layouts: dict, common: dict):
    """``get(name)``: train layout ``name`` = (ranks, overrides) once per module through the
    CLI on top of ``common``, and return its run directory."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            nproc, extra = layouts[name]
            d = tmp_path_factory.mktemp(name) / "run"
            r = run_cli("train", "--nproc", str(nproc), *cli_args(tiny_overrides(d, corpus, **common, **extra)))
            assert r.returncode == 0, r.stderr[-4000:]
            runs[name] = d
        return runs[name]

    return get


def reference_runner(tmp_path_factory, corpus: Path, layouts: dict, common: dict, **extra):
    """``get(name)``: the single-process run for layout ``name``'s model variant (its model.*
    overrides) on top of ``common`` and ``extra``, trained once per variant per module."""
    runs: dict[tuple, Path] = {}

    def get(name: str) -> Path:
        model = {k: v for k, v in layouts[name][1].items() if k.startswith("model.")}
        key = tuple(sorted(model.items()))
        if key not in runs:
            d = tmp_path_factory.mktemp("ref") / "run"
            train(tiny_config(d, corpus, **common, **model, **extra))
            runs[key] = d
        return runs[key]

    return get


def assert_convert_both_ways(hf, hf_cls, tmp_path: Path, vocab: int) -> None:
    """``meshforge convert --from-hf`` then ``--to-hf`` on a saved transformers model: both
    conversions give the original logits to 1e-4 (fp32)."""
    import torch

    from meshforge.checkpoint.weights import load_weights

    hf.save_pretrained(tmp_path / "hf")
    r = run_cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mf"))
    assert r.returncode == 0, r.stderr
    ours = load_weights(tmp_path / "mf")
    r = run_cli("convert", "--to-hf", str(tmp_path / "mf"), "--out", str(tmp_path / "hf2"))
    assert r.returncode == 0, r.stderr
    back = hf_cls.from_pretrained(tmp_path / "hf2").eval()
    x = torch.randint(0, vocab, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-4, rtol=0)


def cached_cpu_peak(cache: Path, **entry) -> None:
    """Write ``cache``/cpu_peak.json holding one fp32 entry for this machine (``entry`` overrides)."""
    import json
    import time

    import torch

    from meshforge.metrics import cpu_peak

    e = {"flops": 1e6, "measured_at": time.time(), "machine": cpu_peak.machine_fingerprint(), **entry}
    key = cpu_peak._key(torch.float32)
    (cache / "cpu_peak.json").write_text(json.dumps({"version": cpu_peak.VERSION, "entries": {key: e}}))


def rendezvous() -> str:
    """An init_method for ranks a test spawns itself: a file store in a fresh directory. A port
    picked free and released could be taken by the other xdist worker's ranks before rank 0
    listened (EADDRINUSE, seen once in a full run)."""
    return f"file://{tempfile.mkdtemp(prefix='meshforge-rdzv-')}/store"
