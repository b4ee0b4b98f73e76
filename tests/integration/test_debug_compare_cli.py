"""`paratron debug compare` end to end on a model whose second layer is a mixture of experts: tensor
parallelism, expert parallelism and ZeRO stage 3 agree with one process; a defect planted in one
tensor-parallel layer, in a module of the second pipeline stage, or in a router whose experts are
split over two ranks is named exactly.

The single-process reference is trained once (--keep), by tensor parallelism's compare, and reused
by the other compares (--reference). Each compare runs the command in this process, each of its runs
of `paratron train` on ranks forked from `run_ranks`' server (two for --nproc 2, one for the
single-process run) instead of a torchrun launch or an interpreter of its own: every fresh
interpreter spends seconds importing torch, and what they check (the captures, the report, the exit
code) does not depend on how the ranks started. The command as a user starts it, its runs in
processes of their own, is bench/debug_compare.py's smoke run (tests/integration/test_bench_smoke.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from paratron.cli import main
from paratron.debugging import compare as compare_command
from paratron.debugging.capture import DEFECT_VARIABLE
from paratron.distributed.local_ranks import run_ranks

TINY = (
    "--config debug --model-name debug-moe --moe-layer-freq [0,1] --moe-shared-expert-intermediate-size 32 "
    "--micro-batch-size 4 --global-batch-size 8 --seq-length 16"
)


@dataclasses.dataclass
class Outcome:
    """What the command returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def train_command(flags: list[str]) -> int:
    """One rank of `paratron train FLAGS`, as a worker that torchrun started."""
    return main(["train", *flags])


def train_on_forked_ranks(label: str, flags: Sequence[str], folder: Path) -> None:
    """The compare's run of `paratron train` (`debugging.compare.train`) on --nproc forked ranks (one without)."""
    flags = list(flags)
    ranks = int(flags[flags.index("--nproc") + 1]) if "--nproc" in flags else 1
    codes = run_ranks(train_command, ranks, flags)
    assert set(codes) == {0}, f"run {label} failed: exit codes {codes}"


@contextlib.contextmanager
def runs_on_forked_ranks(patch: pytest.MonkeyPatch, defect: str | None) -> Iterator[None]:
    """While the block runs, the compare trains its runs on forked ranks, with PARATRON_DEBUG_DEFECT=`defect`
    (the ranks get this process's environment)."""
    patch.setattr(compare_command, "train", train_on_forked_ranks)
    patch.delenv(DEFECT_VARIABLE, raising=False)
    if defect is not None:
        patch.setenv(DEFECT_VARIABLE, defect)
    yield


def compare_in_process(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    *args: str,
    defect: str | None = None,
    steps: int = 2,
) -> Outcome:
    """`paratron debug compare --steps STEPS ARGS` in this process, its runs on forked ranks, with
    PARATRON_DEBUG_DEFECT=`defect`."""
    with runs_on_forked_ranks(monkeypatch, defect):
        capsys.readouterr()
        code = main(["debug", "compare", "--steps", str(steps), *args])
        out, err = capsys.readouterr()
    return Outcome(code, out, err)


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Outcome]:
    """Tensor parallelism's compare, its runs kept (--keep): the single-process reference of the others."""
    folder = tmp_path_factory.mktemp("compare") / "kept"
    output = folder.parent / "agree.json"
    out, err = io.StringIO(), io.StringIO()
    args = ["--keep", str(folder), "--output", str(output), "--", f"{TINY} --nproc 2 --tensor-model-parallel-size 2"]
    with pytest.MonkeyPatch.context() as patch, runs_on_forked_ranks(patch, None):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["debug", "compare", "--steps", "2", *args])
    return folder, Outcome(code, out.getvalue(), err.getvalue())


@pytest.mark.spawns
def test_tensor_parallel_agrees_with_one_process(kept: tuple[Path, Outcome]) -> None:
    folder, done = kept
    assert done.returncode == 0, done.stderr + done.stdout
    assert done.stdout.startswith("the runs agree:") and "layers.1" in done.stdout
    report = json.loads((folder.parent / "agree.json").read_text())
    assert report["first"] is None and report["steps"] == [1, 2] and report["compared"] > 100
    assert not report["only_in_one"]
    assert max(row["forward"] for row in report["layers"]) < 1e-5


@pytest.mark.spawns
@pytest.mark.parametrize(
    "layout", ["--expert-model-parallel-size 2", "--zero-stage 3"], ids=["expert-parallel", "zero-3"]
)
def test_experts_and_zero3_agree_with_one_process(
    kept: tuple[Path, Outcome],
    layout: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """Experts split over two ranks, and FSDP2's sharded parameters and gradients, assemble to the
    single-device tensors: every router's logits and weights, every expert's gradient."""
    folder, first = kept
    assert first.returncode == 0, first.stderr
    output = folder.parent / f"{layout.split()[0][2:]}.json"
    reference = str(folder / "B" / "capture")
    done = compare_in_process(
        monkeypatch, capsys, "--reference", reference, "--output", str(output), "--", f"{TINY} --nproc 2 {layout}"
    )
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(output.read_text())
    names = json.loads((folder / "B" / "capture" / "index.json").read_text())["names"]
    assert {"forward/layers.1.mlp.router.logits", "gradient/layers.1.mlp.experts.w_out"} <= set(names)
    assert report["first"] is None and not report["only_in_one"] and report["compared"] == 2 * len(names)
    assert max(row["gradient"] for row in report["layers"]) < 1e-5


@pytest.mark.spawns
@pytest.mark.parametrize(
    "layout,defect",
    [
        ("--nproc 2 --tensor-model-parallel-size 2", "layers.0.mlp.in_proj.up"),
        ("--nproc 2 --pipeline-model-parallel-size 2", "layers.1.mlp_norm"),
        ("--nproc 2 --expert-model-parallel-size 2", "layers.1.mlp.router"),
    ],
    ids=["tensor-parallel", "pipeline-stage-1", "expert-parallel-router"],
)
def test_a_planted_defect_is_named(
    kept: tuple[Path, Outcome],
    layout: str,
    defect: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    folder, first = kept
    assert first.returncode == 0, first.stderr
    reference = str(folder / "B" / "capture")
    output = folder.parent / f"{defect}.json"
    # (one step: the defect parts the runs at step 1)
    args = ("--reference", reference, "--output", str(output), "--", f"{TINY} {layout}")
    done = compare_in_process(monkeypatch, capsys, *args, defect=defect, steps=1)
    assert done.returncode == 1, done.stderr + done.stdout
    assert done.stdout.startswith(f"the runs part at step 1, forward, {defect}: rel. diff "), done.stdout
    first = json.loads(output.read_text())["first"]
    assert (first["step"], first["phase"], first["name"]) == (1, "forward", defect)
    assert 1e-3 < first["rel_diff"] < 2e-2  # (a 1e-2 defect on all, or on one rank's part, of the output)


MLA = (
    "--config debug --micro-batch-size 2 --global-batch-size 2 --seq-length 16 --position-embedding-type rope "
    "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
    "--v-head-dim 8 --qk-layernorm --rotary-scaling-factor 4"
)


@pytest.mark.spawns
def test_multi_latent_attention_at_tensor_parallel_agrees_with_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Its core's heads are laid out by its query projection's rows per head, which are not its values' width."""
    output = tmp_path / "mla.json"
    layout = "--nproc 2 --tensor-model-parallel-size 2 --sequence-parallel"
    runs = ("--", f"{MLA} --nproc 1", "--", f"{MLA} {layout}")
    done = compare_in_process(monkeypatch, capsys, "--output", str(output), *runs, steps=1)
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(output.read_text())
    assert report["first"] is None and report["compared"] > 50
    assert max(row["forward"] for row in report["layers"]) < 1e-5
