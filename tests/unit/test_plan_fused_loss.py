"""The planner with --cross-entropy-loss-fusion: the last stage's planned memory keeps one chunk's logits instead of
[tokens x vocabulary / TP] twice (and the gradients the fused loss keeps from forward to backward), its time moves
from the loss's backward to its forward, and `paratron train --dry-run` and `paratron plan` show both."""

from __future__ import annotations

import json
import subprocess

import pytest

from paratron.cli import main
from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.planning.activations import CUDA
from paratron.planning.dry_run import with_vocabulary
from paratron.planning.hardware import PRESETS
from paratron.planning.memory_prediction import predict_memory
from paratron.planning.operations import stage_operations

LLAMA3_8B = dict(model_name="llama3-8b", precision="bf16", seq_length=8192, micro_batch_size=1, global_batch_size=64)
TP2_PP2_SP = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True)


def _config(fused: bool, **layout):
    return with_vocabulary(build_config(dict(LLAMA3_8B, **layout, cross_entropy_loss_fusion=fused)))


def test_the_last_stage_plans_one_chunk_of_logits_instead_of_all_of_them():
    plain, fused = (predict_memory(_config(on, **TP2_PP2_SP), 8, CUDA) for on in (False, True))
    assert plain[0] == fused[0]  # (the first stage holds no output layer)
    tokens, rows, h, bf16 = 8192, 128256 // 2, 4096, 2  # (128,256 splits evenly: no padding rows)
    # kept for backward: the fp32 log-probabilities and the labels (and, under TP, which labels the rank holds),
    # against the fp32 gradients of the hidden states and of this rank's output rows, the labels, and the hidden
    # states gathered from the sequence shards (the unfused layer keeps the shard and gathers it again)
    logits_kept = (4 * rows + 8 + 2) * tokens
    fused_kept = (4 * h + 8) * tokens + bf16 * h * (tokens - tokens // 2) + 4 * rows * h
    assert plain[1].activations - fused[1].activations == logits_kept - fused_kept == 882_917_376
    # working memory: the logits in bf16 and in fp32, against one chunk of 2^24 / rows tokens (fp32, bf16) and the
    # chunk's bf16 weight-gradient product
    chunk = 2**24 // rows
    assert plain[1].buffers - fused[1].buffers == (bf16 + 4) * rows * tokens - (
        (4 + bf16) * chunk * rows + bf16 * rows * h
    )
    assert plain[1].total - fused[1].total > 3.4e9  # 3.41 GB of the last stage's 35.6 GB


def test_the_fused_loss_is_priced_in_forward():
    configs = [_config(on, **TP2_PP2_SP) for on in (False, True)]
    plain, fused = (stage_operations(c, resolve_layout(c, 8), PRESETS["h100-80g"])[0] for c in configs)
    assert plain[0] == fused[0]
    first, last = plain[1], fused[1]
    assert last["F"] > first["F"] and last["B"] < first["B"] and last["W"] == first["W"] == 0.0  # (1F1B: no W)
    # the same three matmuls; the loss's second pass over the logits and the unfused backward's gone, the chunks'
    # small all-reduces and a pass over the kept gradients added: within 2% of the unfused sum
    assert abs((last["F"] + last["B"]) / (first["F"] + first["B"]) - 1) < 0.02


def _run(capsys, *args: str) -> subprocess.CompletedProcess:
    code = main(list(args))
    return subprocess.CompletedProcess(args, code, *capsys.readouterr())


def test_dry_run_and_plan_show_the_smaller_last_stage(capsys, tmp_path):
    common = ["--model", "llama3-8b", "--mock-data", "--seq-length", "8192", "--global-batch-size", "64"]
    rows = {}
    for flags in ([], ["--cross-entropy-loss-fusion"]):
        run = _run(
            capsys, "train", *common, *flags, "--bf16", "--micro-batch-size", "1",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
            "--dry-run", "--world-size", "8", "--hardware", "h100-80g",
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        table = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
        rows[bool(flags)] = {row[0]: dict(zip(("act", "buf", "total"), map(float, row[6:9]))) for row in table}
    assert rows[True]["0"] == rows[False]["0"]
    assert rows[False]["1"]["act"] - rows[True]["1"]["act"] == pytest.approx(0.88, abs=0.011)  # GB (2 decimals)
    assert rows[False]["1"]["buf"] - rows[True]["1"]["buf"] > 2.5

    plans = {}
    for flags in ([], ["--cross-entropy-loss-fusion"]):
        output = tmp_path / f"plans{len(flags)}.json"
        run = _run(
            capsys, "plan", *common, *flags, "--hardware", "h100-80g", "--within", "inf", "--output", str(output)
        )
        assert run.returncode == 0, run.stderr
        plans[bool(flags)] = {p["layout"]: p for p in json.loads(output.read_text())["plans"]}
        best = next(line for line in run.stdout.splitlines() if line.startswith("best: "))
        assert ("--cross-entropy-loss-fusion" in best) == bool(flags)
    one_rank_per_shard = "TP1 CP1 PP1 DP8 mbs1 ZeRO-3"  # (every token's logits on each rank: the most saved)
    plain, fused = (plans[on][one_rank_per_shard]["memory_per_rank"][-1] for on in (False, True))
    assert plain["activations"] - fused["activations"] > 1.9e9 and plain["buffers"] - fused["buffers"] > 5e9
