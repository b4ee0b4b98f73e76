"""The engine's own thread in a server: HTTP handlers hand requests over through a queue, outputs come back.

The engine is not thread-safe, so one thread runs it: it takes the handlers' commands (add, abort, stop) from a
thread-safe queue, steps the engine while any request waits or runs (continuous batching: each step serves every
running request) and posts each request's outputs to the asyncio queue of the handler that submitted it
(`loop.call_soon_threadsafe`). Idle, it waits on the queue and calls `engine.keep_alive()` about every second, so
that the other ranks of a tensor- or pipeline-parallel engine, waiting in a collective, do not time out. Stopping
finishes the running requests, then closes the engine (the other ranks' `follow()` returns).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from paratron.inference.engine import Engine
from paratron.inference.params import RequestOutput, SamplingParams
from paratron.inference.runner import KEEP_ALIVE_S

log = logging.getLogger(__name__)

ACCEPTED = "accepted"
"""The first item a submission's queue receives when the engine took all its prompts."""


class EngineFailed(RuntimeError):
    """The engine's thread stopped on an internal failure; the server answers 500 from then on."""


@dataclass
class Submission:
    """One HTTP request's prompts on their way to the engine (all with the same parameters). Its queue receives
    ACCEPTED or the exception that refused them, then (prompt index, RequestOutput) as they advance."""

    prompts: list[list[int]]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_ids: list[str] = field(default_factory=list)

    def post(self, item: Any) -> None:
        """Hand `item` to the handler's event loop (from the engine's thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening any more
            pass


def snapshot(output: RequestOutput) -> RequestOutput:
    """A copy the handler may read while the engine goes on growing the original's lists."""
    completions = [
        dataclasses.replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in output.completions
    ]
    scored = None if output.prompt_logprobs is None else list(output.prompt_logprobs)
    return dataclasses.replace(output, completions=completions, prompt_logprobs=scored)


class EngineThread:
    """Runs `engine` in a thread of its own, for the handlers of one server."""

    def __init__(self, engine: Engine, idle_s: float = KEEP_ALIVE_S) -> None:
        self.engine, self.idle_s = engine, idle_s
        self.inbox: queue.Queue = queue.Queue()
        self.live: dict[str, tuple[Submission, int]] = {}
        self.failure: BaseException | None = None
        self.closed = False
        self.aborted = 0
        """Requests dropped before their end because their client left."""
        self.stats: dict[str, int] = {}
        """What /health reports, written by the engine's thread after each step (read without a lock: a dict
        replaced whole)."""
        self.thread = threading.Thread(target=self._run, name="paratron-engine", daemon=True)

    def start(self) -> None:
        self._note_stats()
        self.thread.start()

    def submit(self, submission: Submission) -> None:
        """Queue `submission`'s prompts for the engine (EngineFailed once the engine has failed)."""
        self._check_alive()
        self.inbox.put(("add", submission))
        if self.failure is not None:  # (it failed while this one was on its way: answer it too)
            self._fail_everyone(self.failure)

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests (those already finished are ignored), freeing their cache blocks."""
        if self.thread.is_alive():
            self.inbox.put(("abort", list(request_ids)))

    def stop(self) -> None:
        """Finish the running requests, close the engine and wait for the thread to end."""
        if self.thread.is_alive():
            self.inbox.put(("stop", None))
            self.thread.join()

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise EngineFailed(f"the engine failed ({type(self.failure).__name__}: {self.failure}); see the log")
        if not self.thread.is_alive():
            raise EngineFailed("the engine has stopped (the server is shutting down)")

    def _run(self) -> None:
        stopping = False
        try:
            while not stopping or self.engine.has_work():
                stopping = self._take_commands(wait=not self.engine.has_work() and not stopping) or stopping
                if self.engine.has_work():
                    outputs = self.engine.step()
                    self._note_stats()  # (before the clients hear of the step: what they read next includes it)
                    self._dispatch(outputs)
                self._note_stats()
        except BaseException as exc:  # an engine bug: every waiting client hears of it, nobody hangs
            log.exception("the engine failed")
            self.failure = exc
            self._fail_everyone(exc)
        finally:
            self.engine.close()
            self.closed = True

    def _note_stats(self) -> None:
        engine = self.engine
        self.stats = {
            "requests": len(self.live),
            "cache_tokens": engine.cache_tokens,
            "free_cache_tokens": engine.free_cache_tokens,
            "aborted_requests": self.aborted,
        }

    def _take_commands(self, wait: bool) -> bool:
        """Carry out the queued commands (waiting up to idle_s for one when `wait`); whether one said stop."""
        stop = False
        try:
            command = self.inbox.get(timeout=self.idle_s) if wait else self.inbox.get_nowait()
        except queue.Empty:
            if wait:
                self.engine.keep_alive()
            return False
        while True:
            kind, payload = command
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self._abort(payload)
            else:
                stop = True
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return stop

    def _add(self, submission: Submission) -> None:
        """All of a submission's prompts join, or none: a refused one withdraws those added before it."""
        added: list[str] = []
        try:
            for prompt in submission.prompts:
                added.append(self.engine.add_request(prompt, submission.params))
        except Exception as exc:  # (a RequestError says which field; anything else is answered as a failure)
            for request_id in added:
                self.engine.abort(request_id)
            submission.post(exc)
            return
        submission.request_ids = added
        for index, request_id in enumerate(added):
            self.live[request_id] = (submission, index)
        submission.post(ACCEPTED)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.live.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                self.aborted += 1

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            entry = self.live.get(output.request_id)
            if entry is None:  # (aborted by its client)
                continue
            submission, index = entry
            submission.post((index, snapshot(output)))
            if output.finished:
                del self.live[output.request_id]

    def _fail_everyone(self, exc: BaseException) -> None:
        failed = EngineFailed(f"the engine failed ({type(exc).__name__}: {exc}); see the server's log")
        for submission, _ in list(self.live.values()):
            submission.post(failed)
        self.live.clear()
        while True:
            try:
                kind, payload = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                payload.post(failed)
