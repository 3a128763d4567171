"""The step record (metrics.jsonl, TensorBoard, console) and the run summary.

Between logged steps only what is free is kept: each step's host wall time and a handle
on its (unreduced, on-device) loss for the summary's first and last-ten losses. Everything
that needs a device sync or a collective (the reduced loss, the grad norm's value, state
bytes, communication counts, pipeline statistics) is taken on measured steps only, by
the step runner and the loop; this file turns those into records.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from meshforge.config.run_plan import RunPlan
from meshforge.data.dataset import TokenDataset
from meshforge.metrics.memory import GIB, peak_mem_gib
from meshforge.metrics.mfu import utilization
from meshforge.metrics.pace import Pace
from meshforge.metrics.step_result import StepResult
from meshforge.models.flops import hardware_flops_per_token, model_flops_per_token
from meshforge.models.shape import ModelShape
from meshforge.parallel.fp8 import fp8_emulated

SUMMARY_TAIL = 10  # final_loss: the mean of the last this-many steps' losses


class StepMetrics:
    """Turns measured steps into records; keeps step times and loss handles in between."""

    def __init__(self, plan: RunPlan, shape: ModelShape, world_size: int, peak: float, device: torch.device):
        t = plan.train
        self.tokens_per_step, self.world_size = t.global_batch_size * t.seq_len, world_size
        self.shape, self.seq_len, self.recompute = shape, t.seq_len, plan.layout.activation_checkpoint
        self.flops_per_token = model_flops_per_token(shape, t.seq_len)
        self.hw_flops_per_token = hardware_flops_per_token(shape, t.seq_len, plan.layout.activation_checkpoint)
        self.spans: list[float] = []  # packed documents masked: the logged windows' attention spans
        self.peak, self.device = peak, device
        self.times: list[float] = []  # every step's wall time (host clock, no sync)
        self.pace = Pace()  # the step time recently (a moving average) and on average, for the summary
        self.window: list[float] = []  # since the last logged step
        self.first_loss: torch.Tensor | None = None
        self.recent: deque[torch.Tensor] = deque(maxlen=SUMMARY_TAIL)
        self.breakdown: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # the time breakdown (a gather)
        self.breakdown_sum: dict[str, float] = {}

    def add(self, dt: float, result: StepResult) -> None:
        """Book one step: its time, and its loss tensor (a reference, no copy, no sync)."""
        self.times.append(dt)
        self.pace.add(1, dt)
        self.window.append(dt)
        if self.first_loss is None:
            self.first_loss = result.loss
        if not result.skipped:  # a skipped step's (non-finite, spiking) loss is not the run's
            self.recent.append(result.loss)

    def recent_step_time(self) -> float:
        """Mean wall time of the last ten steps (for the Young/Daly checkpoint interval)."""
        tail = self.times[-10:]
        return sum(tail) / len(tail)

    def record(self, step: int, tokens_seen: int, result: StepResult, extra: dict[str, Any]) -> dict[str, Any]:
        """The logged record of measured step ``step``; times are the mean over the window
        since the last logged step, which this starts afresh. ``extra``: comm bytes, pp stats."""
        step_time = sum(self.window) / len(self.window)
        self.window = []
        tps = self.tokens_per_step / step_time
        per_device = tps / self.world_size
        state_mem = result.state_mem or {}
        comm = extra.get("comm_bytes_by_kind", {})
        more = {"time_breakdown": self.breakdown(extra.get("pp_stats", {}))} if self.breakdown else {}
        for k, v in more.get("time_breakdown", {}).items():
            if k != "by_rank":
                self.breakdown_sum[k] = self.breakdown_sum.get(k, 0.0) + v
        flops, hw_flops = self.flops(extra.get("attention_span"))
        rec = {
            "step": step,
            "loss": result.global_loss,
            "lr": result.lr,
            "grad_norm": float(result.grad_norm),
            "tokens_per_s": tps,
            "step_time_s": step_time,
            "mfu": utilization(flops, per_device, self.peak),
            "hfu": utilization(hw_flops, per_device, self.peak),
            "peak_mem_gib": peak_mem_gib(self.device),
            "tokens_seen": tokens_seen,
            "state_mem_gib": sum(state_mem.values()) / GIB,
            "state_mem_bytes": dict(state_mem),
            "comm_bytes": {axis: sum(k.values()) for axis, k in comm.items()},
            "comm_bytes_by_kind": comm,
            **extra.get("pp_stats", {}),
            **more,
            **extra.get("moe", {}),  # MoE: lm_loss, aux_loss, z_loss, expert_load, dropped_fraction
        }
        if extra.get("attention_span") is not None:  # packed documents masked: what ran, and the causal count
            self.spans.append(extra["attention_span"])
            rec["attention_span"] = extra["attention_span"]
            rec["mfu_causal"] = utilization(self.flops_per_token, per_device, self.peak)
        if result.replicas is not None:  # fault tolerance: the live replica groups
            rec["replicas"] = result.replicas
        if result.state_mem_host is not None:  # CPU offload: where the state lives
            host = result.state_mem_host
            rec["state_mem_host_bytes"] = dict(host)
            rec["state_mem_device_bytes"] = {k: v - host.get(k, 0) for k, v in state_mem.items()}
        return rec

    def flops(self, span: float | None) -> tuple[float, float]:
        """(model, hardware) FLOPs per token as executed: under document masks attention runs over
        ``span`` keys per query (``Documents.span``) rather than the sequence (docs/metrics.md)."""
        if span is None:
            return self.flops_per_token, self.hw_flops_per_token
        return model_flops_per_token(self.shape, span), hardware_flops_per_token(self.shape, span, self.recompute)

    def summary(self, reduce_loss: Callable[[torch.Tensor], torch.Tensor], **fields: Any) -> dict[str, Any]:
        """The run's summary. ``reduce_loss`` turns the kept per-rank losses into global ones in
        one collective (every rank calls this). ``fields``: steps, interrupted, tokens,
        wall_time_s, val_loss, and start_step (where a resumed session began; 0 by default)."""
        kept = reduce_loss(torch.stack([self.first_loss, *self.recent])).tolist()
        warm = self.times[max(1, len(self.times) // 10) :] or self.times  # leave out the first steps (compile, caches)
        tps = self.tokens_per_step * len(warm) / sum(warm)
        per_device = tps / self.world_size
        out = {k: fields[k] for k in ("steps", "interrupted", "tokens", "wall_time_s")}
        out["start_step"] = fields.get("start_step", 0)
        flops, hw_flops = self.flops(sum(self.spans) / len(self.spans) if self.spans else None)
        return {
            **out,
            "first_loss": kept[0],
            "final_loss": sum(kept[1:]) / len(kept[1:]),
            "final_loss_steps": len(kept[1:]),
            "val_loss": fields["val_loss"],
            "tokens_per_s": tps,
            "step_time_mean_s": self.pace.average,
            "step_time_recent_s": self.pace.recent,
            "mfu": utilization(flops, per_device, self.peak),
            "hfu": utilization(hw_flops, per_device, self.peak),
            "peak_mem_gib": peak_mem_gib(self.device),
            "time_breakdown": self.breakdown_sum,  # summed over the logged steps
        }


def start_line(
    plan: RunPlan,
    params: int,
    world: int,
    device: torch.device,
    precision: str,
    data: TokenDataset,
) -> str:
    """The console's first line: what is trained, where, on what."""
    t, b = plan.train, plan.batch
    return (
        f"meshforge: training {plan.model.preset} ({params / 1e6:.2f}M params) for {t.steps} "
        f"steps on {world} x {device.type} ({precision}) | batch "
        f"{t.global_batch_size} x {t.seq_len} tokens, {b.count} micro-batch(es) of {b.micro} per rank "
        f"| data {data.root} ({len(data.train)} sequences) | run dir {plan.run.dir}"
        + (f" | {fp8_note(plan, device)}" if precision == "fp8" else "")
    )


def fp8_note(plan: RunPlan, device: torch.device) -> str:
    """Says whether fp8 is real or emulated (numerics only) on this device."""
    recipe = plan.train.fp8_recipe
    if device.type != "cuda":
        return f"fp8 ({recipe}) emulated on CPU: numerics only, no speedup"
    if fp8_emulated(device):
        return f"fp8 ({recipe}) emulated: this GPU has no fp8 tensor cores (compute capability < 8.9): numerics only"
    return f"fp8 ({recipe}): real fp8 matmuls"


def end_line(summary: dict[str, Any], run_dir: str) -> str:
    """The console's last line (the final loss is the mean of the last steps': one step's is noisy)."""
    val_loss = summary["val_loss"]
    vl = f" | val loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50)):.2f})" if val_loss is not None else ""
    tail = summary.get("final_loss_steps", SUMMARY_TAIL)
    loss = f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} (mean of the last {tail} steps)"
    return (
        f"{'stopped early' if summary['interrupted'] else 'done'}: {_steps(summary)} in "
        f"{summary['wall_time_s']:.1f}s{_pace(summary)} | {_tokens(summary['tokens'])} | {loss}{vl} | "
        f"{summary['tokens_per_s']:,.0f} tok/s | MFU {100 * summary['mfu']:.1f}% | "
        f"HFU {100 * summary['hfu']:.1f}% | peak mem {summary['peak_mem_gib']:.2f} GiB | {run_dir}"
    )


def _steps(summary: dict[str, Any]) -> str:
    """The steps this session took: a resumed run's wall time is not that of all its steps."""
    start, end = summary.get("start_step", 0), summary["steps"]
    return f"{end} steps" if not start else f"steps {start + 1}-{end} ({end - start} steps, resumed at step {start})"


def _tokens(n: float) -> str:
    """Tokens seen, in millions once there are many (a short run's 2,560 is not "0.00M")."""
    return f"{n:,.0f} tokens" if n < 100_000 else f"{n / 1e6:.2f}M tokens"


def _pace(summary: dict[str, Any]) -> str:
    """A step's time on average and recently (what the ETA used), when the summary has them."""
    mean, recent = summary.get("step_time_mean_s"), summary.get("step_time_recent_s")
    if mean is None or recent is None or not math.isfinite(mean) or not math.isfinite(recent):
        return ""
    return f" ({mean:.3g} s/step on average, {recent:.3g} s/step recently)"
