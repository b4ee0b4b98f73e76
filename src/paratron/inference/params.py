"""What a request asks of the engine (`SamplingParams`) and what it gets back (`RequestOutput`).

A request is a prompt (token ids) and its sampling parameters; its output holds `n` completions, each a list of
token ids, their text, why it finished and, when asked for, the log-probabilities of the chosen tokens with the
likeliest alternatives. Log-probabilities are those of the model's own distribution (log-softmax of its logits,
in fp32), before temperature, penalties or filtering, as lm-evaluation-harness expects them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratron.errors import UserError

MAX_TOP_LOGPROBS = 20
"""The most alternatives a token's log-probability may come with (OpenAI's limit)."""


class RequestError(UserError):
    """A request the engine cannot serve as asked; `param` names the field (an HTTP 400 says it back)."""

    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.status = param, message, status


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. Defaults: greedy, 16 tokens, one completion."""

    max_tokens: int = 16
    """New tokens at most (0: none; with `prompt_logprobs` the prompt is scored alone)."""
    temperature: float = 0.0
    """0 is greedy; above 0 the logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k likeliest tokens (0: all)."""
    top_p: float = 1.0
    """Sample among the likeliest tokens whose probabilities sum to at least p (nucleus sampling)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the likeliest token's probability."""
    repetition_penalty: float = 1.0
    """Above 1 makes every token of the prompt and of the completion so far less likely (a positive logit is
    divided by it, a negative one multiplied), as transformers' `repetition_penalty`."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the completion already holds it (OpenAI's)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the completion already holds (OpenAI's)."""
    seed: int | None = None
    """Seed of this request's sampling: the same seed, prompt and parameters give the same tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion; the text returned stops before them."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (besides the tokenizer's end tokens)."""
    ignore_eos: bool = False
    """Keep going past the tokenizer's end tokens."""
    n: int = 1
    """Completions of the prompt, sampled independently."""
    logprobs: int | None = None
    """With each generated token, its log-probability and this many likeliest alternatives (0: none)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (which has none)."""
    skip_special_tokens: bool = True
    """Leave the tokenizer's special tokens out of the text (vLLM's field and default)."""
    spaces_between_special_tokens: bool = True
    """Where special tokens are kept, one space between two adjacent ones (vLLM's field and default)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def check(self) -> None:
        """One RequestError naming the first field out of range."""
        if self.max_tokens < 0:
            raise RequestError("max_tokens", f"{self.max_tokens} is negative; ask for 0 or more tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError("temperature", f"{self.temperature}: must be 0 (greedy) or more")
        if self.top_k < 0:
            raise RequestError("top_k", f"{self.top_k}: must be 0 (off) or more")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"{self.top_p}: must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise RequestError("min_p", f"{self.min_p}: must be in [0, 1]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise RequestError("repetition_penalty", f"{self.repetition_penalty}: must be above 0 (1: off)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise RequestError(name, f"{value}: must be between -2 and 2")
        if self.n < 1:
            raise RequestError("n", f"{self.n}: must be at least 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise RequestError(name, f"{value}: must be between 0 and {MAX_TOP_LOGPROBS}")
        if any(not s for s in self.stop):
            raise RequestError("stop", "an empty stop string would stop at once; drop it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


@dataclass
class TokenLogprob:
    """A token's log-probability and the `top` likeliest tokens at its place, (id, log-probability), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Completion:
    """One of a request's completions, as far as it got."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    """Generated tokens (a stop token included when one ended it)."""
    text: str = ""
    """Their text, up to a stop string and without a stop token; while running, the part that is final (an
    unfinished character or the start of a stop string is held back)."""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    """None while running; "stop" (a stop token or string), "length" (max_tokens or the context), "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it, if one did."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt and its completions so far."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With `prompt_logprobs`: None for the first prompt token, then each token's log-probability given those before."""

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)
