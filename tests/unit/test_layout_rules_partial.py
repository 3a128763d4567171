"""The layout rules judge a partial layout too (parallel/partial_rules.py): each fixed choice the
planner or the explorer takes is refused by one rule, in the caller's spelling, and the
planner's check_fixed error is that rule's message, word for word."""

from pathlib import Path

import pytest

from meshforge.config.layout import open_layout
from meshforge.errors import ConfigError
from meshforge.models.shape import ModelShape
from meshforge.parallel.rules import partial_problems
from meshforge.planner.candidates import PLAN_FLAGS, check_fixed

SRC = Path(__file__).resolve().parents[2] / "src" / "meshforge"
MOE = ModelShape(hidden=256, layers=4, heads=16, kv_heads=16, ffn_hidden=512, vocab_size=1000, num_experts=8)
DENSE = ModelShape(hidden=256, layers=4, heads=16, kv_heads=16, ffn_hidden=512, vocab_size=1000)
NODE = 8

CASES = [  # (partial layout, model, gpus, the refusing rule's key, its words in config spelling)
    (open_layout(ep=2), DENSE, 8, "parallel.ep", "parallel.ep = 2: this model has no experts (it is dense)"),
    (open_layout(ep=3), MOE, 8, "parallel.ep", "parallel.ep = 3 must divide model.num_experts = 8"),
    (open_layout(tp=16), MOE, 16, "parallel.tp", "parallel.tp = 16 is more than gpus_per_node = 8"),
    (open_layout(tp=3), MOE, 12, "parallel.tp", "parallel.tp = 3 does not divide model.heads = 16"),
    (open_layout(pp=8), MOE, 8, "parallel.pp", "parallel.pp = 8 is more than the 4 layers"),
    (open_layout(tp=2, pp=3), MOE, 8, "gpus", "fixed degrees multiply to 6, which does not divide gpus = 8"),
    (open_layout(tp=2, pp=2, dp_shard=1, cp=1), MOE, 8, "gpus", "multiply to 4, not gpus = 8; leave one out"),
    (open_layout(pp_schedule="zigzag"), MOE, 8, "parallel.pp_schedule", "parallel.pp_schedule = 'zigzag': one of"),
    (open_layout(activation_checkpoint="some"), MOE, 8, "train.activation_checkpoint", "'some': one of none,"),
    (open_layout(zero_stage=4), MOE, 8, "parallel.zero_stage", "parallel.zero_stage = 4: one of 0, 1, 2, 3"),
    (open_layout(offload="disk"), MOE, 8, "parallel.offload", "parallel.offload = 'disk': one of auto, none"),
    (open_layout(offload="cpu", zero_stage=1), DENSE, 8, "parallel.offload", "needs FSDP2's sharded state"),
]


@pytest.mark.parametrize("layout, model, gpus, key, words", CASES)
def test_each_fixed_choice_rule_refuses_its_case(layout, model, gpus, key, words):
    invalid = [p for p in partial_problems(layout, model, gpus, NODE) if p.kind == "invalid"]
    assert [p.key for p in invalid] == [key] and words in invalid[0].message, invalid


@pytest.mark.parametrize("layout, model, gpus, key, words", CASES)
def test_check_fixed_raises_the_rules_message_in_flags(layout, model, gpus, key, words):
    [problem] = [p for p in partial_problems(layout, model, gpus, NODE, PLAN_FLAGS) if p.kind == "invalid"]
    with pytest.raises(ConfigError) as e:
        check_fixed(model, gpus, layout, NODE)
    assert str(e.value) == problem.message and "--" in problem.message


def test_a_valid_partial_layout_is_accepted():
    fixed = open_layout(tp=2, pp=2, ep=2, zero_stage=3, pp_schedule="interleaved_1f1b", activation_checkpoint="full")
    assert partial_problems(fixed, MOE, 8, NODE) == []
    assert partial_problems(open_layout(), DENSE, 8, NODE) == []  # nothing fixed: nothing to judge
    assert partial_problems(open_layout(tp=2, pp=2, dp_shard=2, cp=1, offload="auto"), DENSE, 8, NODE) == []
    check_fixed(MOE, 8, fixed, NODE)  # does not raise
    moe_offload = partial_problems(open_layout(ep=2, zero_stage=3, offload="cpu"), MOE, 8, NODE)
    assert [p.kind for p in moe_offload] == ["unsupported"]  # judged, but not an impossible choice


def test_the_fixed_choice_rules_are_stated_only_in_the_layout_rules():
    for phrase in ("whole experts per rank", "tp stays inside a node", "every stage needs at least one"):
        homes = {p.relative_to(SRC) for p in SRC.rglob("*.py") if phrase in p.read_text()}
        assert homes, phrase
        assert all(h.parts[0] == "parallel" and h.name.endswith("rules.py") for h in homes), (phrase, homes)
