"""What a slow link between islands costs DDP and DiLoCo (``meshforge plan --islands M
--inter-island-gbps X``).

The planner's layout estimate gives the step time inside the islands (compute plus the
fast-link traffic). On top of it:

- DDP across islands all-reduces the gradients over the inter-island link every step:
  2(M-1)/M x P x 4 bytes (fp32 gradients, ring) per island link. Backward hides at most
  its own share of the step (2/3 of the compute), so the exposed part is
  max(0, t_link - 2/3 x t_step).
- DiLoCo all-reduces the pseudo-gradients once per round of H steps, in the sync dtype
  (fp32 4, bf16 2, fp8 1 byte + a 4-byte scale per 256): blocking, t_sync / H per step.
  Streaming DiLoCo sends one fragment (1/F of it) H/F steps apart, each overlapped with
  ``delay`` inner steps: exposed F x max(0, t_sync / F - delay x t_step) / H per step.

Latency is left out: with one sync per round it is amortised over H steps, and DDP is
bandwidth-bound on such links. Same formulas as parallel/diloco/outer.py's traffic (the tests
check the bytes against the communication counters).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshforge.config.keys import keys

DILOCO_KEYS = ("inner_steps", "fragments", "delay", "sync_dtype")
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 256}  # per pseudo-gradient element
# the DiLoCo flags' defaults (they only matter with --islands M > 1): the [diloco] keys' own
DEFAULTS = {"inter_island_gbps": 10.0, **{k: keys()[f"diloco.{k}"].default for k in DILOCO_KEYS}}


def add_arguments(p: argparse.ArgumentParser, key_flag: Callable[..., Any], real: Callable[..., Any]) -> None:
    """The DiLoCo flags: the [diloco] keys' (``key_flag`` builds a flag from its key's field) and the
    link's (``real``: an argparse type)."""
    d = p.add_argument_group("DiLoCo across islands (docs/diloco.md)")
    key_flag(d, "diloco.islands", "islands joined by a slow link; compares DDP and DiLoCo", default=1, metavar="M")
    d.add_argument(
        "--inter-island-gbps",
        type=real(),
        default=DEFAULTS["inter_island_gbps"],
        metavar="GBITS",
        help="island link, Gbit/s per island",
    )
    key_flag(d, "diloco.inner_steps", "", default=DEFAULTS["inner_steps"], metavar="H")
    key_flag(d, "diloco.fragments", "", default=DEFAULTS["fragments"])
    key_flag(d, "diloco.delay", "", default=DEFAULTS["delay"], metavar="TAU")
    key_flag(d, "diloco.sync_dtype", "", default=DEFAULTS["sync_dtype"])


@dataclass(frozen=True)
class IslandCosts:
    islands: int
    link_gbps: float
    inner_step_s: float  # the planner's step time inside an island
    ddp_step_s: float
    diloco_step_s: float
    ddp_bytes_per_step: float  # over each island's link
    diloco_bytes_per_step: float
    diloco_peak_bytes_per_sync: float
    speedup: float  # DDP's step time / DiLoCo's


def unused_flags(args: argparse.Namespace) -> list[str]:
    """The DiLoCo flags set away from their defaults while ``--islands`` is 1 (they would be ignored)."""
    if args.islands > 1:
        return []
    return ["--" + k.replace("_", "-") for k, v in DEFAULTS.items() if getattr(args, k) != v]


def island_costs(params: int, step_s: float, args: argparse.Namespace) -> IslandCosts:
    """DDP's and DiLoCo's step time when M islands share a link of ``args.inter_island_gbps``."""
    m, h, f = args.islands, max(1, args.inner_steps), max(1, args.fragments)
    link = args.inter_island_gbps * 1e9 / 8  # bytes/s
    ring = 2 * (m - 1) / m
    ddp_bytes = ring * params * 4.0
    ddp = step_s + max(0.0, ddp_bytes / link - 2 / 3 * step_s)
    sync_bytes = ring * params * WIRE_BYTES[args.sync_dtype]
    per_fragment = sync_bytes / f / link
    exposed = f * max(0.0, per_fragment - args.delay * step_s) / h
    diloco = step_s + exposed
    return IslandCosts(
        m, args.inter_island_gbps, step_s, ddp, diloco, ddp_bytes, sync_bytes / h, sync_bytes / f, ddp / diloco
    )


def describe(c: IslandCosts, args: argparse.Namespace) -> str:
    """The comparison as a few lines for ``meshforge plan``."""
    gib = 2**30
    return (
        f"\nacross {c.islands} islands on a {c.link_gbps:g} Gbit/s link (best layout inside each island: "
        f"{c.inner_step_s:.4f} s/step):\n"
        f"  DDP over the link:  {c.ddp_step_s:.4f} s/step, {c.ddp_bytes_per_step / gib:.3f} GiB per step on the link\n"
        f"  DiLoCo H={args.inner_steps} fragments={args.fragments} delay={args.delay} {args.sync_dtype}: "
        f"{c.diloco_step_s:.4f} s/step, {c.diloco_bytes_per_step / gib:.4f} GiB per step, "
        f"{c.diloco_peak_bytes_per_sync / gib:.3f} GiB per sync\n"
        f"  DiLoCo is {c.speedup:.1f}x DDP's throughput on this link"
    )
