"""Per-layer statistics (debugging/layer_stats.py) of one process against the same quantities computed by hand: the
layers' outputs of a copy of the model run on the same micro-batches, the gradient buffers, the weights before and
after the step, and torch's own entropy of the router's distributions."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from paratron.config.layout import resolve_layout
from paratron.debugging.layer_stats import LayerStats, finish_statistics, layer_names, layer_of
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model import GPT
from paratron.model.batch import Batch
from paratron.model.moe import MoELayer
from paratron.optim.build import build_optimizer
from paratron.optim.mixed_precision import Precision
from paratron.parallel import parallelize
from paratron.training.run import run_training
from paratron.training.step import StepOptions, train_step

from tiny import tiny_config


def test_parameters_belong_to_their_layers_by_single_device_name():
    assert layer_of("layers.11.mlp.experts.w_in") == "layers.11"
    assert layer_of("position_embedding.weight") == layer_of("embedding.weight") == "embedding"
    assert layer_of("final_norm.weight") == "final_norm" and layer_of("output.weight") == "output"
    assert layer_names(2) == ["embedding", "layers.0", "layers.1", "final_norm", "output"]
    assert layer_names(1, vision=True) == ["embedding", "vision", "layers.0", "final_norm", "output"]


def test_finished_sums_become_root_means_norms_and_ratios():
    sums = torch.zeros(3, 6, dtype=torch.float64)
    sums[0] = torch.tensor([8.0, 2.0, 9.0, 1.0, 4.0, 3.0])  # one layer: activations, gradient, update, weight
    sums[2, :2] = torch.tensor([3.0, 2.0])  # its router: entropy summed over 2 tokens
    record = finish_statistics(["a", "b"], sums, torch.tensor([5.0, 0.0]), torch.tensor([3.0, 0.0]), {0: "a"})
    assert record == {
        "layers/a/act_rms": 2.0,
        "layers/a/act_max": 5.0,
        "layers/a/grad_norm": 3.0,
        "layers/a/update_ratio": 0.5,
        "layers/a/router_entropy": 1.5,
    }  # (layer b: nothing measured, nothing reported)


def one_step(config, micro_batches: int = 2, seed: int = 0):
    """One training step of a single-process model with the statistics on: (the record's statistics, result, the
    model before the step, the model, the micro-batches, the statistics' sums)."""
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))
    optimizer = build_optimizer(model, config.optimizer)
    vocab = config.model.vocab_size
    tokens = torch.randint(0, vocab, (2 * micro_batches, 17), generator=torch.Generator().manual_seed(seed))
    batches = [Batch(tokens[2 * i : 2 * i + 2, :-1], tokens[2 * i : 2 * i + 2, 1:]) for i in range(micro_batches)]
    before = copy.deepcopy(model.module)
    stats = LayerStats(model, optimizer, sequence_parallel=False)
    options = StepOptions(layer_stats=stats)
    result = train_step(model, optimizer, batches, Precision("fp32"), config.optimizer.clip_grad, options=options)
    return stats.finish(), result, before, model, batches, stats.sums


def outputs_by_hand(module: torch.nn.Module, batches: list[Batch]) -> dict[str, list[torch.Tensor]]:
    """Each layer's outputs over the micro-batches, from forward hooks on a copy of the model."""
    found: dict[str, list[torch.Tensor]] = {}
    watched = {"embedding": module.embedding_dropout, "final_norm": module.final_norm, "output": module.output}
    watched.update({f"layers.{i}": block for i, block in enumerate(module.layers)})
    for name, layer in watched.items():
        layer.register_forward_hook(lambda m, i, o, name=name: found.setdefault(name, []).append(o.detach()))
    with torch.no_grad():
        for batch in batches:
            module(batch.input_ids)
    return found


@pytest.mark.parametrize("recompute", [None, "full"])
def test_one_process_statistics_equal_the_hand_computed_ones(tmp_path, recompute):
    """Tied embeddings (the output layer has no weights of its own), two micro-batches; with full recomputation the
    forwards run again inside backward, and are not counted again."""
    recompute_layers = {"recompute_num_layers": 2, "recompute_method": "uniform"} if recompute else {}
    config = tiny_config(
        tmp_path, clip_grad=0.5, recompute_granularity=recompute, lr=1e-2, lr_warmup_iters=0, **recompute_layers
    )
    assert config.model.untie_embeddings_and_output_weights is False
    record, result, before, model, batches, sums = one_step(config)
    assert (type(model.module.layers).__name__ == "RecomputedLayers") == (recompute is not None)
    elements = 2 * 2 * 16 * config.model.hidden_size  # (micro-batches x rows x positions x features)
    assert sums[1, 1].item() == elements  # layers.0's elements, each counted once
    for name, outputs in outputs_by_hand(before, batches).items():
        values = torch.cat([o.reshape(-1) for o in outputs]).double()
        assert record[f"layers/{name}/act_rms"] == pytest.approx(values.square().mean().sqrt().item(), rel=1e-5), name
        assert record[f"layers/{name}/act_max"] == pytest.approx(values.abs().max().item(), rel=1e-6), name
    after = dict(model.module.named_parameters())
    per_layer: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for name, weight in before.named_parameters():
        per_layer.setdefault(layer_of(name), []).append((weight.detach(), after[name].detach(), after[name].grad))
    assert set(per_layer) == {"embedding", "layers.0", "layers.1", "final_norm"}
    assert "layers/output/grad_norm" not in record  # (tied: the embedding's gradient holds the output's part)
    unclipped = float(result.grad_norm) / 0.5  # (the buffers hold the clipped gradients)
    for layer, triples in per_layer.items():
        grad = unclipped * math.sqrt(sum(g.double().square().sum().item() for _, _, g in triples))
        update = math.sqrt(sum((a - b).double().square().sum().item() for b, a, _ in triples))
        weight = math.sqrt(sum(b.double().square().sum().item() for b, _, _ in triples))
        assert record[f"layers/{layer}/grad_norm"] == pytest.approx(grad, rel=1e-5), layer
        assert record[f"layers/{layer}/update_ratio"] == pytest.approx(update / weight, rel=1e-4), layer
        assert record[f"layers/{layer}/update_ratio"] > 0
    squares = sum(record[f"layers/{layer}/grad_norm"] ** 2 for layer in per_layer)
    assert math.sqrt(squares) == pytest.approx(float(result.grad_norm), rel=1e-5)  # the norm before clipping
    assert float(result.grad_norm) > 0.5  # (so clipping acted, and the norms above are the unclipped ones)


def test_router_entropy_is_the_mean_entropy_of_the_token_distributions(tmp_path):
    config = tiny_config(
        tmp_path, model_name="debug-moe", num_layers=2, moe_layer_freq="[0,1]", num_experts=4, moe_router_topk=2
    )
    record, _, before, _, batches, _ = one_step(config, micro_batches=1, seed=1)
    router = next(m for m in before.modules() if isinstance(m, MoELayer)).router
    inputs: list[torch.Tensor] = []
    router.register_forward_hook(lambda m, i, o: inputs.append(i[0].detach()))
    with torch.no_grad():
        before(batches[0].input_ids)
    logits = inputs[0].float() @ router.weight.detach().float().t()
    expected = torch.distributions.Categorical(logits=logits).entropy().mean().item()
    assert record["layers/layers.1/router_entropy"] == pytest.approx(expected, rel=1e-5)
    assert 0 < expected < math.log(4) + 1e-6
    assert "layers/layers.0/router_entropy" not in record  # (a dense layer)


def test_recording_steps_are_logged_to_metrics_and_tensorboard(tmp_path):
    """--log-layer-stats 2 with --log-interval 5: steps 2 and 4 record statistics (and are logged for them), step 5
    is logged for the interval, without them."""
    config = tiny_config(tmp_path, train_iters=5, log_interval=5, log_layer_stats=2, tensorboard=True)
    run_training(config)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "layers/layers.1/act_rms" in r) for r in records] == [(2, True), (4, True), (5, False)]
    events = EventAccumulator(str(next((tmp_path / "tensorboard").glob("events.out.tfevents.*"))))
    logged = events.Reload().Scalars("train/layers/layers.1/grad_norm")
    assert [(e.step, e.value) for e in logged] == [
        (r["step"], pytest.approx(r["layers/layers.1/grad_norm"])) for r in records[:2]
    ]
