"""`paratron train --load` of a converted Hugging Face model starts from its weights at any layout."""

from __future__ import annotations

import pytest
import torch

from paratron.config import build_config
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training


def losses(checkpoint: str, run_dir: str, overrides: dict) -> list[float]:
    config = build_config(
        dict(
            dict(
                load=checkpoint,
                run_dir=run_dir,
                mock_data=True,
                seq_length=16,
                micro_batch_size=4,
                train_iters=3,
                lr=1e-3,
                progress_bar=False,
                tensorboard=False,
                log_interval=1,
                eval_iters=0,
            ),
            **overrides,
        ),
        recipe=f"{checkpoint}/model.yaml",
    )
    return run_training(config).losses


def losses_at_layouts(checkpoint: str, run_dir: str, layouts: dict[str, dict]) -> dict[str, list[float]]:
    """Each layout's losses, one after the other on one process group (one spawn for all)."""
    initialize("gloo")
    return {name: losses(checkpoint, f"{run_dir}/{name}", overrides) for name, overrides in layouts.items()}


def test_training_starts_from_converted_weights_at_any_layout(tmp_path):
    import transformers  # the reference (imported here: the spawned ranks need not load it)

    from paratron.checkpoint.formats import hf_to_paratron

    settings = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).save_pretrained(tmp_path / "hf")
    hf_to_paratron(tmp_path / "hf", tmp_path / "converted")
    checkpoint = str(tmp_path / "converted")
    single = losses(checkpoint, str(tmp_path / "single"), {})
    layouts = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2)}
    results = run_ranks(losses_at_layouts, 2, checkpoint, str(tmp_path), layouts)[0]
    assert list(results) == list(layouts)
    for name, ours in results.items():
        assert ours == pytest.approx(single, rel=1e-5), name
    fresh = build_config(
        dict(
            mock_data=True,
            seq_length=16,
            micro_batch_size=4,
            train_iters=3,
            progress_bar=False,
            tensorboard=False,
            log_interval=1,
            eval_iters=0,
            run_dir=str(tmp_path / "fresh"),
        ),
        recipe=f"{checkpoint}/model.yaml",
    )
    assert run_training(fresh).losses[0] != pytest.approx(single[0], rel=1e-3)  # the weights were used
