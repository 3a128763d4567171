"""How much communication each axis hides, on two simulated hosts joined by a throttled link
(scripts/sim_hosts.sh, torchrun, one rank per host), beside the planner's prediction.

Per axis (a layout where that axis crosses the link) the same run goes twice on the same two
hosts: unthrottled (communication nearly free) and throttled to a rate at which the step's
communication is about its compute (``--comm-ratio``: the rate that moves the step's counted
bytes in ratio x the unthrottled step time). For an axis with an overlap switch both settings
run (off: async_tp false, ep_chunks 1, one huge ZeRO-1/DDP bucket; on: the overlapped path).

    comm     = the step's bytes crossing the link (comm_stats, per rank and collective kind),
               each kind at its own alpha-beta fitted to that collective over the same
               throttled link -- what the communication takes alone
    exposed  = median step time throttled - unthrottled (what the step waits for)
    hidden   = 1 - exposed / comm; for ZeRO-1 also that of the reduce-scatter alone (its
               parameter all-gather after the step is exposed by design)
    speed-up = off / on, throttled (tp)

and the planner's figures for the same layout and link (planner/estimate.py with a profile of
this CPU: the cpu preset with its compute scaled to the unthrottled step, its inter-node link
the probed one, one rank per node): predicted exposed and hidden. Medians over the steps after
``--skip``; every ratio comes from runs of the same invocation.

    sudo python bench/bench_overlap.py                       # every axis
    sudo python bench/bench_overlap.py --axes tp ep --steps 8

On a shared machine nice alone does not keep other sessions' work off it (each session is an
autogroup, and autogroups share the CPU fairly): give the benchmark's session the weight,
``sudo sh -c 'echo -10 > /proc/self/autogroup; exec nice -n -10 python bench/bench_overlap.py'``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from sim_hosts import SimHosts, free_port  # noqa: E402

COMMON = [
    "--train.eval_batches=0", "--train.device=cpu", "--metrics.log_interval=1", "--metrics.console=false",
    "--metrics.report=false", "--checkpoint.interval=0", "--checkpoint.save_final=false", "--run.overwrite=true",
    "--train.skip_memory_check=true", "--optim.warmup_steps=0",
]  # fmt: skip
DENSE = ["--model.heads=8", "--model.kv_heads=8", "--model.layers=2", "--model.vocab_size=512"]


@dataclass
class Row:
    """One axis: its layout (model and batch included), and the off/on settings of its overlap."""

    axis: str
    layout: list[str]
    on: list[str] = field(default_factory=list)
    off: list[str] | None = None  # None: no switch (the overlap is the schedule's own)
    comm_ratio: float = 0.0  # this row's link rate (0: --comm-ratio)
    # kinds of traffic the path never overlaps (ZeRO-1's parameter all-gather after the step):
    # reported apart, so the hidden share of the rest can be read
    exposed_kinds: tuple[str, ...] = ()
    # kinds the "on" path runs as point-to-point rings, priced at the p2p probe (async TP books its
    # rings as the all-gathers and reduce-scatters they replace; gloo's own reduce-scatter runs at
    # an all-reduce's cost, the ring at the link's). The ends' DTensor collectives go with them:
    # that prices them low, so the hidden share it gives is a lower bound.
    on_via: dict[str, str] = field(default_factory=dict)


TP = "--parallel.tp=2"
OFF_TP, ON_TP = ["--parallel.async_tp=false"], ["--parallel.async_tp=true"]
RING = {"all_gather": "p2p", "reduce_scatter": "p2p"}
PP = ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.num_microbatches=4"]


def rows(a: argparse.Namespace) -> dict[str, Row]:
    h, s = a.hidden, a.seq_len

    def width(h: int) -> list[str]:
        return [*DENSE, f"--model.hidden={h}", f"--model.ffn_hidden={4 * h}", f"--train.seq_len={s}"]

    dense = width(h)
    batch = [f"--train.global_batch_size={a.batch}"]
    # the debug-moe (one MoE block of 8 experts of 128 after a dense one); --ep-hidden N:
    # a wider variant (width N, experts 2N, both blocks MoE) where the expert GEMMs weigh more
    moe = ["--model.preset=debug-moe", f"--model.hidden={h // 2}", f"--train.seq_len={s}", "--model.layers=2"]
    if a.ep_hidden:
        e = a.ep_hidden
        moe = [
            "--model.preset=debug-moe", f"--model.hidden={e}", f"--model.moe_ffn_hidden={2 * e}", "--model.heads=8",
            "--model.kv_heads=4", "--model.first_dense_layers=0", f"--train.seq_len={s}", "--model.layers=2",
        ]  # fmt: skip
    tp_extra = [f"--model.layers={a.tp_layers}"] + (["--train.loss_chunk_size=0"] if a.tp_whole_logits else [])
    big = "--parallel.ddp_bucket_mb=65536"  # one bucket (the largest the range allows): reduced after backward
    return {
        # GEMMs beside the collectives are all async TP can hide behind: the tp row's width makes
        # them most of the step, as in the models meshforge is for (--tp-hidden)
        "tp": Row("tp", [*width(a.tp_hidden), *batch, TP, *tp_extra], ON_TP, OFF_TP, on_via=RING),
        "ep": Row(
            "ep",
            [*moe, *batch, "--parallel.dp_shard=2", "--parallel.ep=2"],
            [f"--parallel.ep_chunks={a.ep_chunks}"],
            ["--parallel.ep_chunks=1"],
        ),
        "zero1": Row(
            "dp",
            [*dense, *batch, "--parallel.dp_shard=2", "--parallel.zero_stage=1", "--train.precision=bf16"],
            [f"--parallel.ddp_bucket_mb={a.bucket_mb}"],
            [big],
            comm_ratio=0.5,  # the reduce-scatter about the backward it can hide under
            exposed_kinds=("all_gather",),  # the parameter all-gather after the step
        ),
        "dp": Row(
            "dp",
            [*dense, *batch, "--parallel.dp_shard=2"],
            [f"--parallel.ddp_bucket_mb={a.bucket_mb}"],
            [big],
            comm_ratio=0.5,
        ),
        "pp": Row("pp", [*dense, *batch, *PP]),
        "cp": Row("cp", [*dense, *batch, "--parallel.cp=2", f"--parallel.ddp_bucket_mb={a.bucket_mb}"]),
    }


# ----------------------------------------------------------------------------- running


def launch(hosts: SimHosts, module_args: list[str], tmp: Path, timeout: float) -> None:
    """One torchrun job over the two hosts (a meshforge run, or a script with ``-c``)."""
    port = free_port() if hosts.fallback else 29400 + os.getpid() % 500
    procs = []
    for i in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.addr(0)}:{port}", f"--rdzv-id={hosts.name}",
            f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={hosts.addr(i)}", *module_args,
        ]  # fmt: skip
        procs.append(hosts.popen(i, cmd, out=open(tmp / f"h{i}.log", "w")))  # noqa: SIM115
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"a host failed ({codes}):\n" + (tmp / "h0.log").read_text()[-3000:])


# The layout rules refuse tp across nodes (tp <= ranks per node: it talks on every layer); to
# measure exactly that, the tp row's ranks are told there are 2 ranks per node.
TWO_PER_NODE = (
    "import os, runpy; os.environ['LOCAL_WORLD_SIZE'] = '2'; runpy.run_module('meshforge', run_name='__main__')"  # noqa: E501
)


def train(link: str, args: list[str], a: argparse.Namespace) -> tuple[list[dict], str]:
    """A run's metrics records and its config.toml, on two hosts whose links are ``link``."""
    with SimHosts(2, link) as hosts, tempfile.TemporaryDirectory() as t:
        if hosts.fallback:
            raise SystemExit(f"bench_overlap needs network namespaces (run as root): {hosts.fallback}")
        run_dir = Path(t) / "run"
        over = [*COMMON, f"--train.steps={a.steps}", f"--run.dir={run_dir}", *args]
        entry = ["-m", "meshforge"]
        if TP in args:
            (Path(t) / "two_per_node.py").write_text(TWO_PER_NODE)
            entry = [str(Path(t) / "two_per_node.py")]
        launch(hosts, [*entry, "train", *over], Path(t), a.timeout)
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return recs, (run_dir / "config.toml").read_text()


PROBE = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    peer = 1 - dist.get_rank()

    def shift(x, y):  # the rings' transfer (async TP, ring attention) and pipeline sends: one each way
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def ops(n):  # each moves 4n wire bytes per rank, as comm_stats counts them
        a, b, c = torch.ones(n), torch.empty(2 * n), torch.ones(2 * n)
        return {
            "all_gather": lambda: dist.all_gather_into_tensor(b, a),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(a, c),
            "all_reduce": lambda: dist.all_reduce(a),
            "all_to_all": lambda: dist.all_to_all_single(b, c),
            "p2p": lambda: shift(a, torch.empty(n)),
        }

    out = {}
    top = int(sys.argv[2])  # elements of the largest (about a quarter second on the link)
    reps = int(sys.argv[3])  # timed calls per size (the median counts)
    for n in (max(256, top // 32), max(1024, top // 8), max(2048, top // 2), max(4096, top)):
        for kind, fn in ops(n).items():
            fn(); dist.barrier()
            ts = []
            for _ in range(reps):
                dist.barrier(); t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
            out.setdefault(kind, []).append((4 * n, sorted(ts)[len(ts) // 2]))
    if dist.get_rank() == 0:
        open(sys.argv[1], "w").write(json.dumps(out))
""")


def fit(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha s, beta bytes/s) of t = alpha + S / beta, least squares."""
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return max(0.0, my - slope * mx), 1.0 / slope


def probe(link: str, rate_bps: float, a: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Per collective kind, (alpha seconds, beta wire bytes/s) on the throttled link between the
    two hosts, fitted over messages of 1/128 .. 1/4 second at the nominal rate (the median of
    ``--probe-repeats`` timed calls each): gloo's collectives do not all reach the same rate (its
    reduce-scatter, for one, runs no faster than an all-reduce of the same input), so each kind
    of the step's traffic is priced by its own."""
    with SimHosts(2, link) as hosts, tempfile.TemporaryDirectory() as t:
        script, out = Path(t) / "probe.py", Path(t) / "probe.json"
        script.write_text(PROBE)
        # fp32 elements, 4 bytes each: the largest message about a quarter second at the nominal
        # rate (at most 8 MiB), where the per-message latency no longer blurs the rate
        top = int(min(2**21, rate_bps / 8 / 4 / 4))
        launch(hosts, [str(script), str(out), str(top), str(a.probe_repeats)], Path(t), a.timeout)
        pts = json.loads(out.read_text())
    return {kind: fit(p) for kind, p in pts.items()}


def alone(moved: dict[str, float], links: dict[str, tuple[float, float]], via: dict[str, str] | None = None) -> float:
    """Seconds the step's traffic (wire bytes by kind) takes alone on the probed link (one
    latency per kind: a lower bound); a kind not probed (broadcast) at the all-gather's rate.
    ``via``: kinds that this path runs on another transport (async TP's rings: point-to-point)."""
    out = 0.0
    for kind, b in moved.items():
        kind = (via or {}).get(kind, kind)
        alpha, beta = links.get(kind, links["all_gather"])
        out += alpha + b / beta
    return out


def step_time(recs: list[dict], skip: int) -> float:
    return statistics.median(r["step_time_s"] for r in recs[skip:])


def link_bytes(recs: list[dict], skip: int) -> dict[str, float]:
    """Per collective kind, the median wire bytes per step and rank that the counter saw (all axes)."""
    kinds: dict[str, list[float]] = {}
    for r in recs[skip:]:
        per = collections.Counter()
        for by_kind in r.get("comm_bytes_by_kind", {}).values():
            per.update(by_kind)
        for k in per:
            kinds.setdefault(k, [])
        for k in kinds:
            kinds[k].append(per.get(k, 0.0))
    return {k: statistics.median(v) for k, v in kinds.items()}


# ----------------------------------------------------------------------------- the planner


PLANNER_KINDS = {"p2p": "send_recv"}  # the planner's name of a probed kind, where it differs


def predicted(config_toml: str, links: dict[str, tuple[float, float]], fast_s: float) -> dict[str, float]:
    """The planner's step on this link and unthrottled, with the cpu preset's compute scaled so its
    unthrottled step is the measured one and each collective priced at the probed kind's alpha and
    beta: {"slow", "fast", and each term of the throttled step}."""
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "src"))
    from meshforge.planner.hardware import PRESETS, to_json
    from meshforge.planner.plan import parse_plan_args, plan_from_args

    def run(hw) -> object:  # noqa: ANN001
        with tempfile.TemporaryDirectory() as d:
            cfg, prof = Path(d) / "config.toml", Path(d) / "hw.json"
            cfg.write_text(config_toml)
            prof.write_text(to_json(hw))
            args = ["--config", str(cfg), "--gpus", "2", "--gpus-per-node", "2", "--hardware", str(prof)]
            pl = plan_from_args(parse_plan_args(args))
        return pl.results[0] if pl.results else pl.results.refused[0]

    # two ranks "per node" (the planner keeps tp inside a node), both on the probed link
    fast_hw = replace(PRESETS["cpu"], hbm_gib=1e3, source="bench_overlap", collectives={})
    fast_hw = replace(fast_hw, intra_bw=1e15, inter_bw=1e15, intra_latency=0.0, inter_latency=0.0)
    for _ in range(3):  # scale the compute until the unthrottled step is the measured one
        k = run(fast_hw).step_time_s / fast_s
        scale = {f: getattr(fast_hw, f) * k for f in ("hbm_bw",)}
        peak = {p: v * k for p, v in fast_hw.peak_flops.items()}
        fast_hw = replace(fast_hw, peak_flops=peak, **scale)
    alpha, beta = links["all_gather"]
    per_kind = {PLANNER_KINDS.get(k, k): [al, be] for k, (al, be) in links.items()}
    slow_hw = replace(fast_hw, inter_bw=beta, inter_latency=alpha, intra_bw=beta, intra_latency=alpha)
    slow_hw = replace(slow_hw, collectives=per_kind)
    slow, fast = run(slow_hw), run(fast_hw)
    out = {"slow": slow.step_time_s, "fast": fast.step_time_s}
    out.update({f"t_{k}": v for k, v in slow.time.items()})
    return out


AXIS_TERMS = {  # the planner's (exposed, total) terms per axis
    "tp": ("tp_comm", ("tp_comm", "tp_comm_hidden")),
    "dp": ("dp_comm_exposed", ("dp_comm_total",)),
    "ep": ("ep_a2a", ("ep_a2a", "ep_a2a_hidden")),
    "pp": ("pp_p2p", ("pp_p2p", "pp_p2p_hidden")),
    "cp": ("cp_comm", ("cp_comm", "cp_comm_hidden")),
}


def planner_hidden(p: dict[str, float], axis: str) -> tuple[float, float]:
    """(predicted exposed s, predicted hidden fraction) of one axis's communication."""
    exposed, total = AXIS_TERMS[axis]
    e = p.get(f"t_{exposed}", 0.0)
    t = sum(p.get(f"t_{k}", 0.0) for k in total)
    return e, (1 - e / t) if t > 0 else 0.0


# ----------------------------------------------------------------------------- one axis


def measure(name: str, row: Row, a: argparse.Namespace) -> dict:
    """Unthrottled, then throttled at comm ~ ratio x compute; both settings where there is a switch.
    The conditions run interleaved ``--repeats`` times (the machine's load drifts); each one's
    step time is the median over all its runs' steps after ``--skip``."""
    settings = {"on": row.on} if row.off is None else {"off": row.off, "on": row.on}
    times: dict[tuple[str, str], list[float]] = {}
    recs, cfg = train("", row.layout + row.on, a)
    times[("fast", "on")] = [r["step_time_s"] for r in recs[a.skip :]]
    moved = link_bytes(recs, a.skip)
    ratio = row.comm_ratio or a.comm_ratio
    rate = max(8e5, sum(moved.values()) / (ratio * step_time(recs, a.skip)) * 8)  # bits/s: comm at line rate
    link = f"rate {int(rate / 1e3)}kbit"
    links = probe(link, rate, a)
    for rep in range(a.repeats):
        for speed, kind in [(s, k) for s in ("fast", "slow") for k in settings]:
            if rep == 0 and (speed, kind) == ("fast", "on"):
                continue  # (the run the rate came from)
            r = train("" if speed == "fast" else link, row.layout + settings[kind], a)[0]
            times.setdefault((speed, kind), []).extend(x["step_time_s"] for x in r[a.skip :])
    comm = alone(moved, links, row.on_via)
    waits = alone({k: v for k, v in moved.items() if k in row.exposed_kinds}, links)
    out = {"row": name, "link": link, "links": links, "bytes": moved, "comm_s": comm, "by_design_s": waits}
    for k in settings:
        fast, slow = (statistics.median(times[(sp, k)]) for sp in ("fast", "slow"))
        exposed = slow - fast
        comm = alone(moved, links, row.on_via if k == "on" else None)  # (off: the collectives themselves)
        out[k] = {"fast_s": fast, "slow_s": slow, "exposed_s": exposed, "hidden": 1 - exposed / comm, "comm_s": comm}
        if waits:  # the hideable traffic's own share hidden
            out[k]["hidden_rest"] = 1 - (exposed - waits) / (comm - waits)
        out[k]["steps"] = {sp: times[(sp, k)] for sp in ("fast", "slow")}
    out["config"], out["axis"] = cfg, row.axis
    return with_prediction(out)


def with_prediction(out: dict) -> dict:
    """The planner's figures for a measured row (its layout, link and unthrottled step)."""
    p = predicted(out["config"], out["links"], out["on"]["fast_s"])
    out["predicted"] = {"exposed_s": p["slow"] - p["fast"], "axis": planner_hidden(p, out["axis"]), "terms": p}
    return out


def report(r: dict) -> None:
    on, p = r["on"], r["predicted"]
    line = (
        f"{r['row']:6s} link {r['link']:>14s} (all-gather beta {r['links']['all_gather'][1] / 1e6:6.2f} MB/s)"
        f" | comm {r['comm_s']:7.3f} s ({r['comm_s'] / on['fast_s']:4.2f} x step)"
        f" | step fast {on['fast_s']:7.3f} slow {on['slow_s']:7.3f}"
        f" | exposed {on['exposed_s']:7.3f} hidden {100 * on['hidden']:5.1f}%"
        f" | planner exposed {p['exposed_s']:7.3f} ({100 * (p['exposed_s'] / on['exposed_s'] - 1):+5.1f}%)"
        f" hidden {100 * p['axis'][1]:5.1f}%"
    )
    if "off" in r:
        off = r["off"]
        line += (
            f" | off: fast {off['fast_s']:7.3f} slow {off['slow_s']:7.3f} exposed {off['exposed_s']:7.3f}"
            f" hidden {100 * off['hidden']:5.1f}%"
            f" speed-up {off['slow_s'] / on['slow_s']:4.2f}x"
            # no probe in it: the share of what the path without overlap waits for that this one does not
            f" | on hides {100 * (1 - on['exposed_s'] / off['exposed_s']):5.1f}% of off's exposed"
        )
    if "hidden_rest" in on:
        line += f" | less the {r['by_design_s']:.3f} s exposed by design: hidden {100 * on['hidden_rest']:5.1f}%"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--axes", nargs="*", default=["tp", "ep", "zero1", "dp", "pp", "cp"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tp-hidden", type=int, default=1024, help="the tp row's model width")
    ap.add_argument("--tp-layers", type=int, default=2, help="the tp row's blocks (the ends' collectives: 2 of 4L+2)")
    ap.add_argument("--tp-whole-logits", action="store_true", help="tp: whole logits (the head in the ring)")
    ap.add_argument("--probe-repeats", type=int, default=5, help="timed calls per probe message")
    ap.add_argument("--ep-hidden", type=int, default=0, help="a wider ep row: this width, experts twice it")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of every condition")
    ap.add_argument("--comm-ratio", type=float, default=1.0, help="link rate: comm = this x unthrottled step")
    ap.add_argument("--ep-chunks", type=int, default=4)
    ap.add_argument("--bucket-mb", type=int, default=1)
    ap.add_argument("--json", help="also write every figure here")
    ap.add_argument("--replan", help="no runs: the planner's figures again for the rows of this --json file")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    load = os.getloadavg()[0]
    print(f"two simulated hosts, one rank each, fp32 CPU unless said; load {load:.1f} on {os.cpu_count()} cores")
    table = rows(a)
    results = []
    if a.replan:
        for r in json.loads(Path(a.replan).read_text()):
            results.append(with_prediction(r))
            report(results[-1])
        return
    for name in a.axes:
        results.append(measure(name, table[name], a))
        report(results[-1])
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
