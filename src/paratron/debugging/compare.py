"""`paratron debug compare --steps K [--tol T] [--output FILE.json] -- "<flags A>" [-- "<flags B>"]`:
train two layouts K steps on the same data with --debug-capture, then name the first module
output or gradient where they part (debugging/compare_report.py).

With one group of flags, A is compared with the same run on a single process: A's flags without
any layout flag (every setting of the `parallel` section: process counts, tensor, pipeline,
context and expert parallel sizes, virtual stages, sequence parallelism, ZeRO and its overlaps,
the pipeline schedule, ...). Both runs must build the same model on the same data: a setting of
the model or the data that differs, or a different global batch or seed, is refused by name
before anything runs. Exit codes: 0 the runs agree, 1 they part, 2 bad input or a failed run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paratron.checkpoint.model_of import read_saved_model
from paratron.config.arguments import ArgumentParser, add_config_arguments, given_settings, parse_config_arguments
from paratron.config.fields import section_fields
from paratron.config.loading import LEGACY_SETTINGS, as_flag, resolve_settings
from paratron.config.validation import validate
from paratron.debugging.capture import INDEX_FILE, run_identity
from paratron.debugging.compare_report import DEFAULT_TOL, compare_captures, format_report
from paratron.errors import ConfigError, DataError, UserError
from paratron.storage import replacing

USAGE = 'paratron debug compare --steps K [--tol T] [--output FILE.json] -- "<train flags A>" [-- "<train flags B>"]'
OWN_FLAGS = ("--train-iters", "--eval-iters", "--debug-capture", "--run-dir", "--save", "--debug-capture-elements")
"""Flags the compare sets on both runs itself."""


@dataclasses.dataclass
class CompareOptions:
    steps: int
    tol: float
    output: Path | None
    elements: int
    flags_a: list[str]
    flags_b: list[str]
    single_process_b: bool
    reference: Path | None = None
    keep: Path | None = None


def _options_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="paratron debug compare", usage=USAGE, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, required=True, help="Training steps of each run (at least 1).")
    parser.add_argument("--tol", type=float, default=DEFAULT_TOL, help="Relative difference at which runs part.")
    parser.add_argument("--output", type=Path, default=None, help="Also write the report as JSON to this file.")
    parser.add_argument(
        "--elements", type=int, default=4096, help="Elements kept of each captured tensor (--debug-capture-elements)."
    )
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="Use this capture folder (of an earlier compare's --keep, or `paratron train --debug-capture DIR`) as "
        "run B instead of running it: several layouts against one reference.",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="Keep both runs (captures, metrics, logs) in this new folder."
    )
    return parser


def parse_compare(argv: Sequence[str]) -> CompareOptions:
    """The command's options and the two runs' train flags (B derived from A when only A is given)."""
    argv = list(argv)
    if "--" not in argv:
        raise ConfigError(f'give the train flags after "--": {USAGE}')
    cut = argv.index("--")
    rest = argv[cut + 1 :]
    groups: list[list[str]] = [[]]
    for token in rest:
        if token == "--":
            groups.append([])
        else:
            groups[-1].append(token)
    if len(groups) > 2 or not groups[0]:
        raise ConfigError(f"give one or two groups of train flags, each after --: {USAGE}")
    options = _options_parser().parse_args(argv[:cut])
    if options.steps < 1:
        raise ConfigError(f"--steps {options.steps}: compare at least 1 step")
    if not options.tol > 0:
        raise ConfigError(f"--tol {options.tol}: the tolerance must be above 0 (1e-4 suits fp32)")
    if options.elements < 1:
        raise ConfigError(f"--elements {options.elements}: keep at least 1 element per tensor")
    flags = [shlex.split(g[0]) if len(g) == 1 else g for g in groups]
    for label, group in zip("AB", flags):
        for token in group:
            if token.split("=", 1)[0] in OWN_FLAGS:
                raise ConfigError(
                    f"flags {label}: drop {token.split('=', 1)[0]}; the compare chooses it for both runs "
                    "(they train --steps steps, evaluate and save nothing)"
                )
    if options.reference is not None and len(flags) == 2:
        raise ConfigError("--reference is run B: give only the flags of run A")
    if options.keep is not None and options.keep.exists() and any(options.keep.iterdir()):
        raise ConfigError(f"--keep {options.keep} is not empty; name a new folder")
    single = len(flags) == 1 and options.reference is None
    flags_b = single_process_flags(flags[0]) if single else flags[-1] if options.reference is None else []
    return CompareOptions(
        options.steps,
        options.tol,
        options.output,
        options.elements,
        flags[0],
        flags_b,
        single,
        options.reference,
        options.keep,
    )


def _train_parser(label: str) -> ArgumentParser:
    parser = ArgumentParser(prog=f"paratron train (flags {label})", allow_abbrev=False)
    add_config_arguments(parser)
    return parser


def single_process_flags(flags: Sequence[str]) -> list[str]:
    """`flags` without the settings of the layout (the `parallel` section's, whatever the spelling)."""
    parser = _train_parser("A")
    layout = {info.name for info in section_fields("parallel")}
    layout |= {name for name, section in LEGACY_SETTINGS.items() if section == "parallel"}
    actions = parser._option_string_actions
    out: list[str] = []
    i = 0
    while i < len(flags):
        token = flags[i]
        action = actions.get(token.split("=", 1)[0]) if token.startswith("--") else None
        i += 1
        if action is None or action.dest not in layout:
            out.append(token)
            continue
        if "=" in token or action.nargs == 0:
            continue
        if action.nargs is None:
            i += 1
        else:
            while i < len(flags) and not flags[i].startswith("--"):
                i += 1
    return out


def run_flags(flags: Sequence[str], steps: int, elements: int, folder: Path) -> list[str]:
    """A run's `paratron train` flags: the user's, then the compare's own."""
    return [
        *flags,
        *("--train-iters", str(steps), "--eval-iters", "0", "--debug-capture", str(folder / "capture")),
        *("--debug-capture-elements", str(elements), "--run-dir", str(folder / "run")),
    ]


def resolve_run(flags: Sequence[str], label: str) -> dict[str, Any]:
    """A run's settings, checked as `paratron train` checks them (a mistake names the run), as what
    two compared runs must share (`capture.run_identity`)."""
    try:
        recipe, overrides, namespace = parse_config_arguments(_train_parser(label), list(flags))
        given = given_settings(overrides, namespace)  # (the model as `paratron train` builds it)
        config = resolve_settings(overrides, recipe, read_checkpoint=read_saved_model, given=given).config
        p = config.parallel
        layout = validate(config, p.nproc_per_node * p.nnodes, check_data=False)
    except UserError as exc:
        raise type(exc)(f"flags {label}: {exc}") from None
    return run_identity(config, layout.global_batch_size)


def reference_identity(folder: Path) -> dict[str, Any]:
    """What the reference capture's run was (its index.json)."""
    index = folder / INDEX_FILE
    if not index.is_file():
        raise DataError(f"--reference {folder}: no {INDEX_FILE}; name a folder written by --debug-capture")
    return json.loads(index.read_text())["run"]


def same_model(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Refuse runs that would not compute the same thing: the model, the data, the seed or the global batch."""
    for section in ("model", "data"):
        for name, value in a[section].items():
            other = b[section].get(name)
            if value != other:
                raise ConfigError(
                    f"the runs build different {section}s: A has {_flag(name, value)}, B has {_flag(name, other)}"
                )
    for name, flag in (("seed", "--seed"), ("global_batch_size", "--global-batch-size")):
        if a[name] != b[name]:
            raise ConfigError(f"the runs differ in {flag}: A has {a[name]}, B has {b[name]}; give both the same")


def _flag(name: str, value: Any) -> str:
    try:
        return as_flag(name, value)
    except KeyError:  # (a setting with no flag of its own)
        return f"{name} = {value!r}"


def last_error_line(output: str) -> str:
    """The line that says why a run failed: the last error line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[-1]


def train(label: str, flags: Sequence[str], folder: Path) -> None:
    """Run `paratron train` with these flags; a failure ends the compare with its last error line."""
    command = [sys.executable, "-m", "paratron", "train", *flags]
    print(f"run {label}: paratron train {shlex.join(flags)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    (folder / "train.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise ConfigError(
            f"run {label} failed (exit code {done.returncode}): {last_error_line(done.stderr or done.stdout)}"
        )


def run_compare(options: CompareOptions) -> int:
    """Check both runs' flags, train both (or A only, against --reference), compare; 1 when they part."""
    with contextlib.ExitStack() as stack:
        work = options.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="paratron-compare-")))
        runs = {"A": options.flags_a} if options.reference is not None else {"A": options.flags_a, "B": options.flags_b}
        argv = {label: run_flags(flags, options.steps, options.elements, work / label) for label, flags in runs.items()}
        identity_a = resolve_run(argv["A"], "A")
        if options.reference is not None:
            identity_b = reference_identity(options.reference)
        else:
            identity_b = resolve_run(argv["B"], "B")
        same_model(identity_a, identity_b)
        for label in runs:
            (work / label).mkdir(parents=True)
            train(label, argv[label], work / label)
        reference = options.reference if options.reference is not None else work / "B" / "capture"
        report = compare_captures(work / "A" / "capture", reference, options.tol)
    if options.single_process_b:
        print("B: the same run on a single process", file=sys.stderr)
    print(format_report(report))
    if options.output is not None:
        with replacing(options.output) as path:
            path.write_text(json.dumps(report.to_json(), indent=1))
    return 1 if report.first is not None else 0


def run_debug(argv: list[str]) -> int:
    """`paratron debug SUBCOMMAND ...` (compare is the one)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}\n\n{__doc__}")
        return 0 if argv else 2
    if argv[0] != "compare":
        raise ConfigError(f"unknown debug command {argv[0]!r}; usage: {USAGE}")
    if any(t in ("-h", "--help") for t in argv[1 : argv.index("--") if "--" in argv else None]):
        _options_parser().print_help()
        return 0
    return run_compare(parse_compare(argv[1:]))
