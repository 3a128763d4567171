"""Every config key, read off the dataclasses that declare it: its section, the object of
``Config`` that holds it, its type, default and help (the field's docstring). ``--help``,
docs/configuration.md (tests/unit/test_config_docs.py fails when it is stale) and the loader's
checks are all generated from this one table, so a new key is one field; its range is the field's
``ranged`` metadata (meshforge/ranges.py), which ``meshforge plan`` and the explorer read too.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

from meshforge.config import sections as s
from meshforge.config.layout import Layout
from meshforge.config.values import type_name
from meshforge.models.shape import ModelShape
from meshforge.ranges import EACH, RANGE, WORDS, Span

# (TOML section, Config attribute, declaring class), in the order the sections are written
OWNERS: tuple[tuple[str, str, type], ...] = (
    ("model", "model", s.ModelConfig),
    ("model", "shape", ModelShape),
    ("parallel", "layout", Layout),
    ("train", "train", s.TrainConfig),
    ("optim", "optim", s.OptimConfig),
    ("data", "data", s.DataConfig),
    ("checkpoint", "checkpoint", s.CheckpointConfig),
    ("metrics", "metrics", s.MetricsConfig),
    ("run", "run", s.RunConfig),
    ("health", "health", s.HealthConfig),
    ("profile", "profile", s.ProfileConfig),
    ("diloco", "diloco", s.DiLoCoConfig),
    ("fault_tolerance", "fault_tolerance", s.FaultToleranceConfig),
)
SECTIONS = tuple(dict.fromkeys(section for section, _, _ in OWNERS))
PRESET_DEFAULT = "the preset's"  # shape keys default to the preset's value


@dataclass(frozen=True)
class Key:
    """One config key: ``section.name`` in TOML, ``getattr(getattr(cfg, holder), attr)`` in code."""

    section: str
    name: str
    holder: str
    attr: str
    type: Any
    default: Any
    help: str
    span: Span | None = None
    """the range a number must fall in (the field's ``ranged`` metadata); None: not a number"""
    each: Span | None = None
    """a list key's range for each element"""
    words: tuple[str, ...] = ()
    """words a number's key takes beside its range (``"auto"``), resolved before a run"""

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def choices(self) -> tuple[Any, ...]:
        """The words a ``Literal`` key takes (() for any other type)."""
        return typing.get_args(self.type) if typing.get_origin(self.type) is typing.Literal else ()

    @property
    def type_text(self) -> str:
        """The type as ``--help`` and the reference show it: ``int|auto`` for a number that takes a word."""
        return "|".join((type_name(self.type), *self.words))

    def range_text(self) -> str:
        """The range as the reference shows it ("" for a key without one)."""
        if self.span is not None:
            return f"range {self.span.text()}"
        return f"each in {self.each.text()}" if self.each is not None else ""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under a dataclass's fields (PEP 257 attribute docstrings), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                out[stmt.target.id] = " ".join(nxt.value.value.split())
    return out


def _default(f: dataclasses.Field, holder: str) -> Any:
    if holder == "shape":
        return "auto" if f.name in s.ModelConfig().auto_shape else PRESET_DEFAULT
    if holder == "layout" and f.name == "dp_shard":
        return -1  # the config infers dp_shard; a Layout built in code defaults to 1
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


@functools.cache
def keys() -> dict[str, Key]:
    """Every key by its dotted name, in section order."""
    out = {}
    for section, holder, cls in OWNERS:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("config") is False:
                continue
            k = Key(
                f.metadata.get("section", section),
                f.metadata.get("key", f.name),
                holder,
                f.name,
                hints[f.name],
                _default(f, holder),
                docs.get(f.name, ""),
                f.metadata.get(RANGE),
                f.metadata.get(EACH),
                tuple(f.metadata.get(WORDS, ())),
            )
            out[k.dotted] = k
    home = {holder: section for section, holder, _ in OWNERS}  # a section's own fields before borrowed ones
    order = {dotted: (SECTIONS.index(k.section), home[k.holder] != k.section) for dotted, k in out.items()}
    return dict(sorted(out.items(), key=lambda kv: order[kv[0]]))


def value_of(cfg: Any, dotted: str) -> Any:
    """The value of config key ``section.key`` in a Config (or a RunPlan)."""
    k = keys()[dotted]
    return getattr(getattr(cfg, k.holder), k.attr)


def section_keys(section: str) -> dict[str, Key]:
    return {k.name: k for k in keys().values() if k.section == section}


def plain_text(markdown: str) -> str:
    """A help text for a terminal: links as their text, no backticks."""
    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", markdown).replace("`", "")
