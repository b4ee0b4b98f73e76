"""A padded vocabulary under data parallelism on one tensor-parallel rank: the distributed optimizer's flat buffers
(ZeRO-1) and FSDP2's rows (ZeRO-3) cut through the padding rows, and the run still equals the single process with
no padding, loss by loss, and its checkpoint holds the real vocabulary."""

from __future__ import annotations

import json

from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training

from tiny import tiny_config

VOCAB, STEPS = 250, 6
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=16,
    train_iters=STEPS,
    global_batch_size=8,
    micro_batch_size=4,
    untie_embeddings_and_output_weights=True,
)
ZERO = {"zero1": dict(use_distributed_optimizer=True), "zero3": dict(zero_stage=3)}


def padded_runs(run_dir: str) -> dict[str, list[float]]:
    """On every rank: each ZeRO stage's loss curve with the vocabulary padded to 256 (and a checkpoint)."""
    from paratron.distributed.init import initialize

    initialize("gloo")
    curves = {}
    for name, settings in ZERO.items():
        folder = f"{run_dir}/{name}"
        config = tiny_config(folder, **COMMON, **settings, make_vocab_size_divisible_by=128, save=f"{folder}/c")
        curves[name] = run_training(config).losses
    return curves


def test_zero_stages_with_padding_equal_the_unpadded_single_process(tmp_path):
    reference = run_training(tiny_config(tmp_path / "single", **COMMON, make_vocab_size_divisible_by=1)).losses
    curves = run_ranks(padded_runs, 2, str(tmp_path / "dp"))[0]
    for name, curve in curves.items():
        assert len(curve) == STEPS
        for step, (got, want) in enumerate(zip(curve, reference), start=1):
            assert abs(got - want) <= 1e-5 * want, f"{name}: step {step}: {got} vs unpadded single process {want}"
        index = json.loads(next((tmp_path / "dp" / name / "c").glob("iter_*/model.safetensors.index.json")).read_text())
        assert index["shapes"]["output.weight"] == [VOCAB, 32] and index["shapes"]["embedding.weight"] == [VOCAB, 32]
