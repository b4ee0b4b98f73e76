"""The inference engine at TP2, PP2 and TP2 x PP2 gives what one device gives: the same greedy tokens, the same
seeded samples and the same prompt log-probabilities (GQA, and an MoE model with a sliding window)."""

from __future__ import annotations

import pytest
import torch
import transformers

from paratron.checkpoint.formats import hf_to_paratron
from paratron.config import build_config
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.errors import ConfigError
from paratron.inference.loading import open_engine
from paratron.inference.params import SamplingParams

from tiny import save_random_hf_model

SHAPE = dict(
    vocab_size=90,  # (not a multiple of TP x 128: the vocabulary-parallel logits are padded and cut)
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
PROMPTS = [[5, 17, 3, 88, 41], [9, 2], [70, 11, 12, 13, 14, 15, 16, 30, 31, 32, 33], [1, 2, 3]]

Results = tuple[list[list[int]], list[list[float]], list[list[list[int]]]]


def engine_results(load: str, layouts: dict[str, dict]) -> dict[str, Results]:
    """Per layout (one after the other on one process group): greedy tokens, prompt log-probabilities and seeded
    samples, from the controller (the other ranks follow)."""
    results: dict[str, Results] = {}
    for name, flags in layouts.items():
        config = build_config(dict(load=load, kv_cache_tokens=128, kv_block_size=4, max_batch_tokens=12, **flags))
        engine = open_engine(config, log=lambda *args, **kwargs: None)
        if not engine.is_controller:
            engine.follow()
            continue
        greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=8))
        scored = engine.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=1))
        sampled = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3, n=2))
        engine.close()
        results[name] = (
            [o.completions[0].token_ids for o in greedy],
            [[entry.logprob for entry in o.prompt_logprobs[1:]] for o in scored],
            [[c.token_ids for c in o.completions] for o in sampled],
        )
    return results


def assert_same(ours: Results, single: Results, name: str) -> None:
    assert ours[0] == single[0], name
    for a, b in zip(ours[1], single[1]):
        assert a == pytest.approx(b, abs=1e-5), name
    assert ours[2] == single[2], name


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("inference")
    save_random_hf_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**SHAPE), folder / "llama")
    moe = transformers.MixtralConfig(**SHAPE, sliding_window=6, num_local_experts=4, num_experts_per_tok=2)
    save_random_hf_model(transformers.MixtralForCausalLM, moe, folder / "mixtral")
    for name in ("llama", "mixtral"):
        hf_to_paratron(folder / name, folder / f"{name}-converted")
    return {name: str(folder / f"{name}-converted") for name in ("llama", "mixtral")}


@pytest.fixture(scope="module")
def single_device(models) -> dict[str, Results]:
    """Every model's results on one device, computed once for every layout compared with them."""
    return {name: engine_results(path, {"one": {}})["one"] for name, path in models.items()}


def on_ranks(by_model: dict[str, dict[str, dict]]) -> dict[str, Results]:
    """`engine_results` of every model's layouts, on one process group (one spawn for all)."""
    initialize("gloo")
    merged: dict[str, Results] = {}
    for path, layouts in by_model.items():
        merged.update(engine_results(path, layouts))
    return merged


def test_two_rank_layouts_equal_one_device(models, single_device):
    by_model = {
        models["llama"]: {
            "llama tp2": dict(tensor_model_parallel_size=2),
            "llama pp2": dict(pipeline_model_parallel_size=2),
        },
        models["mixtral"]: {"mixtral tp2": dict(tensor_model_parallel_size=2)},
    }
    outcome = run_ranks(on_ranks, 2, by_model)[0]
    assert list(outcome) == ["llama tp2", "llama pp2", "mixtral tp2"]
    for name, ours in outcome.items():
        assert_same(ours, single_device[name.split()[0]], name)


def test_tp2_x_pp2_equals_one_device(models, single_device):
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    ours = run_ranks(on_ranks, 4, {models["llama"]: {"tp2 x pp2": layout}})[0]["tp2 x pp2"]
    assert_same(ours, single_device["llama"], "tp2 x pp2")
    assert torch.tensor(ours[1][2]).lt(0).all()  # (log-probabilities, not zeros)


def test_a_layout_that_is_not_one_replica_is_refused(models):
    with pytest.raises(ConfigError, match="--nproc 1 must equal --tensor-model-parallel-size 2"):
        open_engine(build_config(dict(load=models["llama"], tensor_model_parallel_size=2)))
