"""Corpus preparation against the tokenizer's own speed; its peak memory; the loader's speed.

Everything is generated in a temporary directory: a 32K byte-level BPE tokenizer trained on
this Python's standard library (no network), and a synthetic corpus of documents cut from
that library's sources (log-normal lengths, median about 4 KB), written three ways with the
same documents in the same order: JSONL, Parquet, and a directory of text files.

1. Throughput: the tokenizer's own ``encode_batch`` over the corpus's documents (already in
   memory, batches of 1,000, the library's thread pool on every core) against
   ``prepare()`` reading each format (reading, parsing, tokenizing, writing shards, with the
   default worker count: every core). Runs alternate baseline / format / baseline ..., each
   in a fresh process; a format's ratio is the baseline's time (the mean of the runs on
   either side) over its own. >= 0.9 is the target.
2. Identity: the three formats' shards, and the JSONL shards prepared by 1 worker and by N,
   must be byte-identical.
3. Memory: ``meshforge data prepare`` (the command a user runs, a fresh process) over a
   ``--memory-mb`` JSONL corpus and over a single ``--single-mb`` text document; its peak
   resident set (the kernel's ru_maxrss; the command imports torch, about 220 MB of it,
   which is reported too). <= 1 GiB is the target.
4. Loader: sequences of ``--seq-len`` from the prepared shards in the sampler's shuffled
   order, one core (torch and numpy single-threaded), tokens/s against what 8 GPUs at 55k
   tokens/s each consume (the 1B preset's measured H200 speed). >= 10x is the target.

    python bench/bench_prepare.py [--mb 200 --memory-mb 1024 --single-mb 256 --rounds 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

GPU_TOKENS_PER_S = 8 * 55_000
HERE = Path(__file__).resolve()


def stdlib_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return "".join(p.read_text(encoding="utf-8", errors="replace").replace("\r", "") for p in files)


def documents(text: str, total_bytes: int, seed: int = 0):
    """Documents cut from ``text`` until ``total_bytes`` characters (deterministic)."""
    rng, n = random.Random(seed), 0
    while n < total_bytes:
        size = min(len(text) - 1, int(rng.lognormvariate(8.3, 1.0)))
        start = rng.randrange(len(text) - size)
        n += size
        yield text[start : start + size]


def train_tokenizer(path: Path, text: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    tok.train_from_iterator((text[i : i + 100_000] for i in range(0, 8_000_000, 100_000)), trainer)
    tok.save(str(path))


def write_corpus(d: Path, text: str, mb: float, formats: list[str]) -> dict[str, Path]:
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    if "jsonl" in formats:
        out["jsonl"] = d / "docs.jsonl"
        with out["jsonl"].open("w", encoding="utf-8") as f:
            for doc in documents(text, int(mb * 1e6)):
                f.write(json.dumps({"text": doc}) + "\n")
    if "parquet" in formats:
        import pyarrow as pa
        import pyarrow.parquet as pq

        out["parquet"] = d / "docs.parquet"
        with pq.ParquetWriter(out["parquet"], pa.schema([("text", pa.string())])) as w:
            batch = []
            for doc in documents(text, int(mb * 1e6)):
                batch.append(doc)
                if len(batch) == 2000:
                    w.write_table(pa.table({"text": batch}))
                    batch = []
            w.write_table(pa.table({"text": batch}))
    if "text" in formats:
        out["text"] = d / "docs"
        out["text"].mkdir()
        for i, doc in enumerate(documents(text, int(mb * 1e6))):
            (out["text"] / f"{i // 1000:03d}").mkdir(exist_ok=True)
            (out["text"] / f"{i // 1000:03d}" / f"{i:07d}.txt").write_text(doc, encoding="utf-8")
    return out


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.child == "baseline":
        from tokenizers import Tokenizer

        docs = [json.loads(line)["text"] for line in open(args.input, encoding="utf-8")]
        tok = Tokenizer.from_file(args.tokenizer)
        encode = getattr(tok, args.method)
        t0, tokens = time.perf_counter(), 0
        for i in range(0, len(docs), 1000):
            tokens += sum(len(e) for e in encode(docs[i : i + 1000], add_special_tokens=False))
        print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": tokens}))
        return
    from meshforge.data.prepare import prepare
    from meshforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    out = prepare([args.input], args.out, tok, 0.01, workers=args.workers, progress=None)
    seconds = time.perf_counter() - t0
    index = json.loads((out / "index.json").read_text())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "tokens": index["tokens"], "rss0_mb": rss0, "peak_mb": peak}))


def run_child(*argv: str) -> tuple[dict, float]:
    """Run this file as a child; its JSON result and its peak RSS in MB (from wait4)."""
    p = subprocess.Popen([sys.executable, str(HERE), *argv], stdout=subprocess.PIPE, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    if status:
        sys.exit(f"child {argv} failed (status {status})")
    return json.loads(out.strip().splitlines()[-1]), usage.ru_maxrss / 1024


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(out.iterdir()):
        if f.name != "index.json":
            h.update(f.name.encode() + f.read_bytes())
    index = json.loads((out / "index.json").read_text())
    index.pop("source")
    return h.update(json.dumps(index, sort_keys=True).encode()) or h.hexdigest()[:16]


def throughput(tmp: Path, tok: str, corpus: dict[str, Path], args: argparse.Namespace) -> dict[str, Path]:
    print(f"\n1. throughput, {args.mb:g} MB corpus, {os.cpu_count()} cores (seconds; ratio = baseline / prepare)")
    base = ["--child", "baseline", "--input", str(corpus["jsonl"]), "--tokenizer", tok]
    outs, times = {}, []
    for r in range(args.rounds):
        times.append(("baseline", run_child(*base, "--method", "encode_batch")[0]["seconds"]))
        for fmt, path in corpus.items():
            outs[fmt] = tmp / f"out-{fmt}-{r}"
            res, _ = run_child("--child", "prepare", "--input", str(path), "--out", str(outs[fmt]), "--tokenizer", tok)
            times.append((fmt, res["seconds"]))
            times.append(("baseline", run_child(*base, "--method", "encode_batch")[0]["seconds"]))
            before, after = times[-3][1], times[-1][1]
            print(f"   round {r}: baseline {before:.1f} | {fmt} {res['seconds']:.1f} | baseline {after:.1f}")
        if r < args.rounds - 1:
            for o in outs.values():
                shutil.rmtree(o)
    for fmt in corpus:
        ratios = [(times[i - 1][1] + times[i + 1][1]) / 2 / t for i, (f, t) in enumerate(times) if f == fmt]
        tokens = json.loads((outs[fmt] / "index.json").read_text())["tokens"]
        best = min(t for f, t in times if f == fmt)
        print(
            f"   {fmt:8s} prepare/encode_batch throughput ratio {min(ratios):.2f}..{max(ratios):.2f} (target >= 0.9)"
            f"  [{args.mb / best:.2f} MB/s, {tokens / best:,.0f} tokens/s at best]"
        )
    if args.fast_baseline:
        fast = run_child(*base, "--method", "encode_batch_fast")[0]["seconds"]
        print(f"   (encode_batch_fast once: {fast:.1f} s)")
    return outs


def identity(tmp: Path, tok: Path, corpus: dict[str, Path], outs: dict[str, Path]) -> None:
    print("\n2. identity")
    digests = {fmt: digest(o) for fmt, o in outs.items()}
    print(f"   shards per format: {digests} -> {'identical' if len(set(digests.values())) == 1 else 'DIFFERENT'}")
    one = tmp / "out-jsonl-1worker"
    run_child(
        "--child",
        "prepare",
        "--input",
        str(corpus["jsonl"]),
        "--out",
        str(one),
        "--tokenizer",
        str(tok),
        "--workers",
        "1",
    )
    same = digest(one) == digests["jsonl"]
    print(f"   JSONL with 1 worker vs {os.cpu_count()} (default): {'identical' if same else 'DIFFERENT'}")
    shutil.rmtree(one)


def memory(tmp: Path, tok: Path, text: str, args: argparse.Namespace) -> None:
    print("\n3. peak memory of `meshforge data prepare` (target <= 1024 MB)")
    torch_mb = run_child("--child", "torch-import")[1]
    big = write_corpus(tmp / "mem", text, args.memory_mb, ["jsonl"])["jsonl"]
    single = tmp / "mem" / "single.txt"
    with single.open("w", encoding="utf-8") as f:
        n = 0
        while n < args.single_mb * 2**20:
            chunk = text[: args.single_mb * 2**20 - n]
            f.write(chunk)
            n += len(chunk)
    for name, path in (
        (f"{big.stat().st_size / 1e6:,.0f} MB JSONL corpus", big),
        (f"single {single.stat().st_size / 1e6:,.0f} MB document", single),
    ):
        out = tmp / "mem" / "out"
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "meshforge",
            "data",
            "prepare",
            "--input",
            str(path),
            "--out",
            str(out),
            "--tokenizer",
            str(tok),
        ]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(p.pid, 0)
        secs = time.perf_counter() - t0
        print(
            f"   {name}: peak RSS {usage.ru_maxrss / 1024:,.0f} MB (status {status}, {secs:.0f} s; "
            f"of which importing torch alone: {torch_mb:,.0f} MB)"
        )
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(tmp / "mem")


def loader(out: Path, args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from meshforge.data.dataset import TokenDataset
    from meshforge.data.sampler import GlobalBatchSampler

    torch.set_num_threads(1)
    ds = TokenDataset(out, args.seq_len)
    sampler = GlobalBatchSampler(len(ds.train), args.batch, seed=0)
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 5:
        batch = ds.train.get(sampler.next_batch())
        tokens += batch.shape[0] * args.seq_len
    rate = tokens / (time.perf_counter() - t0)
    print(
        f"\n4. loader: {len(ds.train):,} sequences of {args.seq_len} (batches of {args.batch}, shuffled), one core:"
        f" {rate:,.0f} tokens/s = {rate / GPU_TOKENS_PER_S:.1f}x 8 GPUs x 55k tokens/s (target >= 10x)"
    )
    assert np.all(batch.numpy() < ds.vocab_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=200, help="corpus size for throughput (each format)")
    p.add_argument("--memory-mb", type=float, default=1024, help="JSONL corpus size for the memory run (0: skip)")
    p.add_argument("--single-mb", type=int, default=256, help="single-document size for the memory run (MiB)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--formats", default="jsonl,parquet,text")
    p.add_argument("--fast-baseline", action="store_true", help="also time encode_batch_fast once")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dir", default="", help="work directory (default: a temporary one, removed after)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--input", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default="", help=argparse.SUPPRESS)
    p.add_argument("--method", default="encode_batch", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "torch-import":
        import torch  # noqa: F401

        print("{}")
        return
    if args.child:
        return child(args)
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        text = stdlib_text()
        tok = tmp / "tokenizer.json"
        t0 = time.perf_counter()
        train_tokenizer(tok, text)
        formats = [f for f in args.formats.split(",") if f]
        corpus = write_corpus(tmp / "corpus", text, args.mb, formats)
        print(f"setup: 32K BPE trained, corpus written as {', '.join(formats)} ({time.perf_counter() - t0:.0f} s)")
        outs = throughput(tmp, str(tok), corpus, args)
        identity(tmp, tok, corpus, outs)
        if args.memory_mb:
            memory(tmp, tok, text, args)
        loader(outs["jsonl"], args)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
