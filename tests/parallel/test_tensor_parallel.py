"""Tensor and sequence parallelism on gloo ranks: collectives by hand, layers and whole models
against the single-device model, dropout streams, and 6-step loss curves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.training.run import run_training

from tiny import tiny_config

GPT_FLAVOUR = dict(
    hidden_dropout=0.0,
    attention_dropout=0.0,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=97,
    max_position_embeddings=64,
    make_vocab_size_divisible_by=128,
)
LLAMA_FLAVOUR = dict(
    GPT_FLAVOUR,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    num_attention_heads=8,
    num_query_groups=2,
    add_bias_linear=False,
    ffn_hidden_size=96,
    untie_embeddings_and_output_weights=True,
    make_vocab_size_divisible_by=4,
)
NEMOTRON_FLAVOUR = dict(  # Nemotron-4's MLP: squared ReLU, not gated; rope, zero-centred LayerNorm, no biases
    GPT_FLAVOUR,
    activation="squared_relu",
    position_embedding_type="rope",
    apply_layernorm_1p=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
CURVE_STEPS = 6
"""Steps of the loss curves: each step already moves every weight, so six prove what twenty would."""
FLAVOURS = {"gpt": GPT_FLAVOUR, "llama": LLAMA_FLAVOUR, "nemotron": NEMOTRON_FLAVOUR}


def _init(world: int):
    import torch.distributed as dist

    from paratron.distributed.topology import ParallelDims, Topology

    ctx = initialize("gloo")
    topology = Topology(ParallelDims(world, tp=world), ctx.rank)
    topology.create_groups()
    return dist, topology


def collectives_by_hand(world: int) -> None:
    """Every autograd collective, forward and backward, against values computed from rank ids."""
    from paratron.distributed import comm
    from paratron.distributed.topology import Axis

    dist, topology = _init(world)
    group, r = topology.group(Axis.TP), topology.rank
    ranks_sum = sum(range(1, world + 1))

    x = torch.full((2, 3), float(r + 1), requires_grad=True)
    y = comm.copy_to_region(x, group)
    assert torch.equal(y, x)
    y.backward(torch.full((2, 3), float(r + 1)))
    assert torch.equal(x.grad, torch.full((2, 3), float(ranks_sum)))  # backward all-reduces

    x = torch.full((2, 3), float(r + 1), requires_grad=True)
    y = comm.reduce_from_region(x, group)
    assert torch.equal(y, torch.full((2, 3), float(ranks_sum)))
    y.backward(torch.ones(2, 3) * (r + 1))
    assert torch.equal(x.grad, torch.ones(2, 3) * (r + 1))  # identity backward

    x = torch.arange(2 * 4 * world, dtype=torch.float32).reshape(2, 4 * world).requires_grad_()
    y = comm.scatter_to_sequence(x, group, dim=-1)  # my 4 columns
    assert torch.equal(y, x[:, 4 * r : 4 * r + 4])
    y.backward(torch.full_like(y, float(r + 1)))
    expected = torch.cat([torch.full((2, 4), float(q + 1)) for q in range(world)], dim=1)
    assert torch.equal(x.grad, expected)  # backward gathers every rank's piece

    # sequence dimension (dim 1 of [batch, seq, hidden])
    x = torch.full((2, 3, 4), float(r + 1), requires_grad=True)
    y = comm.gather_from_sequence(x, group)
    assert y.shape == (2, 3 * world, 4) and torch.equal(y[:, 3 * r : 3 * r + 3], x)
    y.backward(torch.ones_like(y) * (r + 1))
    assert torch.equal(x.grad, torch.full((2, 3, 4), float(ranks_sum)))  # reduce-scatter: sum over ranks

    x = torch.arange(2 * 2 * world * 3, dtype=torch.float32).reshape(2, 2 * world, 3).mul(r + 1).requires_grad_()
    y = comm.reduce_scatter_to_sequence(x, group)
    base = torch.arange(2 * 2 * world * 3, dtype=torch.float32).reshape(2, 2 * world, 3)
    assert torch.equal(y, (base * ranks_sum)[:, 2 * r : 2 * r + 2])
    y.backward(torch.full_like(y, float(r)))
    assert torch.equal(x.grad, torch.cat([torch.full((2, 2, 3), float(q)) for q in range(world)], dim=1))

    x = torch.arange(world * 2, dtype=torch.float32).reshape(1, world * 2, 1).requires_grad_()
    y = comm.scatter_to_sequence(x, group)
    assert y.flatten().tolist() == [2.0 * r, 2.0 * r + 1]
    y.backward(torch.ones_like(y) * (r + 1))
    assert x.grad.flatten().tolist() == [float(q + 1) for q in range(world) for _ in range(2)]

    # counting is opt-in, for the block only: one all-reduce forward, one all-gather and one
    # reduce-scatter for a sequence gather and its backward
    with comm.count_collectives() as counts:
        comm.reduce_from_region(torch.ones(2), group)
        x = torch.ones(1, 2, 1, requires_grad=True)
        comm.gather_from_sequence(x, group).sum().backward()
    assert counts == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}, counts
    comm.reduce_from_region(torch.ones(2), group)
    assert counts == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_by_hand(world):
    run_ranks(collectives_by_hand, world, world)


def model_parity(world: int) -> dict:
    """Every flavour with and without sequence parallelism: initial weights, logits, loss and every
    gradient against the single-device model built on this rank. Returns the worst relative errors.
    (Leaves the process group up, for the curves that follow on it.)"""
    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.distributed import comm
    from paratron.distributed.topology import Axis
    from paratron.model.gpt import GPT, build_model
    from paratron.parallel.parallelize import parallelize
    from paratron.parallel.sharding import gather_full

    dist, topology = _init(world)
    worst: dict[str, float] = {}
    for flavour, model_settings in FLAVOURS.items():
        for sequence_parallel in (False, True):
            key = f"{flavour}{'-sp' if sequence_parallel else ''}"
            config = build_config(
                dict(
                    model_settings,
                    tensor_model_parallel_size=world,
                    mock_data=True,
                    seq_length=16,
                    sequence_parallel=sequence_parallel,
                    seed=11,
                    cross_entropy_loss_fusion=True,  # (only `model.fused_loss` reads it: see _fused_loss_errors)
                )
            )
            reference = build_model(config.model, seed=11)
            with torch.device("meta"):
                meta = GPT(dataclasses.replace(config.model))
            model = parallelize(
                meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
            )
            names = dict(model.module.named_parameters())
            for name, param in reference.named_parameters():
                assert torch.equal(gather_full(names[name], topology.group(Axis.TP)), param), f"{key}: init of {name}"

            ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(5))
            inputs, labels = ids[:, :-1], ids[:, 1:]
            ref_logits = reference(inputs)
            ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
            ref_loss.backward()
            logits = model(inputs)
            loss = model.loss_function(logits, labels)
            loss.backward()
            model.finish_grad_sync()

            # ranks hold consecutive slices of the padded vocabulary; the padding comes last
            full_logits = comm.all_gather(logits.detach(), 2, topology.group(Axis.TP))[..., :97]
            errors = {"logits": _rel(full_logits, ref_logits), "loss": _rel(loss, ref_loss)}
            for name, param in reference.named_parameters():
                grad = gather_full(names[name], topology.group(Axis.TP), names[name].grad)
                if name.endswith("in_proj.k.bias"):
                    # zero in exact arithmetic (softmax ignores a constant added to a row of scores):
                    # both are rounding noise near 1e-11, so compare absolutely
                    assert float((grad - param.grad).abs().max()) < 1e-9, f"{key}: grad {name}"
                    continue
                errors[f"grad {name}"] = _rel(grad, param.grad)
            chunk = 5 if sequence_parallel else None
            tp_group = topology.group(Axis.TP)
            errors.update(_fused_loss_errors(model, reference, inputs, labels, ref_loss, tp_group, chunk))
            for what, error in errors.items():
                assert error < 1e-5, f"{key} TP={world}: {what} differs by {error:.2e} relative"
            worst[key] = max(errors.values())
    return worst


def _fused_loss_errors(model, reference, inputs, labels, ref_loss, group, chunk) -> dict[str, float]:
    """The vocabulary-parallel fused loss (--cross-entropy-loss-fusion) on the same ranks: its loss and every gradient
    against the single-device model's (already computed). The loss `parallelize` built for the flag (one chunk at
    this vocabulary), or with `chunk` the vocabulary-parallel fused loss itself in chunks of that many tokens."""
    from paratron.model.loss import mean_loss
    from paratron.parallel.sharding import gather_full
    from paratron.parallel.tensor.fused_cross_entropy import output_vocab_start, vocab_parallel_fused_token_losses

    model.zero_grad()
    hidden = model(inputs, before_output=True)
    if chunk is None:
        losses = model.fused_loss(hidden, labels)
    else:
        output = model.module.output
        losses = vocab_parallel_fused_token_losses(hidden, labels, output, output_vocab_start(output), chunk)
    loss = mean_loss(losses, labels)
    loss.backward()
    model.finish_grad_sync()
    names = dict(model.module.named_parameters())
    errors = {"fused loss": _rel(loss, ref_loss)}
    for name, param in reference.named_parameters():
        if not name.endswith("in_proj.k.bias"):  # (rounding noise in both: see model_parity)
            errors[f"fused grad {name}"] = _rel(gather_full(names[name], group, names[name].grad), param.grad)
    return errors


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def train_curve(run_dir: str, overrides: dict) -> list[float]:
    return run_training(tiny_config(run_dir, **overrides)).losses


def train_curves(run_dir: str, runs: list[dict]) -> list[list[float]]:
    """Several trainings one after the other on one process group (one spawn for all of them)."""
    initialize("gloo")
    return [train_curve(f"{run_dir}/{i}", overrides) for i, overrides in enumerate(runs)]


def parity_and_curves(world: int, run_dir: str, runs: list[dict]) -> tuple[dict, list[list[float]]]:
    """`model_parity`, then the loss curves of `runs`, on one process group: one spawn for both
    (each rank start costs seconds)."""
    return model_parity(world), train_curves(run_dir, runs)


def _curve_settings(flavour: str) -> dict:
    return dict(
        FLAVOURS[flavour],
        model_name=None,
        train_iters=CURVE_STEPS,
        micro_batch_size=4,
        seq_length=16,
        hidden_dropout=0.0,
    )


@pytest.fixture(scope="module")
def single_device_curves(tmp_path_factory) -> dict[str, list[float]]:
    """Each flavour's single-device curve, trained once for every TP size."""
    root = tmp_path_factory.mktemp("single")
    return {flavour: train_curve(str(root / flavour), _curve_settings(flavour)) for flavour in FLAVOURS}


@pytest.mark.parametrize("world", [2, 4])
def test_logits_gradients_and_six_step_curves_equal_the_single_device_model(tmp_path, single_device_curves, world):
    runs, references = [], []
    for flavour in FLAVOURS:
        for sequence_parallel in (False, True):
            runs.append(
                dict(_curve_settings(flavour), tensor_model_parallel_size=world, sequence_parallel=sequence_parallel)
            )
            references.append((f"{flavour} TP={world} SP={sequence_parallel}", single_device_curves[flavour]))
    worst, curves = run_ranks(parity_and_curves, world, world, str(tmp_path / "tp"), runs)[0]
    assert set(worst) == {"gpt", "gpt-sp", "llama", "llama-sp", "nemotron", "nemotron-sp"}
    for ours, (what, reference) in zip(curves, references, strict=True):
        assert len(ours) == CURVE_STEPS
        for step, (a, b) in enumerate(zip(ours, reference), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {step}: {a} vs {b}"


def dropout_streams(world: int) -> list:
    """Inside TP regions masks differ by rank and repeat with the seed; outside they agree."""
    from paratron.distributed.rng import TENSOR_PARALLEL, TENSOR_PARALLEL_SEED_OFFSET, RNGStates

    dist, topology = _init(world)
    r = topology.rank
    masks = []
    for _ in range(2):  # the same seed twice: the same masks
        torch.manual_seed(3)
        rng = RNGStates("cpu")
        rng.add(TENSOR_PARALLEL, 3 + TENSOR_PARALLEL_SEED_OFFSET + r)
        outside = torch.nn.functional.dropout(torch.ones(64), 0.5)
        with rng.fork(TENSOR_PARALLEL):
            inside = torch.nn.functional.dropout(torch.ones(64), 0.5)
        after = torch.nn.functional.dropout(torch.ones(64), 0.5)  # the default stream went on unperturbed
        masks.append((outside, inside, after))
    assert all(torch.equal(a, b) for a, b in zip(masks[0], masks[1]))
    gathered = [None] * world
    dist.all_gather_object(gathered, [m.tolist() for m in masks[0]])
    dist.destroy_process_group()
    return gathered


def test_dropout_inside_tensor_parallel_regions_differs_by_rank_and_outside_agrees():
    gathered = run_ranks(dropout_streams, 2, 2)[0]
    (outside0, inside0, after0), (outside1, inside1, after1) = gathered
    assert outside0 == outside1 and after0 == after1
    assert inside0 != inside1


def test_tensor_parallel_training_with_dropout_is_reproducible_and_consistent(tmp_path):
    overrides = dict(
        train_iters=6, tensor_model_parallel_size=2, sequence_parallel=True, hidden_dropout=0.2, attention_dropout=0.2
    )
    (first, second), (first_on_1, second_on_1) = run_ranks(train_curves, 2, str(tmp_path), [overrides, overrides])
    assert first == first_on_1 and second == second_on_1  # ranks agree on the loss
    assert first == second  # the run repeats exactly


def test_tensor_parallel_resume_is_exact_and_reshards_weights(tmp_path):
    common = dict(tensor_model_parallel_size=2, hidden_dropout=0.1, attention_dropout=0.1, lr_decay_iters=10)
    save = str(tmp_path / "ckpt")
    runs = [dict(common, train_iters=10), dict(common, train_iters=5, save=save)]
    runs.append(dict(common, train_iters=10, load=save, save=save))
    straight, first, second = run_ranks(train_curves, 2, str(tmp_path / "tp"), runs)[0]
    assert first + second == straight  # per-rank optimizer and dropout streams came back exactly

    # at TP 1 the optimizer state follows too (test_resharding.py checks the curve); from step 10
    # with a fresh optimizer; or from step 0 as a fine-tuning start
    assert len(train_curve(str(tmp_path / "c"), dict(train_iters=12, load=save))) == 2
    assert len(train_curve(str(tmp_path / "d"), dict(train_iters=12, load=save, no_load_optim=True))) == 2
    assert len(train_curve(str(tmp_path / "e"), dict(train_iters=3, load=save, finetune=True))) == 3


def test_tensor_and_data_parallel_together_equal_single_device(tmp_path):
    common = dict(
        FLAVOURS["llama"],
        model_name=None,
        num_query_groups=1,
        train_iters=10,
        micro_batch_size=2,
        global_batch_size=8,
        seq_length=16,
    )  # one key/value head, replicated on both TP ranks
    reference = train_curve(str(tmp_path / "single"), common)
    per_rank = run_ranks(
        train_curve, 4, str(tmp_path / "tp2dp2"), dict(common, tensor_model_parallel_size=2, sequence_parallel=True)
    )
    for step, (ours, ref) in enumerate(zip(per_rank[0], reference), start=1):
        assert abs(ours - ref) <= 1e-5 * abs(ref), f"TP 2 x DP 2, step {step}: {ours} vs {ref}"


def test_mixed_precision_under_tensor_parallelism(tmp_path):
    overrides = dict(train_iters=4, precision="bf16", seq_length=16, micro_batch_size=4)
    single = train_curve(str(tmp_path / "single"), overrides)
    tp = run_ranks(
        train_curve, 2, str(tmp_path / "tp"), dict(overrides, tensor_model_parallel_size=2, sequence_parallel=True)
    )[0]
    assert tp == pytest.approx(single, rel=2e-2)  # bf16 rounding differs with the split, not the result


def fp16_overflow_on_one_rank(world: int) -> dict:
    """An overflow in rank 0's shard only must skip the step and back the scale off on every rank."""
    from paratron.config import build_config
    from paratron.config.layout import resolve_layout
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import LossScaler, Precision
    from paratron.parallel.parallelize import parallelize
    from paratron.training.step import train_step

    dist, topology = _init(world)
    config = build_config(
        dict(GPT_FLAVOUR, tensor_model_parallel_size=world, mock_data=True, seq_length=16, precision="fp16")
    )
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size))
    optimizer = build_optimizer(model, config.optimizer)
    precision = Precision("fp16", LossScaler(65536.0, hysteresis=1))
    weight = model.module.layers[0].mlp.in_proj.up.weight
    if topology.rank == 0:
        weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = model.module.final_norm.weight.detach().clone()
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(0))
    result = train_step(model, optimizer, [Batch(ids[:, :-1], ids[:, 1:])], precision, clip_grad=1.0)
    report = {
        "skipped": result.skipped,
        "scale": precision.scaler.scale,
        "dtype": str(weight.dtype),
        "unchanged": torch.equal(before, model.module.final_norm.weight.detach()),
    }
    dist.destroy_process_group()
    return report


def test_fp16_overflow_on_one_rank_skips_the_step_on_all():
    reports = run_ranks(fp16_overflow_on_one_rank, 2, 2)
    assert all(r["skipped"] and r["unchanged"] and r["dtype"] == "torch.float16" for r in reports), reports
    assert reports[0]["scale"] == reports[1]["scale"] == 32768.0  # backed off from 65536 everywhere
