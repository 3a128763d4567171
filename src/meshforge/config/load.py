"""The user's config as a whole: ``Config``, read from a TOML file plus ``--section.key=value``
overrides (``load_config``) and written back as TOML (``to_toml``).

Loading collects every value first (the file, then the overrides), refuses unknown sections
and keys (naming the nearest one) and wrong types, then builds each frozen section once: the
model's shape from its preset with the given fields laid over it, the layout from [parallel]
and the layout keys of [train] and [diloco]. What a run resolves from this (``auto`` values,
inferred degrees, decisions) is resolve.py's.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from meshforge.config.checks import check_values
from meshforge.config.keys import OWNERS, SECTIONS, Key, keys, section_keys
from meshforge.config.sections import Config
from meshforge.config.values import coerce, toml_value
from meshforge.errors import ConfigError, suggest
from meshforge.models.presets import get_preset
from meshforge.safeio.files import read_regular
from meshforge.safeio.parse import loads_toml


def key_type(dotted: str) -> Any:
    """The annotation of config key ``section.key``, or None when there is no such key."""
    k = keys().get(dotted)
    return k.type if k else None


# torchtitan job-config words a newcomer brings, and where meshforge keeps them (no near spelling finds these)
TORCHTITAN = {
    "job": "[run] dir (its dump_folder)",
    "training": "[train] (steps, seq_len, global_batch_size)",
    "parallelism": "[parallel] (tp, pp, cp, dp_shard, dp_replicate)",
    "lr_scheduler": "[optim] (warmup_steps, schedule)",
    "optimizer": "[optim]",
    "activation_checkpoint": "[train] activation_checkpoint",
    "float8": '[train] precision = "fp8"',
    "model.name": '[model] preset (e.g. preset = "llama3.1-8b")',
    "model.flavor": '[model] preset (e.g. preset = "llama3.1-8b")',
}


def _titan(ours: str) -> str:
    """Where meshforge keeps what a torchtitan job config named."""
    return f"that is torchtitan's; meshforge's is {ours} (every key: meshforge train --help)"


def _lookup(section: str, key: str, where: str) -> Key:
    """The key ``section.key``, or an error naming the nearest section or key."""
    if section not in SECTIONS:
        hint = _titan(TORCHTITAN[section]) if section in TORCHTITAN else suggest(section, SECTIONS)
        raise ConfigError(f"unknown config section [{section}] in {where}; {hint}")
    found = section_keys(section).get(key)
    if found:
        return found
    if f"{section}.{key}" in TORCHTITAN:
        raise ConfigError(f"unknown key {section}.{key} in {where}; {_titan(TORCHTITAN[f'{section}.{key}'])}")
    elsewhere = [sec for sec in SECTIONS if key in section_keys(sec)]
    if elsewhere:
        dashed = where.startswith("--")
        hint = " or ".join(f"--{sec}.{key}" if dashed else f"[{sec}] {key}" for sec in elsewhere)
        raise ConfigError(f"unknown key {section}.{key} in {where}; {elsewhere[0]}.{key} exists: did you mean {hint}?")
    raise ConfigError(f"unknown key {section}.{key} in {where}; {suggest(key, section_keys(section))}")


MAX_CONFIG_BYTES = 16 << 20  # a config is a few KiB
_FIX = "pass a TOML file such as configs/debug.toml"


def _read_regular(p: Path) -> bytes:
    """The bytes of ``p``, checked on the open file (safeio/files.py): a FIFO or device put in the
    file's place after the checks is neither waited on nor read; at most MAX_CONFIG_BYTES."""
    try:
        return read_regular(p, MAX_CONFIG_BYTES, ConfigError, _FIX)
    except ConfigError as e:
        if "is not a regular file" in str(e):
            raise ConfigError(f"--config {p} is not a regular file (a device, FIFO or socket); {_FIX}") from None
        raise ConfigError(str(e) if str(e).startswith("cannot") else f"config file {e}") from None


def _read_file(p: Path) -> dict[str, Any]:
    """The TOML document at ``p``: a regular file (a FIFO or device, even behind a link, is never
    waited on or read: safeio/files.py), at most MAX_CONFIG_BYTES, nested at most MAX_DEPTH deep."""
    if p.is_dir():
        raise ConfigError(f"--config {p} is a directory; pass a TOML file such as configs/debug.toml")
    if not p.exists() and not p.is_symlink():
        raise ConfigError(f"config file {p} does not exist; pass an existing TOML file to --config")
    raw = _read_regular(p)
    try:
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as text mode reads it
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {p} is not a UTF-8 TOML file (line {line}, byte {e.start} is not UTF-8: is it a binary "
            "file?); pass a text TOML config such as configs/debug.toml"
        ) from None
    return loads_toml(text, f"config file {p}", ConfigError, _FIX)


def _section_values(sections: dict[str, Any], where: str) -> dict[str, Any]:
    """The values of a TOML-shaped document ({section: {key: value}}) by dotted key, each checked
    against its key's type."""
    values: dict[str, Any] = {}
    for section, body in sections.items():
        if not isinstance(body, dict):
            raise ConfigError(
                f"{where}: top-level key '{section}' must be a section like [{section}]; "
                f"put keys under one of: {', '.join(SECTIONS)}"
            )
        for key, value in body.items():
            k = _lookup(section, key, where)
            values[k.dotted] = _value(k, value)
    return values


def _collect(path: str | Path | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """Every given value by dotted key (the file's, then the overrides'), each of its key's type."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_section_values(_read_file(Path(path)), str(path)))
    for dotted, value in overrides.items():
        if "." not in dotted:
            raise ConfigError(f"override --{dotted} must name a section and key, like --train.steps=100")
        k = _lookup(*dotted.split(".", 1), f"--{dotted}")
        values[k.dotted] = _value(k, value)
    return values


def _value(k: Key, value: Any) -> Any:
    """The value checked against its key's type, or one of the words the key takes beside it."""
    if isinstance(value, str) and value in k.words:
        return value
    try:
        return coerce(k.dotted, value, k.type)
    except ConfigError as e:
        if not k.words:
            raise
        words = " or ".join(f'"{w}"' for w in k.words)
        raise ConfigError(f"{e} (or {words})") from None


def build(values: dict[str, Any], base: Config | None = None) -> Config:
    """``base`` (the defaults) with ``values`` laid over it: a new preset re-bases the shape."""
    base = base or Config()
    holders: dict[str, dict[str, Any]] = {holder: {} for _, holder, _ in OWNERS}
    for dotted, value in values.items():
        k = keys()[dotted]
        holders[k.holder][k.attr] = value
    shape = copy.copy(base.shape)
    if "preset" in holders["model"]:
        shape = get_preset(holders["model"]["preset"])
    auto = dict.fromkeys(base.model.auto_shape)
    for attr, value in holders.pop("shape").items():
        if isinstance(value, str) and value in keys()[f"model.{attr}"].words:
            auto[attr] = None  # the preset's value stands until the resolution fills it
        else:
            setattr(shape, attr, value)  # (setattr: head_dim = 0 stays "derived", see models/shape.py)
            auto.pop(attr, None)
    if tuple(auto) != base.model.auto_shape:
        holders["model"]["auto_shape"] = tuple(auto)
    parts = {h: dataclasses.replace(getattr(base, h), **v) for h, v in holders.items() if v}
    return dataclasses.replace(base, shape=shape, **parts)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """A Config from an optional TOML file and ``{"section.key": value}`` overrides, value-checked."""
    cfg = build(_collect(path, overrides or {}))
    check_values(cfg)
    return cfg


def config_from_sections(sections: dict[str, Any], where: str) -> Config:
    """A Config from {section: {key: value}} (``to_dict``'s shape, e.g. a run plan handed over
    as JSON), read and checked as a config file's are; ``where`` names it in errors."""
    cfg = build(_section_values(sections, where))
    check_values(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config by section and key, as TOML would hold it."""
    out: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for k in keys().values():
        value = getattr(getattr(cfg, k.holder), k.attr)
        out[k.section][k.name] = list(value) if isinstance(value, tuple) else value
    return out


def to_toml(cfg: Config, comments: dict[str, list[str]] | None = None, only: set[str] | None = None) -> str:
    """TOML text of the config: every key, or the dotted keys in ``only``; ``comments``: lines
    put above a section."""
    lines = []
    for section, body in to_dict(cfg).items():
        body = {k: v for k, v in body.items() if only is None or f"{section}.{k}" in only}
        if not body:
            continue
        lines += [f"# {c}" for c in (comments or {}).get(section, [])]
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items() if v is not None]
        lines.append("")
    return "\n".join(lines)
