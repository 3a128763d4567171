"""Schemas for manifests: what each field of a JSON file must be before a byte it describes is
trusted. A schema is plain data -- ``{"field": spec}`` -- and ``check`` names the first field that
is missing or not what it must be (``splits.train[0].tokens must be a whole number >= 0, not
'12'``), so every manifest is refused in the same words.

Specs: ``Int(lo, hi)``, ``Str(pattern, choices)``, ``Bool()``, ``Null()``, ``ListOf(spec, most)``,
``MapOf(key, value, most)``, ``Obj(fields, optional)``, ``Any_()``, ``OneOf(*specs)``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from meshforge.errors import MeshforgeError

FILE_NAME = r"\.?[A-Za-z0-9_][A-Za-z0-9_.\-]*"  # a file beside the manifest: no "/", no ".." (".metadata" is one)


class SchemaError(ValueError):
    """A value that is not what its field must be (``check`` turns it into the caller's error)."""


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int = 2**63 - 1

    def check(self, v: Any, at: str) -> None:
        if type(v) is not int or not self.lo <= v <= self.hi:
            top = "" if self.hi == 2**63 - 1 else f" and <= {self.hi:,}"
            _bad(at, f"a whole number >= {self.lo:,}{top}", v)


@dataclass(frozen=True)
class Num:
    lo: float = -math.inf
    hi: float = math.inf

    def check(self, v: Any, at: str) -> None:
        try:
            ok = type(v) in (int, float) and math.isfinite(v) and self.lo <= v <= self.hi
        except OverflowError:  # an integer of hundreds of digits
            ok = False
        if not ok:
            _bad(at, f"a finite number in [{self.lo:g}, {self.hi:g}]", v)


@dataclass(frozen=True)
class Str:
    pattern: str = ""
    choices: tuple[str, ...] = ()
    most: int = 1 << 20

    def check(self, v: Any, at: str) -> None:
        if not isinstance(v, str) or len(v) > self.most:
            _bad(at, "a string", v)
        if self.choices and v not in self.choices:
            _bad(at, "one of " + ", ".join(repr(c) for c in self.choices), v)
        if self.pattern and not re.fullmatch(self.pattern, v):
            _bad(at, "a plain file name beside it" if self.pattern == FILE_NAME else f"of the form {self.pattern}", v)


@dataclass(frozen=True)
class Bool:
    def check(self, v: Any, at: str) -> None:
        if type(v) is not bool:
            _bad(at, "true or false", v)


@dataclass(frozen=True)
class Null:
    def check(self, v: Any, at: str) -> None:
        if v is not None:
            _bad(at, "null", v)


@dataclass(frozen=True)
class Any_:
    def check(self, v: Any, at: str) -> None:
        pass


@dataclass(frozen=True)
class OneOf:
    specs: tuple[Any, ...]
    words: str

    def check(self, v: Any, at: str) -> None:
        for s in self.specs:
            try:
                s.check(v, at)
                return
            except SchemaError:
                continue
        _bad(at, self.words, v)


@dataclass(frozen=True)
class ListOf:
    item: Any
    most: int = 1 << 20

    def check(self, v: Any, at: str) -> None:
        if not isinstance(v, list) or len(v) > self.most:
            _bad(at, f"a list (of at most {self.most:,} items)", v)
        for i, x in enumerate(v):
            self.item.check(x, f"{at}[{i}]")


@dataclass(frozen=True)
class MapOf:
    key: Any
    value: Any
    most: int = 1 << 20

    def check(self, v: Any, at: str) -> None:
        if not isinstance(v, dict) or len(v) > self.most:
            _bad(at, f"an object (of at most {self.most:,} entries)", v)
        for k, x in v.items():
            self.key.check(k, f"{at} key {str(k)[:80]!r}")
            self.value.check(x, f"{at}[{str(k)[:80]!r}]")


@dataclass(frozen=True)
class Obj:
    fields: dict[str, Any]
    optional: frozenset[str] = field(default_factory=frozenset)

    def check(self, v: Any, at: str) -> None:
        if not isinstance(v, dict):
            _bad(at, "an object", v)
        for name, spec in self.fields.items():
            where = f"{at}.{name}" if at else name
            if name not in v:
                if name in self.optional:
                    continue
                raise SchemaError(f"{where} is missing")
            spec.check(v[name], where)


def _bad(at: str, want: str, got: Any) -> None:
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    raise SchemaError(f"{at or 'the document'} must be {want}, not {shown[:80]}")


def check(data: Any, schema: Obj, where: str, error: type[MeshforgeError], fix: str) -> None:
    """Refuse ``data`` (the JSON of ``where``) unless it fits ``schema``: one ``error`` naming the
    first field that does not, and ``fix``."""
    try:
        schema.check(data, "")
    except SchemaError as e:
        raise error(f"{where}: {e}; {fix}") from None
