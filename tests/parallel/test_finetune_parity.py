"""Fine-tuning at every layout equals the single process: 6-step loss curves of full SFT and of
LoRA (per-token loss over packed conversations), and `paratron evaluate` of one checkpoint on
conversations and on a text file (whole: its last window padded, its token count n - 1).

One spawn per world size runs all three at each of its layouts (the suite's time budget is tight)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from paratron.config import build_config
from paratron.data.tokenizer import Tokenizer
from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training
from paratron.training.validation_loss import run_evaluation

from tiny import PARITY_RUN, WORDS, no_loss_plot, write_conversations


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
            **dict(PARITY_RUN, train_iters=6),
        ),
        **overrides,
    )


def write_text(data: str) -> str:
    """A text file (one document) of some ten windows of 64 tokens, the last one partial."""
    path = f"{data}/text.txt"
    with open(path, "w") as f:
        f.write(" ".join(WORDS[i * 7 % len(WORDS)] for i in range(601)))
    return path


def evaluations(data: str, run_dir: str, checkpoint: str, layout: dict) -> dict:
    """`paratron evaluate` of `checkpoint` at `layout`: on the conversations (--sft) and on text."""
    at = dict(load=checkpoint, micro_batch_size=1, **layout)
    return {
        "evaluation": run_evaluation(build_config(settings(data, f"{run_dir}/eval", **at)), None),
        "text": run_evaluation(
            build_config(settings(data, f"{run_dir}/eval-text", sft=False, data_path=[f"{data}/text.txt"], **at)), None
        ),
    }


def finetune_and_evaluate(data: str, run_dir: str, checkpoint: str, layout: dict) -> dict:
    """Full SFT and LoRA curves, then the evaluations of `checkpoint`, at `layout` (on every rank)."""
    with no_loss_plot():
        full = run_training(build_config(settings(data, f"{run_dir}/full", **layout))).losses
        lora = run_training(
            build_config(settings(data, f"{run_dir}/lora", lora_rank=4, lora_alpha=8.0, lr=1e-2, **layout))
        ).losses
    return {"full": full, "lora": lora, **evaluations(data, run_dir, checkpoint, layout)}


def finetune_and_evaluate_each(data: str, root: str, checkpoint: str, layouts: dict[str, dict]) -> dict[str, dict]:
    """`finetune_and_evaluate` at each of `layouts`, one after another in one process group (one spawn for all)."""
    from paratron.distributed.init import initialize, shutdown

    initialize("gloo")
    try:
        return {
            name: finetune_and_evaluate(data, f"{root}/{name}", checkpoint, layout) for name, layout in layouts.items()
        }
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
    text = Path(write_text(data)).read_text()
    with no_loss_plot():
        full = run_training(build_config(settings(data, str(runs / "full"), save=str(folder / "ckpt")))).losses
        lora = run_training(
            build_config(settings(data, str(runs / "lora"), lora_rank=4, lora_alpha=8.0, lr=1e-2))
        ).losses
    single = {"full": full, "lora": lora, **evaluations(data, str(runs), str(folder / "ckpt"), {})}
    stream = len(Tokenizer.from_file(folder / "data" / "tokenizer.json").encode(text)) + 1  # + end of document
    assert stream % 64 != 1 and stream > 4 * 64  # a partial last window, several global batches
    assert single["text"]["tokens"] == single["text"]["tasks"]["text.txt"]["tokens"] == stream - 1
    return folder, single


@pytest.fixture(scope="module")
def at_layout(reference) -> Callable[[str], dict]:
    """A layout's results (rank 0's), from one spawn per world size: the first case of that size runs them all."""
    folder, _ = reference
    by_world: dict[int, dict[str, dict]] = {}

    def results(name: str) -> dict:
        world = LAYOUTS[name][0]
        if world not in by_world:
            layouts = {other: layout for other, (size, layout) in LAYOUTS.items() if size == world}
            data, checkpoint = str(folder / "data"), str(folder / "ckpt")
            by_world[world] = run_ranks(finetune_and_evaluate_each, world, data, str(folder), checkpoint, layouts)[0]
        return by_world[world][name]

    return results


@pytest.mark.spawns
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_finetuning_at_every_layout_equals_one_process(reference, at_layout, name):
    _, single = reference
    # it learns (in 6 steps: 0.27 off the first loss, 0.11 with LoRA)
    assert len(single["full"]) == 6 and single["full"][-1] < single["full"][0] - 0.2
    assert single["lora"][-1] < single["lora"][0] - 0.1
    result = at_layout(name)
    assert result["full"] == pytest.approx(single["full"], rel=1e-5)
    assert result["lora"] == pytest.approx(single["lora"], rel=1e-5)
    ours, theirs = result["evaluation"], single["evaluation"]
    assert ours["tokens"] == theirs["tokens"] > 0
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    for task in ("chat", "qa"):
        assert ours["tasks"][task]["loss"] == pytest.approx(theirs["tasks"][task]["loss"], rel=1e-5)
    assert result["text"]["tokens"] == single["text"]["tokens"]
    assert result["text"]["loss"] == pytest.approx(single["text"]["loss"], rel=1e-5)
