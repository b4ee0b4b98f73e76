"""Fine-tuning at every layout equals the single process: 20-step loss curves of full SFT and of
LoRA (per-token loss over packed conversations), and `paratron evaluate` of one checkpoint.

One spawn per layout runs all three (the suite's time budget is tight)."""

from __future__ import annotations

import pytest

from paratron.config import build_config
from paratron.training.evaluate import run_evaluation
from paratron.training.run import run_training

from multiprocess import run_ranks
from tiny import PARITY_RUN, write_conversations


def settings(data: str, run_dir: str, **overrides) -> dict:
    return dict(
        dict(
            num_layers=2,
            hidden_size=32,
            ffn_hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            position_embedding_type="rope",
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
            untie_embeddings_and_output_weights=True,
            sft=True,
            data_path=["0.6", f"{data}/chat.jsonl", "0.4", f"{data}/qa.jsonl"],
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=f"{data}/tokenizer.json",
            chat_template="chatml",
            seq_length=64,
            micro_batch_size=2,
            global_batch_size=4,
            run_dir=run_dir,
            **PARITY_RUN,
        ),
        **overrides,
    )


def finetune_and_evaluate(data: str, run_dir: str, checkpoint: str, layout: dict) -> dict:
    """Full SFT and LoRA curves, then the evaluation of `checkpoint`, at `layout` (on every rank)."""
    from paratron.distributed.init import initialize, shutdown

    initialize("gloo")
    try:
        full = run_training(build_config(settings(data, f"{run_dir}/full", **layout))).losses
        lora = run_training(
            build_config(settings(data, f"{run_dir}/lora", lora_rank=4, lora_alpha=8.0, lr=1e-2, **layout))
        ).losses
        evaluation = run_evaluation(
            build_config(settings(data, f"{run_dir}/eval", load=checkpoint, micro_batch_size=1, **layout)), None
        )
        return {"full": full, "lora": lora, "evaluation": evaluation}
    finally:
        shutdown()


LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "pp2-1f1b": (2, dict(pipeline_model_parallel_size=2)),
    "pp2-zb-h1": (2, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1")),
    "dp2-zero1": (2, dict(use_distributed_optimizer=True)),
    "dp2-zero3": (2, dict(zero_stage=3)),
    "cp2": (2, dict(context_parallel_size=2)),  # (packed conversations: document masks and positions split)
    "tp2xpp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finetune")
    write_conversations(folder / "data")
    data, runs = str(folder / "data"), folder / "runs"
    full = run_training(build_config(settings(data, str(runs / "full"), save=str(folder / "ckpt")))).losses
    lora = run_training(build_config(settings(data, str(runs / "lora"), lora_rank=4, lora_alpha=8.0, lr=1e-2))).losses
    evaluation = run_evaluation(
        build_config(settings(data, str(runs / "eval"), load=str(folder / "ckpt"), micro_batch_size=1)), None
    )
    return folder, {"full": full, "lora": lora, "evaluation": evaluation}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_finetuning_at_every_layout_equals_one_process(reference, name):
    folder, single = reference
    assert len(single["full"]) == 20 and single["full"][-1] < single["full"][0] - 0.5  # it learns
    assert single["lora"][-1] < single["lora"][0] - 0.1
    world, layout = LAYOUTS[name]
    result = run_ranks(
        finetune_and_evaluate, world, str(folder / "data"), str(folder / name), str(folder / "ckpt"), layout
    )[0]
    assert result["full"] == pytest.approx(single["full"], rel=1e-5)
    assert result["lora"] == pytest.approx(single["lora"], rel=1e-5)
    ours, theirs = result["evaluation"], single["evaluation"]
    assert ours["tokens"] == theirs["tokens"] > 0
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    for task in ("chat", "qa"):
        assert ours["tasks"][task]["loss"] == pytest.approx(theirs["tasks"][task]["loss"], rel=1e-5)
