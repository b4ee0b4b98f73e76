"""`paratron inspect`: a 1-process run's checkpoints (configuration, step, samples, verified files and tensors,
optimizer and resume state), a flipped byte found by its checksum, Hugging Face and Megatron-LM checkpoints
recognized with their models, --diff of two steps of one run, and bad paths as one-line errors (all in process,
through the CLI)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratron.checkpoint.formats import hf_to_paratron, paratron_to_megatron
from paratron.checkpoint.verify import read_checkpoint
from paratron.cli import main
from paratron.debugging import inspect_diff
from paratron.debugging.checkpoint_view import mapped_tensors
from paratron.debugging.inspect import tensor_checksum

from tiny import save_random_hf_model


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run of 4 steps that saves at steps 2 and 4."""
    root = tmp_path_factory.mktemp("inspect")
    args = ["train", "--config", "debug", "--mock-data", "--train-iters", "4", "--save-interval", "2"]
    args += ["--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16", "--eval-iters", "0"]
    args += ["--hidden-size", "32", "--num-attention-heads", "4"]
    args += ["--save", str(root / "save"), "--run-dir", str(root / "run"), "--no-progress-bar"]
    assert main(args + ["--data-cache-path", str(root / "cache")]) == 0
    return root / "save"


def inspect(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["inspect", *args])
    return code, capsys.readouterr().out


def test_paratron_checkpoint_shows_its_facts_verified(run, capsys):
    code, out = inspect(capsys, str(run), "--tensors", "all")
    assert code == 0
    assert f"checkpoint: {run / 'iter_0000004'} (paratron, iteration 4)" in out
    assert "also here: iter_0000002" in out and "step: 4, consumed samples: 16" in out
    assert "layers 2, hidden 32" in out and "data.seq_length = 16" in out and "training.train_iters = 4" in out
    assert "layout: TP 1, PP 1, CP 1, EP 1, ZeRO 0" in out
    assert "optimizer: exp_avg 36, exp_avg_sq 36, step 4" in out
    assert "RNG states" in out and "data iterator at sample 16" in out
    assert "verified" in out and "MISMATCH" not in out and out.rstrip().endswith("intact")
    weights = load_file(run / "iter_0000004" / "model.safetensors")
    checksum = tensor_checksum(weights["embedding.weight"])
    assert re.search(rf"\n  embedding.weight +\[512, 32\] +float32 +{checksum}  verified\n", out)

    code, out = inspect(capsys, str(run), "--json", "--tensors", "3")
    facts = json.loads(out)
    assert code == 0 and facts["iteration"] == 4 and facts["consumed_samples"] == 16
    assert facts["tensor_count"] == 36 and len(facts["tensors"]) == 3 and facts["damaged"] == []
    assert facts["model"]["layers"] == 2 and facts["settings"]["data.mock_data"] is True
    assert {f["name"]: f["status"] for f in facts["files"]}["model.safetensors"] == "verified"


def test_flipped_byte_is_a_checksum_mismatch(run, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(run / "iter_0000002", damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64] ^= 0x10  # (a weight's value, not the header)
    weights.write_bytes(bytes(data))
    code, out = inspect(capsys, str(damaged))
    assert code == 1
    assert re.search(r"\n  MISMATCH +[0-9.]+ KiB  model.safetensors\n", out)
    assert "DAMAGED: model.safetensors (MISMATCH)" in out
    assert "float32   " in out and out.count("  MISMATCH\n") >= 1
    code, _ = inspect(capsys, str(damaged), "--no-verify")
    assert code == 0


def test_diff_of_two_steps_names_the_differing_tensors(run, capsys):
    threads = torch.get_num_threads()
    code, out = inspect(capsys, str(run / "iter_0000002"), "--diff", str(run), "--tensors", "all")
    assert code == 1 and torch.get_num_threads() == threads  # (compared on one thread, then given back)
    assert "iteration: 2 vs 4" in out and "consumed samples: 8 vs 16" in out and "settings: identical" in out
    assert "tensors: 36 in both (0 identical), 0 only in A, 0 only in B; 36 differ" in out
    a = load_file(run / "iter_0000002" / "model.safetensors")["final_norm.weight"]
    b = load_file(run / "iter_0000004" / "model.safetensors")["final_norm.weight"]
    line = next(line for line in out.splitlines() if line.strip().startswith("final_norm.weight "))
    assert "values differ" in line and f"{float((a - b).abs().max()):.3e}" in line
    recorded = len(json.loads((run / "iter_0000002" / "meta.json").read_text())["files"])
    assert f"A files: {recorded} of {recorded} verified (sha256)\nB files: {recorded} of {recorded} verified" in out
    code, out = inspect(capsys, str(run), "--diff", str(run / "iter_0000004"), "--json")
    assert code == 0 and json.loads(out)["identical"] is True
    assert set(json.loads(out)["files"]["b"].values()) == {"verified"} and json.loads(out)["damaged"] == []
    code, out = inspect(capsys, str(run), "--diff", str(run / "iter_0000004"), "--no-verify")
    assert code == 0 and f"B files: {recorded} not checked (--no-verify)" in out and out.endswith("identical\n")


def test_diff_with_a_damaged_file_says_so(run, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(run / "iter_0000004", damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64] ^= 0x10  # (a weight's value: the comparison alone would call it a difference of values)
    weights.write_bytes(bytes(data))
    code, out = inspect(capsys, str(run), "--diff", str(damaged), "--tensors", "all")
    assert code == 1
    assert "B files: 1 of " in out and " DAMAGED" in out and "DAMAGED: B model.safetensors (MISMATCH)" in out
    assert "tensors: 36 in both (35 identical), 0 only in A, 0 only in B; 1 differ" in out
    code, out = inspect(capsys, str(damaged), "--diff", str(run), "--json")
    assert code == 1 and json.loads(out)["damaged"] == ["A model.safetensors (MISMATCH)"]


def test_whole_tensors_are_read_from_the_mapped_file(run):
    """Every tensor as `load_file` reads it, whether served from the file's mapping (stored whole) or assembled
    (a tensor whose only box does not cover it)."""
    info = read_checkpoint(run)
    saved = load_file(run / "iter_0000004" / "model.safetensors")
    with mapped_tensors(info) as tensors:
        assert sorted(tensors.names()) == sorted(saved)
        for name in tensors.names():
            assert torch.equal(tensors.whole(name), saved[name]), name
        name = "final_norm.weight"
        assembled = tensors.catalog.whole(name)
        tensors.catalog.shapes[name] = (2 * assembled.shape[0],)  # (the box now holds half of it: no mapping)
        with pytest.raises(Exception, match="holds only 32 of the 64 values of final_norm.weight"):
            tensors.whole(name)


def test_hugging_face_and_megatron_checkpoints_are_recognized(tmp_path, capsys):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = save_random_hf_model(transformers.LlamaForCausalLM, config, tmp_path / "hf")
    code, out = inspect(capsys, str(tmp_path / "hf"), "--tensors", "all")
    assert code == 0 and f"checkpoint: {tmp_path / 'hf'} (hf)" in out and "llama model (LlamaForCausalLM)" in out
    assert "rope positions, RMSNorm, swiglu, untied embeddings, layers 2, hidden 32, ffn hidden 64" in out
    assert "heads 4, kv heads 2, vocab 97" in out and "optimizer: none (weights only)" in out
    embedding = model.model.embed_tokens.weight.detach()
    assert f"[97, 32]           float32   {tensor_checksum(embedding)}" in out

    hf_to_paratron(tmp_path / "hf", tmp_path / "converted")
    paratron_to_megatron(tmp_path / "converted", tmp_path / "megatron", tp=2, pp=1)
    code, out = inspect(capsys, str(tmp_path / "megatron"))
    assert code == 0 and "(megatron (torch), iteration 0)" in out and "layout: TP 2, PP 1" in out
    assert "mp_rank_01/model_optim_rng.pt" in out and "heads 4, kv heads 2, vocab 97" in out
    code, out = inspect(capsys, str(tmp_path / "hf"), "--diff", str(tmp_path / "megatron"))
    assert "tensors: 21 in both (21 identical), 0 only in A, 0 only in B; 0 differ" in out
    code, out = inspect(capsys, str(tmp_path / "converted"))
    assert code == 0 and "weights only" in out and "converted from a Hugging Face llama model" in out


@pytest.mark.parametrize(
    "where, message",
    [
        ("missing", "missing: no such file or directory; give a folder written by --save, a Megatron-LM checkpoint"),
        ("empty", "empty: not a checkpoint (no latest_checkpointed_iteration.txt, meta.json, iter_* folders"),
        ("file.txt", "file.txt: not a checkpoint (a file, not a folder)"),
    ],
)
def test_bad_paths_are_one_line_errors(tmp_path, capsys, where, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_bad_tensor_count_is_refused(run, capsys):
    assert main(["inspect", str(run), "--tensors", "many"]) == 2
    assert "--tensors many: give all, none or a number" in capsys.readouterr().err


def test_checksum_is_of_the_values():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t().contiguous())
    assert tensor_checksum(t) != tensor_checksum(t.to(torch.bfloat16))


def test_tensor_comparison_in_chunks(monkeypatch):
    monkeypatch.setattr(inspect_diff, "CHUNK", 7)  # (several chunks, the largest difference in the last)
    a = torch.linspace(-2.0, 3.0, 50)
    b = a.clone()
    b[45] += 0.25
    result = inspect_diff.compare_tensors(a, b, "w")
    assert result.status == inspect_diff.VALUES and result.max_abs == pytest.approx(0.25)
    assert result.max_rel == pytest.approx(0.25 / 3.0)
    same = inspect_diff.compare_tensors(a, a.to(torch.bfloat16).float(), "w")
    assert same.status == inspect_diff.VALUES and 0 < same.max_abs < 0.02
    assert inspect_diff.compare_tensors(a, a.clone(), "w").status == inspect_diff.SAME
    assert inspect_diff.compare_tensors(a, a.double(), "w").status == inspect_diff.DTYPE
    assert inspect_diff.compare_tensors(a, a[:10], "w").status == inspect_diff.SHAPE
    b[3] = float("nan")
    assert math.isnan(inspect_diff.compare_tensors(a, b, "w").max_abs)


def test_tensor_comparison_across_dtypes_with_one_scratch_buffer(monkeypatch):
    """The buffer kept from pair to pair grows for a larger tensor and is kept apart per working dtype; a pair of
    different dtypes is compared in the wider one (bfloat16 against float32: the rounding, float64: exact)."""
    monkeypatch.setattr(inspect_diff, "CHUNK", 16)
    scratch: dict[torch.dtype, torch.Tensor] = {}
    small = torch.tensor([1.0, -4.0, 2.5])
    result = inspect_diff.compare_tensors(small, small + torch.tensor([0.0, 0.5, 0.0]), "s", scratch)
    assert result.max_abs == 0.5 and result.max_rel == 0.125 and scratch[torch.float32].numel() == 3
    a = torch.linspace(-1.0, 1.0, 40) * 3.3
    rounded = a.to(torch.bfloat16)
    values = inspect_diff.compare_tensors(a, rounded, "w", scratch)
    assert (
        values.status == inspect_diff.VALUES and values.dtype_b == "bfloat16" and scratch[torch.float32].numel() == 16
    )
    assert values.max_abs == pytest.approx(float((a - rounded.float()).abs().max()), abs=0) and values.max_abs > 0
    dtype_only = inspect_diff.compare_tensors(rounded, rounded.float(), "w", scratch)
    assert dtype_only.status == inspect_diff.DTYPE and dtype_only.max_abs == 0
    wide = inspect_diff.compare_tensors(a.double() + 1e-12, a, "w", scratch)
    assert wide.status == inspect_diff.VALUES and 0 < wide.max_abs < 1e-9 and torch.float64 in scratch
    infinite = torch.tensor([float("inf"), 1.0])
    assert inspect_diff.compare_tensors(infinite, infinite.clone(), "i", scratch).status == inspect_diff.SAME
    assert inspect_diff.compare_tensors(infinite, torch.tensor([1.0, 1.0]), "i", scratch).max_abs == math.inf
