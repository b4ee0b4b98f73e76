"""`paratron train | evaluate | preprocess | generate | serve | convert | plan | schedule | debug | doctor | inspect`:
the command line.

Each command is a module of `paratron.commands`, its parser and its run, imported only when that command runs, for
start-up speed: `paratron --help` and `paratron schedule` do not load torch's distributed machinery or the data
pipeline. User mistakes (UserError) print one line and exit 2; internal failures keep their traceback and exit 1.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

try:
    import tomllib
except ImportError:  # (Python 3.10)
    tomllib = None

from paratron.commands.launching import CPP_LOG_LEVEL, USER_CPP_LOG_LEVEL
from paratron.distributed.parent import end_with_launcher
from paratron.errors import PeerFailure, UserError

COMMANDS: dict[str, str] = {
    "train": "train a model (launches itself under torchrun with --nproc N)",
    "evaluate": "per-token loss and perplexity of a saved model over whole files, per file (task)",
    "preprocess": "tokenize text or jsonl into a Megatron-LM indexed dataset (.bin/.idx)",
    "generate": "continue prompts, or hold a conversation, with a saved model",
    "serve": "serve a saved model over HTTP with OpenAI's API (completions, chat), batching requests",
    "convert": "convert weights between Hugging Face, Megatron-LM and paratron checkpoints",
    "plan": "choose the parallel layout: every layout ranked by predicted throughput, with memory and time",
    "schedule": "simulate a pipeline schedule, report its bubble and draw its timeline",
    "debug": "compare two layouts step by step and name the first module or gradient where they part",
    "doctor": "what this machine can do: versions, devices, interconnect, a collective probe, warnings",
    "inspect": "what a checkpoint holds (configuration, layout, step, tensors, optimizer state); --diff two",
}
"""name -> one-line summary; the command itself is `paratron.commands.NAME` (its `run(argv)` returns the exit code)."""


def run_command(name: str, argv: list[str]) -> int:
    """`paratron NAME ARGV`: the command's module imported now, not with this one (start-up speed,
    docs/architecture.md), and run."""
    return importlib.import_module(f"paratron.commands.{name}").run(argv)


def _usage() -> str:
    lines = ["usage: paratron COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {summary}" for name, summary in COMMANDS.items()]
    lines += ["", "`paratron COMMAND --help` describes a command's options; `paratron --version` the version."]
    return "\n".join(lines)


def version() -> str:
    """The installed package's version, else (run from a source tree) its pyproject.toml's."""
    import importlib.metadata  # (start-up speed, docs/architecture.md: only for --version)

    try:
        return importlib.metadata.version("paratron")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        project = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return str(tomllib.loads(project.read_text(encoding="utf-8"))["project"]["version"])
    except (AttributeError, OSError, KeyError, ValueError):  # (AttributeError: Python 3.10 has no tomllib)
        return "unknown (not installed, and no pyproject.toml beside the source)"


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _peer_lost(exc: RuntimeError) -> bool:
    """Whether a worker's collective failed because another rank died (the agent then stops or
    restarts the job; this rank's traceback would only hide the one that matters)."""
    return "RANK" in os.environ and any(sign in str(exc) for sign in PEER_LOST)


def _stop_after_lost_peer(exc: RuntimeError) -> NoReturn:
    """End this worker at once with one line (none when the watchdog's line said it all)."""
    from paratron.distributed.watchdog import hang_reported  # (start-up speed, docs/architecture.md: torch)

    if not hang_reported():
        sign = next(sign for sign in PEER_LOST if sign in str(exc))
        print(f"[rank {os.environ.get('RANK', '0')}] stopped: another rank failed ({sign.lower()})", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # nothing left to tidy, and torch's threads may still hold the dead connections


def _user_log_level_back() -> None:
    """In a worker of a quiet launcher (`commands.launching.quiet_launcher_logs`): torch's C++ log at the level
    the user set, or unset."""
    level = os.environ.pop(USER_CPP_LOG_LEVEL)
    os.environ.pop(CPP_LOG_LEVEL) if not level else os.environ.update({CPP_LOG_LEVEL: level})


def main(argv: Sequence[str] | None = None) -> int:
    """`paratron ARGV`: the command run, its errors mapped to exit codes (2: the user's to fix, 1: internal)."""
    if "RANK" in os.environ and argv is None:  # a worker process: it ends with its launcher
        end_with_launcher(os.getppid())  # (`python -m paratron` has already: this is for the `paratron` script)
    if "RANK" in os.environ and USER_CPP_LOG_LEVEL in os.environ:  # a worker of a quiet launcher
        _user_log_level_back()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"paratron {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"error: unknown command {name!r}; {hint}commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return run_command(name, rest)
    except PeerFailure:
        return 2
    except RuntimeError as exc:
        if not _peer_lost(exc):
            raise
        _stop_after_lost_peer(exc)
    except OSError as exc:  # an unreadable input, an unwritable output, a full disk: the user's to fix
        from paratron.distributed.launch import report_worker_error

        where = f"{exc.filename}: " if exc.filename else ""
        report_worker_error(f"{where}{exc.strerror or exc}")
        return 2
    except UserError as exc:
        from paratron.config.arguments import as_typed
        from paratron.distributed.launch import report_worker_error

        report_worker_error(as_typed(str(exc), rest))
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
