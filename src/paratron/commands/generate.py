"""`paratron generate`: prompts continued by the inference engine, at any layout.

Every prompt is queued at once and the engine batches them (continuous batching); outputs are printed in the
prompts' order. One prompt with one completion is streamed to the terminal as its tokens come; `--chat` holds a
conversation read line by line from standard input, each answer streamed and kept in the history. Only the
controller rank (the one that schedules and samples) reads prompts and prints; the other ranks follow its steps.
"""

from __future__ import annotations

import argparse
import functools
import json
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import torch
import torch.distributed as dist

from paratron.commands.launching import check_and_launch
from paratron.config.arguments import ArgumentParser, Takes, add_config_arguments, parse_config_arguments
from paratron.config.layout import Layout
from paratron.config.loading import Resolution
from paratron.config.schema import Config
from paratron.data.sft import chat_stop_ids, tokenizer_chat_template
from paratron.data.vision.llava import encode_prompt, with_placeholders
from paratron.data.vision.settings import image_settings
from paratron.distributed.init import initialize, shutdown
from paratron.errors import CheckpointError, ConfigError, UserError
from paratron.inference.engine import Engine
from paratron.inference.generate_options import (
    SAMPLING_FLAGS,
    GenerateOptions,
    Prompt,
    add_generate_arguments,
    generate_options,
    read_prompt_lines,
)
from paratron.inference.loading import engine_settings, open_engine
from paratron.inference.params import Completion, RequestError, RequestOutput, SamplingParams
from paratron.inference.runner import KEEP_ALIVE_S

GENERATE_TAKES = (
    ("load", "ckpt_format", "data_cache_path", "precision"),
    ("image_processor", "use_tiling", "max_num_tiles", "use_thumbnail"),
    ("kv_cache_gb", "kv_cache_tokens", "kv_block_size", "max_batch_tokens", "max_running_requests"),
    ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id"),
    ("rdzv_timeout_seconds", "distributed_backend", "distributed_timeout_minutes"),
    ("tensor_model_parallel_size", "pipeline_model_parallel_size"),
)
"""The settings `paratron generate` uses (train's flags): the checkpoint, its precision, the images' preprocessing,
the engine's KV cache and batching, and the layout it runs at; the model and tokenizer come from the checkpoint."""


def parser() -> argparse.ArgumentParser:
    """train's flags that generate uses (GENERATE_TAKES), and its own (prompts, sampling, output)."""
    parser = ArgumentParser(prog="paratron generate", allow_abbrev=False)
    takes = Takes(
        "paratron generate",
        fields=sum(GENERATE_TAKES, ()),
        why=(("model", "paratron generate takes the model from the checkpoint (--load); drop the model flags"),),
    )
    add_config_arguments(parser, takes)
    add_generate_arguments(parser)
    parser.usage = (
        "paratron generate --load CKPT (--prompt TEXT... | --prompt-file FILE | --chat) [sampling flags] [flags]"
    )
    parser.description = (
        "Continue prompts with a saved model (a paratron or Megatron-LM checkpoint, or a Hugging Face folder) at any "
        "layout (--nproc, tensor and pipeline parallelism). All prompts run together in the inference engine "
        "(continuous batching) and are printed in order; a lone prompt is streamed as it is generated; --chat holds "
        "a conversation read from standard input."
    )
    return parser


def run(argv: list[str]) -> int:
    """`paratron generate ARGV`: the prompts read and the flags checked, then the workers launched, or this
    process generates (a worker, or the only process)."""
    recipe, overrides, namespace = parse_config_arguments(parser(), argv)
    options = generate_options(namespace, sys.stdin)  # (files read and flags checked before any worker starts)
    resolution = generate_settings(overrides, recipe)
    launched, config, layout = check_and_launch(resolution.config, ["generate", *argv], resolution.origins)
    if launched is not None:
        return launched
    return generate(config, options, sys.stdin, precision=overrides.get("precision"), layout=layout)


def _aside(message: str) -> None:
    """Progress goes to standard error, so that standard output is the generated text alone."""
    print(message, file=sys.stderr)


"""While waiting for the user's next line, the controller lets the other ranks know it is alive this often."""


@dataclass(frozen=True)
class Request:
    """A prompt ready for the engine: its token ids, sampling, images, and the text printed before its output."""

    prompt: Prompt
    ids: list[int]
    params: SamplingParams
    images: torch.Tensor | None
    echo: str
    """The prompt's text for plain continuations (printed before them); empty for chat answers."""


def generate_settings(overrides: dict[str, Any], recipe: str | None) -> Resolution:
    """The settings of `paratron generate`'s flags over the model of the --load checkpoint (`engine_settings`)."""
    return engine_settings(overrides, recipe, "generate", "the model to generate with", _aside)


def generate(
    config: Config,
    options: GenerateOptions,
    stdin: TextIO,
    precision: str | None = None,
    layout: Layout | None = None,
) -> int:
    """Open the --load checkpoint's engine on this process's ranks and generate (controller) or follow (others);
    in the checkpoint's precision unless `precision` (--bf16, --fp16, --fp32) says. `layout`: the one validation
    worked out (`open_engine`)."""
    owned = not dist.is_initialized()
    initialize(config.parallel.distributed_backend, config.parallel.distributed_timeout_minutes)
    try:
        engine = open_engine(config, log=_aside, precision=precision, layout=layout)
        if not engine.is_controller:
            engine.follow()
            return 0
        try:
            generation = Generation(engine, options, config)
            if options.chat:
                generation.converse(stdin)
            else:
                prompts = list(options.prompts)
                if options.from_stdin:
                    prompts += read_prompt_lines(stdin, "standard input")
                if not prompts:
                    raise ConfigError("standard input holds no prompt; write one a line, or give --prompt TEXT")
                generation.complete(prompts)
        finally:
            engine.close()
    finally:
        if owned:
            shutdown()
    return 0


class Generation:
    """The controller's side: prompts to token ids, requests through the engine, outputs to the terminal."""

    def __init__(self, engine: Engine, options: GenerateOptions, config: Config) -> None:
        if engine.tokenizer is None:
            raise CheckpointError(
                f"{config.checkpoint.load}: holds no tokenizer (trained on mock data), so text cannot be encoded"
            )
        self.engine, self.options, self.config = engine, options, config
        self.tokenizer = engine.tokenizer

    @functools.cached_property
    def template(self) -> Any:
        """The chat template: --chat-template, by default the tokenizer's own."""
        return tokenizer_chat_template(self.options.chat_template or "tokenizer", self.tokenizer)

    @functools.cached_property
    def turn_stop_ids(self) -> tuple[int, ...]:
        """The ids that end an answer: the template's end of turn and the tokenizer's end tokens."""
        return chat_stop_ids(self.template, self.tokenizer)

    def complete(self, prompts: Sequence[Prompt]) -> None:
        """Continue every prompt (one batch in the engine); stream a lone one, else print them in order."""
        requests = [self.request(prompt) for prompt in prompts]
        if self.options.jsonl:
            for request, output in zip(requests, self.run(requests)):
                print(json.dumps(self.record(request, output)), flush=True)
        elif len(requests) == 1 and self.options.sampling.n == 1:
            self.stream(requests[0])
        else:
            outputs = self.run(requests)
            for request, output in zip(requests, outputs):
                for completion in output.completions:
                    which = f", completion {completion.index + 1}" if len(output.completions) > 1 else ""
                    print(f"--- {request.prompt.where}{which} ---")
                    print(request.echo + completion.text)
                    self.print_logprobs(completion)

    def converse(self, stdin: TextIO) -> None:
        """A conversation: each line of `stdin` is the user's turn; each answer is streamed and kept."""
        history: list[dict[str, Any]] = []
        for turn, line in enumerate(_lines_kept_alive(stdin, self.engine, prompt_marker=stdin.isatty()), 1):
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.rstrip("\r\n")})
            answer = self.stream(self.request(Prompt(f"turn {turn}", messages=tuple(history))))
            history.append({"role": "assistant", "content": answer.text})

    def request(self, prompt: Prompt) -> Request:
        """The prompt rendered (chat template for conversations and --chat-template), encoded and checked."""
        images = list(self.options.images)
        echo = ""
        if prompt.messages is not None:
            text = self.template.render(list(prompt.messages), add_generation_prompt=True)
        elif self.options.chat_template:  # (its placeholders inside the user's turn)
            user = {"role": "user", "content": with_placeholders(prompt.text or "", len(images))}
            text = self.template.render([user], add_generation_prompt=True)
        else:
            text = echo = prompt.text or ""
        pixels = None
        if images:
            if not self.config.model.has_vision:
                load = self.config.checkpoint.load
                raise ConfigError(f"--image: the model of {load} has no vision encoder; drop --image")
            settings = image_settings(self.config, self.tokenizer)
            ids, pixels = encode_prompt(text, images, self.tokenizer, settings)
        else:
            ids = self.tokenizer.encode(text)
        if not ids:
            raise UserError(f"{prompt.where}: an empty prompt; give some text to continue")
        params = replace(self.options.sampling, max_tokens=self.new_tokens(prompt, len(ids)))
        if prompt.messages is not None or self.options.chat_template:
            params = replace(params, stop_token_ids=self.turn_stop_ids)
        return Request(prompt, ids, params, pixels, echo)

    def new_tokens(self, prompt: Prompt, prompt_tokens: int) -> int:
        """--max-new-tokens if the context has room for it (else a one-line refusal with the numbers); when not
        given, the default (all the room left, in a conversation) shortened to the room left."""
        context, given = self.engine.max_model_len, self.options.max_tokens_given
        room = context - prompt_tokens
        asked = self.options.sampling.max_tokens if given else 1
        if room < 1 or asked > room:
            if room > 0:
                fix = f"ask for at most {room} (--max-new-tokens)"
            else:
                fix = "start a new conversation" if self.options.chat else "shorten it"
            raise UserError(
                f"{prompt.where}: {prompt_tokens} prompt tokens + {asked} new ones exceed the model's context of "
                f"{context} tokens; {fix}"
            )
        if given:
            return asked
        return room if self.options.chat else min(self.options.sampling.max_tokens, room)

    def run(self, requests: Sequence[Request], on_output: Callable[[RequestOutput], None] | None = None) -> list:
        """Queue every request, step the engine until all are done; the final outputs in the requests' order."""
        for request in requests:  # (all checked before any is queued)
            try:
                self.engine.check_request(request.ids, request.params)
            except RequestError as exc:
                flag_name = SAMPLING_FLAGS.get(exc.param, exc.param)
                raise UserError(f"{request.prompt.where}: {flag_name} {exc.message}") from None
        ids = [self.engine.add_request(r.ids, r.params, images=r.images) for r in requests]
        latest: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for output in self.engine.step():
                latest[output.request_id] = output
                if on_output is not None:
                    on_output(output)
        return [latest[i] for i in ids]

    def stream(self, request: Request) -> Completion:
        """Print the request's one completion as its text becomes final; its log-probabilities after it."""
        print(request.echo, end="", flush=True)
        shown = 0

        def show(output: RequestOutput) -> None:
            nonlocal shown
            text = output.completions[0].text
            print(text[shown:], end="", flush=True)
            shown = len(text)

        [output] = self.run([request], show)
        print(flush=True)
        completion = output.completions[0]
        self.print_logprobs(completion)
        return completion

    def piece(self, token_id: int) -> str:
        """A token's text, quoted (spaces and line breaks shown)."""
        return json.dumps(self.tokenizer.decode([token_id]), ensure_ascii=False)

    def print_logprobs(self, completion: Completion) -> None:
        """One line a generated token: its text, log-probability and likeliest alternatives (--logprobs K)."""
        if not completion.logprobs:
            return
        print("log-probabilities (token, log-probability, likeliest tokens):")
        for entry in completion.logprobs:
            top = "  ".join(f"{self.piece(t)} {p:.6f}" for t, p in entry.top)
            print(f"  {self.piece(entry.token_id)}\t{entry.logprob:.6f}" + (f"\t{top}" if top else ""))

    def record(self, request: Request, output: RequestOutput) -> dict[str, Any]:
        """The --jsonl object of a prompt's output."""
        prompt = request.prompt.text if request.prompt.messages is None else list(request.prompt.messages)
        completions = []
        for c in output.completions:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [
                    {"token_id": e.token_id, "token": self.tokenizer.decode([e.token_id]), "logprob": e.logprob,
                     "top": [[t, p] for t, p in e.top]}
                    for e in c.logprobs
                ]  # fmt: skip
            completions.append(
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "logprobs": logprobs}
            )
        return {"prompt": prompt, "completions": completions}


def _lines_kept_alive(stream: TextIO, engine: Engine, prompt_marker: bool) -> Iterator[str]:
    """The lines of `stream` as the user types them; while waiting, the engine's other ranks are told it is alive
    (they wait in a collective). `prompt_marker`: show "> " on the terminal before each line."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="paratron-chat-input", daemon=True).start()
    while True:
        if prompt_marker:
            print("> ", end="", file=sys.stderr, flush=True)
        line = _next_line(lines, engine)
        if line is None:
            return
        yield line


def _next_line(lines: queue.Queue[str | None], engine: Engine) -> str | None:
    while True:
        try:
            return lines.get(timeout=KEEP_ALIVE_S)
        except queue.Empty:
            engine.keep_alive()
