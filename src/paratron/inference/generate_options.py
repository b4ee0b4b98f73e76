"""What `paratron generate` is asked to do: its own flags (prompts, sampling, output) and the prompts they name.

Prompts come from `--prompt TEXT` (repeatable), a `--prompt-file` (.txt: one prompt a line; .jsonl: one object a
line, {"prompt": TEXT} or {"messages": [...]}) or standard input (`--prompt-file -`, or no prompt given while
stdin is not a terminal: lines of text, or JSON lines when the first line starts with `{`). Flags are checked and
files read before any worker starts, so a mistake is one line; standard input is read by the process that
generates (the one that owns the terminal's input).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from paratron.errors import ConfigError, DataError
from paratron.inference.params import RequestError, SamplingParams

STDIN = "-"
"""`--prompt-file -`: the prompts are read from standard input."""

SAMPLING_FLAGS = {
    "max_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "frequency_penalty": "--frequency-penalty",
    "presence_penalty": "--presence-penalty",
    "seed": "--seed",
    "stop": "--stop",
    "n": "--n",
    "logprobs": "--logprobs",
}
"""A `SamplingParams` field -> the flag of `paratron generate` that sets it (to name it in messages)."""

DEFAULT_NEW_TOKENS = 64
"""New tokens per completion when --max-new-tokens is not given (fewer when the context has less room)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: text to continue, or a conversation (`messages`) to answer through the chat template."""

    where: str
    """Where it came from, for messages (`--prompt 2`, `FILE line 3`)."""
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class GenerateOptions:
    """`paratron generate`'s own settings (the checkpoint, layout and KV cache are train's flags, in `Config`)."""

    prompts: tuple[Prompt, ...]
    """The prompts of --prompt and --prompt-file (empty when they come from standard input, or with --chat)."""
    from_stdin: bool
    chat: bool
    chat_template: str | None
    """--chat-template as given (None: not given; --chat and conversations then use the tokenizer's own)."""
    sampling: SamplingParams
    max_tokens_given: bool
    """Whether --max-new-tokens was given: a default that does not fit the context is shortened, a given one is
    refused."""
    images: tuple[Path, ...] = ()
    jsonl: bool = False


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `paratron generate` besides train's (the prompts, the sampling, the output)."""
    prompts = parser.add_argument_group("prompts and output")
    prompts.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="Text to continue (repeat for several)."
    )
    prompts.add_argument(
        "--prompt-file",
        metavar="FILE",
        help='Prompts from a file: .jsonl, one {"prompt": TEXT} or {"messages": [...]} a line (a conversation, '
        "answered through the chat template); any other file, one prompt a line. `-` reads standard input (also "
        "read when no prompt is given and it is not a terminal): lines of text, or JSON lines when the first line "
        "starts with {. All prompts run together in the engine; their outputs are printed in order.",
    )
    prompts.add_argument(
        "--chat",
        action="store_true",
        help="A conversation: each line of standard input is the user's next message, answered (streamed) through "
        "the chat template and kept in the history, until the input ends.",
    )
    prompts.add_argument(
        "--chat-template",
        dest="generate_chat_template",  # (not train's --sft setting of the same name)
        metavar="TEMPLATE",
        help="Treat each prompt as a user's message: render it with this template (tokenizer, chatml, llama3 or a "
        "jinja file) and print the assistant's answer, up to its end of turn. --chat and conversations use it too "
        "(default there: tokenizer, the tokenizer's own).",
    )
    prompts.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="An image for a vision-language model (repeat for several): each <image> of the prompt, or else one "
        "before it, stands for one; preprocessed as the checkpoint's processor settings say.",
    )
    prompts.add_argument(
        "--jsonl",
        action="store_true",
        help='Print one JSON object a prompt ({"prompt", "completions": [{"text", "token_ids", '
        '"finish_reason", "logprobs"}]}) instead of the text.',
    )
    _add_sampling_arguments(parser.add_argument_group("sampling"))
    parser.add_argument_group("precision").add_argument(
        "--fp32", dest="precision", action="store_const", const="fp32", default=argparse.SUPPRESS,
        help="Compute in fp32 (default: the checkpoint's precision; --bf16 and --fp16 choose those).",
    )  # fmt: skip


def _add_sampling_arguments(group: Any) -> None:
    defaults = SamplingParams()
    group.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        dest="max_tokens",
        type=int,
        metavar="N",
        help=f"New tokens per completion at most (default: {DEFAULT_NEW_TOKENS}, or what the context has room for; "
        "with --chat, the room left). More than the context holds is refused.",
    )
    floats = (
        ("--temperature", "T", "0 is greedy; above 0 divides the logits before sampling"),
        ("--top-p", "P", "nucleus sampling: sample among the likeliest tokens whose probabilities sum to P"),
        ("--min-p", "P", "drop tokens less likely than P times the likeliest one's probability"),
        ("--repetition-penalty", "R", "above 1 makes every token of the prompt and completion less likely"),
        ("--frequency-penalty", "F", "subtracted from a token's logit once per time the completion holds it"),
        ("--presence-penalty", "F", "subtracted from the logit of every token the completion holds"),
    )
    for flag, metavar, text in floats:
        name = flag[2:].replace("-", "_")
        default = getattr(defaults, name)
        group.add_argument(
            flag,
            type=float,
            default=default,
            metavar=metavar,
            help=f"{text[0].upper()}{text[1:]} (default: {default}).",
        )
    group.add_argument("--top-k", type=int, default=0, metavar="K", help="Sample among the K likeliest (0: all).")
    group.add_argument(
        "--seed",
        dest="sampling_seed",  # (not train's --seed)
        type=int,
        default=0,
        metavar="N",
        help="Seed of the sampling: a prompt samples alike with the same seed, alone or with others (default: 0).",
    )
    group.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="End a completion before this text (repeatable)."
    )
    group.add_argument("--n", type=int, default=1, metavar="COUNT", help="Completions of each prompt (default: 1).")
    group.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="Print each generated token's log-probability (the model's own, before temperature and penalties) "
        "and its K likeliest alternatives (0: none).",
    )


def generate_options(namespace: argparse.Namespace, stdin: TextIO) -> GenerateOptions:
    """The options of parsed flags, checked, with the prompts of --prompt and --prompt-file read (one-line errors)."""
    sampling = SamplingParams(
        max_tokens=DEFAULT_NEW_TOKENS if namespace.max_tokens is None else namespace.max_tokens,
        **{name: getattr(namespace, name) for name in SAMPLING_FLAGS if name not in ("max_tokens", "stop", "seed")},
        seed=namespace.sampling_seed,
        stop=tuple(namespace.stop),
    )
    check_sampling(sampling)
    if namespace.max_tokens is not None and namespace.max_tokens < 1:
        raise ConfigError(f"--max-new-tokens {namespace.max_tokens}: must be at least 1")
    several = len(namespace.prompt) > 1
    prompts = [Prompt(f"--prompt {i}" if several else "--prompt", t) for i, t in enumerate(namespace.prompt, 1)]
    file = namespace.prompt_file
    if file is not None and file != STDIN:
        prompts += read_prompt_file(Path(file))
    from_stdin = file == STDIN or (not prompts and not namespace.chat and not stdin.isatty())
    if namespace.chat:
        if prompts or file is not None:
            raise ConfigError("--chat reads the conversation from standard input; drop --prompt and --prompt-file")
        if namespace.image:
            raise ConfigError("--image with --chat: images go with one prompt; give it with --prompt")
        if namespace.n != 1:
            raise ConfigError(f"--n {namespace.n} with --chat: a conversation keeps one answer a turn; drop --n")
    elif not prompts and not from_stdin:
        raise ConfigError(
            "no prompt: give --prompt TEXT, --prompt-file FILE, prompts on standard input, or --chat for a conversation"
        )
    return GenerateOptions(
        prompts=tuple(prompts),
        from_stdin=from_stdin,
        chat=namespace.chat,
        chat_template=namespace.generate_chat_template,
        sampling=sampling,
        max_tokens_given=namespace.max_tokens is not None,
        images=tuple(Path(p) for p in namespace.image),
        jsonl=namespace.jsonl,
    )


def check_sampling(sampling: SamplingParams) -> None:
    """`SamplingParams.check`, its message naming the flag."""
    try:
        sampling.check()
    except RequestError as exc:
        raise ConfigError(f"{SAMPLING_FLAGS.get(exc.param, exc.param)} {exc.message}") from None


def read_prompt_file(path: Path) -> list[Prompt]:
    """The prompts of a --prompt-file: JSON lines for .jsonl, else one prompt a line."""
    if not path.is_file():
        raise DataError(f"--prompt-file {path}: no such file")
    with open(path, encoding="utf-8") as lines:
        prompts = read_prompt_lines(lines, str(path), path.suffix == ".jsonl")
    if not prompts:
        raise DataError(f"--prompt-file {path}: holds no prompt; write one a line")
    return prompts


def read_prompt_lines(lines: Iterable[str], name: str, jsonl: bool | None = None) -> list[Prompt]:
    """Prompts from lines (blank ones skipped): JSON objects when `jsonl`, text otherwise; None: JSON when the
    first non-blank line starts with `{` (standard input)."""
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl is None:
            jsonl = line.lstrip().startswith("{")
        where = f"{name} line {number}"
        prompts.append(_json_prompt(line, where) if jsonl else Prompt(where, line.rstrip("\r\n")))
    return prompts


def _json_prompt(line: str, where: str) -> Prompt:
    form = 'one object a line, {"prompt": TEXT} or {"messages": [{"role": ..., "content": ...}, ...]}'
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{where}: not JSON ({exc}); {form}") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(where, record["prompt"])
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: neither a "prompt" string nor a "messages" list; {form}')
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
            raise DataError(f'{where}: a message without a "role" and a "content": {json.dumps(message)}; {form}')
    return Prompt(where, messages=tuple(messages))
