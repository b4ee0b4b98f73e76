"""Conversations -> token ids and which of them the model is trained to produce.

How assistant tokens are found, for any chat template (no `{% generation %}` tag needed):

1. Render the whole conversation once: `full`.
2. For each assistant message i, render `messages[:i]` with the generation prompt, and
   `messages[:i+1]` without it. Both must be prefixes of `full` (true of templates that
   write each turn independently of what follows). The assistant turn is the characters
   between their two lengths: everything the template writes for that turn after its
   generation prompt, i.e. the content, the end-of-turn token and any separator it appends
   (so the model learns to stop).
3. Tokenize `full` once, with character offsets, and mark a token trained when its
   characters overlap an assistant span. This is the rule of transformers'
   `return_assistant_tokens_mask` (from the token holding a span's first character to the
   one holding its last), so the masks agree with it token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratron.data.sft.conversations import Message, read_conversations
from paratron.data.sft.templates import ChatTemplate, ChatTemplateError
from paratron.data.tokenizer import Tokenizer
from paratron.errors import DataError


@dataclass(frozen=True, eq=False)
class TokenizedConversation:
    ids: np.ndarray
    """int32 token ids of the rendered conversation."""
    trained: np.ndarray
    """bool, True where the token belongs to an assistant turn."""
    where: str = ""
    """'FILE:LINE' it came from, for error messages."""


def tokenize_conversation(
    messages: list[Message], template: ChatTemplate, tokenizer: Tokenizer, where: str
) -> TokenizedConversation:
    """Render, tokenize and mark the assistant tokens of one conversation (see the module docstring)."""
    full, spans = assistant_spans(messages, template, where)
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise DataError(f"{where}: supervised fine-tuning needs a Hugging Face tokenizer (with character offsets)")
    encoding = hf.encode(full, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int32)
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    trained = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    if not trained[1:].any():  # the first token has nothing before it to predict it from
        raise DataError(
            f"{where}: the assistant turns render to no token that can be trained on "
            "(empty turns, or an assistant turn at the very start); give the assistant some content"
        )
    return TokenizedConversation(ids, trained, where)


def assistant_spans(messages: list[Message], template: ChatTemplate, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn."""
    full = _render(template, messages, False, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(template, messages[:i], True, where)
        through = _render(template, messages[: i + 1], False, where)
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise DataError(
                f"{where}: the chat template does not render conversations prefix by prefix, so assistant "
                f"turns cannot be located (message {i + 1}); use a template that writes each turn "
                "independently of later ones, e.g. --chat-template chatml or llama3"
            )
        spans.append((len(before), len(through)))
    return full, spans


def _render(template: ChatTemplate, messages: list[Message], add_generation_prompt: bool, where: str) -> str:
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:
        raise DataError(f"{where}: the chat template failed to render: {exc.reason}") from None


def iter_tokenized(path: Path, template: ChatTemplate, tokenizer: Tokenizer) -> Iterator[TokenizedConversation]:
    """The conversations of one file, tokenized one at a time (for files too big to hold)."""
    for line, messages in read_conversations(path):
        yield tokenize_conversation(messages, template, tokenizer, f"{path}:{line}")


def tokenize_file(path: Path, template: ChatTemplate, tokenizer: Tokenizer) -> list[TokenizedConversation]:
    return list(iter_tokenized(path, template, tokenizer))
