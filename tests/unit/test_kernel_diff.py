"""bench/gpu/kernel_diff.py: the kernel-by-kernel diff of two one-step traces. A synthetic GPU
trace pair with every time known (clipping, overlap, gaps, GEMM shapes, name normalization,
the check), and real CPU torch.profiler traces of two different tiny models (CPU ops stand in
for kernels)."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
from kernel_diff import GAPS, OVERLAP, compare, exclusive_pieces, main, normalize  # noqa: E402

from meshforge.models.llama import build_model  # noqa: E402
from meshforge.models.shape import ModelShape  # noqa: E402

ADD = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
    "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)"
)
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"


def ev(cat, name, ts, dur, ext=None, dims=None, tid=1, corr=None):
    args = {} if ext is None else {"External id": ext}
    if corr is not None:
        args["correlation"] = corr
    if dims is not None:
        args["Input Dims"] = dims
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


def side_a():
    """Step window [0, 120]: the annotation ends at 100, the last kernel launched in it at 120."""
    return [
        ev("user_annotation", "meshforge step 7", 0, 100),
        ev("cpu_op", "aten::mm", 5, 4, ext=1, dims=[[4, 8], [8, 16]]),
        ev("cpu_op", "aten::add", 35, 3, ext=2),
        ev("cpu_op", "aten::item", 48, 10, ext=9),
        ev("cpu_op", "aten::add", 58, 1, ext=3),
        ev("kernel", "void prev_step_kernel()", -20, 25, tid=7),  # clipped to [0, 5]
        ev("kernel", GEMM, 10, 30, ext=1, tid=7),
        ev("kernel", ADD, 40, 10, ext=2, tid=7),
        ev("kernel", ADD, 60, 10, ext=3, tid=7),
        ev("kernel", "triton_poi_fused_add_mul_0", 70, 20, tid=7),
        ev("kernel", "triton_poi_fused_add_mul_1", 80, 40, tid=8),  # a second stream: overlaps 10
    ]


def side_b():
    return [
        ev("user_annotation", "peer step", 1000, 80),
        ev("cpu_op", "aten::mm", 1002, 4, ext=11, dims=[[4, 8], [8, 16]]),
        ev("kernel", GEMM, 1010, 20, ext=11, tid=7),
        ev("kernel", ADD, 1030, 10, tid=7),
        ev("cuda_runtime", "cudaLaunchKernel", 1070, 2, corr=77),  # launched in the step, runs after its host side
        ev("kernel", "void optimizer_tail()", 1085, 5, tid=7, corr=77),
        ev("cuda_runtime", "cudaLaunchKernel", 1095, 2, corr=78),
        ev("kernel", "void later_kernel()", 1100, 5, tid=7, corr=78),  # launched after the step: not in it
    ]


def write(tmp_path, name, events):
    p = tmp_path / name
    p.write_text(json.dumps({"traceEvents": events}))
    return p


def rows_by_key(data):
    return {r["key"]: r for r in data["rows"]}


def test_normalize_kernel_names():
    assert normalize(ADD) == "vectorized_elementwise_kernel<4, CUDAFunctor_add<float> >"
    assert normalize("triton_red_fused__to_copy_mean_pow_12") == "triton_red_fused__to_copy_mean_pow"
    assert normalize("void (anonymous namespace)::softmax_warp_forward<float>(float*)") == (
        "softmax_warp_forward<float>"
    )
    assert normalize(GEMM) == GEMM


def test_synthetic_pair_every_time_known(tmp_path):
    a, b = write(tmp_path, "a.json", side_a()), write(tmp_path, "b.json", side_b())
    text, data = compare(a, b, ("meshforge", "peer"))
    rows = rows_by_key(data)
    assert data["mode"] == "gpu" and data["span_ms"] == (0.12, 0.09)
    gemm = f"{GEMM} [aten::mm 4x8 8x16]"
    assert rows[gemm]["calls"] == (1, 1) and rows[gemm]["us"] == (30, 20)
    add = "vectorized_elementwise_kernel<4, CUDAFunctor_add<float> >"
    assert rows[add]["calls"] == (2, 1) and rows[add]["us"] == (20, 10)
    assert rows["triton_poi_fused_add_mul"]["calls"] == (2, 0) and rows["triton_poi_fused_add_mul"]["us"] == (60, 0)
    assert rows["prev_step_kernel"]["us"] == (5, 0) and rows["optimizer_tail"]["us"] == (0, 5)
    assert "later_kernel" not in rows
    assert rows[GAPS]["us"] == (15, 55)  # A: [5, 10] and [50, 60]; B: [1000, 1010] and [1040, 1085]
    assert rows[OVERLAP]["us"] == (-10, 0)
    diffs = [r["diff_us"] for r in data["rows"]]
    assert diffs == sorted(diffs, reverse=True) and diffs[0] == 60  # largest A - B first
    assert sum(diffs) == 30 and sum(r["us"][0] for r in data["rows"]) == 120  # the rows add up to the step
    assert data["ok"] and "+0.030 ms" in data["check"][0]
    gap = next(line for line in text.splitlines() if line.startswith("| 10.0 | 0.050 |"))
    assert gap == "| 10.0 | 0.050 | aten::add | aten::item | aten::add |"  # before, host, next


def test_check_against_measured_step_times(tmp_path):
    a, b = write(tmp_path, "a.json", side_a()), write(tmp_path, "b.json", side_b())
    _, data = compare(a, b, step_a=120e-6, step_b=91e-6)  # measured 29 µs vs traced 30: 3.4%
    assert data["ok"] and "OK" in data["check"][1]
    _, data = compare(a, b, step_a=120e-6, step_b=80e-6)  # measured 40 µs: off by 25%
    assert not data["ok"] and "NOT MET" in data["check"][1]


def test_exclusive_time_of_nested_cpu_ops():
    outer = ev("cpu_op", "aten::linear", 0, 10)
    inner = ev("cpu_op", "aten::mm", 2, 5)
    empty = ev("cpu_op", "aten::view", 8, 0)
    pieces = [(s, f, e["name"], n) for s, f, e, n in exclusive_pieces([inner, empty, outer])]
    own = {}
    for s, f, name, n in pieces:
        own[name] = (own.get(name, (0, 0))[0] + f - s, own.get(name, (0, 0))[1] + n)
    assert own == {"aten::linear": (5, 1), "aten::mm": (5, 1), "aten::view": (0, 1)}


def profile_step(model, x, mark, path):
    """One forward + backward traced under ``mark``; its wall time measured around the mark."""

    def step():
        model(x).float().square().mean().backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(mark):
            step()
    prof.export_chrome_trace(str(path))


def test_real_cpu_traces_of_two_tiny_models(tmp_path):
    torch.manual_seed(0)
    ours = build_model(ModelShape(64, 2, 4, 2, 128, 256, 64))
    other = nn.Sequential(
        nn.Embedding(256, 64), nn.Linear(64, 256, bias=False), nn.GELU(), nn.Linear(256, 64, bias=False)
    )
    x = torch.randint(0, 256, (2, 32))
    profile_step(ours, x, "meshforge step 0", tmp_path / "a.json")
    profile_step(other, x, "peer step", tmp_path / "b.json")
    text, data = compare(tmp_path / "a.json", tmp_path / "b.json", ("meshforge", "mlp"), top=10)
    assert data["mode"] == "cpu"
    for i in (0, 1):  # each side's rows (own times, gaps, overlap) add up to its step window
        assert sum(r["us"][i] for r in data["rows"]) == pytest.approx(1e3 * data["span_ms"][i], rel=1e-9)
    rows = rows_by_key(data)
    sdpa = [k for k in rows if "scaled_dot_product" in k or "attention" in k]
    assert sdpa and all(rows[k]["calls"][1] == 0 for k in sdpa)  # only the transformer attends
    # GEMMs keyed by their input dims and matched across sides: 64 tokens x hidden 64 into 256 is
    # the head's forward on one side (its backward has other shapes), on the other the first
    # Linear's forward and the second's two backward products
    assert rows["aten::mm [aten::mm 64x64 64x256]"]["calls"] == (1, 3)
    assert rows["aten::mm [aten::mm 64x64 64x32]"]["calls"] == (4, 0)  # wk and wv (kv 2 x 16) forward, 2 blocks
    span_a, span_b = data["span_ms"]
    _, same = compare(tmp_path / "a.json", tmp_path / "b.json", step_a=span_a / 1e3, step_b=span_b / 1e3)
    assert same["ok"]  # measured equal to traced: the check passes
    off = 0.1 * abs(span_a - span_b) / 1e3
    _, skewed = compare(tmp_path / "a.json", tmp_path / "b.json", step_a=span_a / 1e3, step_b=span_b / 1e3 + off)
    assert not skewed["ok"]  # 10% off the difference: the check fails
    assert "| (host gaps: nothing running) | gaps |" in text


def test_cli_refuses_bad_input_and_existing_output(tmp_path, capsys):
    a, b = write(tmp_path, "a.json", side_a()), write(tmp_path, "b.json", side_b())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main([str(bad), str(b)]) == 2
    assert "kernel_diff: error:" in capsys.readouterr().err
    out = tmp_path / "out.md"
    assert main([str(a), str(b), "--out", str(out), "--step-a", "0.00012", "--step-b", "0.00009"]) == 0
    first = out.read_text()
    assert "Kernel diff" in first and "OK" in first
    assert main([str(a), str(b), "--out", str(out)]) == 2 and out.read_text() == first  # never overwritten


def test_step_time_is_measured_around_the_mark(tmp_path):
    """The traced window of a real step matches its wall time (what the check relies on)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    model(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        with record_function("peer step"):
            model(x).sum().backward()
        wall = time.perf_counter() - t
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    _, data = compare(tmp_path / "t.json", tmp_path / "t.json")
    assert 0 < data["span_ms"][0] <= 1e3 * wall
