"""Autoregressive generation with a KV cache: greedy, or temperature with optional top-k."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paratron.model.gpt import GPT
from paratron.model.transformer import KVCache


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]; temperature 0 means greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: GPT,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | Iterable[int] | None = None,
    seed: int | None = None,
    images: torch.Tensor | None = None,
) -> list[int]:
    """Continue `prompt_ids`; returns only the new tokens, the last of them the stop id if one was
    generated. `eos_id` is the id, or the ids, that stop generation (a tokenizer's `stop_ids`: its
    end-of-document token and every end token its model declares, e.g. Llama 3's three).

    The prompt is cut from the left if prompt + new tokens exceed the model's positions. A vision-language model
    takes the prompt's `images` [N, 3, H, W] (their placeholders in the prompt; such a prompt is never cut).
    """
    stop_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id or ())
    device = next(model.parameters()).device
    limit = model.config.max_position_embeddings
    max_new_tokens = max(0, min(max_new_tokens, limit - 1))
    if images is not None and len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"a prompt of {len(prompt_ids)} tokens with images leaves no room in {limit} positions")
    prompt_ids = prompt_ids[-(limit - max_new_tokens) :] or stop_ids[:1] or [0]
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    cache = KVCache(len(model.layers), len(prompt_ids) + max_new_tokens)
    pixels = None if images is None else images.to(device)
    logits = model(torch.tensor([prompt_ids], device=device), cache, images=pixels)[:, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, generator)
        out.append(int(token))
        if out[-1] in stop_ids:
            break
        logits = model(token.view(1, 1), cache)[:, -1]
    model.train(was_training)
    return out
