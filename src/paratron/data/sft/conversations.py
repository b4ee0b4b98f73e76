"""Reading supervised fine-tuning conversations from `.jsonl` files (one JSON object a line).

Each line becomes a list of messages `{"role": ..., "content": ...}`. Three line forms are
accepted, so that the common public SFT sets load without conversion:

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}                      (+ optional "system")
    {"instruction": "...", "input": "...", "output": "..."}     (+ optional "system"; "input" may be absent)

A bad line stops reading with its file and line and the fix: a skipped line would silently
change what the model is trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratron.errors import DataError

Message = dict[str, str]
ROLES = ("system", "user", "assistant")
FORMS = (
    '{"messages": [{"role": ..., "content": ...}, ...]}, '
    '{"prompt": ..., "completion": ...} or {"instruction": ..., "input": ..., "output": ...}'
)


def read_conversations(path: Path) -> Iterator[tuple[int, list[Message]]]:
    """(1-based line number, messages) for each non-blank line of `path`."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file; give a .jsonl file of conversations")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            text = _decode(raw, where)
            if not text.strip():
                continue
            yield number, messages_of(parse_line(text, where), where)


def messages_of(record: Any, where: str) -> list[Message]:
    """The messages of one parsed line, in whichever of the three forms it is written."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object; write each line as {FORMS}")
    if "messages" in record:
        messages = _messages_form(record["messages"], where)
    elif "prompt" in record:
        messages = _prompt_form(record, where)
    elif "instruction" in record:
        messages = _instruction_form(record, where)
    else:
        raise DataError(f"{where}: no 'messages', 'prompt' or 'instruction' key; write each line as {FORMS}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to train on; add an assistant message")
    return messages


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: byte {exc.start} of the line is not valid UTF-8; save the file as UTF-8") from None


def parse_line(text: str, where: str) -> Any:
    """One JSON lines record; a line that is not JSON is one line naming `where` (file:line)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{where}: not valid JSON ({exc.msg}, column {exc.colno}); write one JSON object per line"
        ) from None


def _messages_form(messages: Any, where: str) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} objects")
    return [_message(m, where, number) for number, m in enumerate(messages, start=1)]


def _message(message: Any, where: str, number: int) -> Message:
    if not (
        isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
    ):
        raise DataError(
            f"{where}: message {number} is not an object with string 'role' and 'content'; "
            'write it as {"role": "user", "content": "..."}'
        )
    role = message["role"]
    if role not in ROLES:
        raise DataError(f"{where}: message {number} has role {role!r}; the roles are {', '.join(ROLES)}")
    return {"role": role, "content": _text(message["content"], where, f"the content of message {number}")}


def _prompt_form(record: dict, where: str) -> list[Message]:
    prompt = _field(record, "prompt", where)
    completion = _field(record, "completion", where)
    return _with_system(record, where) + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": completion},
    ]


def _instruction_form(record: dict, where: str) -> list[Message]:
    instruction = _field(record, "instruction", where)
    extra = _field(record, "input", where, required=False)
    output = _field(record, "output", where)
    prompt = instruction + ("\n\n" + extra if extra else "")
    return _with_system(record, where) + [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": output},
    ]


def _with_system(record: dict, where: str) -> list[Message]:
    system = _field(record, "system", where, required=False)
    return [{"role": "system", "content": system}] if "system" in record else []


def _field(record: dict, key: str, where: str, required: bool = True) -> str:
    """A string field; an absent optional one reads as empty."""
    if key not in record:
        if required:
            raise DataError(f"{where}: no {key!r} key; write each line as {FORMS}")
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: the value of {key!r} is a {type(value).__name__}; it must be a string")
    return _text(value, where, f"the value of {key!r}")


def _text(value: str, where: str, what: str) -> str:
    """JSON can smuggle in lone surrogates (\\ud800), which no tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{where}: character {exc.start} of {what} is a lone surrogate, not valid Unicode") from None
    return value
