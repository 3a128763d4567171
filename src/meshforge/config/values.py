"""Config values against their type annotations: a TOML or ``--section.key=value`` value
checked and widened to its key's type (``coerce``), a type's name for --help, an override's
text read as a TOML literal and a value written back as one. Nothing here knows the keys:
those are config/keys.py's.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from typing import Any, Literal, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from meshforge.errors import ConfigError, suggest


def coerce(name: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints widen to floats, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(name, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        hint = suggest(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        raise ConfigError(
            f"{name} = {value!r} is not one of {', '.join(repr(c) for c in choices)}" + (f"; {hint}" if hint else "")
        )
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r} (e.g. [4, 4])")
        item = typing.get_args(tp)[0]
        return origin(coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{name} = {value!r} must be a finite number")
            return float(value)
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r} (quote it in TOML)")
    raise ConfigError(f"{name}: unsupported config type {tp}")  # pragma: no cover


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "|".join(str(c) for c in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return "|".join(type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def parse_value(text: str) -> Any:
    """Read an override value as a TOML literal (numbers, booleans, lists); else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):  # ([[[[... nested past the parser's depth: text)
        return text


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and every control character escaped, so any
    value meshforge writes (a run.dir holding a newline or a quote) reads back as written."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(_ESCAPES.get(ch, f"\\u{ord(ch):04x}"))
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
