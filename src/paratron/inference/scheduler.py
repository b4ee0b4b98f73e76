"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step first gives each decoding sequence its next token, then fills the rest of the step's token budget
(--max-batch-tokens) with prompts: first those already under way, then waiting ones in arrival order, a long
prompt in pieces across steps. A request joins at the next step after it arrives and leaves the step it finishes.
When the cache has no free block for a growing sequence, the sequence admitted last is preempted: its blocks are
given back and it waits at the head of the queue, to be computed again (prompt and tokens so far) when room frees.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from paratron.inference.kv_cache import BlockPool
from paratron.inference.params import Completion, SamplingParams
from paratron.inference.text import IncrementalText


@dataclass(eq=False)
class Sequence:
    """One completion of a request: its tokens (prompt, then generated) and where their keys are cached."""

    request_id: str
    params: SamplingParams
    tokens: list[int]
    prompt_length: int
    completion: Completion
    text: IncrementalText
    generator: torch.Generator | None = None
    images: torch.Tensor | None = None
    score_prompt: bool = False
    """This sequence's prefill scores the prompt (`prompt_logprobs`; the request's first completion, once)."""
    computed: int = 0
    """Tokens whose keys and values are in the cache."""
    blocks: list[int] = field(default_factory=list)
    admitted: int = -1
    """When it was last admitted (preemption takes the latest first)."""

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]


@dataclass
class Scheduled:
    """A sequence's part of a step: tokens[start : start + count] run; `samples` when they reach its end."""

    sequence: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.sequence.tokens)


class Scheduler:
    """The waiting and running sequences and the cache's blocks (the controller's bookkeeping)."""

    def __init__(self, pool: BlockPool, max_batch_tokens: int, max_running: int) -> None:
        self.pool, self.max_batch_tokens, self.max_running = pool, max_batch_tokens, max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        self.preemptions = 0
        """Sequences preempted so far (each computed again later)."""

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def remove(self, sequence: Sequence) -> None:
        """Drop a finished or aborted sequence, giving its blocks back."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.pool.give_back(sequence.blocks)
        sequence.blocks = []

    def schedule(self) -> list[Scheduled]:
        """The next step's work (empty when there is none)."""
        step: list[Scheduled] = []
        budget = self.max_batch_tokens
        for sequence in list(self.running):  # decoding sequences first, each its next token
            if sequence not in self.running or sequence.computed < len(sequence.tokens) - 1:
                continue
            if not self._grow(sequence, sequence.computed + 1, step):
                continue
            step.append(Scheduled(sequence, sequence.computed, 1))
            budget -= 1
        under_way = [s for s in self.running if s.computed < len(s.tokens) - 1]
        for sequence in under_way + list(self.waiting):
            if budget <= 0:
                break
            if any(s.sequence is sequence for s in step):  # (preempted and queued again in this loop)
                continue
            fresh = sequence not in self.running
            if fresh and len(self.running) >= self.max_running:
                break
            remaining = len(sequence.tokens) - sequence.computed
            count = remaining if sequence.images is not None else min(remaining, budget)  # (images: never in pieces)
            if count > budget and step:
                break
            if not self._grow(sequence, sequence.computed + count, step, admit=fresh):
                break
            if fresh:
                self.waiting.remove(sequence)
                self.running.append(sequence)
                sequence.admitted, self._admissions = self._admissions, self._admissions + 1
            step.append(Scheduled(sequence, sequence.computed, count))
            budget -= count
        return step

    def _grow(self, sequence: Sequence, tokens: int, step: list[Scheduled], admit: bool = False) -> bool:
        """Give `sequence` the blocks for `tokens` tokens, preempting running sequences not in `step` (latest first)
        when the pool runs dry; False when that cannot be done (a waiting sequence never preempts)."""
        needed = self.pool.blocks_for(tokens) - len(sequence.blocks)
        while needed > self.pool.num_free:
            if admit:
                return False
            busy = {id(s.sequence) for s in step}
            victims = [s for s in self.running if id(s) not in busy and s is not sequence]
            if not victims:
                self._preempt(sequence)
                return False
            self._preempt(max(victims, key=lambda s: s.admitted))
        if needed > 0:
            sequence.blocks += self.pool.take(needed)
        return True

    def _preempt(self, sequence: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(sequence)
        self.pool.give_back(sequence.blocks)
        sequence.blocks, sequence.computed = [], 0
        self.waiting.appendleft(sequence)
