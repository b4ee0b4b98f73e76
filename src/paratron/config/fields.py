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
from dataclasses import dataclass
from typing import Any, Literal, Union

from paratron.config import schema
from paratron.errors import ConfigError


@dataclass(frozen=True)
class FieldInfo:
    """One setting: where it lives and what values it takes."""

    section: str
    name: str
    base_type: type
    """int, float, str, bool or list (of str)."""
    optional: bool
    choices: tuple[Any, ...] | None
    default: Any
    doc: str

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


def _describe_type(hint: Any) -> tuple[type, bool, tuple[Any, ...] | None]:
    optional = False
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        (hint,) = args
        origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), optional, choices
    if origin is list:
        return list, optional, None
    return hint, optional, None


@functools.cache
def section_fields(section: str) -> tuple[FieldInfo, ...]:
    cls = type(getattr(schema.Config(), section))
    hints = typing.get_type_hints(cls)
    docs = _attribute_docs(cls)
    infos = []
    for f in dataclasses.fields(cls):
        base, optional, choices = _describe_type(hints[f.name])
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        infos.append(FieldInfo(section, f.name, base, optional, choices, default, docs.get(f.name, "")))
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
        else:
            value = str(value) if not isinstance(value, str) else value
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number", list: "a list"}.get(base, "text")
        raise ConfigError(f"{where}: expected {kind}, got {value!r}") from None
    if info.choices is not None and value not in info.choices:
        options = ", ".join(str(c) for c in info.choices)
        raise ConfigError(f"{where}: {value!r} is not one of: {options}")
    return value
