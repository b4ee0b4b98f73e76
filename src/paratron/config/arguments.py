"""Command-line flags generated from the config dataclasses.

Every field becomes `--field-name` with its doc as help; Megatron-LM's switch spellings
(`--fp16`, `--swiglu`, ...) are added from `megatron.py`. Only flags given on the command
line reach the overrides, so recipe values are not clobbered by argparse defaults.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from paratron.config import schema
from paratron.config.fields import FieldInfo, all_fields, section_fields
from paratron.config.megatron import (
    ACCEPTED,
    FOLDED,
    MAPPED,
    REFUSED,
    RENAMES,
    SWITCHES,
    megatron_flags,
    unknown_megatron_flag_message,
)
from paratron.errors import ConfigError
from paratron.storage import write_text_atomic

_IGNORED = "_accepted_for_compatibility"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports mistakes as a one-line ConfigError instead of usage + exit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused: dict[str, str] = {}
        """Flags of `paratron train` this command does not take -> the line that says so."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}; see `{self.prog} --help`")


def _shown_default(default: Any) -> str:
    """A default as --help and docs/flags.md show it (a tuple as its items, comma-separated)."""
    if default in (None, [], ()):
        return "unset"
    return ",".join(map(str, default)) if isinstance(default, tuple) else str(default)


def _help(info: FieldInfo) -> str:
    default = _shown_default(info.default)
    off = f" --no-{info.flag[2:]} turns it off." if info.base_type is bool else ""
    suffix = "" if "(default:" in info.doc else f" (default: {default})"
    return f"{info.doc}{off}{suffix}".replace("%", "%%")


def _mapped_value(text: str, flag: str, values: dict[str, Any]) -> Any:
    """The setting's value for a MAPPED flag's `text` (a one-line error for another word)."""
    if text not in values:
        raise ConfigError(f"{flag} {text}: choose one of {', '.join(values)}")
    return values[text]


@dataclass(frozen=True)
class Takes:
    """The settings a command other than `paratron train` takes, as train's flags: whole sections
    and single settings. Its --help lists only those, grouped by section as train's; train's other
    flags are refused by name, with the reason `why` gives for their section or setting, or as
    settings the command does not use."""

    command: str
    """The command, as its messages name it (paratron evaluate)."""
    sections: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    why: tuple[tuple[str, str], ...] = ()
    """(section or setting name, why the command leaves it out and what to do instead)."""
    otherwise: str | None = None
    """The same for the other settings it leaves out (default: it does not use them; drop them)."""

    def __contains__(self, name: str) -> bool:
        """Whether the command takes the setting `name`."""
        return name in self.fields or all_fields()[name].section in self.sections

    def refusal(self, option: str, name: str | None) -> str:
        """The one line for `option` (of setting `name`, None for a flag that sets none)."""
        reasons = dict(self.why)
        reason = None
        if name is not None:
            reason = reasons.get(name) or reasons.get(all_fields()[name].section)
        reason = reason or self.otherwise or f"{self.command} does not use this setting of paratron train; drop it"
        return f"{option}: {reason} (`{self.command} --help` lists the flags it takes)"


def add_config_arguments(parser: ArgumentParser, takes: Takes | None = None) -> None:
    """The settings' flags by section, Megatron-LM's spellings and switches and (for train) the
    Megatron-LM flags accepted without effect; with `takes`, only the flags of the settings that
    command uses, the others noted in `parser.refused`."""
    parser.add_argument(
        "--config",
        metavar="RECIPE",
        default=None,
        help="A recipe shipped with paratron (debug, demo, finetune-demo), NAME for ./configs/NAME.yaml of your own, "
        "or the path of a YAML file; flags override it.",
    )

    def wanted(options: list[str], name: str | None) -> bool:
        if takes is None or (name is not None and name in takes):
            return True
        parser.refused.update({option: takes.refusal(option, name) for option in options})
        return False

    renames_of: dict[str, list[str]] = {}
    for alias, name in RENAMES.items():
        renames_of.setdefault(name, []).append(alias)
    for section in schema.SECTIONS:
        spelled = [(info, [info.flag, *renames_of.get(info.name, [])]) for info in section_fields(section)]
        taken = [(info, names) for info, names in spelled if wanted([*names, *_negative(info)], info.name)]
        if taken:
            doc = (type(getattr(schema.Config(), section)).__doc__ or "").strip()
            group = parser.add_argument_group(f"{section} settings", doc)
            for info, names in taken:
                _add_setting(group, info, names)
    compat = parser.add_argument_group("Megatron-LM switches")
    for alias, (name, value, text) in SWITCHES.items():
        option = "--" + alias.replace("_", "-")
        if wanted([option], name):
            compat.add_argument(
                option, dest=name, action="store_const", const=value, default=argparse.SUPPRESS, help=text
            )
    for alias, (name, values, text) in MAPPED.items():
        option = "--" + alias.replace("_", "-")
        if wanted([option], name):
            compat.add_argument(
                option,
                dest=name,
                type=functools.partial(_mapped_value, flag=option, values=values),
                metavar="{" + ",".join(values) + "}",
                default=argparse.SUPPRESS,
                help=text,
            )
    for alias, (name, text) in FOLDED.items():
        option = "--" + alias.replace("_", "-")
        if wanted([option, "--no-" + option[2:]], name):
            compat.add_argument(option, dest=alias, action="store_true", default=argparse.SUPPRESS, help=text)
            compat.add_argument(
                "--no-" + option[2:],
                dest=alias,
                action="store_false",
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
    _add_accepted(parser, wanted)


def _negative(info: FieldInfo) -> list[str]:
    """A bool setting's --no- flag (none for the others)."""
    return ["--no-" + info.flag[2:]] if info.base_type is bool else []


def _add_setting(group: Any, info: FieldInfo, names: list[str]) -> None:
    """One setting's flags: a switch and its --no- twin for a bool, else a flag with a value."""
    if info.base_type is bool:
        group.add_argument(*names, dest=info.name, action="store_true", default=argparse.SUPPRESS, help=_help(info))
        group.add_argument(
            *_negative(info), dest=info.name, action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        return
    metavar = (
        "{" + ",".join(map(str, info.choices)) + "}"
        if info.choices
        else "PATH"
        if info.base_type is list
        else info.item_type.__name__.upper()
        if info.base_type is tuple
        else info.base_type.__name__.upper()
    )
    group.add_argument(
        *names,
        dest=info.name,
        default=argparse.SUPPRESS,
        metavar=metavar,
        nargs="+" if info.base_type in (list, tuple) else None,
        help=_help(info),
    )


def _add_accepted(parser: argparse.ArgumentParser, wanted: Callable[[list[str], str | None], bool]) -> None:
    """Megatron-LM's flags accepted without effect (train only: `wanted` refuses them elsewhere)."""
    accepted = None
    for flag, entry in ACCEPTED.items():
        if "--" + flag in parser._option_string_actions:
            continue  # a setting now (test_megatron_flags checks that the tables do not overlap)
        if not wanted(["--" + flag], None):
            continue
        if accepted is None:
            accepted = parser.add_argument_group(
                "Megatron-LM flags accepted without effect",
                "Implementation choices of Megatron-LM that cannot change "
                "what paratron computes (docs/megatron.md says why for each).",
            )
        accepted.add_argument(
            "--" + flag,
            dest=flag.replace("-", "_") if entry.noted else _IGNORED,
            action="store_const" if entry.nargs == 0 else "store",
            **({"const": True} if entry.nargs == 0 else {"nargs": entry.nargs, "metavar": "VALUE"}),
            default=argparse.SUPPRESS,
            help=f"{entry.meaning} Accepted: {entry.why}".replace("%", "%%"),
        )


def check_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Refuse unknown flags by name before argparse sees them: train's flags that this command does
    not take with the reason, Megatron-LM's flags that paratron does not implement with theirs,
    other unknown flags with the nearest flag of this command."""
    known = set(parser._option_string_actions)
    refused = getattr(parser, "refused", {})
    if "--fp16" in argv and "--bf16" in argv:
        raise ConfigError("--fp16 and --bf16 were both given; choose one")
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        flag = token.split("=", 1)[0]
        if flag in known:
            continue
        if flag in refused:
            raise ConfigError(refused[flag])
        if flag[2:] in REFUSED or flag[2:] in megatron_flags():
            raise ConfigError(unknown_megatron_flag_message(flag))
        settings = sorted(f for f in known if parser._option_string_actions[f].dest != _IGNORED)
        close = difflib.get_close_matches(flag, settings, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown flag {flag}{hint} (`{parser.prog} --help` lists every flag)")


def parse_config_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[str | None, dict[str, Any], argparse.Namespace]:
    """Parse argv into (recipe, field overrides, the full namespace)."""
    check_flags(parser, argv)
    namespace = parser.parse_args(list(argv))
    fields = all_fields()
    overrides = {k: v for k, v in vars(namespace).items() if k in fields or k in FOLDED}
    return namespace.config, overrides, namespace


def as_typed(message: str, argv: Sequence[str]) -> str:
    """`message` (a one-line error) with each flag in the spelling the user typed: `--nproc 0` is
    answered about `--nproc`, not the `--nproc-per-node` it sets, unless that was typed too or the
    message already names both."""
    typed = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    fields = all_fields()
    for alias, name in RENAMES.items():
        own = fields[name].flag
        if alias in typed and own not in typed and not _whole_flag(alias).search(message):
            message = _whole_flag(own).sub(alias, message)
    return message


def _whole_flag(flag: str) -> re.Pattern[str]:
    """`flag` as a whole word of a message (not the start of a longer flag)."""
    return re.compile(rf"(?<![\w-]){re.escape(flag)}(?![\w-])")


def given_settings(overrides: dict[str, Any], namespace: argparse.Namespace) -> set[str]:
    """The settings given on the command line, and the accepted Megatron-LM flags that are checked
    (for `adjust_like_megatron`)."""
    noted = {flag.replace("-", "_") for flag, entry in ACCEPTED.items() if entry.noted}
    return set(overrides) | (noted & set(vars(namespace)))


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
            kind = " \\| ".join(map(str, info.choices)) if info.choices else _kind(info)
            default = _shown_default(info.default)
            default = default if default == "unset" else f"`{default}`"
            off = f" (`--no-{info.flag[2:]}` turns it off)" if info.base_type is bool else ""
            lines.append(f"| `{info.flag}`{off} | {kind} | {default} | {info.doc} |")
        lines.append("")
    lines += [
        "## Megatron-LM flags",
        "",
        "Megatron-LM's switches (`--bf16`, `--swiglu`, ...), the flags accepted without effect and those refused are "
        "listed in [megatron.md](megatron.md).",
        "",
    ]
    return "\n".join(lines)


def _kind(info: FieldInfo) -> str:
    """A setting's type as docs/flags.md names it (tuple[int] for a tuple of integers)."""
    return f"tuple[{info.item_type.__name__}]" if info.base_type is tuple else info.base_type.__name__


MEGATRON_DOC_MARK = "<!-- Everything below is generated by `make docs` from src/paratron/config/megatron.py. -->"
"""The line of docs/megatron.md after which the flag table is generated."""


def refresh_megatron_doc(path: str) -> None:
    """Rewrite the generated part of docs/megatron.md (after MEGATRON_DOC_MARK), keeping the prose above it."""
    doc = Path(path)
    text = doc.read_text(encoding="utf-8")
    if MEGATRON_DOC_MARK not in text:
        raise ConfigError(f"{path}: the line {MEGATRON_DOC_MARK!r} is missing; put it where the table goes")
    head = text[: text.index(MEGATRON_DOC_MARK) + len(MEGATRON_DOC_MARK)]
    write_text_atomic(doc, head + "\n\n" + markdown_megatron())


def markdown_megatron() -> str:
    """docs/megatron.md's reference part: how paratron treats every Megatron-LM flag it knows of."""
    mlm = megatron_flags()
    lines = [
        "## Every flag",
        "",
        "Generated from `src/paratron/config/megatron.py` by `make docs`; do not edit by hand.",
        "",
        *_megatron_implemented(mlm),
        *_megatron_accepted_and_refused(),
        *_megatron_others(mlm),
    ]
    return "\n".join(lines)


def _megatron_implemented(mlm: frozenset[str]) -> list[str]:
    """The section on the flags paratron implements: its own settings under Megatron-LM's names, then the
    switches, translated values and other spellings."""
    fields = all_fields()
    lines = [
        "### Implemented with Megatron-LM's meaning",
        "",
        "Settings whose flag is Megatron-LM's own. The meaning column is paratron's `--help` text; where "
        "paratron's default differs from Megatron-LM's, the recipes set it, not the defaults.",
        "",
        "| flag | meaning in paratron |",
        "|---|---|",
    ]
    for _, info in sorted(fields.items()):
        negative = "no-" + info.flag[2:]
        if info.flag[2:] in mlm:
            lines.append(f"| `{info.flag}` | {info.doc} |")
        elif info.base_type is bool and negative in mlm:
            lines.append(f"| `--{negative}` | Turns off: {info.doc} |")
    lines += ["", "Switches, translated values and other spellings:", "", "| flag | meaning in paratron |", "|---|---|"]
    folded = {alias: (name, None, text) for alias, (name, text) in FOLDED.items()}
    for alias, (_, _, text) in sorted({**SWITCHES, **MAPPED, **folded}.items()):
        lines.append(f"| `--{alias.replace('_', '-')}` | {text} |")
    for flag, name in sorted(RENAMES.items()):
        lines.append(f"| `{flag}` | Another spelling of `{fields[name].flag}`. |")
    return lines


def _megatron_accepted_and_refused() -> list[str]:
    """The sections on the flags paratron accepts without effect and on those it refuses."""
    lines = [
        "",
        "### Accepted: no effect on the numbers",
        "",
        "| flag | in Megatron-LM | in paratron |",
        "|---|---|---|",
    ]
    for flag, entry in sorted(ACCEPTED.items()):
        lines.append(f"| `--{flag}` | {entry.meaning} | {entry.why} |")
    lines += [
        "",
        "### Refused, with the reason",
        "",
        "| flag | in Megatron-LM | why paratron refuses it |",
        "|---|---|---|",
    ]
    for flag, entry in sorted(REFUSED.items()):
        lines.append(f"| `--{flag}` | {entry.meaning} | {entry.reason.capitalize()}. |")
    return lines


def _megatron_others(mlm: frozenset[str]) -> list[str]:
    """The section listing Megatron-LM's flags that paratron's parser neither takes nor refuses with a reason."""
    parser = ArgumentParser(prog="paratron train")
    add_config_arguments(parser)
    listed = {flag[2:] for flag in parser._option_string_actions} | set(REFUSED)
    others = sorted(f for f in mlm if f not in listed)
    return [
        "",
        "### Other Megatron-LM flags",
        "",
        f"Megatron-LM's parser has {len(mlm)} flags. These {len(others)} others belong to features paratron does "
        "not have (other model families, inference servers, reinforcement learning, vendor kernels); each is "
        "refused by name as a Megatron-LM flag paratron does not implement:",
        "",
        ", ".join(f"`--{f}`" for f in others) + ".",
        "",
    ]
