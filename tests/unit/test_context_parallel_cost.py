"""The ring-attention cost formulas (planner/context_costs.py) against the textbook
figures, and the planner using exactly them (the code's own bytes are checked against the
same formulas in test_context_parallel.py)."""

from dataclasses import replace

import pytest

from meshforge.planner.context_costs import (
    local_tokens,
    ring_bytes,
    ring_extra_saved_bytes_per_token,
    ring_messages,
)
from meshforge.planner.estimate import estimate, plan_layout
from meshforge.planner.hardware import GIB, get_hardware
from meshforge.planner.memory import activation_bytes_per_layer
from meshforge.planner.model_flags import from_preset

H100 = get_hardware("h100-sxm")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_moves_the_papers_share_of_k_and_v(cp):
    """Per layer and micro-batch: forward (cp-1)/cp of the whole sequence's K and V; backward
    as much again plus the K/V gradients (fp32) once around the ring; allgather's all-reduce
    of the gradients 2(cp-1)/cp of every rank's."""
    seq, micro, kv_width, e = 8192, 2, 1024, 2
    tokens = micro * local_tokens(seq, cp)
    whole_kv = 2 * micro * seq * kv_width * e
    ring = ring_bytes(tokens, kv_width, cp, "ring", e)
    assert ring["forward_kv"] == pytest.approx((cp - 1) / cp * whole_kv)
    assert ring["backward_kv"] == ring["forward_kv"]
    assert ring["backward_grads"] == pytest.approx(whole_kv * 4 / e)  # cp hops of a 1/cp block, in fp32
    gather = ring_bytes(tokens, kv_width, cp, "allgather", e)
    assert gather["forward_kv"] == ring["forward_kv"]
    assert gather["backward_grads"] == pytest.approx(2 * (cp - 1) / cp * whole_kv * 4 / e)
    assert ring_bytes(tokens, kv_width, cp, "ring", e, recompute=True)["backward_kv"] == 2 * ring["forward_kv"]
    assert ring_messages(cp) == 3 * cp - 2 and ring_messages(cp, "allgather") == 3
    assert sum(ring_bytes(tokens, kv_width, 1).values()) == 0


@pytest.mark.parametrize("precision, recompute", [("bf16", "none"), ("fp32", "selective"), ("bf16", "full")])
def test_planner_uses_the_ring_formulas(precision, recompute):
    shape = from_preset("llama3.1-8b")
    seq, cp, tp, m = 32768, 4, 2, 2
    lay = plan_layout(tp=tp, pp=1, dp=1, cp=cp, num_microbatches=m, activation_checkpoint=recompute)
    e = 4 if precision == "fp32" else 2
    est = estimate(shape, lay, seq, m, precision, H100, 8)
    tokens = local_tokens(seq, cp)
    rc = recompute != "none"
    bw, alpha = H100.link("send_recv", True)
    per_layer = sum(ring_bytes(tokens, shape.kv_dim / tp, cp, "ring", e, rc).values()) / bw
    per_layer += ring_messages(cp, "ring", rc) * alpha
    assert est.time["cp_comm"] == pytest.approx(0.5 * shape.layers * m * per_layer)
    # activations: the layer's at seq / cp tokens, plus what the ring keeps beyond a fused kernel
    # (the base's dp takes cp's ranks: the same FSDP2 bf16 block)
    base = estimate(shape, replace(lay, cp=1, dp_shard=cp), seq // cp, m, precision, H100, 8).memory["activations"]
    extra = 0 if recompute == "full" else ring_extra_saved_bytes_per_token(shape.heads / tp, shape.head_dim, e)
    want = shape.layers * tokens * extra / GIB
    assert est.memory["activations"] - base == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert activation_bytes_per_layer(shape, tokens, 1, tp, True, recompute, e) > 0
