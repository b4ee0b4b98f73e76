"""Mixed precision: the loss scaler's rules, 16-bit weights with fp32 masters and gradients,
recovery from fp16 overflows, bf16/fp16 curves near the fp32 one, and the memory report."""

from __future__ import annotations

import json
import math

import pytest
import torch

from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.distributed.topology import ParallelDims, Topology
from paratron.model.batch import Batch
from paratron.model.gpt import GPT, build_model
from paratron.optim.build import build_optimizer
from paratron.optim.master_weights import ReplicatedOptimizer
from paratron.optim.mixed_precision import LossScaler, Precision
from paratron.parallel import parallelize
from paratron.parallel.recompute import apply_recompute
from paratron.training.memory_report import SavedActivations
from paratron.training.run import run_training

from tiny import tiny_config


def test_dynamic_loss_scale_follows_megatron_rules():
    scaler = LossScaler(2.0**10, min_scale=2.0**8, window=3, hysteresis=2)
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**10  # the first overflow only uses up hysteresis
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**9
    scaler.update(overflow=True)  # hysteresis stays spent until the scale grows again
    assert scaler.scale == 2.0**8
    scaler.update(overflow=True)
    assert scaler.scale == 2.0**8  # never below the minimum
    for _ in range(2):
        scaler.update(overflow=False)
    assert scaler.scale == 2.0**8
    scaler.update(overflow=False)  # a clean window of 3: doubles, hysteresis refilled
    assert scaler.scale == 2.0**9 and scaler.hysteresis_left == 2
    scaler.update(overflow=False)
    scaler.update(overflow=True)  # an overflow restarts the window
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 2.0**9
    restored = LossScaler(1.0)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_static_loss_scale_never_moves():
    scaler = LossScaler(128.0, dynamic=False)
    for overflow in (True, True, False, True):
        scaler.update(overflow)
    assert scaler.scale == 128.0


def test_unscale_divides_and_detects_overflow():
    precision = Precision("fp16", LossScaler(4.0))
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([2.0])]
    assert precision.unscale(grads) is False
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [0.5]
    assert precision.unscale([torch.tensor([1.0, float("inf")])]) is True
    assert precision.unscale([torch.tensor([float("nan")])]) is True
    assert Precision("bf16").unscale([torch.tensor([float("inf")])]) is False  # bf16: no scaling, no skipping


def test_sixteen_bit_weights_have_fp32_master_weights_and_gradients():
    config = build_config(
        dict(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=64,
            seq_length=16,
            max_position_embeddings=16,
            precision="bf16",
            mock_data=True,
        )
    )
    with torch.device("meta"):
        meta = GPT(config.model)
    model = parallelize(meta, config, Topology(ParallelDims(1)), torch.device("cpu"), resolve_layout(config, 1))
    optimizer = build_optimizer(model, config.optimizer)
    assert isinstance(optimizer, ReplicatedOptimizer)
    weight = model.module.layers[0].mlp.out_proj.weight
    main_grad = model.gradients.reducer.main_grad(weight)
    assert weight.dtype == torch.bfloat16 and main_grad.dtype == torch.float32
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    model.forward_backward(
        [Batch(b[:, :-1], b[:, 1:]) for b in (ids[:2], ids[2:])]
    )  # two micro-batches accumulate in fp32
    assert weight.grad is None and main_grad.abs().sum() > 0  # the 16-bit gradient was folded in
    master = optimizer.masters[[id(p) for p in optimizer.targets].index(id(weight))]
    before = master.detach().clone()
    optimizer.prepare_grads()
    optimizer.step()
    optimizer.after_step()
    assert master.dtype == torch.float32 and not torch.equal(master, before)
    assert torch.equal(weight.detach(), master.detach().to(torch.bfloat16))  # written back, rounded
    state = optimizer.state_dict()
    assert len(state["master_weights"]) == len(optimizer.masters)  # a checkpoint keeps the fp32 values


def test_fp16_run_forced_to_overflow_recovers(tmp_path):
    """A loss scale of 2^30 overflows fp16 gradients: steps are skipped on every rank and the scale
    backs off until they fit; then training goes on, and the scale grows again after clean windows."""
    state = run_training(
        tiny_config(
            tmp_path, train_iters=40, precision="fp16", initial_loss_scale=2.0**30, loss_scale_window=5, hysteresis=2
        )
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in records]
    skipped = [r["step"] for r in records if r["grad_norm"] is None]
    assert state.skipped_iterations == len(skipped) and records[-1]["skipped_iterations"] == len(skipped)
    first_ok = next(r["step"] for r in records if r["grad_norm"] is not None)
    assert first_ok > 8 and skipped[: first_ok - 1] == list(range(1, first_ok))  # backed off step by step
    assert scales[0] == 2.0**30 and scales[first_ok - 1] < 2.0**22
    lowest = scales.index(min(scales))
    assert max(scales[lowest:]) > min(scales)  # grew again after clean windows
    assert len(skipped) < 25 and all(math.isfinite(x) for x in state.losses)
    assert sum(state.losses[-5:]) / 5 < state.losses[first_ok - 1] - 0.15  # and it learns


def test_bf16_and_fp16_curves_stay_near_fp32_over_100_steps(tmp_path):
    """The band: every one of 100 steps within 2% of the fp32 loss (measured on this model: bf16
    1.24% at worst, fp16 0.69%; final losses 3.517 and 3.514 against fp32's 3.513)."""
    curves = {
        p: run_training(tiny_config(tmp_path / p, train_iters=100, precision=p, initial_loss_scale=2.0**16)).losses
        for p in ("fp32", "bf16", "fp16")
    }
    for precision in ("bf16", "fp16"):
        worst = max(abs(a - b) / b for a, b in zip(curves[precision], curves["fp32"]))
        assert worst < 0.02, f"{precision}: {worst:.2%} from fp32"
    assert curves["bf16"][-1] < curves["bf16"][0] - 2.0  # and they learn as fp32 does


def test_mixed_precision_memory_report(tmp_path):
    run_training(tiny_config(tmp_path, train_iters=2, precision="bf16", log_memory=True))
    rank = json.loads((tmp_path / "memory.json").read_text())["ranks"][0]
    n = sum(p.numel() for p in build_model(tiny_config(tmp_path, vocab_size=512).model).parameters())
    assert rank["parameters"] == 2 * n  # bf16 weights
    assert rank["gradients"] == rank["master"] == 4 * n  # fp32 main gradients and master weights
    assert rank["optimizer_state"] == 8 * n  # Adam's two fp32 moments
    assert rank["activations_peak"] > 0 and rank["coordinates"] == "tp0 pp0 dp0"


# ---------------------------------------------------------------- activations saved for backward

S, B, H, A = 64, 2, 128, 4  # sequence, micro-batch, hidden, heads


def _saved_bytes_per_layer(granularity: str | None, **model) -> float:
    """Bytes saved for backward by one GPT-2-style layer in bf16 (two models' difference), / sbh."""
    saved = []
    for layers in (1, 2):
        config = build_config(
            dict(
                num_layers=layers,
                hidden_size=H,
                num_attention_heads=A,
                seq_length=S,
                max_position_embeddings=S,
                vocab_size=256,
                hidden_dropout=0.1,
                attention_dropout=0.1,
                **model,
            )
        )
        gpt = build_model(config.model).to(torch.bfloat16)
        if granularity is not None:
            apply_recompute(gpt, granularity, "uniform" if granularity == "full" else None, None, None)
        ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
        with SavedActivations(gpt) as activations:
            loss = gpt(ids).float().mean()
        saved.append(activations.live)
        loss.backward()
        assert activations.live == 0  # every saved tensor released by backward
    return (saved[1] - saved[0]) / (S * B * H)


def test_saved_activations_per_layer_match_the_formulas():
    """Korthikanti et al. (2022) per layer, in units of sbh bytes, adjusted as docs/memory.md
    explains: dropout masks are 2 bytes (not 1) on CPU, and CPU attention with dropout runs its
    core in fp32. Layer norm statistics add 2 x 2 x 2 / h."""
    stats = 8 / H
    assert _saved_bytes_per_layer("full") == 2.0  # only the layer's input
    assert _saved_bytes_per_layer("selective") == pytest.approx(34 + 2 + stats)
    assert _saved_bytes_per_layer(None) == pytest.approx(42 + 12 * A * S / H + stats)
