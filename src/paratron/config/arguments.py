"""Command-line flags generated from the config dataclasses.

Every field becomes `--field-name` with its doc as help; Megatron-LM's switch spellings
(`--fp16`, `--swiglu`, ...) are added from `megatron.py`. Only flags given on the command
line reach the overrides, so recipe values are not clobbered by argparse defaults.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

from paratron.config import schema
from paratron.config.fields import FieldInfo, all_fields, section_fields
from paratron.config.megatron import RENAMES, SWITCHES, UNSUPPORTED, unsupported_flag_message
from paratron.errors import ConfigError

_IGNORED = "_accepted_for_compatibility"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports mistakes as a one-line ConfigError instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}; see `{self.prog} --help`")


def _help(info: FieldInfo) -> str:
    default = info.default if info.default not in (None, []) else "unset"
    off = f" --no-{info.flag[2:]} turns it off." if info.base_type is bool else ""
    suffix = "" if "(default:" in info.doc else f" (default: {default})"
    return f"{info.doc}{off}{suffix}".replace("%", "%%")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="RECIPE",
        default=None,
        help="Recipe name in configs/ (debug, demo, ...) or path of a YAML file; flags override it.",
    )
    renames_of: dict[str, list[str]] = {}
    for alias, name in RENAMES.items():
        renames_of.setdefault(name, []).append("--" + alias.replace("_", "-"))
    for section in schema.SECTIONS:
        doc = (type(getattr(schema.Config(), section)).__doc__ or "").strip()
        group = parser.add_argument_group(f"{section} settings", doc)
        for info in section_fields(section):
            names = [info.flag, *renames_of.get(info.name, [])]
            if info.base_type is bool:
                group.add_argument(
                    *names, dest=info.name, action="store_true", default=argparse.SUPPRESS, help=_help(info)
                )
                group.add_argument(
                    "--no-" + info.flag[2:],
                    dest=info.name,
                    action="store_false",
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS,
                )
            else:
                metavar = (
                    "{" + ",".join(map(str, info.choices)) + "}"
                    if info.choices
                    else "PATH"
                    if info.base_type is list
                    else info.base_type.__name__.upper()
                )
                group.add_argument(
                    *names,
                    dest=info.name,
                    default=argparse.SUPPRESS,
                    metavar=metavar,
                    nargs="+" if info.base_type is list else None,
                    help=_help(info),
                )
    compat = parser.add_argument_group("Megatron-LM switches")
    for alias, (name, value, text) in SWITCHES.items():
        dest = name if value is not None else _IGNORED
        compat.add_argument(
            "--" + alias.replace("_", "-"),
            dest=dest,
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=text,
        )


def check_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Refuse unknown flags by name (and Megatron flags we do not support yet) before argparse sees them."""
    known = set(parser._option_string_actions)
    if "--fp16" in argv and "--bf16" in argv:
        raise ConfigError("--fp16 and --bf16 were both given; choose one")
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        flag = token.split("=", 1)[0]
        if flag in known:
            continue
        if flag[2:] in UNSUPPORTED:
            raise ConfigError(unsupported_flag_message(flag))
        close = difflib.get_close_matches(flag, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown flag {flag}{hint} (`{parser.prog} --help` lists every flag)")


def parse_config_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[str | None, dict[str, Any], argparse.Namespace]:
    """Parse argv into (recipe, field overrides, the full namespace)."""
    check_flags(parser, argv)
    namespace = parser.parse_args(list(argv))
    fields = all_fields()
    overrides = {k: v for k, v in vars(namespace).items() if k in fields}
    return namespace.config, overrides, namespace


def markdown_reference() -> str:
    """docs/flags.md: every setting by section, with its flag, type, default and doc."""
    lines = [
        "# Flags and settings",
        "",
        "Generated from `src/paratron/config/schema.py` by `make docs`; do not edit by hand.",
        "",
        "Every setting can be given as a flag (`--hidden-size 256`) or in a recipe's YAML section "
        "(`model: {hidden_size: 256}`). Flags override the recipe, which overrides the `--model` preset.",
        "",
    ]
    for section in schema.SECTIONS:
        doc = (type(getattr(schema.Config(), section)).__doc__ or "").strip()
        lines += [f"## {section}", "", doc, "", "| flag | type | default | meaning |", "|---|---|---|---|"]
        for info in section_fields(section):
            kind = " \\| ".join(map(str, info.choices)) if info.choices else info.base_type.__name__
            default = "unset" if info.default in (None, []) else f"`{info.default}`"
            off = f" (`--no-{info.flag[2:]}` turns it off)" if info.base_type is bool else ""
            lines.append(f"| `{info.flag}`{off} | {kind} | {default} | {info.doc} |")
        lines.append("")
    lines += ["## Megatron-LM switches", "", "| flag | meaning |", "|---|---|"]
    lines += [f"| `--{alias.replace('_', '-')}` | {text} |" for alias, (_, _, text) in SWITCHES.items()]
    lines += [
        "",
        "Other spellings: " + ", ".join(f"`--{a}` = `--{n.replace('_', '-')}`" for a, n in RENAMES.items()) + ".",
        "",
        "Megatron-LM flags that paratron does not support yet are refused by name:",
        "",
        ", ".join(f"`--{flag}`" for flag in sorted(UNSUPPORTED)) + ".",
        "",
    ]
    return "\n".join(lines)
