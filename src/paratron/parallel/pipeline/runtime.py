"""Executing a pipeline schedule: this rank walks its list of operations for one step.

    F(m, c)  take the stage input (or the tokens), run the chunk, then send the output
             on (or compute the loss); the output's values are freed once sent, keeping only
             its autograd graph, which is all backward needs (Megatron-LM does the same)
    B(m, c)  take the output gradient (or start from the loss), run backward, send the input
             gradient back
    W(m, c)  run the weight gradients that B deferred (zero-bubble schedules)

The receive an operation needs is posted when the previous operation ends, together with
that operation's sends, and waited for only when the tensor is needed.

The last stage turns each micro-batch's output (logits, or the token losses themselves where the
runner applies the fused loss) into the sum of its token losses times that micro-batch's weight
(see `training.step.loss_weights`), so the gradients that accumulate in the parameters' buffers
are those of the step's loss, as without pipelining.
The gradient synchronizer of data parallelism is given at construction: it is told before
each backward operation whether it is the step's last for its chunk, and of every weight
gradient a W operation completes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.autograd import Variable

from paratron.model.batch import Batch
from paratron.parallel.pipeline.p2p import ACTIVATION, GRADIENT, PendingReceive, StageComm
from paratron.parallel.pipeline.schedules import Action, Schedule, Span
from paratron.parallel.pipeline.stage import StageRunner
from paratron.parallel.pipeline.zero_bubble import WeightGradStore


class GradientSync(Protocol):
    """What the pipeline tells data parallelism (`parallel.data_parallel.DataParallelGradients`)."""

    def require_sync(self, enabled: bool) -> None: ...

    def grad_ready(self, param: nn.Parameter) -> None: ...


@dataclass
class _StepState:
    """What one step's operations share: the loss total, the clock's origin, and per (micro-batch, chunk) the
    input whose gradient B sends back (None on the first stage) and the output (or loss) B starts from."""

    total: torch.Tensor
    origin: float = 0.0
    inputs: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


class PipelineRuntime:
    def __init__(
        self,
        runner: StageRunner,
        schedule: Schedule,
        comm: StageComm,
        token_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        gradients: GradientSync,
        store: WeightGradStore | None = None,
        synchronize: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner, self.schedule, self.comm = runner, schedule, comm
        self.pp_ranks = comm.ranks  # global rank of every pipeline rank
        self.rank = runner.layout.rank
        self.token_loss = token_loss
        self.gradients = gradients
        self.store = store
        self.synchronize = synchronize  # device sync, for honest operation times when profiling
        self.record = False
        self.spans: list[Span] = []
        """Operation times (ms from the step's start) of the last step run with `record` set."""
        self.peak_live = 0
        """The most micro-batch chunks whose activations this rank held at once in the last step."""
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}  # tensors for this rank's own next stage

    def _peer(self, chunk: int, offset: int) -> int:
        rank, _ = self.schedule.place(self.runner.layout.stage(chunk) + offset)
        return self.pp_ranks[rank]

    def forward_backward(
        self, batches: list[Batch], *, weights: list[torch.Tensor], backward: Callable[[torch.Tensor], None]
    ) -> torch.Tensor:
        """Run the schedule over `batches` (every rank is given all of them); gradients accumulate
        in the parameters. Micro-batch m's loss is the sum of its token losses times `weights[m]`;
        returns their sum on the last stage's rank, zero elsewhere. `backward(loss)` starts
        backward from a loss (it may scale it first)."""
        count = len(batches)
        if count != self.schedule.microbatches:
            raise ValueError(f"the schedule is for {self.schedule.microbatches} micro-batches, got {count}")
        step = _StepState(total=torch.zeros((), device=batches[0].device))
        self.spans = []
        if self.record:
            self.synchronize()  # (only then: a device sync in every step would cost time)
        step.origin = time.perf_counter()
        actions = self.schedule.ranks[self.rank]
        self.peak_live = 0
        incoming = self._post_receive(actions[0], batches)
        for position, action in enumerate(actions):
            batch = batches[action.microbatch]
            if action.kind == "F":
                begin = self._forward(action, batch, incoming, weights[action.microbatch], step)
            elif action.kind == "B":
                begin = self._backward(action, incoming, backward, action.microbatch == count - 1, step)
            else:
                begin = self._weight_grads(action, action.microbatch == count - 1, step)
            if self.record:
                self.spans.append((action, begin, self._now(step.origin)))
            # this operation's sends leave now, with the next operation's receive
            following = actions[position + 1] if position + 1 < len(actions) else None
            incoming = self._post_receive(following, batches) if following is not None else None
        self.comm.wait_sends()
        return step.total

    def _forward(
        self, action: Action, batch: Batch, incoming: PendingReceive | None, weight: torch.Tensor, step: _StepState
    ) -> float:
        """F: run the chunk and send its output on, or turn it into the weighted loss on the last stage; returns
        when the operation began."""
        key = (action.microbatch, action.chunk)
        x = batch.input_ids if incoming is None else incoming.wait().requires_grad_()
        begin = self._now(step.origin)
        out = self.runner(action.chunk, x, batch)
        if self.runner.is_last(action.chunk):
            loss = self._token_losses(out, batch).sum() * weight
            step.total += loss.detach()
            step.outputs[key] = loss
        else:
            self._send(out, action, +1, ACTIVATION)
            _free_values(out)
            step.outputs[key] = out
        step.inputs[key] = None if self.runner.is_first(action.chunk) else x
        self.peak_live = max(self.peak_live, len(step.outputs))
        return begin

    def _backward(
        self,
        action: Action,
        incoming: PendingReceive | None,
        backward: Callable[[torch.Tensor], None],
        last_microbatch: bool,
        step: _StepState,
    ) -> float:
        """B: backward from the loss or the received output gradient, then send the input gradient back; returns
        when the operation began."""
        key = (action.microbatch, action.chunk)
        self.gradients.require_sync(last_microbatch)
        out = step.outputs.pop(key)
        grad = None if incoming is None else incoming.wait()
        begin = self._now(step.origin)
        with self.store.capture(key) if self.store is not None else contextlib.nullcontext():
            if self.runner.is_last(action.chunk):
                backward(out)
            else:
                _backward_through(out, grad)
        x = step.inputs.pop(key)
        if x is not None:
            self._send(x.grad, action, -1, GRADIENT)
        return begin

    def _weight_grads(self, action: Action, last_microbatch: bool, step: _StepState) -> float:
        """W: the weight gradients B deferred; returns when the operation began."""
        self.gradients.require_sync(last_microbatch)
        begin = self._now(step.origin)
        if self.store is not None:  # (without one, B computed the weight gradients)
            self.store.run((action.microbatch, action.chunk), self.gradients.grad_ready)
        return begin

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> torch.Tensor:
        """Forward only, in the schedule's forward order; the summed token loss of all micro-batches
        on the last stage's rank (zero elsewhere)."""
        total = torch.zeros((), device=batches[0].device)
        for action in self.schedule.ranks[self.rank]:
            if action.kind != "F":
                continue
            batch = batches[action.microbatch]
            incoming = self._post_receive(action, batches)
            x = batch.input_ids if incoming is None else incoming.wait()
            out = self.runner(action.chunk, x, batch)
            if self.runner.is_last(action.chunk):
                total += self._token_losses(out, batch).sum()
            else:
                self._send(out, action, +1, ACTIVATION)
        self.comm.wait_sends()
        return total

    def _token_losses(self, out: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The last stage's per-token losses: its output already is them under the fused loss (computed inside the
        runner's forward, `StageRunner.fused_loss`); otherwise it is logits."""
        return out if self.runner.fused_loss is not None else self.token_loss(out, batch.labels)

    def _post_receive(self, action: Action, batches: list[Batch]) -> PendingReceive | None:
        """Post the queued sends and the receive `action` needs (None if it needs none: then the
        sends leave alone)."""
        stage = self.runner.layout.stage(action.chunk)
        tokens = batches[action.microbatch].input_ids
        need = None
        if action.kind == "F" and stage > 0:
            need = (-1, ACTIVATION)
        elif action.kind == "B" and stage < self.runner.layout.num_stages - 1:
            need = (+1, GRADIENT)
        peer = None if need is None else self._peer(action.chunk, need[0])
        if need is None or peer == self.pp_ranks[self.rank]:
            self.comm.flush()
            return None if need is None else _Handed(self._local, (need[1], action.microbatch, stage))
        return self.comm.post_receive(self.comm.message_shape(tokens), peer, need[1])

    def _send(self, tensor: torch.Tensor, action: Action, offset: int, kind: str) -> None:
        """To the neighbouring stage: through the network, or by hand when this rank runs it too
        (the bend of ZB-V's V)."""
        peer = self._peer(action.chunk, offset)
        if peer == self.pp_ranks[self.rank]:
            stage = self.runner.layout.stage(action.chunk) + offset
            self._local[(kind, action.microbatch, stage)] = tensor.detach()
        else:
            self.comm.send(tensor, peer, kind)

    def _now(self, origin: float) -> float:
        if self.record:
            self.synchronize()
        return (time.perf_counter() - origin) * 1e3


def _free_values(output: torch.Tensor) -> None:
    """Drop an output's values once sent; its graph (all that backward needs) stays."""
    if output.grad_fn is not None and output._base is None:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def _backward_through(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from an output whose values were freed: the engine is called directly, since
    `Tensor.backward` would compare the gradient's shape with the emptied tensor's."""
    Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        (output,),
        (grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class _Handed:
    """A 'receive' from this rank's own other chunk: the tensor is already here when needed."""

    def __init__(self, mailbox: dict, key: tuple[str, int, int]) -> None:
        self.mailbox, self.key = mailbox, key

    def wait(self) -> torch.Tensor:
        return self.mailbox.pop(self.key)
