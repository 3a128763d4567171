"""``meshforge generate RUN_DIR|WEIGHTS --prompt TEXT``: sample text from a trained model on one
device, streamed to stdout as it comes. It reads a run directory (its ``final/`` weights, else its
newest complete checkpoint), a meshforge weights directory, a checkpoint (or a ``checkpoints/``
folder) or a Hugging Face directory, and decodes with the tokenizer the run trained with (its
``config.toml``'s ``data.tokenizer``), a Hugging Face directory's own ``tokenizer.json``, or
``--tokenizer``. Everything is checked before the model is loaded: bad input is one paragraph and
exit 2, and nothing is written. Imported only for the ``generate`` command (cli/main.py)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError, MeshforgeError

MAX_NEW_TOKENS = 1 << 20  # far beyond any context meshforge trains


def add_parser(sub: Any) -> None:
    """The ``generate`` subcommand's arguments."""
    g = sub.add_parser("generate", help="sample text from a trained run, a checkpoint or weights (one device)")
    g.add_argument(
        "source",
        metavar="RUN_DIR|WEIGHTS",
        help="a run directory, meshforge weights (a run's final/), a checkpoint or a Hugging Face directory",
    )
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to add (default 100)")
    g.add_argument(
        "--temperature", type=float, default=0.8, metavar="T", help="sampling temperature; 0: greedy (default 0.8)"
    )
    g.add_argument("--top-k", type=int, default=50, metavar="K", help="sample among the K likeliest; 0: all (50)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="the sampler's seed: the same seed, the same text")
    g.add_argument(
        "--tokenizer",
        help="'byte' or a tokenizer.json (default: the run's data.tokenizer, or the directory's tokenizer.json)",
    )


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flag values that cannot sample, naming the flag and what it takes."""
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be between 1 and {MAX_NEW_TOKENS:,}")
    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= 100):
        raise ConfigError(f"--temperature {args.temperature} must be a number in [0, 100] (0: greedy)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k} must be 0 (every token) or more")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed {args.seed} must be in [0, 2^63)")
    if not args.prompt:
        raise ConfigError("--prompt is empty; give the text to continue")


def locate(source: Path) -> tuple[str, Path, Path | None]:
    """(kind, path, run directory) of what ``source`` names: kind is weights, hf or checkpoint."""
    from meshforge.checkpoint import store

    if not source.is_dir():
        what = "does not exist" if not source.exists() else "is not a directory"
        raise MeshforgeError(f"{source} {what}; give a run directory, a run's final/, a checkpoint or weights")
    if (source / "meshforge.json").is_file():
        return "weights", source, _run_dir(source.parent)
    if (source / "config.json").is_file():
        return "hf", source, _run_dir(source.parent)
    if (source / store.COMPLETE).is_file() or (source / "meta.json").is_file():
        return "checkpoint", source, _run_dir(source.parent.parent)
    if store.list_complete(source):  # a checkpoints/ folder
        return "checkpoint", source, _run_dir(source.parent)
    if (source / "config.toml").is_file():
        if (source / "final" / "meshforge.json").is_file():
            return "weights", source / "final", source
        if (source / "checkpoints").is_dir() and store.list_complete(source / "checkpoints"):
            return "checkpoint", source / "checkpoints", source
        raise MeshforgeError(
            f"{source} holds no weights: no final/ and no complete checkpoint (the run stopped before it saved "
            "any, or checkpoint.save_final = false, checkpoint.final = false and checkpoint.interval = 0); train it "
            "again with them"
        )
    raise MeshforgeError(
        f"{source} is neither a run directory (config.toml) nor weights (meshforge.json, a Hugging Face "
        "config.json) nor a checkpoint; give a run directory such as runs/debug-..., or its final/"
    )


def _run_dir(d: Path) -> Path | None:
    """``d`` when it is the run directory the weights were found in (it holds the run's config.toml)."""
    return d if (d / "config.toml").is_file() else None


def pick_tokenizer(args: argparse.Namespace, kind: str, path: Path, run: Path | None) -> Any:
    """The tokenizer to decode with: --tokenizer, the run's data.tokenizer, a Hugging Face directory's own."""
    from meshforge.config import load_config
    from meshforge.data.tokenizer import load_tokenizer

    if args.tokenizer:
        given = Path(args.tokenizer)
        if args.tokenizer != "byte" and not (given.is_file() or (given / "tokenizer.json").is_file()):
            raise MeshforgeError(
                f"--tokenizer {args.tokenizer} is neither 'byte' nor a tokenizer.json (or a folder holding one); "
                "pass the tokenizer the model was trained with"
            )
        return load_tokenizer(args.tokenizer)
    if run is not None:
        spec = load_config(run / "config.toml").data.tokenizer
        if spec != "byte" and not Path(spec).exists():
            raise MeshforgeError(
                f"{run / 'config.toml'} names data.tokenizer = '{spec}', which is not there from this directory; "
                "run from where the run was trained, or pass --tokenizer PATH"
            )
        return load_tokenizer(spec)
    if kind == "hf" and (path / "tokenizer.json").is_file():
        return load_tokenizer(str(path / "tokenizer.json"))
    raise MeshforgeError(
        f"no tokenizer is known for {path} (no run's config.toml beside it, no tokenizer.json in it); "
        "pass --tokenizer byte or --tokenizer PATH/tokenizer.json, the one the model was trained with"
    )


def load_model(kind: str, path: Path) -> Any:
    """The model on one device (a GPU where there is one), in evaluation mode."""
    import torch

    from meshforge.checkpoint.export import load_checkpoint_model
    from meshforge.checkpoint.weights import load_pretrained

    model = load_checkpoint_model(path)[0] if kind == "checkpoint" else load_pretrained(path)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def run(args: argparse.Namespace) -> int:
    """Check, load, and stream the continuation of the prompt to stdout."""
    from meshforge.models.generate import Sampling

    check_flags(args)
    kind, path, run = locate(Path(args.source))
    tok = pick_tokenizer(args, kind, path, run)
    model = load_model(kind, path)
    shape = model.shape
    if tok.vocab_size > shape.vocab_size:
        raise MeshforgeError(
            f"the tokenizer's vocabulary ({tok.vocab_size:,}) is larger than the model's ({shape.vocab_size:,} rows): "
            "it is not the tokenizer the model was trained with; pass that one with --tokenizer"
        )
    prompt = [int(i) for i in tok.encode(args.prompt)]
    room = shape.max_seq_len - len(prompt)
    if room < 1:
        raise MeshforgeError(
            f"the prompt is {len(prompt):,} tokens; the model's context is {shape.max_seq_len:,} positions "
            "(model.max_seq_len), and at least one must be left to generate into; shorten the prompt"
        )
    new = min(args.max_new_tokens, room)
    if new < args.max_new_tokens:
        print(f"meshforge: note: {new} new tokens fill the model's context ({shape.max_seq_len:,})", file=sys.stderr)
    s = Sampling(new, args.temperature, args.top_k, args.seed, tok.vocab_size, tok.eos_id)
    return stream(model, tok, args.prompt, prompt, s, path)


def stream(model: Any, tok: Any, text: str, prompt: list[int], s: Any, path: Path) -> int:
    """Print the prompt, then each new token's text as soon as it decodes to whole characters."""
    from meshforge.models.generate import generate

    out = sys.stdout
    out.write(text)
    out.flush()
    shown, ids, t0 = tok.decode(prompt), list(prompt), time.perf_counter()
    for token in generate(model, prompt, s):
        ids.append(token)
        full = tok.decode(ids)
        if not full.endswith("\ufffd") and full.startswith(shown):  # (a character split over tokens: wait)
            out.write(full[len(shown) :])
            out.flush()
            shown = full
    full = tok.decode(ids)
    out.write((full[len(shown) :] if full.startswith(shown) else "") + "\n")
    out.flush()
    dt = time.perf_counter() - t0
    n = len(ids) - len(prompt)
    stop = " (stopped at end-of-text)" if ids[-1] == s.stop_id else ""
    print(f"meshforge: {n} new tokens in {dt:.1f}s ({n / dt:,.0f} tokens/s) from {path}{stop}", file=sys.stderr)
    return 0
