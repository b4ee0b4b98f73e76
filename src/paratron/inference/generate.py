"""One prompt continued on one device: the run's closing sample and scripts that hold a model in memory.

A thin use of the engine (`inference.engine`) for a single request; `paratron generate` and the server drive the
engine directly, many requests at a time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paratron.config.inference import InferenceConfig
from paratron.inference.loading import engine_for_model
from paratron.inference.params import SamplingParams
from paratron.model.gpt import GPT


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
    """Continue `prompt_ids`; returns only the new tokens, the last of them the stop id if one was generated.
    `eos_id` is the id, or the ids, that stop generation (a tokenizer's `stop_ids`).

    For a sample that always fits, the prompt is cut from the left when prompt + new tokens exceed the model's
    positions (the new tokens to one less than them). A vision-language model takes the prompt's `images`
    [N, 3, H, W] (their placeholders in the prompt; such a prompt is never cut)."""
    stop_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id or ())
    limit = model.config.max_position_embeddings
    max_new_tokens = max(0, min(max_new_tokens, limit - 1))
    if images is not None and len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"a prompt of {len(prompt_ids)} tokens with images leaves no room in {limit} positions")
    prompt_ids = prompt_ids[-(limit - max_new_tokens) :] or stop_ids[:1] or [0]
    if max_new_tokens == 0:
        return []
    params = SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0, seed=seed, stop_token_ids=stop_ids
    )
    settings = InferenceConfig(kv_cache_tokens=len(prompt_ids) + max_new_tokens)
    engine = engine_for_model(model, None, settings)
    engine.add_request(prompt_ids, params, images=images)
    while engine.has_work():
        outputs = engine.step()
    return outputs[-1].completions[0].token_ids
