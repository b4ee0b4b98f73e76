"""lm-evaluation-harness' model "paratron": the harness' requests answered by an inference `Engine`, in process.

Requests are encoded as the harness' own `hf` model encodes them, so the two give the same numbers on the same
weights: a context and its continuation are encoded whole and alone, the continuation being the whole's tail; a
context too long is cut from the left; a text scored whole (`loglikelihood_rolling`) is cut into the harness' rolling
windows. Each sequence is scored as one prompt (max_tokens=0, prompt_logprobs=1) and its continuation's
log-probabilities summed; many go to the engine at once and continuous batching runs them. The model's `max_length`
is the engine's context less one: the engine reads every token of what it scores, the last one included, where a
forward pass over `max_length` tokens scores `max_length + 1`.

The harness sees one process (rank 0 of 1): it runs on the engine's controller while the other ranks of the model
follow the engine (`Engine.follow`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from paratron.data.tokenizer import NullTokenizer
from paratron.errors import UserError
from paratron.inference.params import Completion, RequestOutput, SamplingParams

SAMPLING_KWARGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
)
"""The harness' generation arguments (a task's `generation_kwargs`) that map onto `SamplingParams` fields."""

Pair = tuple[tuple[str, str] | None, list[int], list[int]]
"""A loglikelihood request as `TemplateLM` hands it on: (context, continuation), their token ids (None for the text
of a rolling window, which is not cached alone)."""


def encode_text(tokenizer: Any, text: str, special_tokens: bool) -> list[int]:
    """`text`'s token ids; with `special_tokens`, with what the tokenizer's own files add around a text (a
    tokenizer.json's post-processor, e.g. Llama's beginning-of-text token), as transformers' `encode` does."""
    hf = getattr(tokenizer, "hf", None)
    if special_tokens and isinstance(hf, HFTokenizer):
        return hf.encode(text, add_special_tokens=True).ids
    return list(tokenizer.encode(text))


def decode_text(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text of `ids`; with `skip_special_tokens`, without the tokenizer.json's special tokens (as transformers'
    `decode(..., skip_special_tokens=True)`)."""
    hf = getattr(tokenizer, "hf", None)
    if skip_special_tokens and isinstance(hf, HFTokenizer):
        return hf.decode(list(ids), skip_special_tokens=True)
    return tokenizer.decode(list(ids))


def score_prompts(
    engine: Any, prompts: Sequence[list[int]], batch_size: int, progress: tqdm | None = None
) -> list[RequestOutput]:
    """Each prompt's log-probabilities (max_tokens=0, prompt_logprobs=1, with the likeliest token at each place),
    `batch_size` prompts per `engine.generate` call; the same prompt is scored once."""
    unique: dict[tuple[int, ...], int] = {}
    for prompt in prompts:
        unique.setdefault(tuple(prompt), len(unique))
    distinct = [list(prompt) for prompt in unique]
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    outputs: list[RequestOutput] = []
    for first in range(0, len(distinct), batch_size):
        batch = distinct[first : first + batch_size]
        outputs += engine.generate(batch, params)
        if progress is not None:
            progress.update(len(batch))
    return [outputs[unique[tuple(prompt)]] for prompt in prompts]


def continuation_score(output: RequestOutput, length: int) -> tuple[float, bool]:
    """The summed log-probability of the prompt's last `length` tokens, and whether each was the likeliest."""
    scored = (output.prompt_logprobs or [])[-length:]
    if length < 1 or len(scored) < length or any(entry is None for entry in scored):
        raise ValueError(f"{length} tokens to score, but the prompt has {len(output.prompt_token_ids)}")
    total = sum(entry.logprob for entry in scored)
    greedy = all(entry.top and entry.top[0][0] == entry.token_id for entry in scored)
    return float(total), bool(greedy)


@register_model("paratron")
class ParatronLM(TemplateLM):
    """An `Engine` as an lm-evaluation-harness model (`lm_eval.simple_evaluate(model=ParatronLM(engine), ...)`)."""

    def __init__(
        self,
        engine: Any,
        batch_size: int = 512,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
    ) -> None:
        """`batch_size`: requests per `engine.generate` call; `max_length`: tokens a scored sequence may condition
        on (default the engine's context less one); `max_gen_toks`: a generation's length unless the task says;
        `add_bos_token`, `prefix_token_id`: as the harness' `hf` model's arguments of those names."""
        super().__init__()
        if engine.tokenizer is None or isinstance(engine.tokenizer, NullTokenizer):
            raise UserError(
                f"{engine.model_name} has no tokenizer that reads text (trained on --mock-data or token ids?); "
                "harness tasks are text: load a checkpoint saved with one"
            )
        if batch_size < 1:
            raise UserError(f"batch_size {batch_size}: give 1 or more requests per engine call")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.batch_size = batch_size
        self._max_length = max_length or engine.max_model_len - 1
        if not 1 <= self._max_length < engine.max_model_len:
            raise UserError(f"max_length {self._max_length}: the engine's context holds {engine.max_model_len} tokens")
        self.max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id

    # ---------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for: the beginning of text, else the end of text (as `hf`)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = getattr(self.tokenizer, "bos_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.engine.model_name

    def get_model_info(self) -> dict[str, Any]:
        """What the harness' results JSON says of the model."""
        return {"model_name": self.engine.model_name, "max_length": self.max_length}

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """As `hf`'s: special tokens unless told otherwise (or the text begins with the beginning-of-text token)."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tok_decode([self.prefix_token_id], False)):
            special = False
        ids = encode_text(self.tokenizer, string, special is not False)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """As `hf`'s: special tokens left out unless asked for."""
        return decode_text(self.tokenizer, tokens, skip_special_tokens)

    # ---------------------------------------------------------------- requests

    def _loglikelihood_tokens(
        self, requests: list[Pair], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        """Each continuation's log-probability after its context (cut from the left to `max_length` + 1 tokens in
        all), and whether greedy decoding would have produced it."""
        prompts = []
        for _, context_ids, continuation_ids in requests:
            if not 0 < len(continuation_ids) <= self.max_length:
                raise UserError(
                    f"a continuation of {len(continuation_ids)} tokens ({self.tok_decode(continuation_ids)[:40]!r}) "
                    f"does not fit the model's {self.max_length} tokens of context"
                )
            prompts.append((context_ids + continuation_ids)[-(self.max_length + 1) :])
        with tqdm(total=len(prompts), desc="paratron loglikelihood", disable=disable_tqdm) as progress:
            outputs = score_prompts(self.engine, prompts, self.batch_size, progress)
        results = []
        for (pair, _, continuation_ids), output in zip(requests, outputs):
            answer = continuation_score(output, len(continuation_ids))
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability, scored in the harness' disjoint rolling windows of `max_length` tokens
        after the prefix token."""
        windows: list[Pair] = []
        owners: list[int] = []
        for index, (text,) in enumerate(request.args for request in requests):
            ids = self.tok_encode(text)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, scores):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to the first stop string (`until`, and the end-of-text token), at most
        `max_gen_toks` tokens, greedy unless the task samples; requests with the same arguments go together."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        eos = self.tok_decode([self.eot_token_id], False)
        with tqdm(total=len(requests), desc="paratron generate_until", disable=disable_tqdm) as progress:
            for indices in groups.values():
                gen_kwargs = requests[indices[0]].args[1]
                params, until = self.sampling_params(gen_kwargs, eos)
                context_room = self.max_length - params.max_tokens  # (as `hf`: the context and the generation)
                prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=context_room) for i in indices]
                for first in range(0, len(prompts), self.batch_size):
                    outputs = self.engine.generate(prompts[first : first + self.batch_size], params)
                    for i, output in zip(indices[first : first + self.batch_size], outputs):
                        text = postprocess_generated_text(self.completion_text(output.completions[0]), until, None)
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                        results[i] = text
                    progress.update(len(outputs))
        return [text or "" for text in results]

    def completion_text(self, completion: Completion) -> str:
        """The completion's tokens decoded whole, less the stop token that ended it (as `hf` decodes its output; the
        engine's own text holds back a last character still incomplete, which `hf` shows as a replacement)."""
        tokens = completion.token_ids
        if completion.finish_reason == "stop" and isinstance(completion.stop_reason, int):
            tokens = tokens[:-1]
        return self.tok_decode(tokens)

    def sampling_params(self, gen_kwargs: dict[str, Any], eos: str) -> tuple[SamplingParams, list[str]]:
        """A task's generation arguments as `SamplingParams`, and its stop strings (the end-of-text token's text
        among them, as `hf` adds it)."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_tokens = int(kwargs.pop("max_gen_toks"))
        if not 0 < max_tokens < self.max_length:
            raise UserError(
                f"max_gen_toks {max_tokens}: a generation takes 1 to {self.max_length - 1} tokens, leaving room for "
                f"its context in the model's {self.max_length}"
            )
        do_sample = bool(kwargs.pop("do_sample", False))
        kwargs.pop("max_length", None)
        unknown = sorted(set(kwargs) - set(SAMPLING_KWARGS))
        if unknown:
            raise UserError(
                f"generation_kwargs {', '.join(unknown)}: not supported by paratron's engine; it takes "
                f"until, max_gen_toks, do_sample and {', '.join(SAMPLING_KWARGS)}"
            )
        fields = {name: kwargs[name] for name in SAMPLING_KWARGS if kwargs.get(name) is not None}
        if not do_sample:
            fields["temperature"] = 0.0
        params = SamplingParams(max_tokens=max_tokens, stop=tuple(s for s in until if s), **fields)
        params.check()
        return params, until
