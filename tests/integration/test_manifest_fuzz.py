"""The fuzz of issue 50 with a small budget (tests/manifest_fuzz.py; bench/bench_manifest_fuzz.py
runs >= 10,000 inputs): seeded mutations of a config, an index.json, a meta.json and a .metadata,
each through its real command, end in exit 0 or exit 2 with one paragraph -- never a traceback,
a hang or a write outside the run directory."""

from __future__ import annotations

import pytest

from manifest_fuzz import TARGETS, Tally, fuzz, make_workspace, run_case

EXAMPLES = 40  # per manifest: about 20 s in all on a shared 2-core machine


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, corpus):
    return make_workspace(tmp_path_factory.mktemp("fuzz"), corpus)


@pytest.mark.parametrize("target", TARGETS)
def test_the_unmutated_manifest_runs_through_its_command(workspace, target):
    """The harness itself: the file as written trains or converts (exit 0), so a refusal of a
    mutated one is the mutation's doing."""
    kind, detail = run_case(workspace, target, workspace.base[target], 10**6)
    assert kind == "exit 0", detail


@pytest.mark.parametrize("target", TARGETS)
def test_mutated_manifests_end_in_exit_0_or_one_paragraph_and_exit_2(workspace, target):
    tally = Tally()
    fuzz(workspace, target, EXAMPLES, 50, tally)
    assert tally.total() >= EXAMPLES // 2, tally.counts  # (Hypothesis stops early only when it runs out)
    assert tally.failures == [], "\n".join(tally.failures[:5])
    assert tally.total("exit 2") > 0, tally.counts  # the mutations do reach the checks
