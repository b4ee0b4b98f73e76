"""Writing files: a full disk ends in one line, half-written files are removed, modes follow the umask.

Every writer (checkpoints, conversions, preprocessed data, plans, evaluation results) writes under a
temporary name renamed into place: a file through `replacing` (or `write_bytes_atomic` and
`write_text_atomic`, which add the full-disk line), a folder through `new_folder`. When the
filesystem fills up (or a quota runs out) on the way, `writing` turns the error - an `OSError` with
ENOSPC or EDQUOT, or the safetensors or torch error that wraps one - into a `UserError` of one line
that says what was being written, where, how much it needed and how much was free, and removes the
partial file or folder. `check_space` refuses before anything is written when an estimate of the
bytes does not fit.

safetensors creates its files with mode 0600 whatever the umask, so teammates on a shared filesystem
could not read a checkpoint; `save_tensors` and `honour_umask` give files the mode `open` and
`torch.save` give them (0666 & ~umask) and folders 0777 & ~umask.
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratron.errors import UserError

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")
"""How a full disk reads in errors raised outside Python (safetensors' and tokenizers' Rust, torch's C++)."""
DEFAULT_FIX = "free space or write it elsewhere"

Needed = int | Callable[[], int | None] | None
"""Bytes a write needs: a number, a function that estimates it when asked (after a failure), or unknown."""

_umask_lock = threading.Lock()


@dataclass(frozen=True)
class Space:
    """The filesystem a path is on, as `df` shows it."""

    mount: Path
    device: int
    free: int
    """Bytes an ordinary user may still write."""


def existing_ancestor(path: Path) -> Path:
    """The path itself, or its nearest parent that exists (what is about to be written may not yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def space_at(path: Path) -> Space:
    """The filesystem `path` will be written on: where it is mounted, its device id and free bytes."""
    place = existing_ancestor(path)
    mount = place.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return Space(mount, os.stat(place).st_dev, shutil.disk_usage(place).free)


def format_sizes(*sizes: int) -> list[str]:
    """Byte counts in the one decimal unit that suits the largest, so they compare at a glance."""
    largest = max(sizes)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= scale:
            return [f"{size / scale:.1f} {unit}" for size in sizes]
    return [f"{size} B" for size in sizes]


def is_disk_full(error: BaseException) -> bool:
    """Whether an error (or one it wraps) is a full filesystem or an exhausted quota. A `UserError`
    has been reported already and is never one."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and not isinstance(current, UserError):
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE_ERRNOS:
            return True
        if any(text in str(current) for text in NO_SPACE_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def no_space_message(
    what: str, path: Path, needed: int | None, space: Space, fix: str = DEFAULT_FIX, ahead: bool = False
) -> str:
    """The one line of a full disk: what, where, how much it needs, how much is (`ahead`: before
    writing) or was free, and the fix."""
    if needed is None:
        (free,) = format_sizes(space.free)
        amount = f"it needs more than the {free} that were free"
    else:
        need, free = format_sizes(max(needed, 0), space.free)
        amount = f"it needs {need}, {free} {'are' if ahead else 'were'} free"
    if ahead:
        return f"not enough space on {space.mount} for {what} ({path}): {amount}; {fix}"
    return f"no space left on {space.mount} while writing {what} ({path}): {amount}; {fix}"


def check_space(what: str, path: Path, needed: int, fix: str = DEFAULT_FIX) -> Space:
    """Refuse (one line) a write of about `needed` bytes at `path` that its filesystem cannot hold;
    returns the space found."""
    space = space_at(path)
    if needed > space.free:
        raise UserError(no_space_message(what, path, needed, space, fix, ahead=True))
    return space


def remove_partial(path: Path) -> None:
    """Delete a half-written file or folder (nothing if it is not there)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def writing(
    what: str,
    path: Path,
    needed: Needed = None,
    fix: str = DEFAULT_FIX,
    partial: Path | None = None,
    space: Space | None = None,
) -> Iterator[None]:
    """Around a write of `what` to `path`: on any error remove `partial` (the temporary file or
    folder, if given); a full disk becomes a one-line `UserError` with `needed` bytes (or its
    estimate), the free space measured before (or `space`, measured earlier) and `fix`."""
    space = space or space_at(path)
    try:
        yield
    except BaseException as error:
        if partial is not None:
            remove_partial(partial)
        if not is_disk_full(error):
            raise
        amount = needed() if callable(needed) else needed
        raise UserError(no_space_message(what, path, amount, space, fix)) from None


FOLDER_SLACK = 1 << 16
"""Bytes a written folder may take beyond its tensors and files: configs, indexes, headers, meta.json."""


@contextmanager
def new_folder(what: str, destination: Path, needed: int, fix: str = DEFAULT_FIX) -> Iterator[Path]:
    """Write the folder `destination` (a conversion's) through a temporary one beside it, yielded
    (made, empty): the space is checked first, a full disk is one line with the partial folder
    removed, and when the block ends its files get the umask's modes and it is renamed into place."""
    tmp = destination.with_name(f".{destination.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    check_space(what, destination, needed, fix)
    with writing(what, destination, needed, fix, partial=tmp):
        tmp.mkdir(parents=True)
        yield tmp
        honour_umask(tmp)  # (copied files, a tokenizer's, keep their source's mode otherwise)
        tmp.replace(destination)


def temporary_beside(path: Path) -> Path:
    """A hidden name in `path`'s folder to write it under before the rename (same folder, so the
    rename is atomic), naming its writer's host and process plus a random part, so writers sharing
    the folder (other machines, other threads) never write the same temporary file."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Write the file `path` whole or not at all: the block writes the temporary path yielded
    (`temporary_beside`), which is renamed over `path` when the block ends, or removed when it
    fails. The writer creates the file, so it has the mode the umask gives."""
    tmp = temporary_beside(path)
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        remove_partial(tmp)
        raise


def write_bytes_atomic(path: Path, data: bytes, what: str | None = None, fix: str = DEFAULT_FIX) -> None:
    """Write through a temporary file renamed into place (`replacing`): a stopped writer leaves no
    half-written file, and a full disk says so in one line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(what or "a file", path, len(data), fix), replacing(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: Path, text: str, what: str | None = None, fix: str = DEFAULT_FIX) -> None:
    """`write_bytes_atomic` of UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"), what, fix)


def save_figure(figure: Any, path: Path, what: str, fix: str = DEFAULT_FIX, **options: Any) -> Path:
    """A matplotlib figure as a PNG at `path`, drawn in memory first (its size is known before the
    disk is asked for it), then `write_bytes_atomic`; `options` go to `savefig` (dpi, ...)."""
    picture = io.BytesIO()
    figure.savefig(picture, format="png", **options)
    write_bytes_atomic(Path(path), picture.getvalue(), what, fix)
    return Path(path)


def current_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (other threads may be
    creating files meanwhile), else set and put back under a lock."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def honour_umask(*paths: Path) -> None:
    """Give files the mode `open` would (0666 & ~umask) and folders 0777 & ~umask; a folder's
    contents too. Entries owned by someone else, and filesystems with permissions of their own
    (no chmod), keep theirs."""
    mask = current_umask()
    for path in paths:
        entries = [path, *Path(path).rglob("*")] if Path(path).is_dir() else [path]
        for entry in entries:
            if entry.is_symlink():
                continue
            try:
                os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~mask)
            except OSError:
                pass


def save_tensors(tensors: Mapping[str, Any], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file with the mode the umask gives (safetensors itself makes it 0600)."""
    from safetensors.torch import save_file  # (start-up speed: workers need no torch; docs/architecture.md)

    save_file(dict(tensors), str(path), metadata=metadata)
    honour_umask(Path(path))


def save_object(value: Any, path: Path) -> None:
    """`torch.save` through a Python file, so that a full disk surfaces as its `OSError` (torch's
    own writer reports only a position mismatch)."""
    import torch  # (start-up speed: workers need no torch; docs/architecture.md)

    with open(path, "wb") as file:
        torch.save(value, file)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a value (nested in dicts, lists and tuples), as they are stored."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0
