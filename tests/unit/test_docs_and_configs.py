from pathlib import Path

import pytest

from meshforge.config import load_config, to_dict
from meshforge.resolve import resolve

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_resolve(path):
    world = 2 if ("ddp" in path.name or "zero" in path.name) else 1
    cfg = resolve(load_config(path), world)
    assert cfg.train.steps > 0


def test_every_config_key_is_documented():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for section, body in to_dict(load_config()).items():
        assert f"## [{section}]" in doc
        for key in body:
            assert f"| `{key}` |" in doc, f"{section}.{key} missing from docs/configuration.md"


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("meshforge trains")]
    assert "meshforge train --config configs/debug.toml" in head
    test_cmd = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q -n 2 --dist loadfile"
    assert test_cmd in head
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_front_page():
    """At most 200 lines, table cells of one short line, and every link it gives resolves."""
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    assert max(len(c) for c in cells) <= 200
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
