"""One writer at a time in a --save folder.

Two jobs saving into one folder interleave their checkpoints: a job restarted while the one
before it still runs resumes from a step the other is already past, and both publish the same
iterations. So a job takes `SAVE/paratron.lock` before it writes: a small JSON file naming the
holder's host, pid, the process's start time (from /proc, where the system has it, so that a
reused pid is not taken for the holder) and since when. A second job that finds a live holder
stops in one line; a holder that is gone (on this host) is taken over with a one-line note; a
holder on another host cannot be checked from here, so the line says how to remove its lock.

The launcher (`paratron train --nproc N`) holds it for the whole job, across --max-restarts
attempts, and tells its workers so (`HELD_ENV`); under plain torchrun rank 0 holds it. The
nodes of one multi-node job share it: every node's launcher names the same job (`job_key`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from paratron.config.fields import flag
from paratron.config.schema import ParallelConfig
from paratron.errors import CheckpointError
from paratron.storage import replacing

try:
    import fcntl
except ImportError:  # (not on Windows: there the exclusive creation alone guards the lock)
    fcntl = None

LOCK_NAME = "paratron.lock"
HELD_ENV = "PARATRON_SAVE_LOCK"
"""Set by the launcher for its workers: the job id of the lock it holds for them."""


@dataclass(frozen=True)
class Holder:
    """Who holds a save folder: the process, where it runs, and the job it belongs to."""

    host: str
    pid: int
    started: str | None
    since: str
    job: str

    def names(self) -> str:
        return f"host {self.host}, pid {self.pid}, since {self.since}"


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks after boot (/proc/PID/stat, field 22), which
    tells a process from a later one given the same pid; None where /proc does not say."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from its third field on (after the command name, which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def process_alive(pid: int, started: str | None) -> bool:
    """Whether the process `pid` on this host still runs and is the one that started at `started`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: it exists)
        pass
    fields = _stat_fields(pid)
    if fields is not None and fields[0] == "Z":  # dead, not yet collected by its parent
        return False
    now = fields[19] if fields is not None and len(fields) > 19 else None
    return started is None or now is None or now == started


def this_process(job: str) -> Holder:
    """This process as the holder of a lock for `job`, from now."""
    pid = os.getpid()
    since = datetime.now().astimezone().isoformat(timespec="seconds")
    return Holder(socket.gethostname(), pid, process_start_time(pid), since, job)


def job_key(parallel: ParallelConfig) -> str:
    """The job id a launcher writes in the lock: the same on every node of a multi-node job (its
    rendezvous), so that the nodes share the folder; a fresh one otherwise."""
    if parallel.nnodes > 1:
        where = parallel.rdzv_endpoint or f"{parallel.master_addr}:{parallel.master_port}"
        return f"{parallel.rdzv_id or 'paratron'}@{where}"
    return uuid.uuid4().hex[:12]


class SaveLock:
    """The lock of one --save folder; `acquire` takes it (or raises CheckpointError), `release`
    gives it back if this job still holds it."""

    def __init__(self, folder: Path, job: str | None = None) -> None:
        self.folder = Path(folder).expanduser()
        self.path = self.folder / LOCK_NAME
        self.me = this_process(job or uuid.uuid4().hex[:12])
        self.owned = False
        self.created_folder = False
        """Whether taking the lock made the folder: a job that ends before its first save leaves none."""

    @property
    def job(self) -> str:
        return self.me.job

    def acquire(self) -> SaveLock:
        """Take the folder: create the lock, or join this job's own, or take over a gone holder's."""
        try:
            self.created_folder = not self.folder.exists()
            self.folder.mkdir(parents=True, exist_ok=True)
            with self._guard():
                gone = self._take()
        except OSError as exc:
            raise CheckpointError(
                f"{flag.save} {self.folder}: cannot take its lock ({exc.strerror or exc}); give a folder this user "
                "can write, on a filesystem with space"
            ) from None
        if gone is not None:
            print(
                f"note: {flag.save} {self.folder}: took over the lock of a job that is gone ({gone.names()})",
                file=sys.stderr,
            )
        return self

    def _take(self) -> Holder | None:
        """Create the lock, or join this job's, or write over a gone holder's (returned)."""
        for _ in range(3):  # (a holder may let go between a look and the next)
            if self._create():
                self.owned = True
                return None
            try:
                holder = self._read()
            except FileNotFoundError:
                continue
            if holder.job == self.job:  # (another node of this job took it first)
                return None
            self._refuse_unless_gone(holder)
            self._write_over()
            self.owned = True
            return holder
        raise CheckpointError(
            f"{flag.save} {self.folder}: its lock comes and goes, as if another job were starting there; start again "
            f"once it has, or give this run another {flag.save} folder"
        )

    def release(self) -> None:
        """Remove the lock if it is still this job's (a taken-over or removed one is left alone)."""
        if not self.owned:
            return
        self.owned = False
        with contextlib.suppress(OSError, CheckpointError):
            if self._read() == self.me:
                self.path.unlink()
            if self.created_folder:
                self.folder.rmdir()  # (only when empty: nothing was saved)

    def __enter__(self) -> SaveLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refuse_unless_gone(self, holder: Holder) -> None:
        if holder.host != self.me.host:
            raise CheckpointError(
                f"{flag.save} {self.folder}: locked by a job on host {holder.host} (pid {holder.pid}, since "
                f"{holder.since}), which cannot be checked from {self.me.host}; if that job is gone, delete "
                f"{self.path} and start again, else give this run another {flag.save} folder"
            )
        if process_alive(holder.pid, holder.started):
            raise CheckpointError(
                f"{flag.save} {self.folder}: another job is writing there ({holder.names()}); wait for it to end or "
                f"stop it, or give this run another {flag.save} folder"
            )

    def _content(self) -> str:
        return json.dumps(asdict(self.me)) + "\n"

    def _create(self) -> bool:
        """Create the lock with its content in one step (a hard link of a full file, which is also
        exclusive on network file systems); False when there is one already."""
        scratch = self.folder / f".{LOCK_NAME}.{self.me.host}.{self.me.pid}"
        scratch.write_text(self._content(), encoding="utf-8")
        try:
            os.link(scratch, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # (no hard links here: an exclusive create, then the content)
            try:
                descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(self._content())
            return True
        finally:
            scratch.unlink(missing_ok=True)

    def _write_over(self) -> None:
        with replacing(self.path) as scratch:
            scratch.write_text(self._content(), encoding="utf-8")

    def _read(self) -> Holder:
        try:
            return Holder(**json.loads(self.path.read_text(encoding="utf-8")))
        except (ValueError, TypeError):
            raise CheckpointError(
                f"{flag.save} {self.folder}: its lock {self.path} is unreadable; if no job is writing there, delete it "
                "and start again"
            ) from None

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Jobs starting at the same moment decide one after the other (an advisory lock on the
        folder, where the system and file system have one)."""
        if fcntl is None:
            yield
            return
        descriptor = os.open(self.folder, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # (which also lets the advisory lock go)


@contextlib.contextmanager
def held_for_the_launch(save: str | None, parallel: ParallelConfig) -> Iterator[None]:
    """The launcher's hold on --save for the whole job: taken before any worker starts, named to
    the workers (`HELD_ENV`) so that they write without taking it, released when the job ends
    however it ends (done, failed, Ctrl-C)."""
    if save is None:
        yield
        return
    with SaveLock(Path(save), job=job_key(parallel)) as lock:
        os.environ[HELD_ENV] = lock.job
        try:
            yield
        finally:
            os.environ.pop(HELD_ENV, None)


def held_by_the_launcher() -> bool:
    """Whether this process is a worker of a launcher that holds the --save lock for it."""
    return HELD_ENV in os.environ
