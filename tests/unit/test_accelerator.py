"""The device and collective backend come from `torch.accelerator` (faked here: CUDA, XPU, MPS, none),
--distributed-backend wins, and a request the machine cannot serve is one line with the fix."""

from __future__ import annotations

import pytest
import torch

from paratron.distributed import init
from paratron.distributed.init import accelerator_type, choose_backend, default_backend, visible_devices
from paratron.errors import ConfigError


def fake_accelerator(monkeypatch, kind: str | None, count: int = 1) -> list[int]:
    """Make torch report `kind` as this machine's accelerator (None: none); returns the device indices set."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: kind is not None)
    device = None if kind is None else torch.device(kind)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: device)
    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count if kind else 0)
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return chosen


@pytest.mark.parametrize(
    "kind, backend",
    [("cuda", "nccl"), ("xpu", "xccl"), ("mps", "gloo"), (None, "gloo")],
)
def test_auto_takes_the_accelerator_and_its_backend(monkeypatch, kind, backend):
    chosen = fake_accelerator(monkeypatch, kind)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert accelerator_type() == (kind or "cpu")
    assert choose_backend("auto") == (backend, torch.device(kind or "cpu", 0) if kind else torch.device("cpu"))
    assert chosen == ([0] if kind else [])


def test_the_local_rank_picks_the_device(monkeypatch):
    chosen = fake_accelerator(monkeypatch, "xpu", count=4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert choose_backend("auto") == ("xccl", torch.device("xpu", 3)) and chosen == [3]
    assert visible_devices("auto") == 4 and visible_devices("gloo") is None


def test_the_requested_backend_wins(monkeypatch):
    chosen = fake_accelerator(monkeypatch, "cuda")
    assert choose_backend("gloo") == ("gloo", torch.device("cpu")) and chosen == []
    assert choose_backend("nccl") == ("nccl", torch.device("cuda", 0))


@pytest.mark.parametrize("kind, requested, needs", [(None, "nccl", "CUDA"), ("cuda", "xccl", "Intel XPU")])
def test_a_backend_the_machine_cannot_serve_is_one_line(monkeypatch, kind, requested, needs):
    fake_accelerator(monkeypatch, kind)
    with pytest.raises(ConfigError, match=f"--distributed-backend {requested} needs .*{needs}.*use gloo or auto") as e:
        choose_backend(requested)
    assert "\n" not in str(e.value)


def test_several_processes_on_mps_are_refused(monkeypatch):
    chosen = fake_accelerator(monkeypatch, "mps")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^2 processes on Apple MPS: .*--nproc-per-node 1.*gloo") as e:
        choose_backend("auto")
    assert "\n" not in str(e.value) and chosen == []
    assert visible_devices("auto") == 1  # (so --nproc above one is refused before any process starts)


def test_backends_torch_pairs_with_each_device():
    assert [default_backend(kind) for kind in ("cuda", "xpu", "mps", "cpu")] == ["nccl", "xccl", "gloo", "gloo"]
    assert init.collective_device() == torch.device("cpu")  # (no process group here)


@pytest.mark.parametrize(
    "given, cores, local_world, threads",
    [(None, 8, 2, 4), (None, 2, 4, 1), ("3", 8, 2, 3), ("x", 8, 4, 2), ("0", 8, 1, 8)],
)
def test_cpu_processes_take_omp_num_threads_or_a_share_of_the_cores(monkeypatch, given, cores, local_world, threads):
    monkeypatch.setattr(init.os, "cpu_count", lambda: cores)
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    assert init.cpu_threads(local_world) == threads
