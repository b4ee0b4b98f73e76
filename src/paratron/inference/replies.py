"""The answers of the completions and chat routes, made from the engine's outputs: a whole body once every prompt is
done, or a stream of chunks (server-sent events) as tokens come, ending with `data: [DONE]`.

A request with several prompts and n completions each has choices numbered prompt x n + completion. A streamed
choice sends only what is new since its last chunk: the engine's `Completion.text` holds back what may still change
(an unfinished character, the start of a stop string), so the sent text never needs taking back.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from paratron.errors import UserError
from paratron.inference import openai_api as api
from paratron.inference.engine_thread import EngineFailed, Submission
from paratron.inference.params import Completion, RequestOutput


def event(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


@dataclass
class _Sent:
    """How much of a streamed choice its client has: characters of text, tokens with log-probabilities, the text
    offset of the next token, whether its first chunk and its last went out."""

    chars: int = 0
    tokens: int = 0
    offset: int = 0
    started: bool = False
    done: bool = False


class Reply:
    """One request's answer; subclasses say how a choice reads."""

    prefix, whole_kind, chunk_kind = "", "", ""

    def __init__(self, submission: Submission, body: api.CompletionRequest | api.ChatRequest, model: str) -> None:
        self.submission, self.body, self.model = submission, body, model
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine's thread posts them, until every prompt is done."""
        remaining = len(self.submission.prompts)
        while remaining:
            item = await self.submission.queue.get()
            if isinstance(item, BaseException):
                raise item
            index, output = item
            remaining -= output.finished
            yield index, output

    def choice_index(self, prompt: int, completion: Completion) -> int:
        return prompt * self.body.n + completion.index

    async def whole(self) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in self.outputs():
            if output.finished:
                finals[index] = output
        outputs = [finals[i] for i in range(len(finals))]
        choices = [self.whole_choice(p, out, c) for p, out in enumerate(outputs) for c in out.completions]
        return api.response_body(self.whole_kind, self.id, self.created, self.model, choices, _usage(outputs))

    async def events(self) -> AsyncIterator[str]:
        sent: dict[int, _Sent] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, output in self.outputs():
                for completion in output.completions:
                    state = sent.setdefault(self.choice_index(index, completion), _Sent())
                    choice = None if state.done else self.chunk_choice(index, output, completion, state)
                    if choice is not None:
                        yield event(self.chunk([choice]))
                if output.finished:
                    finals[index] = output
            if self.body.include_usage:
                yield event(self.chunk([], _usage(list(finals.values()))))
        except (EngineFailed, UserError) as exc:  # (headers are out: the failure goes down the stream)
            yield event(api.error_body(str(exc), kind="server_error"))
        yield DONE

    def chunk(self, choices: list[dict], counts: dict | None = None) -> dict[str, Any]:
        return api.response_body(self.chunk_kind, self.id, self.created, self.model, choices, counts)

    def whole_choice(self, prompt: int, output: RequestOutput, completion: Completion) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, prompt: int, output: RequestOutput, completion: Completion, sent: _Sent) -> dict | None:
        """The choice's part of the next chunk, or None when there is nothing new."""
        raise NotImplementedError


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    return api.usage(prompt, sum(len(c.token_ids) for out in outputs for c in out.completions))


class CompletionReply(Reply):
    """/v1/completions: text, with echo the prompt first; logprobs in the completions API's format."""

    prefix, whole_kind, chunk_kind = "cmpl", "text_completion", "text_completion"

    def __init__(
        self,
        submission: Submission,
        body: api.CompletionRequest,
        model: str,
        texts: api.TokenTexts,
        prompt_texts: list[str],
    ) -> None:
        super().__init__(submission, body, model)
        self.completion_body, self.texts, self.prompt_texts = body, texts, prompt_texts

    def _head(self, output: RequestOutput) -> dict[str, list] | None:
        """The echoed prompt's log-probabilities (None without echo)."""
        if not self.completion_body.echo:
            return None
        return api.prompt_logprobs_block(output.prompt_token_ids, output.prompt_logprobs or [None], self.texts)

    def whole_choice(self, prompt: int, output: RequestOutput, completion: Completion) -> dict[str, Any]:
        echo = self.prompt_texts[prompt] if self.completion_body.echo else ""
        block = None
        if self.completion_body.logprobs is not None:
            head = self._head(output)
            offset = _end(head)
            block = api.joined_logprobs(head, api.completion_logprobs(completion.logprobs or [], self.texts, offset))
        index, text = self.choice_index(prompt, completion), echo + completion.text
        return api.completion_choice(index, text, block, completion.finish_reason, completion.stop_reason)

    def chunk_choice(self, prompt: int, output: RequestOutput, completion: Completion, sent: _Sent) -> dict | None:
        if not (completion.token_ids or completion.finished):  # (its prompt is still being read)
            return None
        text, head = completion.text[sent.chars :], None
        sent.chars += len(text)
        if not sent.started:
            sent.started = True
            if self.completion_body.echo:
                text = self.prompt_texts[prompt] + text
                head = self._head(output) if self.completion_body.logprobs is not None else None
                sent.offset = _end(head)
        block = None
        if self.completion_body.logprobs is not None:
            entries = (completion.logprobs or [])[sent.tokens :]
            sent.tokens += len(entries)
            block = api.completion_logprobs(entries, self.texts, sent.offset)
            sent.offset = _end(block) if block["tokens"] else sent.offset
            block = api.joined_logprobs(head, block)
        sent.done = completion.finished
        if not (text or (block and block["tokens"]) or completion.finished):
            return None
        index = self.choice_index(prompt, completion)
        return api.completion_choice(index, text, block, completion.finish_reason, completion.stop_reason)


def _end(block: dict[str, list] | None) -> int:
    """The text offset just after a logprobs block's last token (0 for none)."""
    if not block or not block["tokens"]:
        return 0
    return block["text_offset"][-1] + len(block["tokens"][-1])


class ChatReply(Reply):
    """/v1/chat/completions: the assistant's message; logprobs in the chat API's format."""

    prefix, whole_kind, chunk_kind = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, submission: Submission, body: api.ChatRequest, model: str, texts: api.TokenTexts) -> None:
        super().__init__(submission, body, model)
        self.chat_body, self.texts = body, texts

    def whole_choice(self, prompt: int, output: RequestOutput, completion: Completion) -> dict[str, Any]:
        logprobs = api.chat_logprobs(completion.logprobs or [], self.texts) if self.chat_body.logprobs else None
        index = self.choice_index(prompt, completion)
        return api.chat_choice(index, completion.text, logprobs, completion.finish_reason)

    def chunk_choice(self, prompt: int, output: RequestOutput, completion: Completion, sent: _Sent) -> dict | None:
        text = completion.text[sent.chars :]
        sent.chars += len(text)
        entries = (completion.logprobs or [])[sent.tokens :]
        sent.tokens += len(entries)
        first, sent.started = not sent.started, True
        sent.done = completion.finished
        if not (first or text or entries or completion.finished):
            return None
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        logprobs = api.chat_logprobs(entries, self.texts) if self.chat_body.logprobs else None
        return api.chat_chunk_choice(self.choice_index(prompt, completion), delta, logprobs, completion.finish_reason)
