"""``meshforge calibrate``: measure this machine into a hardware profile for the planner.

One "device" is what one rank gets: a GPU, or on a CPU a 1/nproc share of the cores (the
threads ``meshforge train --nproc N`` gives each rank). Every rank measures at the same
time, as they compute in training (sharing caches, memory bandwidth and clocks), and the
slowest rank's figures are kept. Measured:

- matmul throughput over a sweep of sizes and dtypes; the best is the peak, and the
  half-efficiency size is fitted to the rest (efficiency(f) = f / (f + f_half));
- the attention core (SDPA forward + backward) as a fraction of that peak;
- memory bandwidth (a large copy), and the cost of a Llama block's work outside GEMMs and
  attention (norms, RoPE, residuals, SwiGLU, copies): a real block's forward + backward
  less the GEMM and attention time the profile predicts for it, in bytes per token x hidden;
- between ``nproc`` local ranks (gloo on CPU, NCCL on GPU), each collective as training
  issues it (c10d all-reduce, flat all-gather and reduce-scatter as FSDP2 does, DTensor
  redistributes as tensor parallelism does, batched send/recv as pipelining does) over
  message sizes, each fitted to the planner's α-β formula for that collective;
- how much of an all-reduce hides under concurrent matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from meshforge.calibration.collectives import COLLECTIVES, collective_times, comm_overlap, fit_alpha_beta
from meshforge.calibration.layout_fixed import layout_fixed_costs
from meshforge.errors import ConfigError
from meshforge.metrics.compute_profile import SYNC_COMPUTE, Timer, compute_profile, noise_warning
from meshforge.planner.hardware import PRESETS, Hardware, profile_fields


def _worker(rank: int, world: int, port: int, quick: bool, threads: int, out: str) -> None:
    """One rank: compute measured while every rank computes (they share the machine as in
    training), then all-reduce timings; rank 0 writes the slowest rank's figures."""
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(threads)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        dist.barrier()
        SYNC_COMPUTE[0] = True
    timer = Timer()
    mine = compute_profile(dev, quick, timer)
    SYNC_COMPUTE[0] = False
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        slowest = min(every, key=lambda c: c["peaks"]["bf16" if cuda else "fp32"])
        mesh = init_device_mesh(dev.type, (world,))
        sizes = [2**k for k in range(12, 23 if quick else 25, 2)]
        per_round = 2**20 if quick else 2**22  # bytes each round of calls moves
        rep = 3 if quick else 6
        points = {
            kind: timer.figure(
                f"collective {kind}", lambda k=kind: collective_times(k, dev, sizes, rep, timer, mesh, per_round)
            )
            for kind in COLLECTIVES
        }
        SYNC_COMPUTE[0] = True
        overlap = timer.figure("comm overlap", lambda: comm_overlap(dev, 3 if quick else 5, timer))
        kinds = {} if cuda else timer.figure("layout fixed", lambda: _layout_fixed(world, quick, timer))
        if rank == 0:
            slowest["timing"] = timer.report()  # (every rank agreed on each figure's spread)
            res = {"compute": slowest, "points": points, "overlap": overlap, "layout_fixed": kinds}
            Path(out).write_text(json.dumps(res))
        dist.destroy_process_group()
    else:
        Path(out).write_text(json.dumps({"compute": mine, "points": {}, "overlap": 1.0}))


def _layout_fixed(world: int, quick: bool, timer: Timer) -> dict[str, dict[str, float]]:
    """The per-kind fixed costs (calibration/layout_fixed.py), each rank's step timed by ``timer``
    with as many calls on every rank; the slowest rank's figures."""
    per_call = (lambda fn: timer.time(fn, 3, calls=3)) if quick else (lambda fn: timer.time(fn, 5, calls=10))
    return _slowest(layout_fixed_costs(world, per_call), world)


def _slowest(costs: dict[str, dict[str, float]], world: int) -> dict[str, dict[str, float]]:
    """Each figure's largest value over the ranks (the step waits for the slowest)."""
    every: list = [None] * world
    dist.all_gather_object(every, costs)
    return {k: {f: max(c[k][f] for c in every) for f in costs[k]} for k in costs}


def calibrate(nproc: int, quick: bool) -> Hardware:
    cuda = torch.cuda.is_available()
    if cuda and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPU(s) are visible")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    out = tempfile.mktemp(suffix=".json")
    single = None
    if not cuda and nproc > 1:  # `meshforge train --nproc 1` gives its one rank every core's thread
        torch.set_num_threads(os.cpu_count() or 1)
        single = compute_profile(torch.device("cpu"), quick)
    if nproc == 1:
        _worker(0, 1, 0, quick, threads, out)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(nproc, port, quick, threads, out), nprocs=nproc, join=True)
    res = json.loads(Path(out).read_text())
    Path(out).unlink()
    c, points = res["compute"], res["points"]
    fits = {kind: list(fit_alpha_beta(pts, nproc, kind)) for kind, pts in points.items()}
    alpha, link = fits.get("all_reduce", (10e-6, 1e10))
    base = PRESETS["cpu"] if not cuda else PRESETS["h100-sxm"]
    return Hardware(
        name=("cuda:" + torch.cuda.get_device_name()) if cuda else f"cpu/{nproc}",
        peak_flops=c["peaks"],
        hbm_gib=(torch.cuda.get_device_properties(0).total_memory / 2**30) if cuda else _ram_gib() / nproc,
        hbm_bw=c["bw"],
        intra_bw=link,
        inter_bw=link,
        intra_latency=alpha,
        inter_latency=alpha,
        gemm_efficiency=1.0,  # the peak is the best measured matmul
        gemm_half_flop=c["half"],
        attention_efficiency=c["attn"],
        attention_half_seq=0.0,  # measured at one length
        elementwise_bytes_per_hidden=c["elem"],
        block_fixed_s=c.get("fixed", 0.0),
        optimizer_fixed_s=c.get("opt", 0.0),
        layout_fixed_s=res.get("layout_fixed", {}),
        by_ranks={"1": profile_fields(single)} if single else {},
        reserve_gib=base.reserve_gib,
        collectives=fits,
        comm_overlap=res["overlap"],
        source="calibrated",
        extra={"threads_per_rank": threads, "nproc": nproc, "collective_points": points, "time": time.time()}
        | _timings(c, single),
    )


def _timings(c: dict, single: dict | None) -> dict:
    """Each figure's spread and what stayed noisy (metrics/compute_profile.py), as N and as 1 rank."""
    return {"timing": c.get("timing", {}), "timing_one_rank": single.get("timing", {}) if single else {}}


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 16.0


def run(args: argparse.Namespace) -> int:
    hw = calibrate(args.nproc, args.quick)
    Path(args.out).write_text(json.dumps(asdict(hw), indent=1))
    parts = {f"as {args.nproc} rank(s)": "timing", "as 1 rank": "timing_one_rank"}
    warning = "; ".join(f"{who}: {w}" for who, k in parts.items() if (w := noise_warning(hw.extra.get(k, {}))))
    if warning:
        print(
            f"meshforge calibrate: warning: {args.out} was written from noisy measurements: {warning}", file=sys.stderr
        )
    print(
        f"wrote {args.out}: {hw.name}, peak "
        + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in hw.peak_flops.items())
        + ", "
        f"GEMM half-efficiency at {hw.gemm_half_flop / 1e6:.1f} MFLOP, attention {100 * hw.attention_efficiency:.0f}% "
        f"of peak, memory {hw.hbm_bw / 1e9:.1f} GB/s, elementwise {hw.elementwise_bytes_per_hidden:.1f} B/h, "
        f"per block fixed {hw.block_fixed_s * 1e3:.2f} ms (fwd+bwd) + {hw.optimizer_fixed_s * 1e3:.2f} ms (AdamW), "
        + "".join(
            f"under {k}: block {v['block'] * 1e3:.2f} ms, ends {v['ends'] * 1e3:.2f} ms per micro-batch, "
            f"+ {v['block_step'] * 1e3:.2f} / {v['ends_step'] * 1e3:.2f} ms per step, "
            for k, v in hw.layout_fixed_s.items()
        )
        + "".join(
            f"as {n} rank(s): peak fp32 {f['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, " for n, f in hw.by_ranks.items()
        )
        + f"between {args.nproc} ranks: "
        + ", ".join(f"{k} α {a * 1e6:.0f} us B {b / 1e9:.2f} GB/s" for k, (a, b) in hw.collectives.items())
        + (f"; {100 * hw.comm_overlap:.0f}% of an all-reduce hides under compute" if args.nproc > 1 else "")
    )
    print(f"plan with it: meshforge plan --hardware {args.out} --gpus {args.nproc} --gpus-per-node {args.nproc} ...")
    return 0
