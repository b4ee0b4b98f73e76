"""`paratron serve`'s processes: every rank opens its part of the engine; the controller (rank 0) serves HTTP with
uvicorn and runs the engine's thread, the other ranks follow its steps.

Rank 0 takes its port before the model loads, so a port in use is reported at once (on every rank). SIGTERM (or
Ctrl-C) starts uvicorn's graceful shutdown: it stops accepting connections, lets the running requests finish (a
stream to its end), then the application's shutdown finishes the engine's work and closes it, which lets the other
ranks' `follow()` return; the process then exits 0.
"""

from __future__ import annotations

import errno
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import uvicorn
from fastapi import FastAPI

from paratron.config.layout import Layout
from paratron.config.loading import Resolution
from paratron.config.schema import Config
from paratron.data.build import Log
from paratron.distributed.init import initialize, raise_any_failure, shutdown
from paratron.errors import ConfigError
from paratron.inference.engine import Engine
from paratron.inference.http_app import ServerSettings, build_app
from paratron.inference.loading import engine_settings, open_engine


def serve_settings(overrides: dict[str, Any], recipe: str | None) -> Resolution:
    """The settings of `paratron serve`'s flags over the model of the --load checkpoint (`engine_settings`)."""
    return engine_settings(overrides, recipe, "serve", "the model to serve", lambda line: print(line, file=sys.stderr))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), for uvicorn; a ConfigError naming the flag when it cannot
    be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror}); give one") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port {port}: already in use on {host}; choose another, or --port 0 for a free one"
            ) from None
        where = f"--host {host} --port {port}"
        raise ConfigError(f"{where}: cannot listen there ({exc.strerror}); choose another") from None
    sock.listen(2048)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it listens."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready()


def _finish_quietly(signum: int, frame: Any) -> None:
    """After its graceful shutdown uvicorn raises the signal that began it again, for the handler it found: this
    one, so that a terminated server ends with exit code 0."""


def serve_http(app: FastAPI, sock: socket.socket, on_ready: Callable[[], None]) -> None:
    """Serve `app` on `sock` until SIGTERM or SIGINT, then shut down gracefully."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=None)
    server = _Server(config, on_ready)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _finish_quietly) if main else None
    try:
        server.run(sockets=[sock])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def run_server(
    config: Config,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log: Log = print,
    precision: str | None = None,
    layout: Layout | None = None,
) -> None:
    """Serve `config.checkpoint.load` at `config`'s layout (every rank of the job calls this) until terminated;
    in the checkpoint's precision unless `precision` (fp32, bf16, fp16: the user's flag) says. `layout`: the one
    validation worked out (`open_engine`)."""
    owned = not dist.is_initialized()
    ctx = initialize(config.parallel.distributed_backend, config.parallel.distributed_timeout_minutes)
    sock = None
    try:
        failure = None
        if ctx.is_main:
            try:
                sock = listening_socket(host, port)
            except ConfigError as exc:
                failure = exc
        raise_any_failure(failure, "rank 0 could not listen; see its message")
        engine = open_engine(config, log if ctx.is_main else (lambda *a, **k: None), precision, layout)
        if not engine.is_controller:
            signal.signal(signal.SIGTERM, _finish_quietly)  # (the controller ends the engine, and then this rank)
            engine.follow()
            return
        assert sock is not None
        _serve_engine(engine, sock, config, host, api_key, served_model_name, log)
    finally:
        if sock is not None:
            sock.close()
        if owned:
            shutdown()


def _serve_engine(
    engine: Engine,
    sock: socket.socket,
    config: Config,
    host: str,
    api_key: str | None,
    served_model_name: str | None,
    log: Log,
) -> None:
    """The controller's part: the application over the engine, served until terminated; the engine is closed in
    the end whatever happened (the other ranks wait for that)."""
    name = served_model_name or engine.model_name
    app = None
    try:
        app = build_app(engine, ServerSettings(name, api_key, config.data.chat_template))
        port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        where = f"http://{shown}:{port}"
        layout = f"tensor {config.parallel.tensor_model_parallel_size} x pipeline "
        layout += f"{config.parallel.pipeline_model_parallel_size}"
        details = f"context {engine.max_model_len} tokens, KV cache {engine.cache_tokens:,} tokens, {layout}"
        details += ", API key required" if api_key else ""
        serve_http(app, sock, lambda: log(f"serving {name} on {where} ({details})"))
    finally:
        if app is None or not app.state.serving.engine_thread.closed:
            engine.close()
