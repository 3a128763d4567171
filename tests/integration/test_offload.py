"""parallel.offload = "cpu": FSDP2's CPU offload. On a CPU run it is refused (see
test_fp8.py::test_refusals_name_the_key); the CUDA path runs in the GPU suite (2+ GPUs)."""

import json

import pytest
import torch

from conftest import cli_args, run_cli, tiny_overrides
from meshforge.metrics.memory import host_state_bytes, state_bytes
from meshforge.models.llama import ModelShape, build_model


def test_host_bytes_count_the_tensors_in_host_memory():
    model = build_model(ModelShape(64, 2, 4, 2, 128, 256, 64), device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)).sum().backward()
    opt.step()
    assert host_state_bytes(model, opt) == state_bytes(model, opt)  # a CPU model: all of it is on the host
    if torch.cuda.is_available():
        model.cuda()
        assert host_state_bytes(model, opt)["params"] == 0


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CPU offload needs FSDP2 on 2+ CUDA devices")
def test_offload_matches_and_moves_state_to_the_host(tmp_path, corpus):
    runs = {}
    for offload in ("none", "cpu"):
        d = tmp_path / offload
        o = tiny_overrides(d, corpus, **{"parallel.zero_stage": 3, "parallel.offload": offload, "train.steps": 4})
        r = run_cli("train", "--nproc", "2", *cli_args({**o, "train.precision": "bf16", "train.device": "cuda"}))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[offload] = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in runs["cpu"]] == pytest.approx([m["loss"] for m in runs["none"]], rel=1e-3)
    last = runs["cpu"][-1]
    host, device = last["state_mem_host_bytes"], last["state_mem_device_bytes"]
    assert host["params"] == last["state_mem_bytes"]["params"] and device["params"] == 0
    assert host["optimizer"] > 0
