"""``meshforge`` command line: train, plan, calibrate, report, explore, data prepare, convert.

Each subcommand imports what it runs inside its own function (the only function-local
imports in meshforge, on purpose): ``meshforge --help`` or a bad flag answers at once,
without loading torch, the training stack or the planner.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from meshforge import __version__, launch_env
from meshforge.errors import ConfigError, MeshforgeError, suggest
from meshforge.lifeline import tie_to_launcher

TRAIN_USAGE = """usage: meshforge train [--config FILE.toml] [--nproc N] [--max-restarts K] [--dry-run]
                       [--section.key=value ...]

Train a model. Any config key can be overridden as --section.key=value or --section.key value,
e.g. --train.steps=100 --model.preset llama3.2-1b --optim.lr 3e-4. See README.md, configs/ for
examples and docs/configuration.md for what each key means.

  --config FILE      a TOML config (a run's config.toml reproduces that run)
  --nproc N          local ranks to start (default 1; under torchrun leave it out)
  --max-restarts K   restart the ranks up to K times after a failure, resuming from the last checkpoint
  --dry-run          resolve the config for --nproc ranks, print it and the planner's estimate, and exit

config keys (type, default):"""

_TRAIN_FLAGS = ("--config", "--nproc", "--max-restarts", "--dry-run", "--help")


def parse_train_args(argv: list[str]) -> tuple[str | None, int, int, dict[str, Any]]:
    """Split ``train`` arguments into (config file, nproc, max restarts, {section.key: value});
    ``--dry-run`` is read by ``cmd_train`` itself."""
    from meshforge.config import key_type, parse_value

    config, nproc, restarts = None, 1, 0
    overrides: dict[str, Any] = {}
    argv = [a for a in argv if a != "--dry-run"]
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            elif "." in name:
                if key_type(name) not in (None, bool):
                    raise ConfigError(f"--{name} needs a value, e.g. --{name}=VALUE (only boolean keys stand alone)")
                value = "true"  # a bare --section.flag turns a boolean on
            elif name not in ("help",):
                raise ConfigError(f"--{name} needs a value")
        i += 1
        if name == "config":
            config = value
        elif name in ("nproc", "max-restarts"):
            try:
                n = int(value)
            except ValueError:
                raise ConfigError(f"--{name} takes a whole number, got '{value}'") from None
            if name == "nproc":
                nproc = n
            else:
                restarts = n
        elif "." in name:
            parsed = parse_value(value)
            # a text key takes the text as written: --run.dir=1, --run.dir nan, --data.path true
            overrides[name] = value if key_type(name) is str and not isinstance(parsed, str) else parsed
        else:
            raise ConfigError(
                f"unknown option --{name}; {suggest('--' + name, _TRAIN_FLAGS, cutoff=0.6)} "
                "(or a --section.key=value config override)"
            )
    return config, nproc, restarts, overrides


def cmd_train(argv: list[str]) -> int:
    tie_to_launcher()  # a rank that `meshforge train --nproc N` started dies with it (nothing under torchrun)
    if "--help" in argv or "-h" in argv:
        from meshforge.config import describe_keys

        print(TRAIN_USAGE)
        print(describe_keys())
        return 0
    from meshforge import run_lock

    early = run_lock.run_dir_in_argv(argv)
    if early and "--dry-run" not in argv and not launch_env.under_launcher() and Path(early).is_dir():
        run_lock.hold(Path(early))  # a second run into a busy run.dir is refused here, before torch loads
    try:
        return _train(argv)
    finally:
        if early:
            run_lock.release(Path(early))  # (a no-op when the run released it itself)


def _train(argv: list[str]) -> int:
    """``meshforge train`` once run.dir is locked: in this process, or launching the ranks."""
    from meshforge import run_lock
    from meshforge.config import load_config

    config_file, nproc, restarts, overrides = parse_train_args(argv)
    cfg = load_config(config_file, overrides)
    if "--dry-run" in argv:
        return dry_run(cfg, nproc if "--nproc" in " ".join(argv) else launch_env.world_size())
    if restarts and (cfg.checkpoint.interval == 0 or cfg.checkpoint.load == "none"):
        raise ConfigError(
            f"--max-restarts {restarts}: a restarted group resumes from the last complete checkpoint, so it needs "
            'checkpoint.interval > 0 (or "auto") and checkpoint.load = latest; e.g. --checkpoint.interval=100'
        )
    from meshforge.launch import check_nproc, launch_local
    from meshforge.train import preflight

    if launch_env.under_launcher():
        if nproc > 1:
            raise ConfigError("--nproc starts ranks itself; under torchrun leave it out (torchrun sets the ranks)")
        summary = train_and_report(cfg)
        return 0 if summary else 1
    check_nproc(nproc, cfg.train.device)
    if nproc == 1 and not restarts:
        train_and_report(cfg)
        return 0
    # Check everything (config, run dir, data) once here, before any rank starts.
    cfg = preflight(cfg, nproc, launcher=True)
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    run_lock.hold(Path(cfg.run.dir))  # the launcher holds it across restarts; its ranks know (HELD_ENV)
    os.environ[run_lock.HELD_ENV] = str(Path(cfg.run.dir).resolve())
    child = ["train"]
    if config_file:
        child += ["--config", config_file]
    child += [
        f"--{k}={v}" if not isinstance(v, (list, bool)) else f"--{k}={str(v).lower()}"
        for k, v in overrides.items()
        if k != "run.dir"
    ]
    child.append(f"--run.dir={cfg.run.dir}")
    try:
        return launch_local(nproc, child, restarts)
    finally:
        os.environ.pop(run_lock.HELD_ENV, None)
        run_lock.release(Path(cfg.run.dir))


def train_and_report(cfg: Any) -> dict[str, Any]:
    """Train on this rank, then (rank 0) write run.dir/report.html from whatever the run
    wrote, also after a failed or stopped run. Written here, above train/, so that training
    never imports the analysis side (report/ reads the planner). Rank 0 checks the run first
    (as the multi-rank launch does): a refused run writes nothing, not even into an old run."""
    from meshforge.train import preflight, train

    main = launch_env.rank() == 0
    if main:
        cfg.run.dir = preflight(cfg, launch_env.world_size()).run.dir  # under torchrun, rank 0's dir is the run's
    try:
        return train(cfg)
    finally:
        if main:
            write_run_report(cfg)


def write_run_report(cfg: Any) -> None:
    """run.dir/report.html (unless metrics.report = false); a report error is logged as an
    event (``report_failed``), never raised over the run's own outcome."""
    from meshforge.disk import describe
    from meshforge.report import write_report
    from meshforge.train.run_dir import event_writer

    run_dir = Path(cfg.run.dir)
    if not cfg.metrics.report or not ((run_dir / "metrics.jsonl").is_file() or (run_dir / "events.jsonl").is_file()):
        return
    try:
        write_report([run_dir], run_dir / "report.html")
    except Exception as e:  # noqa: BLE001 - the report must never hide the training outcome
        why = describe(run_dir / "report.html", e, "write") if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        print(f"meshforge: note: report.html skipped ({why})", file=sys.stderr)
        try:
            event_writer(cfg)("report_failed", error=why[:2000])
        except OSError:
            pass


def dry_run(cfg: Any, world: int) -> int:
    """Print the config resolved for ``world`` ranks, this machine's device and memory, and the
    planner's estimate of exactly that layout on it (the one the pre-flight fit check uses);
    start nothing and write nothing (run.dir is not touched)."""
    from meshforge.config import to_toml
    from meshforge.fit import device_memory, estimate_run, uses_cuda
    from meshforge.models.presets import model_shape
    from meshforge.resolve import resolve
    from meshforge.train.run_dir import check_precision_and_offload

    cfg = resolve(cfg, world)
    print(f"# meshforge train --dry-run: the config resolved for {world} rank(s)\n{to_toml(cfg)}")
    try:  # what only the machine decides (CPU offload needs a GPU, fp8 needs torchao)
        check_precision_and_offload(cfg, model_shape(cfg.model))
    except MeshforgeError as e:
        print(f"on this machine meshforge train refuses it: {e}")
    cuda = uses_cuda(cfg)
    mem = device_memory(cuda, 0, 1 if cuda else world)
    print(f"device: {mem.describe()}" + (" (GPU 0; each rank checks its own)" if cuda and world > 1 else ""))
    run = estimate_run(cfg, world, mem)
    e = run.estimate
    if e is None:
        print(f"planner: no estimate for this layout ({run.error})")
        return 0
    fits = "fits" if e.fits else f"does NOT fit: {e.overflow}"
    if run.islands > 1:
        print(f"diloco: {run.islands} islands of {run.ranks} rank(s); the estimate is one island's")
    skip = " (train.skip_memory_check = true: not checked)" if cfg.train.skip_memory_check else ""
    print(
        f"planner estimate on {run.ranks} x {run.hardware}: memory {e.memory['total']:.2f} GiB per device "
        f"({fits}){skip} | "
        f"step time {e.step_time_s:.4g} s | {e.tokens_per_s_per_gpu:,.0f} tokens/s per device | MFU {100 * e.mfu:.1f}%"
    )
    print("dry run: no ranks started, nothing written")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from meshforge.data.prepare import prepare
    from meshforge.data.tokenizer import load_tokenizer

    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers} must be 0 (one per core) or more")
    tok = load_tokenizer(args.tokenizer)
    out = prepare(
        args.input, args.out, tok, args.val_fraction, field=args.field, workers=args.workers, progress=sys.stderr
    )
    index = json.loads((out / "index.json").read_text())
    counts = {k: sum(s["tokens"] for s in v) for k, v in index["splits"].items()}
    print(
        f"prepared {index['documents']} documents into {out}: {counts.get('train', 0):,} train tokens, "
        f"{counts.get('val', 0):,} val tokens ({index['dtype']}, tokenizer {index['tokenizer']})"
    )
    print(
        f"train on it with: meshforge train --data.path {out}"
        + (f" --data.tokenizer {args.tokenizer}" if args.tokenizer != "byte" else "")
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from meshforge.checkpoint.weights import load_pretrained, save_model_weights
    from meshforge.models.hf import load_hf_checkpoint, save_hf_checkpoint

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise MeshforgeError(f"--out {out} exists and is not empty; choose a new directory")
    if args.from_checkpoint:
        from meshforge.checkpoint.export import checkpoint_to_hf

        path = checkpoint_to_hf(Path(args.from_checkpoint), out)
        print(f"converted checkpoint {path} -> Hugging Face checkpoint {out} (loads with from_pretrained)")
        return 0
    if args.from_hf:
        if not Path(args.from_hf).is_dir():
            raise MeshforgeError(
                f"--from-hf {args.from_hf}: not a directory. meshforge reads local Hugging Face directories only "
                f"(no hub downloads): fetch it first, e.g. `huggingface-cli download {args.from_hf} --local-dir DIR`, "
                "then pass --from-hf DIR"
            )
        model = load_hf_checkpoint(args.from_hf)
        save_model_weights(model, out)
        print(f"converted Hugging Face checkpoint {args.from_hf} -> meshforge weights {out}")
        print(f"train from it with: meshforge train --model.init_from {out} ...")
    else:
        model = load_pretrained(args.to_hf)
        save_hf_checkpoint(model, out)
        print(f"converted {args.to_hf} -> Hugging Face checkpoint {out} (loads with from_pretrained)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from meshforge.report import write_report

    path = write_report(args.run_dirs, args.out)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB); open it in a browser: file://{path.resolve()}")
    return 0


def cmd_explore(args: argparse.Namespace) -> int:
    from meshforge.explore import serve

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} must be in 0..65535 (0: any free port)")
    try:
        return serve(args.host, args.port)
    except socket.gaierror as e:
        raise MeshforgeError(
            f"cannot listen on --host {args.host} ({e.strerror}); give an address of this machine, e.g. 127.0.0.1"
        ) from None
    except OSError as e:
        raise MeshforgeError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); try another --port") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshforge", description="Train transformer language models across a device mesh.")
    p.add_argument("--version", action="version", version=f"meshforge {__version__}")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("train", help="train a model (meshforge train --help)", add_help=False)
    data = sub.add_parser("data", help="prepare corpora into token shards")
    dsub = data.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="tokenize text, JSONL, Parquet or Arrow into shards")
    prep.add_argument("--input", nargs="+", required=True, help="files, directories, globs: text, JSONL, Parquet")
    prep.add_argument("--field", default="text", help="the JSONL field / Parquet or Arrow column with the text")
    prep.add_argument("--workers", type=int, default=0, help="tokenizing threads (default 0: one per core, at most 16)")
    prep.add_argument("--out", required=True, help="directory to create")
    prep.add_argument("--tokenizer", default="byte", help="'byte' or a path to a Hugging Face tokenizer.json")
    prep.add_argument(
        "--val-fraction", type=float, default=0.01, help="share of the tokens held out for validation (default 0.01)"
    )
    conv = sub.add_parser("convert", help="convert between Hugging Face, meshforge weights and checkpoints")
    g = conv.add_mutually_exclusive_group(required=True)
    g.add_argument("--from-hf", metavar="DIR", help="a Hugging Face Llama-family or Mixtral/Qwen3-MoE directory")
    g.add_argument("--to-hf", metavar="DIR", help="meshforge weights (e.g. a run's final/) to write as Hugging Face")
    g.add_argument(
        "--from-checkpoint",
        metavar="DIR",
        help="a complete training checkpoint (or a run's checkpoints/ folder: the newest) to write as Hugging Face",
    )
    conv.add_argument("--out", required=True, metavar="DIR", help="directory to write the converted weights to")
    from meshforge.planner.plan import add_arguments, whole

    plan = sub.add_parser("plan", help="find the layout that fits and runs fastest; predict memory, time and MFU")
    add_arguments(plan)
    cal = sub.add_parser("calibrate", help="measure this machine into a hardware profile for meshforge plan")
    cal.add_argument("--out", required=True, metavar="FILE", help="hardware profile (JSON) to write, for --hardware")
    cal.add_argument(
        "--nproc", type=whole(1, 1024), default=2, help="local ranks for the collective measurements (default 2)"
    )
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    rep = sub.add_parser("report", help="write a self-contained HTML report of one or more runs (curves overlaid)")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (meshforge train's out_dir)")
    rep.add_argument("--out", metavar="FILE", help="where to write it (default: the first run's report.html)")
    exp = sub.add_parser("explore", help="the strategy explorer: a local web page over the planner")
    exp.add_argument("--port", type=int, default=8800, help="port to listen on (default 8800; 0: any free port)")
    exp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "train":
            return cmd_train(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "data":
            return cmd_data(args)
        if args.command == "convert":
            return cmd_convert(args)
        if args.command == "plan":
            from meshforge.planner.plan import run

            return run(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "explore":
            return cmd_explore(args)
        if args.command == "calibrate":
            from meshforge.calibration.measure import run as run_calibrate

            return run_calibrate(args)
        parser.print_help()
        return 0
    except MeshforgeError as e:
        if e.every_rank and launch_env.under_launcher() and launch_env.local_rank() != 0:
            from meshforge.peer_lost import leave_it_to_local_rank0

            return leave_it_to_local_rank0(e)  # said once per node
        print(f"meshforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshforge: aborted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _pipe_closed()
    except Exception as e:
        from meshforge.peer_lost import is_peer_lost, say_peer_lost

        if launch_env.under_launcher() and is_peer_lost(e):
            return say_peer_lost(e)
        raise


def entry() -> None:
    """The console script and ``python -m meshforge``. A rank of a multi-rank run that failed
    leaves with os._exit: torch's process-group teardown at interpreter exit can abort it
    (SIGABRT, "terminate called without an active exception") once its peers are gone, and
    the launcher would then report -6 instead of the documented exit code (docs/health.md)."""
    code = main()
    if code and launch_env.under_launcher() and launch_env.world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def _pipe_closed() -> int:
    """The reader of stdout went away (``meshforge ... | head``): stop quietly, as ``cat`` does.
    Stdout goes to /dev/null so the interpreter's last flush does not raise again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0
