"""Every benchmark in bench/ still runs: each one's --smoke (tiny sizes, one round, its own checks on,
its peer still compared), so a benchmark that stops working fails here rather than on the day its
figures are wanted. The benchmarks run in this process (those that need ranks spawn them); the
published results in bench/results are not touched."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the benchmarks import their shared modules (common.py) by name

SMOKES = {
    "activation_memory": [],
    "attention": [],
    "checkpoint": [],
    "checkpoint_sharded": [],
    "collectives": [],
    "compile": [],
    "context_parallel": [],
    "data_parallel": ["step"],
    "data_pipeline": ["all"],
    "debug_compare": [],
    "expert_parallel": [],
    "faults": [],
    "finetune": [],
    "fused_loss": [],
    "fused_matmuls": [],
    "layer_stats": [],
    "generate": [],
    "harness": [],
    "inspect_checkpoint": [],
    "megatron_step": [],
    "moe": [],
    "optimizer_step": [],
    "pipeline_bubble": [],
    "pipeline_step": [],
    "plan_cpu": [],
    "plan_published": [],
    "recompute": [],
    "serve": [],
    "step_time": [],
    "stragglers": [],
    "tensor_parallel": ["all"],
    "vision": [],
    "zero_memory": [],
}
"""Each benchmark and the arguments before --smoke."""


def test_every_benchmark_has_a_smoke_run():
    scripts = {p.stem for p in BENCH.glob("*.py")} - {"common", "pipeline_common", "llama_common"}
    assert scripts == set(SMOKES), "bench/ and this test list different benchmarks"


@pytest.fixture
def _restored():
    """A benchmark may set threads, environment variables or the working directory for its runs,
    and a one-process benchmark may leave its process group (its process would end there)."""
    environment, threads, folder = dict(os.environ), torch.get_num_threads(), os.getcwd()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(threads)
    os.chdir(folder)


@pytest.mark.spawns
@pytest.mark.parametrize("name", sorted(SMOKES))
def test_benchmark_smoke(name: str, _restored: None) -> None:
    importlib.import_module(name).main([*SMOKES[name], "--smoke"])


@pytest.mark.spawns
def test_the_gpu_script_parses_and_refuses_without_cuda() -> None:
    """bench/gpu.sh runs only where CUDA is: elsewhere one line and exit code 2, before anything runs."""
    script = BENCH / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run for minutes")
    environment = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=environment, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("bench/gpu.sh: no CUDA device here") and done.stderr.count("\n") == 1
