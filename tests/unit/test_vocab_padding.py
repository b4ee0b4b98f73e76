"""The vocabulary padded to --make-vocab-size-divisible-by on one process too: the output matmul runs on the padded
shape while the loss, the gradient norm and the trained weights are the unpadded model's, the padding rows stay
zero, and checkpoints hold the real vocabulary only (a padded run's loads unpadded and back, bit for bit)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from paratron.checkpoint.gather import full_state
from paratron.checkpoint.load import load_model_weights
from paratron.checkpoint.optimizer_state import load_optimizer
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.debugging.compare_report import compare_captures
from paratron.debugging.layer_stats import LayerStats
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model.batch import Batch
from paratron.model.gpt import GPT
from paratron.optim.build import build_optimizer
from paratron.optim.mixed_precision import Precision
from paratron.parallel import parallelize
from paratron.parallel.parallelize import parallelize_for_inference
from paratron.parallel.sharding import shard_of
from paratron.parallel.tensor.layers import VocabParallelEmbedding, VocabParallelOutput, padded_vocab_size
from paratron.planning.activations import padded_vocab
from paratron.training.run import run_training
from paratron.training.step import StepOptions, train_step

from tiny import tiny_config

VOCAB, PADDED, HIDDEN, STEPS = 250, 256, 32, 4
TINY = dict(
    num_layers=2,
    hidden_size=HIDDEN,
    num_attention_heads=4,
    vocab_size=VOCAB,
    seq_length=16,
    max_position_embeddings=16,
    mock_data=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    lr=1e-2,
    weight_decay=0.1,
    clip_grad=1.0,
    seed=7,
)


def _build(divisible_by: int, **overrides):
    config = build_config(dict(TINY, make_vocab_size_divisible_by=divisible_by, **overrides))
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))
    return config, model, build_optimizer(model, config.optimizer)


def _batches(step: int) -> list[Batch]:
    """Two micro-batches of ids that reach the last real words (the padding starts at 250); every other step the
    same ones, so that the loss falls."""
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(100 + step % 2))
    ids[0, :4] = torch.tensor([VOCAB - 1, VOCAB - 2, 0, VOCAB - 1])
    return [Batch(b[:, :-1], b[:, 1:]) for b in (ids[:2], ids[2:])]


def _train(model, optimizer, steps: range, stats: list[dict] | None = None) -> list[tuple[float, float]]:
    """Losses and gradient norms of `steps`; with `stats`, each step's per-layer statistics appended to it."""
    out = []
    for step in steps:
        watch = LayerStats(model, optimizer, sequence_parallel=False) if stats is not None else None
        options = StepOptions(layer_stats=watch)
        result = train_step(model, optimizer, _batches(step), Precision("fp32"), clip_grad=1.0, options=options)
        out.append((float(result.loss), float(result.grad_norm)))
        if watch is not None and stats is not None:
            stats.append(watch.finish())
    return out


def test_padded_sizes_at_every_tensor_parallel_size_one_included():
    assert padded_vocab_size(50257, 1, 128) == 50304  # GPT-2
    assert padded_vocab_size(VOCAB, 1, 128) == PADDED and padded_vocab_size(VOCAB, 2, 128) == PADDED
    assert padded_vocab_size(VOCAB, 1, 1) == VOCAB and padded_vocab_size(VOCAB, 4, 1) == 252
    assert padded_vocab_size(PADDED, 1, 128) == PADDED and padded_vocab_size(VOCAB, 3, 128) == 384
    config = build_config(dict(TINY, make_vocab_size_divisible_by=128))
    assert padded_vocab(config, 1) == PADDED  # the planner prices the padded matmul on one process too


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused-loss"])
@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_one_process_padded_training_equals_unpadded(untied: bool, fused: bool):
    settings = dict(untie_embeddings_and_output_weights=untied, cross_entropy_loss_fusion=fused)
    _, padded, padded_optimizer = _build(128, **settings)
    _, plain, plain_optimizer = _build(1, **settings)
    output = padded.module.output
    assert isinstance(output, VocabParallelOutput) and isinstance(padded.module.embedding, VocabParallelEmbedding)
    assert output.weight.shape == (PADDED, HIDDEN) and plain.module.output.weight.shape == (VOCAB, HIDDEN)
    assert (output.weight is padded.module.embedding.weight) is not untied
    assert type(plain.module.output) is torch.nn.Linear  # (divisible by 1: no padding, no swap)
    with torch.no_grad():
        logits = padded.module(_batches(0)[0].input_ids)
    assert logits.shape[-1] == VOCAB  # the padded columns never leave the layer

    got_stats: list[dict] = []
    want_stats: list[dict] = []
    got = _train(padded, padded_optimizer, range(STEPS), got_stats)
    want = _train(plain, plain_optimizer, range(STEPS), want_stats)
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want):
        assert loss == pytest.approx(loss_ref, abs=1e-6) and norm == pytest.approx(norm_ref, abs=1e-6)
    assert set(got_stats[0]) == set(want_stats[0])
    assert ("layers/output/act_rms" in got_stats[0]) is not fused  # (the fused loss runs the output layer itself)
    for name, value in want_stats[0].items():  # (the first step's: the same weights, padding left out)
        assert got_stats[0][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert got[2][0] < got[0][0] - 0.05  # it trains
    trained, reference = full_state(padded.module, padded.topology), full_state(plain.module, plain.topology)
    for name, tensor in reference.items():
        assert trained[name].shape == tensor.shape, name  # the real vocabulary rows only
        if not fused:  # (the fused loss sums its softmax over 256 columns, 6 of them zero, in another order: its
            # gradients differ in the last bits, which Adam's first steps scale up where a gradient is near zero;
            # the padded matmul, wider, may also sum in another order on some CPUs: 2e-5 on an AMD EPYC)
            torch.testing.assert_close(trained[name], tensor, rtol=0, atol=1e-4)
    assert torch.count_nonzero(output.weight[VOCAB:]) == 0  # padding: no gradient, no update, no decay
    if untied:
        assert torch.count_nonzero(padded.module.embedding.weight[VOCAB:]) == 0


@pytest.mark.parametrize("settings", [dict(lora_rank=4), dict(num_experts=4, moe_router_topk=2)], ids=["lora", "moe"])
def test_lora_and_experts_train_as_unpadded(settings: dict):
    _, padded, padded_optimizer = _build(128, **settings)
    _, plain, plain_optimizer = _build(1, **settings)
    output = padded.module.output
    assert output.weight.shape == (PADDED, HIDDEN)
    assert output.weight.requires_grad is plain.module.output.weight.requires_grad is ("lora_rank" not in settings)
    got, want = _train(padded, padded_optimizer, range(STEPS)), _train(plain, plain_optimizer, range(STEPS))
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want):
        assert loss == pytest.approx(loss_ref, abs=1e-6) and norm == pytest.approx(norm_ref, abs=1e-6)


def test_padded_checkpoint_loads_unpadded_and_back_bit_for_bit(tmp_path):
    config, padded, padded_optimizer = _build(128, untie_embeddings_and_output_weights=True)
    _train(padded, padded_optimizer, range(2))
    folder = save_checkpoint(tmp_path / "padded", CheckpointContent(2, 8, config, padded.module, padded_optimizer))
    saved = read_checkpoint(tmp_path / "padded")
    assert saved.config.model.make_vocab_size_divisible_by == 128
    with safe_open(folder / "model.safetensors", "pt") as weights:  # (whole tensors of the real vocabulary)
        assert {name: weights.get_slice(name).get_shape() for name in ("embedding.weight", "output.weight")} == {
            "embedding.weight": [VOCAB, HIDDEN],
            "output.weight": [VOCAB, HIDDEN],
        }

    unpadded_config, plain, plain_optimizer = _build(1, untie_embeddings_and_output_weights=True)
    load_model_weights(saved, plain.module)
    load_optimizer(saved.path, plain_optimizer, plain.module)
    assert plain.module.output.weight.shape == (VOCAB, HIDDEN)
    torch.testing.assert_close(plain.module.output.weight, padded.module.output.weight[:VOCAB], rtol=0, atol=0)
    save_checkpoint(tmp_path / "plain", CheckpointContent(2, 8, unpadded_config, plain.module, plain_optimizer))

    _, again, again_optimizer = _build(128, untie_embeddings_and_output_weights=True)
    back = read_checkpoint(tmp_path / "plain")
    load_model_weights(back, again.module)
    load_optimizer(back.path, again_optimizer, again.module)
    for name, param in padded.module.named_parameters():
        assert torch.equal(dict(again.module.named_parameters())[name], param), name  # padding included (zero)
    # the next step of all three: the optimizer state came along too
    losses = [_train(m, o, range(2, 3)) for m, o in ((padded, padded_optimizer), (plain, plain_optimizer))]
    assert _train(again, again_optimizer, range(2, 3)) == losses[0]
    assert losses[1][0][0] == pytest.approx(losses[0][0][0], abs=1e-6)


def test_inference_on_one_process_keeps_the_unpadded_model(tmp_path):
    config = build_config(dict(TINY, make_vocab_size_divisible_by=128))
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize_for_inference(
        meta, config, Topology(ParallelDims(1)), [range(2)], torch.device("cpu"), torch.float32
    )
    assert type(model.output) is torch.nn.Linear and model.output.weight.shape == (VOCAB, HIDDEN)
    assert shard_of(model.output.weight) is None


def test_debug_captures_of_a_padded_and_an_unpadded_run_agree(tmp_path):
    """--debug-capture names and shapes the single-device tensors (the real vocabulary's logits), so the two runs
    compare module by module."""
    for divisible_by in (128, 1):
        run = tmp_path / str(divisible_by)
        config = dict(TINY, train_iters=2, micro_batch_size=2, make_vocab_size_divisible_by=divisible_by)
        run_training(tiny_config(run, **config, debug_capture=str(run / "c"), debug_capture_elements=64))
    index, other = (json.loads((tmp_path / run / "c" / "index.json").read_text()) for run in ("128", "1"))
    assert (index["names"], index["shapes"]) == (other["names"], other["shapes"])
    assert index["shapes"]["forward/output"] == [1, 16, VOCAB]
    assert index["shapes"]["gradient/embedding.weight"] == [VOCAB, HIDDEN]
    same = compare_captures(tmp_path / "128" / "c", tmp_path / "1" / "c", 1e-6)
    assert same.first is None and same.compared == 2 * len(index["names"])
