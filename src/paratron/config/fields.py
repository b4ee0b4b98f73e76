"""Reflection over the config dataclasses: every field's section, type, default and doc.

The docs are the string literals written under each field in `schema.py`; Python does
not keep them at run time, so they are read from the source once with `ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from paratron.config import schema
from paratron.config.limits import DERIVED
from paratron.errors import ConfigError


@dataclass(frozen=True)
class FieldInfo:
    """One setting: where it lives and what values it takes."""

    section: str
    name: str
    base_type: type
    """int, float, str, bool, list (of str) or tuple (of `item_type`)."""
    optional: bool
    """None is a value it takes: unset, or (a derived setting) worked out when the config is built."""
    choices: tuple[Any, ...] | None
    default: Any
    doc: str
    limits: Mapping[str, Any] = field(default_factory=dict)
    """Bounds from the field's metadata: min (inclusive), above and below (exclusive)."""
    item_type: type = str
    """The type of a tuple's items."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _attribute_docs(cls: type) -> dict[str, str]:
    """Map field name -> the string literal that follows its annotation in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _describe_type(hint: Any) -> tuple[type, bool, tuple[Any, ...] | None, type]:
    optional = False
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        (hint,) = args
        origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), optional, choices, str
    if origin is list:
        return list, optional, None, str
    if origin is tuple:
        return tuple, optional, None, typing.get_args(hint)[0]
    return hint, optional, None, str


@functools.cache
def section_fields(section: str) -> tuple[FieldInfo, ...]:
    cls = type(getattr(schema.Config(), section))
    hints = typing.get_type_hints(cls)
    parts = [c for c in cls.__mro__ if dataclasses.is_dataclass(c)]  # (a section may inherit a part's settings)
    docs = {name: doc for part in reversed(parts) for name, doc in _attribute_docs(part).items()}
    own = set(cls.__dict__.get("__annotations__", {}))
    infos = []
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):  # (its own settings first)
        base, optional, choices, item = _describe_type(hints[f.name])
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        optional = optional or bool(f.metadata.get(DERIVED))
        limits = {k: v for k, v in f.metadata.items() if k in ("min", "above", "below")}
        doc = docs.get(f.name, "")
        infos.append(FieldInfo(section, f.name, base, optional, choices, default, doc, limits, item))
    return tuple(infos)


@functools.cache
def all_fields() -> dict[str, FieldInfo]:
    """Every setting by its (globally unique) name."""
    out: dict[str, FieldInfo] = {}
    for section in schema.SECTIONS:
        for info in section_fields(section):
            if info.name in out:
                raise RuntimeError(f"config field {info.name} is defined twice")
            out[info.name] = info
    return out


class _FlagNames:
    """`flag.hidden_size` is "--hidden-size": a setting's flag, taken from its field, so that
    messages cannot name a flag that does not exist."""

    def __getattr__(self, name: str) -> str:
        info = all_fields().get(name)
        if info is None:
            raise AttributeError(f"no setting named {name}")
        return info.flag


flag = _FlagNames()


def coerce(info: FieldInfo, value: Any, where: str) -> Any:
    """Check and convert a value from YAML, a dict or the command line to the field's type."""
    if value is None:
        if info.optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    base = info.base_type
    try:
        if base is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                value = value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError
        elif base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            value = int(value)
        elif base is float:
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        elif base is list:
            value = [value] if isinstance(value, str) else [str(v) for v in value]
        elif base is tuple:
            value = _coerce_items(info.item_type, value)
        else:
            value = str(value) if not isinstance(value, str) else value
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number", list: "a list"}.get(base, "text")
        kind = "a list of integers" if base is tuple and info.item_type is int else kind
        raise ConfigError(f"{where}: expected {kind}, got {value!r}") from None
    if info.choices is not None and value not in info.choices:
        options = ", ".join(str(c) for c in info.choices)
        raise ConfigError(f"{where}: {value!r} is not one of: {options}")
    return value


def _coerce_items(item_type: type, value: Any) -> tuple[Any, ...]:
    """A tuple setting from a list or from text (words separated by commas or spaces), in order, each item once."""
    words = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    parts = [w for v in words for w in (v.replace(",", " ").split() if isinstance(v, str) else [v])]
    if item_type is int and any(isinstance(p, bool) or isinstance(p, float) for p in parts):
        raise ValueError
    return tuple(dict.fromkeys(item_type(p) for p in parts))
