"""Shared test set-up: a per-session cache, and the `spawns` marker that splits the suite.

A test that starts a process (a subprocess, gloo ranks, a multiprocessing pool or worker) is
marked `spawns`: `make test-fast` (`pytest -m "not spawns"`) runs every other test in minutes.
Most spawning tests are marked here, by what their code (and the helpers and fixtures it uses)
calls; one that starts processes only inside paratron (a data loader's workers, a pool) carries
`@pytest.mark.spawns` itself. While `-m "not spawns"` runs, starting a process fails the test with
one line that says to mark it, so the fast tier stays free of processes. The test process computes
on one intra-op thread (see `pytest_configure`).
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, ModuleType

import pytest
import torch

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # tests/tiny.py and tests/megatron_oracle.py

SPAWN_CALLS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve"},
}
"""A module's functions that start a process: `subprocess.run(...)` in a test's code spawns."""
SPAWN_MODULES = ("multiprocessing", "torch.multiprocessing", "concurrent.futures.process")
"""Modules whose use in a test's code means processes (ranks, pools)."""
RANK_RUNNERS = {"run_ranks"}
"""Helpers that run a function on gloo ranks (paratron.distributed.local_ranks)."""


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread in the test process, whatever paratron asks for (it gives a process the
    machine's cores): the tests' models are so small that two threads mostly wait on each other,
    and on busy cores a step took 25 times longer with two than with one (the same losses). Gloo
    ranks and subprocesses get one thread through OMP_NUM_THREADS, which paratron honours."""
    os.environ["OMP_NUM_THREADS"] = "1"
    set_num_threads = torch.set_num_threads
    set_num_threads(1)
    torch.set_num_threads = lambda threads: set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tokenizers and tokenized corpora built by tests go to a per-session cache."""
    os.environ["PARATRON_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield


def _is_spawning_module(value: object) -> bool:
    name = getattr(value, "__name__", "") if isinstance(value, ModuleType) else getattr(value, "__module__", "")
    return isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in SPAWN_MODULES)


def _under_tests(value: object) -> bool:
    code = getattr(value, "__code__", None)
    return code is not None and Path(code.co_filename).is_relative_to(TESTS)


def _code_spawns(code: CodeType, namespace: dict, seen: set) -> bool:
    """Whether this code, a function nested in it, or a tests/ helper it names starts a process."""
    if code in seen:
        return False
    seen.add(code)
    names = set(code.co_names)
    for name in names:
        value = namespace.get(name)
        if inspect.isfunction(value):
            value = inspect.unwrap(value)  # a @contextmanager helper: its generator
        module = getattr(value, "__name__", None) if isinstance(value, ModuleType) else None
        if module in SPAWN_CALLS and names & SPAWN_CALLS[module]:
            return True
        if getattr(value, "__module__", None) in SPAWN_CALLS and getattr(value, "__name__", "") in SPAWN_CALLS.get(
            value.__module__, ()
        ):
            return True  # from subprocess import run
        if _is_spawning_module(value) or (callable(value) and getattr(value, "__name__", "") in RANK_RUNNERS):
            return True
        if isinstance(value, ModuleType) and any(hasattr(value, r) for r in names & RANK_RUNNERS):
            return True  # local_ranks.run_ranks(...)
        if inspect.isclass(value) and value.__module__ in sys.modules and _under_tests(value.__init__):
            members = [m for m in vars(value).values() if inspect.isfunction(m)]
            if any(_code_spawns(m.__code__, m.__globals__, seen) for m in members):
                return True
        elif inspect.isfunction(value) and _under_tests(value):
            if _code_spawns(value.__code__, value.__globals__, seen):
                return True
    return any(isinstance(c, CodeType) and _code_spawns(c, namespace, seen) for c in code.co_consts)


def _function_spawns(function: object, seen: set) -> bool:
    function = inspect.unwrap(getattr(function, "_get_wrapped_function", lambda: function)())
    code = getattr(function, "__code__", None)
    return code is not None and _code_spawns(code, function.__globals__, seen)


def spawns(item: pytest.Item) -> bool:
    """Whether the test, or a fixture it uses, starts a process by what its code calls."""
    seen: set = set()
    if _function_spawns(getattr(item, "obj", None), seen):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for definitions in info.name2fixturedefs.values() if info else ():
        if any(_under_tests(d.func) and _function_spawns(d.func, seen) for d in definitions):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("spawns") is None and spawns(item):
            item.add_marker(pytest.mark.spawns)


class _Guard:
    """Stands in for the process starters while a test that is not marked `spawns` runs."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def refuse(self, what: str) -> None:
        self.started.append(what)
        pytest.fail(self.message(), pytrace=False)

    def message(self) -> str:
        return (
            f"started a process ({self.started[0]}) but is not marked spawns: decorate the test with "
            "@pytest.mark.spawns, so that `make test-fast` (-m 'not spawns') leaves it out"
        )

    @contextmanager
    def watching(self) -> Iterator[None]:
        guard = self

        def popen(self, args, *rest, **kwargs):  # (the child's start, once Popen has set itself up)
            guard.refuse(f"subprocess.Popen {args!r:.80}")

        def start(self):
            guard.refuse(f"multiprocessing {type(self).__name__}.start")

        def refuse_os(name: str):
            return lambda *args, **kwargs: guard.refuse(f"os.{name}")

        patched = [(subprocess.Popen, "_execute_child", popen), (multiprocessing.process.BaseProcess, "start", start)]
        starters = [*SPAWN_CALLS["os"], "system", "popen"]
        patched += [(os, name, refuse_os(name)) for name in starters if hasattr(os, name)]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
        for owner, name, replacement in patched:
            setattr(owner, name, replacement)
        try:
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


def _guarded(item: pytest.Item) -> bool:
    expression = item.config.option.markexpr or ""
    return "not spawns" in " ".join(expression.split()) and item.get_closest_marker("spawns") is None


def _watched(item: pytest.Item):
    """Run a test phase (setup or call) with the guard on, if the item is guarded."""
    if not _guarded(item):
        return (yield)
    guard = _Guard()
    with guard.watching():
        result = yield
    if guard.started:  # the code under test caught the failure: the test still fails
        pytest.fail(guard.message(), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _watched(item))
