"""The chunked loss under tensor parallelism (vocab-sharded head, log-sum-exp all-reduced
over tp, with and without sequence parallelism, tied), the pipeline's last stage, context
parallelism, DDP and FSDP2 (ZeRO-3: the head gathered by its hooks when the loss calls
it), against the single-process run with the plain full-logits loss (fp32, gloo, CPU):
losses, gradient norms, validation loss and final weights to 1e-5, through conftest's
assert_run_matches as in test_tensor_parallel.py / test_pipeline.py."""

import pytest

from conftest import assert_run_matches, layout_runner, reference_runner

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = {
    "model.hidden": 64,
    "model.heads": 4,
    "model.kv_heads": 2,
    "model.ffn_hidden": 128,
    "model.layers": 2,
    "train.steps": STEPS,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 2,
    "train.grad_clip": 0.5,
    "train.eval_batches": 1,
    "optim.lr": 1e-3,
}
CHUNK = {"train.loss_chunk_size": 24}  # 2 x 32 tokens per micro-batch (16 per cp rank): a ragged last chunk

LAYOUTS = {  # name: (ranks, overrides)
    "tp2": (2, {"parallel.tp": 2, **CHUNK}),
    "tp2-nosp-tied": (
        2,
        {"parallel.tp": 2, "parallel.sequence_parallel": False, "model.tie_embeddings": True, **CHUNK},
    ),
    "pp2-1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", **CHUNK}),
    "cp2": (2, {"parallel.cp": 2, **CHUNK}),
    "ddp2": (2, {"parallel.zero_stage": 0, **CHUNK}),  # the head's weight used outside DDP's forward
    "zero3": (2, {"parallel.zero_stage": 3, **CHUNK}),  # the head's own FSDP2 unit, gathered when the loss calls it
    "zero3-tied": (
        2,
        {"parallel.zero_stage": 3, "model.tie_embeddings": True, **CHUNK},
    ),  # in the root unit: kept gathered for the loss
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """Single-process runs with the plain loss (train.loss_chunk_size = 0), per model variant."""
    return reference_runner(tmp_path_factory, corpus, LAYOUTS, COMMON, **{"train.loss_chunk_size": 0})


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, corpus):
    return layout_runner(tmp_path_factory, corpus, LAYOUTS, COMMON)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_layout_matches_plain_single_process(name, reference, layout_runs):
    assert_run_matches(reference(name), layout_runs(name), STEPS)
