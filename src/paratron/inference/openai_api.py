"""The OpenAI API as `paratron serve` speaks it: request bodies, their sampling parameters, response bodies.

Requests are pydantic models (FastAPI reads and checks them): `/v1/completions` takes a prompt as text, a list of
texts, token ids or a list of lists of ids; `/v1/chat/completions` takes messages that the tokenizer's chat
template renders. Both accept OpenAI's sampling fields and the extras vLLM accepts (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos). Responses follow OpenAI's shapes, log-probabilities included:
completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, chat's `content` list. Errors have
OpenAI's body, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paratron.data.sft import ROLES, ChatTemplate
from paratron.inference.params import RequestError, SamplingParams, TokenLogprob

INVALID_REQUEST = "invalid_request_error"
LOWEST_LOGPROB = -9999.0
"""Where log-probabilities are cut off: JSON has no -Infinity (vLLM writes the same floor)."""


def error_body(message: str, param: str | None = None, code: str | None = None, kind: str = INVALID_REQUEST) -> dict:
    """OpenAI's error body: what the official clients read into their exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    """A last chunk with the request's token counts (and no choices)."""


class _Sampling(BaseModel):
    """The fields both routes share."""

    model_config = ConfigDict(extra="ignore")  # (clients send fields that change nothing here, e.g. `user`)

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_k: int = 0
    """vLLM's extra: -1 or 0 is off."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    """Not supported: refused when not empty."""
    response_format: dict[str, Any] | None = None
    """Only {"type": "text"}: JSON modes need constrained decoding, which this server does not do."""
    skip_special_tokens: bool = True
    """vLLM's extra: leave the tokenizer's special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """vLLM's extra: one space between two adjacent special tokens kept in the text."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, values: Any) -> Any:
        """Clients send null for a field they leave at its default; OpenAI reads it so."""
        return {k: v for k, v in values.items() if v is not None} if isinstance(values, dict) else values

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise RequestError("logit_bias", "not supported by this server; drop it")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise RequestError(
                "response_format",
                f"type {kind!r} is not supported by this server (no constrained decoding); drop it or ask for 'text'",
            )

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None, end_ids: tuple[int, ...] = ()
    ) -> SamplingParams:
        """The engine's parameters for this request (checked: a RequestError names the field out of range).
        `end_ids`: more token ids that end a completion (a chat template's end of turn)."""
        self.refuse_unsupported()
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=0 if self.top_k == -1 else self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            seed=self.seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(dict.fromkeys((*(self.stop_token_ids or ()), *end_ids))),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        params.check()
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """The body of POST /v1/completions."""

    prompt: Prompt
    max_tokens: int | None = 16
    """New tokens per completion (None: up to the context); 0 with echo and logprobs scores the prompt alone."""
    echo: bool = False
    logprobs: int | None = None
    """Each token's log-probability and this many likeliest alternatives (with echo, the prompt's too)."""
    suffix: str | None = None
    best_of: int | None = None

    def prompt_texts(self, prompts: list[list[int]], decode: Callable[[list[int]], str]) -> list[str]:
        """The prompts' texts as echo repeats them: as the client wrote them, decoded where it sent token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, str) for p in self.prompt):
            return [str(p) for p in self.prompt]
        return [decode(p) for p in prompts]

    def prompts(self, encode: Callable[[str], list[int]]) -> list[list[int]]:
        """The prompts as token ids (`encode`: text -> ids); an empty prompt is refused by the engine."""
        if self.suffix:
            raise RequestError("suffix", "not supported by this server (no fill-in-the-middle); drop it")
        if self.best_of not in (None, 1, self.n):
            raise RequestError("best_of", "not supported by this server; ask for n completions instead")
        prompt = self.prompt
        if isinstance(prompt, str):
            return [encode(prompt)]
        if not prompt:
            raise RequestError("prompt", "an empty list; give a text, a list of texts or of token ids")
        if all(isinstance(p, str) for p in prompt):
            return [encode(p) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [list(p) for p in prompt]

    def params(self, max_tokens: int) -> SamplingParams:
        """echo with logprobs asks for the prompt's log-probabilities too."""
        return self.sampling_params(max_tokens, self.logprobs, self.logprobs if self.echo else None)


class ContentPart(BaseModel):
    """A part of a message's content: text parts are read; any other type (image_url, input_audio, ...) is refused
    by name when the conversation is rendered."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    def rendered(self, index: int) -> dict[str, str]:
        """The message as the chat template reads it; a role the templates do not know or a part that is not text
        is a RequestError naming it (param `messages`)."""
        if self.role not in ROLES:
            raise RequestError(
                "messages", f"message {index} has role {self.role!r}; the roles it may have: {', '.join(ROLES)}"
            )
        if not isinstance(self.content, list):
            return {"role": self.role, "content": self.content or ""}
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise RequestError(
                    "messages",
                    f"message {index} has a content part of type {part.type!r}; this server reads text parts only "
                    '({"type": "text", "text": ...}): send the text alone',
                )
        return {"role": self.role, "content": "".join(part.text or "" for part in self.content)}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template reads them (checked: see `ChatMessage.rendered`)."""
    return [message.rendered(index) for index, message in enumerate(messages)]


class ChatRequest(_Sampling):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    """New tokens per answer (None: up to the context)."""
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens (it wins when both are given)."""
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    """OpenAI's legacy function calling: refused, as `tools` is."""
    function_call: str | dict[str, Any] | None = None

    def prompt(self, template: ChatTemplate, encode: Callable[[str], list[int]]) -> list[int]:
        """The conversation rendered by the chat template, up to the assistant's turn, as token ids."""
        for name in ("tools", "functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):  # ("none": call no function, as here)
                raise RequestError(name, "not supported by this server (no function calling); drop it")
        return encode(template.render(template_messages(self.messages), add_generation_prompt=True))

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def params(self, max_tokens: int, end_ids: tuple[int, ...]) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, end_ids=end_ids)


class TokenizeRequest(BaseModel):
    """The body of POST /tokenize (vLLM's): a text, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    """Put the tokenizer's beginning-of-text token first, when it has one."""


class DetokenizeRequest(BaseModel):
    """The body of POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]


class TokenTexts:
    """Each token's text as the responses show it (the token decoded alone), remembered."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.known: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.known.get(token_id)
        if text is None:
            text = self.known[token_id] = self.decode([token_id])
        return text


def completion_logprobs(entries: list[TokenLogprob | None], texts: TokenTexts, offset: int) -> dict[str, list]:
    """The completions API's logprobs block for `entries` (None: the prompt's first token, which has none), the
    first token at `offset` characters into the choice's text. `top_logprobs` maps token text -> log-probability
    for the likeliest tokens and the chosen one, as vLLM writes it (lm-evaluation-harness reads greediness off it)."""
    block: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        if entry is None:  # (only the first prompt token; its text is the prompt's first)
            continue
        token = texts(entry.token_id)
        top: dict[str, float] = {}
        for token_id, logprob in [*entry.top, (entry.token_id, entry.logprob)]:
            top.setdefault(texts(token_id), max(logprob, LOWEST_LOGPROB))
        block["tokens"].append(token)
        block["token_logprobs"].append(max(entry.logprob, LOWEST_LOGPROB))
        block["top_logprobs"].append(top)
        block["text_offset"].append(offset)
        offset += len(token)
    return block


def prompt_logprobs_block(prompt_ids: list[int], entries: list[TokenLogprob | None], texts: TokenTexts) -> dict:
    """The prompt's part of an echoed logprobs block: its first token with null log-probabilities."""
    first = texts(prompt_ids[0])
    rest = completion_logprobs(entries[1:], texts, len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def joined_logprobs(first: dict[str, list] | None, second: dict[str, list]) -> dict[str, list]:
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}


def _token_record(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": max(logprob, LOWEST_LOGPROB), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict[str, list]:
    """The chat API's logprobs: `content`, one record per token with its `top_logprobs` records."""
    content = []
    for entry in entries:
        record = _token_record(entry.token_id, entry.logprob, texts)
        record["top_logprobs"] = [_token_record(i, logprob, texts) for i, logprob in entry.top]
        content.append(record)
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons are stop and length; an aborted completion (it is not sent) reads as stop."""
    return "stop" if reason == "abort" else reason


def completion_choice(
    index: int, text: str, logprobs: dict | None, reason: str | None, stop_reason: int | str | None = None
) -> dict[str, Any]:
    """One choice of a completion or of a streamed chunk of one (`stop_reason`: vLLM's extra, the stop string or
    token id that ended it)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    if reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def chat_choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
    }


def chat_chunk_choice(index: int, delta: dict[str, str], logprobs: dict | None, reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def response_body(kind: str, request_id: str, created: int, model: str, choices: list, counts: dict | None) -> dict:
    """A whole response or one streamed chunk (`kind`: text_completion, chat.completion, chat.completion.chunk);
    `counts`: its usage, or None."""
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if counts is not None:
        body["usage"] = counts
    return body
