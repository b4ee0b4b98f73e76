"""The fused output layer + cross-entropy: the unfused loss's values and gradients, chunk by chunk, and in training."""

from __future__ import annotations

import importlib

import pytest
import torch

from paratron.commands.train import parser as train_parser
from paratron.config import build_config, validate
from paratron.config.arguments import parse_config_arguments
from paratron.model.batch import IGNORE_INDEX
from paratron.model.fused_loss import chunk_tokens, fused_token_losses
from paratron.model.loss import token_losses
from paratron.training.run import run_training

from tiny import tiny_config


def _inputs(tied: bool, seed: int = 0):
    """Hidden states [2, 9, 16], an output weight [37, 16] (the embedding's, when tied) and labels with ignored ones."""
    gen = torch.Generator().manual_seed(seed)
    embedding = torch.nn.Embedding(37, 16)
    output = torch.nn.Linear(16, 37, bias=False)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(37, 16, generator=gen))
        output.weight.copy_(torch.randn(37, 16, generator=gen))
    if tied:
        output.weight = embedding.weight
    ids = torch.randint(0, 37, (2, 9), generator=gen)
    hidden = (embedding(ids) * 0.5 + torch.randn(2, 9, 16, generator=gen)).detach().requires_grad_()
    labels = torch.randint(0, 37, (2, 9), generator=gen)
    labels[0, 3] = labels[1, 0] = labels[1, 8] = IGNORE_INDEX
    return hidden, output, embedding, labels


def _losses_and_grads(fused: bool, tied: bool, chunk: int, token_weights: torch.Tensor | None):
    hidden, output, embedding, labels = _inputs(tied)
    if fused:
        losses = fused_token_losses(hidden, output.weight, labels, chunk=chunk)
    else:
        losses = token_losses(output(hidden), labels)
    weighted = losses * token_weights if token_weights is not None else losses.sum() / 15
    weighted.sum().backward()
    return losses.detach(), hidden.grad, output.weight.grad


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, 18, 100])
def test_fused_matches_unfused_losses_and_gradients(tied, chunk):
    reference = _losses_and_grads(False, tied, chunk, None)
    fused = _losses_and_grads(True, tied, chunk, None)
    for want, got in zip(reference, fused):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert reference[0][0, 3] == 0 and fused[0][1, 8] == 0


def test_tokens_weighted_apart_still_match():
    """A gradient that differs per token (not one loss scale) recomputes the chunks: still the unfused gradients."""
    token_weights = torch.linspace(0.1, 2.0, 18).view(2, 9)
    reference = _losses_and_grads(False, False, 4, token_weights)
    fused = _losses_and_grads(True, False, 4, token_weights)
    for want, got in zip(reference, fused):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_no_gradients_computed_without_autograd_and_frozen_weight_gets_none():
    hidden, output, _, labels = _inputs(False)
    with torch.no_grad():
        losses = fused_token_losses(hidden, output.weight, labels, chunk=5)
    assert losses.grad_fn is None
    torch.testing.assert_close(losses, token_losses(output(hidden), labels).detach(), rtol=0, atol=1e-5)
    output.weight.requires_grad_(False)
    fused_token_losses(hidden, output.weight, labels, chunk=5).sum().backward()
    assert output.weight.grad is None and hidden.grad is not None


def test_chunk_bounds_the_logits():
    assert chunk_tokens(128_256) == (1 << 24) // 128_256
    assert chunk_tokens(10, limit=5) == 1


def _cli_config(tmp_path, *flags: str):
    argv = ["--config", "debug", "--run-dir", str(tmp_path), "--train-iters", "4", "--eval-iters", "0", *flags]
    argv += ["--no-progress-bar", "--no-tensorboard", "--log-interval", "1"]
    recipe, overrides, _ = parse_config_arguments(train_parser(), argv)
    return build_config(overrides, recipe)


def test_training_with_fusion_gives_the_same_losses(tmp_path, monkeypatch):
    plain = run_training(_cli_config(tmp_path / "plain")).losses
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fused_token_losses(*args, **kwargs)

    building = importlib.import_module("paratron.parallel.parallelize")  # (the module, not its function)
    monkeypatch.setattr(building, "fused_token_losses", counted)
    fused_config = _cli_config(tmp_path / "fused", "--cross-entropy-loss-fusion")
    fused = run_training(fused_config).losses
    assert len(calls) >= 4 and len(calls[0]) == 3  # (hidden states [B, T, H] reached the loss, every step)
    assert len(fused) == 4 and fused == pytest.approx(plain, abs=1e-5)


@pytest.mark.parametrize(
    "settings, world",
    [
        (dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v", num_layers=4), 2),
        (dict(zero_stage=3, tensor_model_parallel_size=2, sequence_parallel=True), 4),
        (dict(zero_stage=3, pipeline_model_parallel_size=2), 4),
    ],
)
def test_pipeline_and_zero3_layouts_are_served(tmp_path, settings, world):
    """(Their parity: tests/parallel/test_fused_loss_parity.py.)"""
    config = tiny_config(tmp_path, cross_entropy_loss_fusion=True, **settings)
    layout = validate(config, world, check_data=False)
    assert layout.pp == settings.get("pipeline_model_parallel_size", 1)
