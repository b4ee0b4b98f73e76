"""Every setting within the limits its field declares (`fields`), checked once per frozen section."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from paratron.config.fields import FieldInfo, all_fields
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_bounds(config: Config) -> None:
    """Every setting within the limits of its field's metadata (a derived value is checked where it is used).

    A section found within its limits is remembered (sections are frozen): the planner validates thousands of
    candidate configs that share all but a few of their sections."""
    for name, limited in _limited_fields().items():
        section = getattr(config, name)
        held = _WITHIN_BOUNDS.get(id(section))
        if held is not None and held() is section:
            continue
        for info in limited:
            value = getattr(section, info.name)
            if value is None or info.name in getattr(section, "derived", ()):
                continue
            bound = _broken_bound(info.limits, value)
            if bound is not None:
                raise ConfigError(f"{info.flag} {value}: must be {bound}")
        _WITHIN_BOUNDS[id(section)] = weakref.ref(section)


_WITHIN_BOUNDS: dict[int, weakref.ReferenceType] = {}
"""Sections already found within their limits, by identity (the reference tells a reused id from its section)."""


def _limited_fields() -> dict[str, list[FieldInfo]]:
    """The fields with limits, by section."""
    out: dict[str, list[FieldInfo]] = {}
    for info in all_fields().values():
        if info.limits:
            out.setdefault(info.section, []).append(info)
    return out


def _broken_bound(limits: Mapping[str, Any], value: Any) -> str | None:
    """How `value` must be instead, or None when it is within `limits`."""
    low, above, below = limits.get("min"), limits.get("above"), limits.get("below")
    if below is not None:
        return None if (low is None or low <= value) and value < below else f"in [{low}, {below})"
    if above is not None and not value > above:
        return f"at least {above + 1}"
    if low is not None and not value >= low:
        return "zero or more" if low == 0 else f"at least {low}"
    return None
