"""From next-token logits to tokens: penalties, temperature, top-k / top-p / min-p filtering, a seeded draw; and
the log-probabilities a request asks for.

Each sequence samples with its own generator, seeded from its request's seed, so what it draws does not depend on
the other sequences of the step: a seeded request gives the same tokens alone or in any batch.
"""

from __future__ import annotations

import torch

from paratron.inference.params import SamplingParams, TokenLogprob


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor, generated: torch.Tensor
) -> torch.Tensor:
    """`logits` [V] less likely for tokens already there: the repetition penalty over `seen` (prompt and
    completion: ids [n]), the frequency and presence penalties over `generated` (the completion's ids [m])."""
    if params.repetition_penalty != 1 and seen.numel():
        picked = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and generated.numel():
        counts = torch.bincount(generated, minlength=logits.numel()).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logits` [V] (temperature applied) with the tokens top-k, top-p and min-p rule out set to -inf."""
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1 or params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        if params.min_p > 0:
            logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        if params.top_p < 1:
            ordered, order = torch.sort(probs, descending=True)
            before = torch.cumsum(ordered, dim=-1) - ordered  # (probability of the likelier tokens)
            drop = torch.zeros_like(probs, dtype=torch.bool)
            drop[order] = before >= params.top_p  # (keeps the token that crosses p)
            logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    seen: torch.Tensor,
    generated: torch.Tensor,
) -> int:
    """The next token of one sequence from its logits [V] (fp32)."""
    if params.penalized:
        logits = apply_penalties(logits, params, seen, generated)
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(filtered(logits / params.temperature, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its token (`logits` [R, V], `tokens` [R]) and its `top` likeliest tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    ids: list[list[int]] = [[] for _ in chosen]
    values: list[list[float]] = [[] for _ in chosen]
    if top:
        best = torch.topk(logprobs, min(top, logprobs.size(-1)), dim=-1)
        ids, values = best.indices.tolist(), best.values.tolist()
    return [TokenLogprob(int(t), lp, list(zip(i, v))) for t, lp, i, v in zip(tokens.tolist(), chosen, ids, values)]
