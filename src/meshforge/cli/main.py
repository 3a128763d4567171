"""``meshforge`` command line: train, plan, calibrate, report, explore, data prepare, convert, generate.

Each subcommand imports what it runs inside its own function (the only function-local
imports in meshforge, on purpose): ``meshforge --help`` or a bad flag answers at once,
without loading torch, the training stack or the planner.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import shlex
import socket
import sys
import threading
from pathlib import Path
from typing import NoReturn

from meshforge import __version__
from meshforge.errors import ConfigError, MeshforgeError
from meshforge.guards.disk import DiskError, check_name_length, describe
from meshforge.guards.out_paths import check_file_out, check_out_dir, check_profile_out, check_report_out
from meshforge.launch import env as launch_env
from meshforge.launch import startup_gc
from meshforge.safeio.parse import read_json


def cmd_data(args: argparse.Namespace) -> int:
    from meshforge.data.corpus import split_warnings
    from meshforge.data.prepare import prepare
    from meshforge.data.tokenizer import load_tokenizer
    from meshforge.health.text_check import refuse_binary

    if not 0 <= args.val_fraction < 1:
        raise ConfigError(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    if args.workers < 0:
        raise ConfigError(f"--workers {args.workers} must be 0 (one per core) or more")
    for path in args.input:
        refuse_binary(path, args.allow_binary, "--input", "--allow-binary")
    out = Path(args.out)
    check_name_length(out, "--out")
    if not (out / "index.json").is_file():  # (prepared data there is said by prepare itself)
        check_out_dir(out)
    tok = load_tokenizer(args.tokenizer)
    try:
        out = prepare(
            args.input, out, tok, args.val_fraction, field=args.field, workers=args.workers, progress=sys.stderr
        )
    except OSError as e:
        raise DiskError(describe(out, e, "write", "--out")) from None
    index = read_json(out / "index.json", ConfigError)
    counts = {k: sum(s["tokens"] for s in v) for k, v in index["splits"].items()}
    print(
        f"prepared {index['documents']:,} document{'s' if index['documents'] != 1 else ''} into {out}: "
        f"{counts.get('train', 0):,} train tokens, "
        f"{counts.get('val', 0):,} val tokens ({index['dtype']}, tokenizer {index['tokenizer']})"
    )
    sys.stdout.flush()  # (the warnings on stderr come after this line, before the next)
    for line in split_warnings(counts, args.val_fraction):
        print(f"meshforge: warning: {line}", file=sys.stderr, flush=True)
    print(
        f"train on it with: meshforge train --data.path {shlex.quote(str(out))}"
        + (f" --data.tokenizer {shlex.quote(args.tokenizer)}" if args.tokenizer != "byte" else "")
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_out_dir(out)
    try:
        return _convert(args, out)
    except OSError as e:
        writing = not e.filename or str(Path(e.filename).absolute()).startswith(str(out.absolute()))
        raise DiskError(describe(out, e, "write" if writing else "read", "--out")) from None


def _convert(args: argparse.Namespace, out: Path) -> int:
    from meshforge.checkpoint.weights import load_pretrained, save_model_weights
    from meshforge.models.hf import load_hf_checkpoint, save_hf_checkpoint

    _refuse_run_dir(args)
    if args.from_checkpoint:
        from meshforge.checkpoint.export import checkpoint_to_hf

        path = checkpoint_to_hf(Path(args.from_checkpoint), out)
        print(f"converted checkpoint {path} -> Hugging Face checkpoint {out} (loads with from_pretrained)")
        return 0
    if args.from_hf:
        if not Path(args.from_hf).is_dir():
            raise MeshforgeError(
                f"--from-hf {args.from_hf}: not a directory. meshforge reads local Hugging Face directories only "
                f"(no hub downloads): fetch it first, e.g. `hf download {args.from_hf} --local-dir DIR` (the `hf` "
                "command of huggingface_hub 0.34 or later), then pass --from-hf DIR"
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


def _refuse_run_dir(args: argparse.Namespace) -> None:
    """A run directory given where its final/ or checkpoints/ goes (generate takes a run directory
    whole; convert does not): name the folder to give instead of "holds neither meshforge.json ..."."""
    flag, sub = ("--to-hf", "final") if args.to_hf else ("--from-checkpoint", "checkpoints")
    given = Path(args.to_hf or args.from_checkpoint or "")
    if args.from_hf or not (given / "config.toml").is_file() or (given / "meshforge.json").is_file():
        return
    if (given / sub).is_dir():
        raise ConfigError(f"{flag} {given} is a run directory; give its {sub}/: {flag} {given / sub}")
    raise ConfigError(
        f"{flag} {given} is a run directory without {sub}/; give weights (a run's final/) or a checkpoint"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from meshforge.cli import generate

    return generate.run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from meshforge.report import write_report

    if args.out:
        check_report_out(Path(args.out))
    try:
        path = write_report(args.run_dirs, args.out)
    except OSError as e:
        raise DiskError(describe(args.out or "report.html", e, "write the report to", "--out")) from None
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
        fix = "try another --port"
        if e.errno == errno.EADDRNOTAVAIL:  # an address of another machine, not a port in use
            fix = "--host must be an address of this machine, e.g. 127.0.0.1 (or 0.0.0.0: all of them)"
        raise MeshforgeError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); {fix}") from None


def _add_convert(sub: argparse._SubParsersAction) -> None:
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


def cmd_lighthouse(args: argparse.Namespace) -> int:
    """``meshforge lighthouse``: torchft's quorum server in the foreground (parallel/fault_tolerance)."""
    from meshforge.parallel.fault_tolerance.lighthouse import serve

    return serve(args.bind, args.min_replicas)


class OneParagraphParser(argparse.ArgumentParser):
    """argparse, less the usage it prints before an error: `meshforge plan`'s alone is 20 lines above
    the one that matters. Bad input is one paragraph and exit 2; the subcommands inherit this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists every flag\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneParagraphParser(prog="meshforge", description="Train transformer language models across a device mesh.")
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
    prep.add_argument("--allow-binary", action="store_true", help="tokenize inputs that are mostly not text")
    _add_convert(sub)
    from meshforge.cli.generate import add_parser as add_generate
    from meshforge.planner.plan_args import add_arguments, whole

    add_generate(sub)

    plan = sub.add_parser("plan", help="find the layout that fits and runs fastest; predict memory, time and MFU")
    add_arguments(plan)
    cal = sub.add_parser("calibrate", help="measure this machine into a hardware profile for meshforge plan")
    cal.add_argument("--out", required=True, metavar="FILE", help="hardware profile (JSON) to write, for --hardware")
    cal.add_argument(
        "--nproc", type=whole(1, 1024), default=2, help="local ranks for the collective measurements (default 2)"
    )
    cal.add_argument("--quick", action="store_true", help="fewer sizes, repeats and calls per timing")
    rep = sub.add_parser("report", help="write a self-contained HTML report of one or more runs (curves overlaid)")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (meshforge train's run.dir)")
    rep.add_argument("--out", metavar="FILE", help="where to write it (default: the first run's report.html)")
    lh = sub.add_parser("lighthouse", help="run torchft's lighthouse: the quorum server of fault-tolerant groups")
    lh.add_argument("--bind", required=True, metavar="HOST:PORT", help="address to listen on, e.g. 0.0.0.0:29510")
    lh.add_argument("--min-replicas", type=whole(1, 1024), required=True, metavar="N", help="groups a quorum needs")
    exp = sub.add_parser("explore", help="the strategy explorer: a local web page over the planner")
    exp.add_argument("--port", type=int, default=8800, help="port to listen on (default 8800; 0: any free port)")
    exp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "train":
            from meshforge.cli.train import cmd_train

            return cmd_train(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        simple = {"data": cmd_data, "convert": cmd_convert, "generate": cmd_generate, "lighthouse": cmd_lighthouse}
        if args.command in simple:
            return simple[args.command](args)
        if args.command == "plan":
            from meshforge.planner.plan import run

            if args.emit_config:
                check_file_out(Path(args.emit_config), "--emit-config", None, "a new file")
            return run(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "explore":
            return cmd_explore(args)
        if args.command == "calibrate":
            from meshforge.calibration.calibrate import run as run_calibrate

            check_profile_out(Path(args.out))
            return run_calibrate(args)
        parser.print_help()
        return 0
    except MeshforgeError as e:
        if e.every_rank and launch_env.under_launcher() and launch_env.local_rank() != 0:
            from meshforge.health.peer_lost import leave_it_to_local_rank0

            return leave_it_to_local_rank0(e)  # said once per node
        print(f"meshforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshforge: aborted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _pipe_closed()
    except Exception as e:
        from meshforge.health.peer_lost import is_peer_lost, say_peer_lost

        if launch_env.under_launcher() and is_peer_lost(e):
            return say_peer_lost(e)
        raise


def entry() -> None:
    """The console script and ``python -m meshforge``. A rank of a multi-rank run that failed
    leaves with os._exit: torch's process-group teardown at interpreter exit can abort it
    (SIGABRT, "terminate called without an active exception") once its peers are gone, and
    the launcher would then report -6 instead of the documented exit code (docs/health.md)."""
    if sys.argv[1:2] == ["train"]:
        startup_gc.pause()  # a train process, until its long part starts; not for in-process main()
    code = main()
    if code and launch_env.under_launcher() and launch_env.world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    leave(code)


def leave(code: int) -> None:
    """Exit as the interpreter would, less its final teardown. Once torch and the training
    stack are loaded, unloading ~2,000 modules at exit costs a process 1-2.5 s of wall time,
    for nothing: the OS frees it all anyway. That is paid by every rank and every launcher,
    so a 2-rank run spent ~3.5 s of its ~20 s leaving. What the exit must still do is done
    here first: non-daemon threads are joined (threading's own shutdown: executors finish
    their work), atexit handlers run (run locks, logging, weakref finalizers), streams are
    flushed; then ``os._exit``. An exception out of main() takes the ordinary way out."""
    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first (CPython)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    os._exit(code)


def _pipe_closed() -> int:
    """The reader of stdout went away (``meshforge ... | head``): stop quietly, as ``cat`` does.
    Stdout goes to /dev/null so the interpreter's last flush does not raise again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0
