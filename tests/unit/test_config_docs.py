"""Every config key is declared once, as a dataclass field whose docstring is its help:
``meshforge train --help`` and docs/configuration.md are generated from those fields, and
this test fails when the doc is stale or a key has no help. Regenerate the doc with
``python -m meshforge.config.reference > docs/configuration.md``."""

from __future__ import annotations

import ast
from pathlib import Path

from meshforge.cli.main import main
from meshforge.config import keys
from meshforge.config.keys import plain_text
from meshforge.config.reference import markdown

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "meshforge"


def test_configuration_doc_is_generated_from_the_fields():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == markdown(), "stale: run python -m meshforge.config.reference > docs/configuration.md"


def test_every_key_has_help_and_appears_in_train_help(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for k in keys().values():
        assert len(k.help) > 3, f"{k.dotted} has no docstring under its field"
        lines = out.split("config keys (type, default):", 1)[1].splitlines()
        at = next(i for i, x in enumerate(lines) if x.strip().startswith(f"--{k.dotted} "))
        entry = " ".join(" ".join(lines[at : at + 12]).split())  # the key's line and its help under it
        assert " ".join(plain_text(k.help).split())[:40] in entry
    assert "--dry-run" in out and "default 200" in out and "auto|fp32|bf16|fp8" in out


def test_layout_and_shape_keys_are_declared_once():
    """micro_batch_size, activation_checkpoint and islands live in Layout only (their section is
    metadata); no config section re-declares a Layout or ModelShape field; no make_dataclass."""
    sections = (SRC / "config" / "sections.py").read_text()
    for name in ("micro_batch_size", "activation_checkpoint", "islands", "hidden", "tp", "zero_stage"):
        assert f"    {name}:" not in sections, f"{name} is declared again in config/sections.py"
    assert keys()["train.micro_batch_size"].holder == "layout"
    assert keys()["diloco.islands"].holder == "layout"
    assert keys()["model.hidden"].holder == "shape"
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "make_dataclass" not in names, f"{path} builds a dataclass at run time"
