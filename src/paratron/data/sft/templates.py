"""Chat templates: messages -> the text a chat model is trained on (--chat-template).

Templates are jinja, rendered the way Hugging Face transformers renders them (a sandboxed,
immutable environment with trim_blocks and lstrip_blocks, its `tojson`, `raise_exception` and
`strftime_now`, and its `{% generation %}` tag), so a tokenizer's own template produces here
exactly the text it produces there. A template comes from the tokenizer's files
(`tokenizer`), a built-in (`chatml`, `llama3`) or a jinja file.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from paratron.data.special_tokens import CHAT_TEMPLATE_FILE
from paratron.data.tokenizer import AnyTokenizer, Tokenizer
from paratron.errors import DataError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
FIX = "pass --chat-template chatml, llama3, tokenizer or the path of a jinja file"


class ChatTemplateError(DataError):
    """A template that failed while rendering; `reason` is the failure without a location,
    so that callers can prefix the conversation it failed on."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the chat template failed to render: {reason}")
        self.reason = reason


class GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: marks an assistant turn for its
    own assistant mask. Here assistant turns are found by rendering prefixes instead
    (sft/tokenize.py), so the body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **options: Any) -> str:
    """transformers' tojson: plain json.dumps, without jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **options)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled jinja chat template and the special-token strings it may refer to."""

    def __init__(self, name: str, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.name = name
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise DataError(
                f"--chat-template {name}: jinja syntax error at line {exc.lineno}: {exc.message}; fix the template"
            ) from None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The text of `messages`; any failure inside the template is a ChatTemplateError."""
        variables = {
            **self.special_tokens,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        try:
            return self._compiled.render(**variables)
        except Exception as exc:  # a template is a user's program: whatever it raises is theirs
            raise ChatTemplateError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r})"


def load_chat_template(
    spec: str,
    tokenizer_path: str | Path | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
) -> ChatTemplate:
    """--chat-template SPEC: `tokenizer` (the tokenizer's own), `chatml`, `llama3`, or a jinja file.

    Special tokens come from the tokenizer's tokenizer_config.json when it has one, else
    from `bos_token`/`eos_token`/`pad_token`."""
    folder = _tokenizer_folder(tokenizer_path)
    config = _read_config(folder / "tokenizer_config.json") if folder is not None else {}
    given = (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token))
    specials = {k: v for k, v in given if v is not None}
    specials.update(_special_tokens(config))
    if spec == "tokenizer":
        name, source = _tokenizer_template(folder, config)
    elif spec in BUILTIN_TEMPLATES:
        name, source = spec, BUILTIN_TEMPLATES[spec]
    else:
        name, source = spec, _read_template_file(spec)
    return ChatTemplate(name, source, specials)


def _tokenizer_folder(tokenizer_path: str | Path | None) -> Path | None:
    if tokenizer_path is None:
        return None
    path = Path(tokenizer_path).expanduser()
    return path if path.is_dir() else path.parent


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not readable JSON ({exc}); fix or remove the file") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object; fix or remove the file")
    return config


def _special_tokens(config: dict) -> dict[str, str]:
    """Special tokens as tokenizer_config.json writes them: strings, or {"content": ...} objects."""
    out = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _tokenizer_template(folder: Path | None, config: dict) -> tuple[str, str]:
    if folder is None:
        raise DataError(f"--chat-template tokenizer needs a Hugging Face tokenizer (--tokenizer-model); or {FIX}")
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return str(jinja_file), _read_text(jinja_file)
    where = folder / "tokenizer_config.json"
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(
                f"--chat-template tokenizer: {where} names templates {', '.join(map(str, named))} but no "
                f"'default'; pass one of them as a jinja file, or {FIX}"
            )
        template = named["default"]
    if not isinstance(template, str):
        raise DataError(
            f"--chat-template tokenizer: {folder} has no chat template (no chat_template.jinja and no "
            f"'chat_template' in tokenizer_config.json); {FIX}"
        )
    return str(where), template


def _read_template_file(spec: str) -> str:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"--chat-template {spec}: no such file; {FIX}")
    return _read_text(path)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"--chat-template {path}: byte {exc.start} is not valid UTF-8; save it as UTF-8") from None


def tokenizer_chat_template(spec: str, tokenizer: AnyTokenizer) -> ChatTemplate:
    """--chat-template SPEC for this tokenizer: its own files hold the template `tokenizer` names,
    and the special tokens it declares (special_tokens.py) are the template's bos_token, eos_token
    and pad_token."""
    if not isinstance(tokenizer, Tokenizer):
        raise DataError("--sft needs a Hugging Face tokenizer (its character offsets locate the assistant turns)")
    special = tokenizer.special
    bos, eos, pad = (tokenizer.token(i) for i in (special.bos_token_id, special.eos_token_id, special.pad_token_id))
    return load_chat_template(spec, tokenizer.source or None, bos, eos, pad)


_ANSWER = "\x1fparatron answer\x1f"
"""Stands for an assistant's answer when rendering a template to see what follows one."""


def chat_stop_ids(template: ChatTemplate, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end a chat answer: the tokenizer's stop ids and the special token the template
    closes an assistant turn with (ChatML's <|im_end|>, Llama 3's <|eot_id|>, ...), found by
    rendering a short conversation and reading the first token after the answer."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _ANSWER}]
    try:
        rendered = template.render(messages)
    except ChatTemplateError:  # a template that refuses this conversation declares no end of turn
        return tokenizer.stop_ids
    if _ANSWER not in rendered:
        return tokenizer.stop_ids
    after = rendered[rendered.rindex(_ANSWER) + len(_ANSWER) :].lstrip()
    ids = tokenizer.hf.encode(after, add_special_tokens=False).ids[:1]
    added = tokenizer.hf.get_added_tokens_decoder()
    end_of_turn = [i for i in ids if i in added and added[i].special]
    return tuple(dict.fromkeys((*tokenizer.stop_ids, *end_of_turn)))
