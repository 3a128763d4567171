"""Packed documents on CPU: what the document mask costs, and what ring attention skips.

1. **Masking cost** (one process, one thread): a training step (forward, backward, AdamW) of a
   packed batch with document masking and reset positions (the CPU tiled path) against the same
   batch with plain causal attention, at seq 1024 with documents of mean length 256
   (exponentially distributed). Variants alternate within each round; the figure is the median
   over rounds of the per-round ratio (the machine is shared: a ratio taken side by side is
   steadier than either time). The dense-mask SDPA reference is timed beside them.
2. **Ring attention, cp 4** (4 gloo processes, one thread each), seq 8192, mean document 1024:
   the blocks the ring skips (counted from the plans the ring runs, summed over ranks) and the
   step of the masked ring against the unmasked one (alternating rounds, the slowest rank's time).
3. **Zigzag balance under documents**: each cp rank's attention work (block squares; a causal
   triangle 1/2) from the ring plans, over many sequences, for zigzag and contiguous splits,
   with exponential lengths and with the real document lengths of the default corpus (this
   Python's standard library, byte tokens), against the planner's expected work
   (``parallel/context/cost.ring_block_work``).

4. **GPU** (``--part gpu``, CUDA only, not run by "all"): llama3.2-1b, seq 8192, documents of
   mean 1024: the masked step (FlexAttention) against plain causal SDPA.

    python bench/bench_packed.py                 # parts 1-3 (CPU)
    python bench/bench_packed.py --part mask --rounds 9 --tiles 64,128,256
    python bench/bench_packed.py --part gpu      # on a GPU machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def exponential_lengths(rows: int, seq: int, mean: float, seed: int) -> list[list[int]]:
    """Rows of document lengths (exponential, mean ``mean``, at least 1) cut to ``seq`` tokens."""
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        lens, left = [], seq
        phase = int(gen.integers(0, max(1, int(mean))))  # a sequence starts inside a document
        first = True
        while left:
            n = max(1, int(gen.exponential(mean)))
            n = max(1, n - phase) if first else n
            first = False
            lens.append(min(n, left))
            left -= lens[-1]
        out.append(lens)
    return out


def _model(seq: int, hidden: int, layers: int):
    from meshforge.models.llama import build_model
    from meshforge.models.presets import get_preset

    args = dataclasses.replace(
        get_preset("debug"), hidden=hidden, layers=layers, heads=hidden // 32, ffn_hidden=3 * hidden, max_seq_len=seq
    )
    return build_model(args, device="cpu", seed=0), args


def mask_cost(rounds: int, seq: int, mean: float, rows: int, hidden: int, tiles: list[int]) -> dict:
    """Part 1: step time of causal, tiled masking (per tile size) and the dense-mask reference."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import meshforge.models.document_attention as da
    from meshforge.models.documents import Documents

    class DenseCore(nn.Module):
        """The reference: SDPA with the whole (rows, 1, seq, seq) boolean mask."""

        def forward(self, q, k, v, documents=None):
            mask = da.dense_mask(documents.ids, documents.ids)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    torch.set_num_threads(1)
    model, args = _model(seq, hidden, 4)
    cores = [b.attention for b in model.layers.values()]
    tiled, dense = cores[0].core, DenseCore()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(args.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    lengths = exponential_lengths(rows, seq, mean, seed=1)

    def step(variant: str) -> float:
        for attention in cores:
            attention.core = dense if variant == "dense" else tiled
        da.TILE = int(variant[5:]) if variant.startswith("tiles") else 128
        t0 = time.perf_counter()
        docs = None if variant == "causal" else Documents.from_lengths(lengths, seq)  # per step, as in training
        logits = model(tokens[:, :-1], None if docs is None else docs.positions, docs)
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    variants = ["causal", *[f"tiles{t}" for t in tiles], "dense"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds + 1):  # the first round warms up
        for v in variants:
            dt = step(v)
            if r:
                times[v].append(dt)
    da.TILE = 128
    ratios = {v: statistics.median([t / c for t, c in zip(times[v], times["causal"], strict=True)]) for v in variants}
    docs = Documents.from_lengths(lengths, seq)
    return {
        "seq": seq,
        "rows": rows,
        "hidden": hidden,
        "mean_doc": mean,
        "docs_per_row": float(np.mean([len(r) for r in lengths])),
        "span_over_seq": docs.span() / seq,
        "attended_fraction_tile128": da.attended_fraction(docs),
        "median_step_ms": {v: round(1e3 * statistics.median(t), 1) for v, t in times.items()},
        "median_ratio_vs_causal": {v: round(x, 3) for v, x in ratios.items()},
        "rounds": rounds,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_worker(rank: int, cp: int, port: int, seq: int, mean: float, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshforge.models.documents import Documents
    from meshforge.parallel.context.ring import RingAttention, shard_index

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    model, args = _model(seq, 128, 2)
    for block in model.layers.values():
        block.attention.core = RingAttention(dist.group.WORLD, rank, cp, "zigzag", "ring")
    idx = shard_index(seq, cp, rank, "zigzag")
    tokens = torch.randint(args.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1][:, idx], tokens[:, 1:][:, idx]
    lengths = exponential_lengths(1, seq, mean, seed=2)
    times: dict[str, list[float]] = {"causal": [], "masked": []}
    plan = None
    for r in range(rounds + 1):
        for variant in ("causal", "masked"):
            docs = Documents.from_lengths(lengths, seq) if variant == "masked" else None
            positions = docs.positions[:, idx] if docs is not None else idx
            dist.barrier()
            t0 = time.perf_counter()
            F.cross_entropy(model(x, positions, docs).flatten(0, 1), y.flatten()).backward()
            dist.barrier()  # the slowest rank's step
            if r:
                times[variant].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
            if docs is not None:
                plan = model.layers["0"].attention.core.plan(docs)
    rec = {"times": times, "computed": plan.computed, "skipped": plan.skipped, "work": plan.work}
    Path(out, f"{rank}.json").write_text(json.dumps(rec))
    dist.destroy_process_group()


def ring_cost(rounds: int, seq: int, cp: int, mean: float) -> dict:
    """Part 2: skipped ring blocks (counted) and the masked vs unmasked ring step."""
    import torch.multiprocessing as mp

    from meshforge.planner.context_costs import ring_skipped_fraction

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(ring_worker, args=(cp, _free_port(), seq, mean, rounds, d), nprocs=cp, join=True)
        ranks = [json.loads(Path(d, f"{r}.json").read_text()) for r in range(cp)]
    computed = sum(r["computed"] for r in ranks)
    skipped = sum(r["skipped"] for r in ranks)
    causal = [max(r["times"]["causal"][i] for r in ranks) for i in range(rounds)]
    masked = [max(r["times"]["masked"][i] for r in ranks) for i in range(rounds)]
    return {
        "seq": seq,
        "cp": cp,
        "mean_doc": mean,
        "blocks_skipped": skipped,
        "blocks_total": computed + skipped,
        "skipped_fraction": skipped / (computed + skipped),
        "skipped_fraction_expected": ring_skipped_fraction(seq, cp, "zigzag", mean),
        "work_per_rank": [round(r["work"], 2) for r in ranks],
        "median_step_s": {"unmasked": statistics.median(causal), "masked": statistics.median(masked)},
        "median_ratio_masked_vs_unmasked": statistics.median([m / c for m, c in zip(masked, causal, strict=True)]),
        "rounds": rounds,
    }


def stdlib_lengths() -> list[int]:
    """The default corpus's documents in byte tokens: each stdlib file's size plus its separator."""
    from meshforge.data.prepare import stdlib_sources

    return [f.stat().st_size + 1 for f in stdlib_sources()]


def pack(lengths: list[int], seq: int, count: int, seed: int) -> list[list[int]]:
    """``count`` sequences cut from the documents concatenated in a shuffled order."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    cuts = np.cumsum([lengths[i] for i in order])
    starts = np.arange(count) * seq + int(np.random.default_rng(seed + 1).integers(0, seq))
    out = []
    for s in starts:
        inside = cuts[(cuts > s) & (cuts < s + seq)] - s
        out.append(np.diff(np.concatenate(([0], inside, [seq]))).tolist())
    return out


def balance(seq: int, cp: int, mean: float, count: int) -> list[dict]:
    """Part 3: each rank's ring work (plans counted) by split, for exponential and real lengths."""
    from meshforge.models.documents import Documents
    from meshforge.parallel.context.document_ring import plan_ring
    from meshforge.parallel.context.ring import chunk_ids
    from meshforge.planner.context_costs import ring_block_work

    real = stdlib_lengths()
    cases = {
        f"exponential, mean {mean:g}": (exponential_lengths(count, seq, mean, seed=3), mean),
        f"stdlib files, mean {np.mean(real):.0f}": (pack(real, seq, count, seed=4), float(np.mean(real))),
    }
    rows = []
    for name, (lengths, m) in cases.items():
        docs = Documents.from_lengths(lengths, seq)
        for split in ("zigzag", "none"):
            n = 2 * cp if split == "zigzag" else cp
            work = [
                plan_ring(docs, lambda r, s=split: chunk_ids(cp, r, s), rank, cp, n).work / count for rank in range(cp)
            ]
            causal = ring_block_work(seq, cp, split)
            rows.append(
                {
                    "documents": name,
                    "split": split,
                    "work_per_rank": [round(w, 2) for w in work],
                    "max_over_mean": max(work) / (sum(work) / cp),
                    "expected_per_rank": [round(w, 2) for w in ring_block_work(seq, cp, split, m)],
                    "unmasked_per_rank": causal,
                    "slowest_vs_unmasked_slowest": max(work) / max(causal),
                }
            )
    return rows


def gpu_cost(rounds: int, seq: int, mean: float, preset: str) -> dict:
    """Part 4 (CUDA only): a ``preset`` step (bf16 autocast, forward + backward) at ``seq`` with
    documents of mean ``mean``: FlexAttention with the block mask (built each step) against
    SDPA's causal kernel, alternating, after a warm-up that compiles FlexAttention."""
    import torch
    import torch.nn.functional as F

    from meshforge.models.documents import Documents
    from meshforge.models.llama import build_model
    from meshforge.models.presets import get_preset

    device = torch.device("cuda")
    args = dataclasses.replace(get_preset(preset), max_seq_len=max(seq, get_preset(preset).max_seq_len))
    model = build_model(args, device=device, seed=0)
    tokens = torch.randint(args.vocab_size, (1, seq + 1), device=device)
    lengths = exponential_lengths(1, seq, mean, seed=5)

    def step(masked: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        docs = Documents.from_lengths(lengths, seq, device) if masked else None
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(tokens[:, :-1], None if docs is None else docs.positions, docs)
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"causal": [], "masked": []}
    for r in range(rounds + 2):  # two warm-up rounds (FlexAttention compiles in the first)
        for masked in (False, True):
            dt = step(masked)
            if r >= 2:
                times["masked" if masked else "causal"].append(dt)
    ratio = statistics.median([m / c for m, c in zip(times["masked"], times["causal"], strict=True)])
    return {
        "device": torch.cuda.get_device_name(),
        "preset": preset,
        "seq": seq,
        "mean_doc": mean,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "median_ratio_masked_vs_causal": ratio,
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["all", "mask", "ring", "balance", "gpu"], default="all")
    ap.add_argument("--preset", default="llama3.2-1b", help="the model of part gpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tiles", default="128", help="tile sizes of the CPU path to time (comma-separated)")
    ap.add_argument("--rows", type=int, default=2, help="sequences per step in part 1")
    ap.add_argument("--hidden", type=int, default=256, help="model width in part 1 (heads of 32)")
    a = ap.parse_args()
    if a.part in ("all", "mask"):
        tiles = [int(t) for t in a.tiles.split(",")]
        print(json.dumps(mask_cost(a.rounds, 1024, 256, a.rows, a.hidden, tiles)), flush=True)
    if a.part in ("all", "ring"):
        print(json.dumps(ring_cost(max(3, a.rounds // 2), 8192, 4, 1024)), flush=True)
    if a.part == "gpu":  # (not in "all": it needs a CUDA GPU)
        print(json.dumps(gpu_cost(a.rounds, 8192, 1024, a.preset)), flush=True)
    if a.part in ("all", "balance"):
        for row in balance(8192, 4, 1024, 64):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
