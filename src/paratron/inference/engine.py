"""The inference engine: requests in, tokens out, many requests at a time.

`Engine` lives on the controller rank (a model replica's first rank). Each `step()` the scheduler picks the work
(continuous batching, `inference.scheduler`), the engine lays it out as one row of tokens (`StepPlan`), every rank
of the replica runs its part of the model on it (`inference.runner`), and the controller samples the next token of
each sequence that reached its end, scores prompt tokens when asked, and decides which completions are done (a stop
token or string, max_tokens, the model's context). The other ranks call `follow()`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from paratron.config.inference import InferenceConfig
from paratron.inference.kv_cache import BlockPool, StepPlan
from paratron.inference.params import Completion, RequestError, RequestOutput, SamplingParams, TokenLogprob
from paratron.inference.runner import ModelRunner
from paratron.inference.sampling import sample_token, seeded_generator, token_logprobs
from paratron.inference.scheduler import Scheduled, Scheduler, Sequence
from paratron.inference.text import IncrementalText, TextDecoder, special_token_ids


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sequences: list[Sequence]
    prompt_logprobs: list[TokenLogprob | None] | None

    def output(self) -> RequestOutput:
        completions = [s.completion for s in self.sequences]
        return RequestOutput(self.request_id, self.prompt, completions, self.prompt_logprobs)


class Engine:
    """Batched generation over a `ModelRunner` (see the module's docstring); the API is the controller's, but for
    `follow()`, which every other rank calls."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: object,
        settings: InferenceConfig,
        max_model_len: int,
        num_blocks: int,
        model_name: str = "paratron",
        seed: int = 0,
    ) -> None:
        self.runner, self.tokenizer, self.settings = runner, tokenizer, settings
        self.max_model_len, self.model_name = max_model_len, model_name
        self.pool = BlockPool(num_blocks, settings.kv_block_size)
        self.scheduler = Scheduler(self.pool, settings.max_batch_tokens, settings.max_running_requests)
        self.stop_ids = frozenset(getattr(tokenizer, "stop_ids", ()) or ())
        self.special_ids = special_token_ids(tokenizer) if tokenizer is not None else frozenset()
        self._requests: dict[str, _Request] = {}
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()
        self._seeds = random.Random(seed)

    @property
    def is_controller(self) -> bool:
        return self.runner.is_controller

    @property
    def cache_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    @property
    def free_cache_tokens(self) -> int:
        return self.pool.num_free * self.pool.block_size

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: torch.Tensor | None = None,
    ) -> str:
        """Queue a request; its id. `RequestError` names what makes it impossible (see `check_request`)."""
        request_id = request_id if request_id is not None else f"request-{next(self._ids)}"
        if request_id in self._requests:
            raise RequestError("request_id", f"{request_id!r} is already running; give each request its own id")
        prompt = [int(t) for t in prompt_ids]
        self.check_request(prompt, params)
        if images is not None and not self.runner.model.config.has_vision:
            raise RequestError("images", "this model has no vision encoder; send text alone")
        scored = params.prompt_logprobs is not None
        sequences = []
        for index in range(params.n):
            generator = None
            if not params.greedy:
                seed = params.seed + index if params.seed is not None else self._seeds.getrandbits(62)
                generator = seeded_generator(seed, self.runner.device)
            completion = Completion(index, logprobs=[] if params.logprobs is not None else None)
            text = IncrementalText(self.text_decoder(params), params.stop)
            sequence = Sequence(request_id, params, list(prompt), len(prompt), completion, text, generator, images)
            sequence.score_prompt = scored and index == 0
            sequences.append(sequence)
            self.scheduler.add(sequence)
        self._requests[request_id] = _Request(request_id, prompt, params, sequences, [None] if scored else None)
        return request_id

    def text_decoder(self, params: SamplingParams) -> TextDecoder | None:
        """How a completion's tokens become its text (None without a tokenizer: no text)."""
        if self.tokenizer is None:
            return None
        skip, spaces = params.skip_special_tokens, params.spaces_between_special_tokens
        return TextDecoder(self.tokenizer, self.special_ids, skip, spaces)  # type: ignore[arg-type]

    def check_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse a request the engine cannot serve: parameters out of range, an empty prompt, a token outside the
        vocabulary, more tokens than the model's context or the whole KV cache holds."""
        params.check()
        limit, length = self.max_model_len, len(prompt)
        if not prompt:
            raise RequestError("prompt", "is empty; give at least one token")
        outside = [t for t in prompt if not 0 <= t < self.runner.vocab_size]
        if outside:
            last = self.runner.vocab_size - 1
            raise RequestError("prompt", f"token id {outside[0]} is outside the vocabulary (0..{last})")
        if length > limit or (params.max_tokens and length >= limit):
            raise RequestError(
                "prompt", f"{length} tokens do not fit the model's context of {limit} tokens with room to generate"
            )
        if length + params.max_tokens > limit:
            raise RequestError(
                "max_tokens",
                f"{params.max_tokens} new tokens after a prompt of {length} exceed the model's context of {limit} "
                f"tokens; ask for at most {limit - length}",
            )
        if self.pool.blocks_for(length + params.max_tokens) > self.pool.num_blocks:
            raise RequestError(
                "max_tokens",
                f"a prompt of {length} tokens and {params.max_tokens} new ones need more than the KV cache's "
                f"{self.cache_tokens} tokens; ask for fewer or give the cache more room (--kv-cache-gb)",
            )

    def abort(self, request_id: str) -> None:
        """Drop a request, giving its cache blocks back; its last output (next `step`) says "abort"."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for sequence in request.sequences:
            self.scheduler.remove(sequence)
            if not sequence.completion.finished:
                sequence.completion.finish_reason = "abort"
        self._aborted.append(request.output())

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    # ------------------------------------------------------------ steps

    def step(self) -> list[RequestOutput]:
        """One step of every rank (nothing when idle); the outputs of the requests that advanced."""
        outputs, self._aborted = self._aborted, []
        work = self.scheduler.schedule()
        if not work:
            return outputs
        plan, rows = self._plan(work)
        logits = self.runner.run(plan)
        touched = self._score_prompts(rows, logits)
        touched |= self._sample(work, rows, logits)
        for request_id in [r for r in self._requests if r in touched]:  # (in the order they came)
            output = self._requests[request_id].output()
            outputs.append(output)
            if output.finished:
                del self._requests[request_id]
        return outputs

    def generate(
        self,
        prompts: Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to the end (each with its params, or all with one); their outputs in order."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        for prompt, p in zip(prompts, each):
            self.check_request(list(prompt), p)
        ids = [self.add_request(list(prompt), p) for prompt, p in zip(prompts, each)]
        last: dict[str, RequestOutput] = {}
        while len(last) < len(ids) or not all(last[i].finished for i in ids):
            for output in self.step():
                last[output.request_id] = output
                if on_output is not None:
                    on_output(output)
        return [last[i] for i in ids]

    def keep_alive(self) -> None:
        """Tell the other ranks, waiting for the next step, that the controller is still there."""
        self.runner.idle()

    def close(self) -> None:
        """Let the other ranks' `follow()` return."""
        self.runner.close()

    def follow(self) -> None:
        """Every rank but the controller: run its steps until it closes."""
        self.runner.follow()

    # ------------------------------------------------------------ the step's parts

    def _plan(self, work: list[Scheduled]) -> tuple[StepPlan, dict[str, list[tuple[int, Sequence, int]]]]:
        """The step as one row; and its logit rows: ("sample" | "prompt", [(row, sequence, position)])."""
        block = self.pool.block_size
        columns: dict[str, list[np.ndarray]] = {"input_ids": [], "positions": [], "slots": [], "key_slots": []}
        per_sequence: dict[str, list[int]] = {"seq_rows": [], "seq_tokens": [], "seq_keys": [], "seq_lengths": []}
        rows: dict[str, list[tuple[int, Sequence, int]]] = {"prompt": [], "sample": []}
        offset, keys, images = 0, 0, []
        for item in work:
            sequence, start, end = item.sequence, item.start, item.start + item.count
            table = np.asarray(sequence.blocks, dtype=np.int64)
            every = np.arange(end, dtype=np.int64)
            slots = table[every // block] * block + every % block
            columns["input_ids"].append(np.asarray(sequence.tokens[start:end], dtype=np.int64))
            columns["positions"].append(every[start:])
            columns["slots"].append(slots[start:])
            columns["key_slots"].append(slots)
            for name, value in zip(per_sequence, (offset, item.count, keys, end)):
                per_sequence[name].append(value)
            if sequence.score_prompt:  # (position p scores token p + 1, once: not again after a preemption)
                scored = self._requests[sequence.request_id].prompt_logprobs or [None]
                first, last = max(start, len(scored) - 1), min(end, sequence.prompt_length - 1)
                rows["prompt"] += [(offset + p - start, sequence, p) for p in range(first, last)]
            if item.samples and len(sequence.generated) < sequence.params.max_tokens:
                rows["sample"].append((offset + item.count - 1, sequence, end - 1))
            if sequence.images is not None and start == 0:
                images.append(sequence.images)
            offset, keys = offset + item.count, keys + end
        device = self.runner.device
        fields = {name: np.concatenate(parts) for name, parts in columns.items()}
        fields |= {name: np.asarray(values, dtype=np.int64) for name, values in per_sequence.items()}
        fields["logit_rows"] = np.asarray([r for r, _, _ in rows["prompt"] + rows["sample"]], dtype=np.int64)
        names = [name for group in StepPlan.SIZED.values() for name in group]
        flat = torch.from_numpy(np.concatenate([fields[name] for name in names])).to(device)  # (one copy over)
        tensors = dict(zip(names, flat.split([len(fields[name]) for name in names])))
        pixels = torch.cat(images).to(device) if images else None
        return StepPlan(**tensors, images=pixels), rows

    def _score_prompts(self, rows: dict[str, list[tuple[int, Sequence, int]]], logits: torch.Tensor) -> set[str]:
        """Record the prompt tokens' log-probabilities the step computed (they come first among its rows)."""
        scored = rows["prompt"]
        if not scored:
            return set()
        targets = torch.tensor([s.tokens[p + 1] for _, s, p in scored], device=logits.device)
        top = max(s.params.prompt_logprobs or 0 for _, s, _ in scored)
        results = token_logprobs(logits[: len(scored)], targets, top)
        for (_, sequence, _), result in zip(scored, results):
            result.top = result.top[: sequence.params.prompt_logprobs]
            listed = self._requests[sequence.request_id].prompt_logprobs
            assert listed is not None
            listed.append(result)
        return {s.request_id for _, s, _ in scored}

    def _sample(
        self, work: list[Scheduled], rows: dict[str, list[tuple[int, Sequence, int]]], logits: torch.Tensor
    ) -> set[str]:
        """Draw the next token of every sequence that reached its end; finish what is done."""
        touched = set()
        sampled = logits[len(rows["prompt"]) :]
        argmax = sampled.argmax(dim=-1).tolist()  # (greedy rows without penalties: one call for the step)
        for (_, sequence, _), row, best in zip(rows["sample"], sampled, argmax):
            params = sequence.params
            if params.greedy and not params.penalized:
                token = best
            else:
                seen = generated = row.new_empty(0, dtype=torch.long)
                if params.penalized:
                    seen = torch.tensor(sequence.tokens, device=row.device)
                    generated = seen[sequence.prompt_length :]
                token = sample_token(row, params, sequence.generator, seen, generated)
            sequence.tokens.append(token)
            sequence.completion.token_ids.append(token)
            if params.logprobs is not None:
                chosen = torch.tensor([token], device=row.device)
                sequence.completion.logprobs.append(token_logprobs(row[None], chosen, params.logprobs)[0])  # type: ignore[union-attr]
            self._update(sequence)
            touched.add(sequence.request_id)
        for item in work:  # (a prompt scored alone, max_tokens 0, ends with its prefill)
            sequence = item.sequence
            if item.samples and sequence.params.max_tokens == 0 and not sequence.completion.finished:
                sequence.completion.finish_reason = "length"
                self.scheduler.remove(sequence)
                touched.add(sequence.request_id)
            else:
                sequence.computed = max(sequence.computed, item.start + item.count)
        return touched

    def _update(self, sequence: Sequence) -> None:
        """A completion's text and whether it is done, after a new token."""
        completion, params = sequence.completion, sequence.params
        token = completion.token_ids[-1]
        if token in params.stop_token_ids or (token in self.stop_ids and not params.ignore_eos):
            completion.finish_reason, completion.stop_reason = "stop", token
        elif len(completion.token_ids) >= params.max_tokens or len(sequence.tokens) >= self.max_model_len:
            completion.finish_reason = "length"
        stop = sequence.text.add(token) if completion.stop_reason is None else None  # (a stop token has no text)
        if stop is not None:
            completion.finish_reason, completion.stop_reason = "stop", stop
        if completion.finished:
            completion.text = sequence.text.text
            self.scheduler.remove(sequence)
        else:
            completion.text = sequence.text.final()
