"""Context parallelism on CPU (gloo): what a cp rank keeps for backward, its peak RSS and
throughput, by sequence length and cp; ring vs allgather rotation; zigzag vs contiguous
balance (each rank's attention-kernel time).

Every point is a fresh world of cp processes (so peak RSS is that point's) running one
forward/backward of one sequence through the debug preset (max_seq_len raised) with every
block's attention core swapped for ring attention, exactly as ``apply_cp`` does; cp = 1 is
the plain model (SDPA). Saved activation bytes are counted with
``torch.autograd.graph.saved_tensors_hooks`` during the forward: unique storages that are
not parameters (deterministic). Tokens/s is the sequence over the slowest rank's step,
each rank on one thread (cp = 4 on a 2-core machine shares cores: its times are not scaling).

    python bench/bench_cp.py                       # seq 1K, 4K, 16K x cp 1, 2, 4 + comparisons at 4K
    python bench/bench_cp.py --seqs 1024,2048 --cps 1,2 --compare-seq 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import socket
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seq: int, cp: int, rank: int, balance: str, rotate: str):
    import torch.distributed as dist

    from meshforge.models.llama import Transformer, init_weights
    from meshforge.models.presets import get_preset
    from meshforge.parallel.context.ring import RingAttention

    args = dataclasses.replace(get_preset("debug"), max_seq_len=seq)
    model = Transformer(args)
    init_weights(model, 0)
    if cp > 1:
        for block in model.layers.values():
            block.attention.core = RingAttention(dist.group.WORLD, rank, cp, balance, rotate)
    return model, args


def _timed_kernels() -> dict[str, float]:
    """Wrap the ring's block kernels to add up this rank's attention compute time (no waits)."""
    import meshforge.parallel.context.ring as ring

    spent = {"s": 0.0}
    for name in ("block_forward", "block_backward"):
        fn = getattr(ring, name)

        def timed(*a, _fn=fn, **k):
            t = time.perf_counter()
            out = _fn(*a, **k)
            spent["s"] += time.perf_counter() - t
            return out

        setattr(ring, name, timed)
    return spent


def _step(model, tokens, targets, positions, count: bool) -> tuple[float, int]:
    """One forward/backward; returns its time and (when ``count``) the saved activation bytes."""
    import torch
    import torch.nn.functional as F

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count else _null():
        logits = model(tokens, positions)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return time.perf_counter() - t0, sum(storages.values())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def worker(rank: int, cp: int, port: int, seq: int, balance: str, rotate: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from meshforge.parallel.context.ring import shard_index

    torch.set_num_threads(1)  # one core per rank, as one device per rank (and no spinning OpenMP on a busy machine)
    if cp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    model, args = _model(seq, cp, rank, balance, rotate)
    spent = _timed_kernels()
    seqs = torch.randint(args.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    idx = shard_index(seq, cp, rank, balance) if cp > 1 else torch.arange(seq)
    tokens, targets = seqs[:, :-1][:, idx], seqs[:, 1:][:, idx]
    steps = 3 if seq <= 4096 else 1  # the first counts saved bytes (and warms up when there are more)
    times, saved = [], 0
    for i in range(steps):
        spent["s"] = 0.0
        dt, b = _step(model, tokens, targets, idx, count=i == 0)
        saved = saved or b
        times.append(dt)
        model.zero_grad(set_to_none=True)
    step_s = min(times[1:] or times)
    rec = {
        "rank": rank,
        "saved": saved,
        "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "step_s": step_s,
        "kernel_s": spent["s"],
    }
    Path(out, f"{rank}.json").write_text(json.dumps(rec))
    if cp > 1:
        dist.destroy_process_group()


def run_point(seq: int, cp: int, balance: str = "zigzag", rotate: str = "ring") -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(cp, _free_port(), seq, balance, rotate, d), nprocs=cp, join=True)
        ranks = [json.loads(Path(d, f"{r}.json").read_text()) for r in range(cp)]
    step = max(r["step_s"] for r in ranks)
    return {
        "seq": seq,
        "cp": cp,
        "balance": balance if cp > 1 else "-",
        "rotate": rotate if cp > 1 else "-",
        "saved_mib": max(r["saved"] for r in ranks) / 2**20,
        "rss_mib": max(r["rss_kib"] for r in ranks) / 1024,
        "tokens_s": seq / step,
        "kernel_ms": [round(r["kernel_s"] * 1e3) for r in ranks],
    }


def table(rows: list[dict]) -> str:
    base = {r["seq"]: r["saved_mib"] for r in rows if r["cp"] == 1}
    head = "| seq_len | cp | rotate | balance | saved for backward / rank (MiB) | vs cp 1 | peak RSS / rank (MiB) "
    head += "| tokens/s | attention kernel time per rank (ms) |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        ratio = f"{r['saved_mib'] / base[r['seq']]:.3f}" if r["seq"] in base else "-"
        kern = " / ".join(str(k) for k in r["kernel_ms"]) if r["cp"] > 1 else "-"
        lines.append(
            f"| {r['seq']} | {r['cp']} | {r['rotate']} | {r['balance']} | {r['saved_mib']:.1f} | {ratio} "
            f"| {r['rss_mib']:.0f} | {r['tokens_s']:.0f} | {kern} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--compare-seq", type=int, default=4096, help="where ring/allgather and zigzag/none are compared")
    a = ap.parse_args()
    rows = []
    for seq in (int(s) for s in a.seqs.split(",")):
        for cp in (int(c) for c in a.cps.split(",")):
            rows.append(run_point(seq, cp))
            print(json.dumps(rows[-1]), flush=True)
    for cp in (c for c in (2, 4) if str(c) in a.cps.split(",")):
        for balance, rotate in (("zigzag", "allgather"), ("none", "ring")):
            rows.append(run_point(a.compare_seq, cp, balance, rotate))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
