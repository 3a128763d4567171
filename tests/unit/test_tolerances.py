"""The arithmetic the equivalence tests' tolerances rest on, measured on the CPU that runs them.

Every layout test compares a parallel run with the single process to 1e-5 relative (losses,
gradient norms) and per-tensor weights, which holds only while one Adam step turns a
summation-order difference in the gradients into a bounded weight difference (tests/conftest.py,
``ADAM_EPS``). If a CPU's round-off is larger than assumed, this test fails and names the
cause, instead of equivalence tests failing one by one on a machine nobody tried."""

import copy

import torch

from conftest import ADAM_EPS
from meshforge.models.llama import build_model
from meshforge.models.shape import ModelShape

SHAPE = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512)
LR = 3e-3  # the config's default, the largest most layout tests use
STEP_BOUND = 1e-7  # per element per step: 8 steps stay under the 1e-6 the per-element tests allow


def _grads_in_two_orders(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same batch's gradient summed as one batch of 8 and as 4 micro-batches of 2."""
    tokens = torch.randint(0, SHAPE.vocab_size, (8, 33), generator=torch.Generator().manual_seed(0))
    out = []
    for micro in (8, 2):
        model.zero_grad()
        for i in range(0, 8, micro):
            t = tokens[i : i + micro]
            loss = torch.nn.functional.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
            (loss * micro / 8).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out[0], out[1]


def _one_step(model: torch.nn.Module, grads: list[torch.Tensor], eps: float) -> list[torch.Tensor]:
    m = copy.deepcopy(model)
    for p, g in zip(m.parameters(), grads, strict=True):
        p.grad = g.clone()
    torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.95), eps=eps, weight_decay=0.1).step()
    return [p.detach() for p in m.parameters()]


def test_one_adam_step_bounds_a_summation_order_difference():
    """The same gradient summed in two orders differs by round-off only; with ``ADAM_EPS`` one
    AdamW step keeps every weight within STEP_BOUND of the other order's. torch's default ε
    (1e-8) does not: an element whose gradient is ~0 moves by up to ±lr either way -- the cause of
    the equivalence failures on an AVX-512 Xeon (shown here when this CPU's orders differ)."""
    model = build_model(SHAPE, seed=0)
    a, b = _grads_in_two_orders(model)
    dg = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    gmax = max(float(x.abs().max()) for x in a)
    assert dg <= 64 * 2**-24 * gmax, f"gradients differ by {dg:.2e}: more than round-off of {gmax:.2e}"
    wa, wb = _one_step(model, a, ADAM_EPS), _one_step(model, b, ADAM_EPS)
    worst = max(float((x - y).abs().max()) for x, y in zip(wa, wb, strict=True))
    assert worst <= STEP_BOUND, (
        f"one Adam step (eps {ADAM_EPS:g}) turned gradient round-off of {dg:.2e} into weights {worst:.2e} apart; "
        f"the equivalence tests assume <= {STEP_BOUND:g}: raise ADAM_EPS in tests/conftest.py"
    )
    if dg > 0:  # this CPU sums the two orders differently: the small ε really amplifies it
        wa, wb = _one_step(model, a, 1e-8), _one_step(model, b, 1e-8)
        assert max(float((x - y).abs().max()) for x, y in zip(wa, wb, strict=True)) > 10 * worst
