"""`paratron serve`'s HTTP application: OpenAI's completions, chat completions and models routes, a health route and
the tokenizer routes lm-evaluation-harness' `local-completions` model reads with `tokenizer_backend=remote`.

`build_app(engine, settings)` makes a FastAPI application over an `Engine` (run by uvicorn, or by starlette's
TestClient in tests). The engine runs in a thread of its own (`engine_thread`), started and stopped with the
application (its lifespan): handlers turn a request into token ids and `SamplingParams`, hand them over, and answer
with the outputs as they come: whole, or streamed as server-sent events ending with `data: [DONE]`. A client that
goes away mid-request has its requests aborted (their KV-cache blocks freed). Every failure answers with OpenAI's
error body; the server goes on serving the others.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from paratron.data.sft import chat_stop_ids, tokenizer_chat_template
from paratron.errors import UserError
from paratron.inference import openai_api as api
from paratron.inference.engine import Engine
from paratron.inference.engine_thread import ACCEPTED, EngineFailed, EngineThread, Submission
from paratron.inference.params import RequestError, SamplingParams
from paratron.inference.replies import ChatReply, CompletionReply, Reply


@dataclass(frozen=True)
class ServerSettings:
    """How one server presents its model."""

    model_name: str
    """The name /v1/models lists and requests must name (or leave out)."""
    api_key: str | None = None
    """With a key, every route but /health wants `Authorization: Bearer KEY`."""
    chat_template: str = "tokenizer"
    """The chat template of /v1/chat/completions (as --chat-template: tokenizer, chatml, llama3 or a jinja file)."""


class Unauthorized(Exception):
    """A request without the server's API key."""


class Serving:
    """What the routes share: the engine's thread, the tokenizer, the request limits and the chat template."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.settings, self.engine_thread = settings, EngineThread(engine)
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        limits = engine.settings
        self.max_prompt_tokens = limits.max_prompt_tokens or engine.max_model_len - 1
        self.max_request_tokens = limits.max_request_tokens or engine.max_model_len
        self.max_request_n = limits.max_request_n
        self.texts = api.TokenTexts(self.tokenizer.decode)
        self.created = int(time.time())
        self.template, self.template_error, self.end_ids = None, "", ()
        try:
            self.template = tokenizer_chat_template(settings.chat_template, self.tokenizer)
            self.end_ids = chat_stop_ids(self.template, self.tokenizer)
        except UserError as exc:
            if settings.chat_template != "tokenizer":  # (one the user named must work)
                raise
            self.template_error = f"{exc} (the server serves completions only)"

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise RequestError(
                "model", f"the model `{model}` does not exist; this server serves `{self.settings.model_name}`", 404
            )

    def max_tokens(self, requested: int | None, prompts: list[list[int]]) -> int:
        """A request's max_tokens within the server's limit; None: as many as the longest prompt leaves room for."""
        limit = self.max_request_tokens
        if requested is None:
            return max(0, min(limit, self.max_model_len - max(len(p) for p in prompts)))
        if requested > limit:
            raise RequestError(
                "max_tokens", f"{requested} is more than this server's limit of {limit} (--max-request-tokens)"
            )
        return requested

    def check_limits(self, prompts: list[list[int]], n: int, field: str) -> None:
        """The server's limits on a prompt's length and on n (the engine checks the context and the cache)."""
        if n > self.max_request_n:
            raise RequestError("n", f"{n} is more than this server's limit of {self.max_request_n} (--max-request-n)")
        longest = max(len(p) for p in prompts)
        if longest > self.max_prompt_tokens:
            raise RequestError(
                field,
                f"{longest} tokens, more than this server's limit of {self.max_prompt_tokens} (the model's context "
                f"holds {self.max_model_len}; --max-prompt-tokens sets the limit)",
            )

    async def submit(self, prompts: list[list[int]], params: SamplingParams) -> Submission:
        """Hand the prompts to the engine; once it took them all, their submission (else its refusal, raised)."""
        submission = Submission(prompts, params, asyncio.get_running_loop())
        self.engine_thread.submit(submission)
        reply = await submission.queue.get()
        if reply != ACCEPTED:
            raise reply
        return submission

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _authorized(request: Request) -> None:
    key = _serving(request).settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise Unauthorized()


class _EngineStream(StreamingResponse):
    """Server-sent events; whichever way the response ends (done, or the client gone), `on_end` runs."""

    def __init__(self, events: AsyncIterator[str], on_end: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read: what arrives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer(reply: Reply, request: Request, stream: bool) -> Response:
    """The reply to a submitted request: streamed, or whole once every prompt is done (aborted if the client
    leaves first)."""
    serving = _serving(request)

    def abort() -> None:
        serving.engine_thread.abort(reply.submission.request_ids)

    if stream:
        return _EngineStream(reply.events(), abort)
    collecting = asyncio.ensure_future(reply.whole())
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            abort()
    if collecting.cancelled():
        return Response(status_code=499)  # (nobody reads it)
    return JSONResponse(collecting.result())


router = APIRouter(dependencies=[Depends(_authorized)])


@router.post("/v1/completions")
async def completions(body: api.CompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    serving.check_model(body.model)
    prompts = body.prompts(serving.encode)
    serving.check_limits(prompts, body.n, "prompt")
    params = body.params(serving.max_tokens(body.max_tokens, prompts))
    submission = await serving.submit(prompts, params)
    texts = body.prompt_texts(prompts, serving.tokenizer.decode)
    reply = CompletionReply(submission, body, serving.settings.model_name, serving.texts, texts)
    return await _answer(reply, request, body.stream)


@router.post("/v1/chat/completions")
async def chat_completions(body: api.ChatRequest, request: Request) -> Response:
    serving = _serving(request)
    serving.check_model(body.model)
    if serving.template is None:
        raise RequestError("messages", f"this server has no chat template: {serving.template_error}")
    prompts = [body.prompt(serving.template, serving.encode)]
    serving.check_limits(prompts, body.n, "messages")
    params = body.params(serving.max_tokens(body.requested_tokens, prompts), serving.end_ids)
    submission = await serving.submit(prompts, params)
    reply = ChatReply(submission, body, serving.settings.model_name, serving.texts)
    return await _answer(reply, request, body.stream)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    serving = _serving(request)
    card = {
        "id": serving.settings.model_name,
        "object": "model",
        "created": serving.created,
        "owned_by": "paratron",
        "max_model_len": serving.max_model_len,
    }
    return {"object": "list", "data": [card]}


@router.post("/tokenize")
async def tokenize(body: api.TokenizeRequest, request: Request) -> dict:
    serving = _serving(request)
    serving.check_model(body.model)
    if body.messages is not None:
        if serving.template is None:
            raise RequestError("messages", f"this server has no chat template: {serving.template_error}")
        rendered = api.template_messages(body.messages)
        ids = serving.encode(serving.template.render(rendered, add_generation_prompt=True))
    elif body.prompt is not None:
        ids = serving.encode(body.prompt)
    else:
        raise RequestError("prompt", "give a prompt (a text) or messages")
    bos = getattr(serving.tokenizer, "bos_id", None)
    if body.add_special_tokens and bos is not None:
        ids = [bos, *ids]
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: api.DetokenizeRequest, request: Request) -> dict:
    serving = _serving(request)
    serving.check_model(body.model)
    vocab = serving.tokenizer.vocab_size
    outside = [t for t in body.tokens if not 0 <= t < vocab]
    if outside:
        raise RequestError("tokens", f"token id {outside[0]} is outside the vocabulary (0..{vocab - 1})")
    return {"prompt": serving.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    serving = _serving(request)
    tokenizer = serving.tokenizer
    special = getattr(tokenizer, "special", None)

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else serving.texts(token_id)

    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": text(getattr(tokenizer, "eod_id", None)),
        "bos_token": text(getattr(tokenizer, "bos_id", None)),
        "pad_token": text(special.pad_token_id if special is not None else None),
        "chat_template": serving.template.source if serving.template is not None else None,
        "model_max_length": serving.max_model_len,
        "vocab_size": tokenizer.vocab_size,
    }


async def health(request: Request) -> JSONResponse:
    """Whether the engine runs, with its KV cache's free room (no key needed: for load balancers)."""
    thread = _serving(request).engine_thread
    ok = thread.failure is None and thread.thread.is_alive()
    return JSONResponse({"status": "ok" if ok else "failed", **thread.stats}, status_code=200 if ok else 503)


def _error(status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "") -> Response:
    return JSONResponse(api.error_body(message, param, code, kind or api.INVALID_REQUEST), status_code=status)


def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    """FastAPI's 422 as OpenAI's 400, naming the first field at fault."""
    first = exc.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return _error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not where:
        return _error(400, f"the body {first['msg'].lower()}: send a JSON object")
    fields = [part for part in where if not _type_tag(part)] or where
    shown = repr(first.get("input"))
    shown = shown if len(shown) < 80 else shown[:77] + "..."
    if len(fields) < len(where):  # (a union's members each refused it)
        return _error(400, f"{'.'.join(fields)}: {shown} is of none of the types it takes", fields[0])
    return _error(400, f"{'.'.join(fields)}: {first['msg']} (got {shown})", fields[0])


def _type_tag(part: str) -> bool:
    """Whether a part of a pydantic error's location names a member of a union type (`str`, `list[int]`), not a
    field."""
    return part in ("str", "int", "float", "bool") or "[" in part


def _handlers() -> dict:
    return {
        RequestError: lambda _, exc: _error(exc.status, str(exc), exc.param),
        UserError: lambda _, exc: _error(400, str(exc)),
        RequestValidationError: _validation_error,
        Unauthorized: lambda _, exc: _error(
            401, "a valid API key is needed: send `Authorization: Bearer KEY`", code="invalid_api_key"
        ),
        EngineFailed: lambda _, exc: _error(500, str(exc), kind="server_error"),
        HTTPException: lambda _, exc: _error(exc.status_code, str(exc.detail)),
    }


def build_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """The application over `engine` (its controller rank); the engine's thread runs while the application does
    and closes the engine when it stops."""
    serving = Serving(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving.engine_thread.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, serving.engine_thread.stop)

    # (no /docs, /redoc or /openapi.json: every route but /health is behind the key, and these would not be)
    app = FastAPI(
        title="paratron",
        lifespan=lifespan,
        exception_handlers=_handlers(),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.serving = serving
    app.include_router(router)
    app.add_api_route("/health", health, methods=["GET"])
    return app
