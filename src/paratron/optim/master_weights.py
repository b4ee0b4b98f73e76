"""Optimizers over fp32 master weights, one per way the weights are held (all follow
`protocol.TrainingOptimizer`):

- `ReplicatedOptimizer` (ZeRO stage 0): every data-parallel rank steps the whole model part.
  (It and the next share `ParameterOptimizer`: one master per parameter.)
- `FullyShardedOptimizer` (ZeRO stage 3): each rank steps its FSDP2 shards.
- `DistributedOptimizer` (ZeRO stages 1 and 2, `distributed.py`): each rank steps its pieces of
  the gradient buckets.

A master is the weight itself when the weights are fp32 (no copy) and an fp32 copy of 16-bit
weights otherwise; its `.grad` is the fp32 gradient the step uses (an fp32 copy, made each step,
where the data-parallel gradients are kept in bf16: --grad-reduce-in-bf16). Weight decay applies to
matrices and embeddings, not to biases and norm weights. Checkpoints carry the master copies,
which 16-bit weights cannot restore.

The step runs on the device's fast path (`step_implementation`): torch's fused kernels on CUDA,
its multi-tensor (foreach) kernels elsewhere, where torch's own default would pick the
per-tensor loop (for CPU tensors and DTensors); foreach gives the loop's values bit for bit in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from paratron.config.schema import OptimizerConfig
from paratron.distributed.topology import RankGroup
from paratron.optim.protocol import GradsForNorm, OptimizerPiece
from paratron.parallel.data_parallel.fully_sharded import fsdp_rows, local_tensor

FUSED_DEVICE_TYPES = frozenset({"cuda"})
"""Device types whose masters torch's fused AdamW / SGD kernels step (one pass, few launches).
Not the CPU, though its fused kernels are 3 to 4.6 times faster there (bench/optimizer_step.py): torch
2.13's CPU fused kernels round differently from the per-tensor loop on tensors of more than a few
elements (weights part by up to 1.2e-7 for AdamW and 2.4e-7 for SGD within six steps from
unit-normal values; 1.5e-8 for AdamW on GPT-2 weights of scale 0.02 in 15 steps), where the foreach
kernels agree with the loop bit for bit."""


def step_implementation(masters: Sequence[torch.Tensor]) -> dict[str, bool]:
    """The `foreach` / `fused` arguments of the optimizer over `masters`: fused where every master
    is a floating-point tensor on a device of `FUSED_DEVICE_TYPES`, foreach otherwise. Left to its
    default, torch would take the per-tensor loop for CPU tensors and for FSDP2's DTensor shards (it
    lists neither). foreach computes the same values with fewer dispatches: on a CPU 1.1 times
    faster over many small tensors, level with the loop over large ones, where memory traffic bounds
    the step (bench/optimizer_step.py).
    Both torch paths group tensors by device and dtype, so mixed masters still step correctly."""
    fused = bool(masters) and all(
        local_tensor(m).device.type in FUSED_DEVICE_TYPES and m.is_floating_point() for m in masters
    )
    return {"foreach": not fused, "fused": fused}


def make_inner_optimizer(groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The PyTorch optimizer that steps fp32 tensors, from parameter groups, on the masters'
    device's fast path (`step_implementation`)."""
    implementation = step_implementation([m for group in groups for m in group["params"]])
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, **implementation)
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, **implementation
    )


def step_counter(optimizer: torch.optim.Optimizer, master: torch.Tensor, step: float | torch.Tensor) -> torch.Tensor:
    """A master's step count as `optimizer` keeps it in its state: on the master's device for the
    fused kernels, which read it there, a CPU tensor otherwise (torch's own placement)."""
    on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    device = local_tensor(master).device if on_device else torch.device("cpu")
    return torch.as_tensor(step, dtype=torch.float32).detach().clone().to(device)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: tensors of two or more dims decay; biases and norm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return decay_groups(params, params, weight_decay)


def decay_groups(params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor], weight_decay: float) -> list[dict]:
    """Optimizer groups of `masters`, each decaying as its parameter (of the same position) does."""
    decay = [m for p, m in zip(params, masters) if p.dim() >= 2]
    no_decay = [m for p, m in zip(params, masters) if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_groups(
    params: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    config: OptimizerConfig,
    decoupled: Collection[int] = (),
) -> list[dict]:
    """The weight-decay groups of `decay_groups`; with --decoupled-lr the parameters whose id is in
    `decoupled` (the embedding and output layer) move to groups of their own that carry the peak
    ("max_lr") and floor ("min_lr", with --decoupled-min-lr) the schedule gives them, as Megatron-LM's
    param groups do. Empty decoupled groups are left out."""
    if config.decoupled_lr is None or not decoupled:
        return decay_groups(params, masters, config.weight_decay)
    own = [id(p) in decoupled for p in params]

    def part(decoupled_part: bool) -> list[dict]:
        pairs = [(p, m) for p, m, o in zip(params, masters, own) if o == decoupled_part]
        return decay_groups([p for p, _ in pairs], [m for _, m in pairs], config.weight_decay)

    main, separate = part(False), part(True)
    schedule = {"max_lr": config.decoupled_lr}
    if config.decoupled_min_lr is not None:
        schedule["min_lr"] = config.decoupled_min_lr
    return main + [{**group, **schedule} for group in separate if group["params"]]


def master_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor the optimizer steps for `param`: itself when fp32, an fp32 copy otherwise."""
    return param if param.dtype == torch.float32 else nn.Parameter(local_tensor(param).detach().float().clone())


class MasterWeightsOptimizer:
    """The protocol's common part. Subclasses fill `masters` (one fp32 tensor each) and `targets`
    (where each master's value goes after a step: a 16-bit parameter or a piece of one), build
    `optimizer` over the masters, and give `prepare_grads` and `pieces`."""

    masters: list[torch.Tensor]
    targets: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    norm_weights: torch.Tensor | None
    norm_group: RankGroup
    copies_grads: bool = False
    """`prepare_grads` gave the masters fp32 copies of bf16 gradients (--grad-reduce-in-bf16), which `step`
    frees: they are needed from the reduction to the update only, not through the next backward."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def prepare_grads(self) -> None:
        raise NotImplementedError

    def pieces(self) -> list[OptimizerPiece]:
        raise NotImplementedError

    def grads_for_norm(self) -> GradsForNorm:
        return GradsForNorm([m.grad for m in self.masters], self.norm_weights, self.norm_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the masters' gradients (as torch optimizers do). The model's gradients are zeroed by
        the model (`ParallelModel.zero_grad`); where the masters are the weights themselves this
        detaches them from the model's gradient buffer, which the next step reports."""
        for master in self.masters:
            master.grad = None

    def step(self) -> None:
        self.optimizer.step()
        if self.copies_grads:
            for master in self.masters:
                master.grad = None

    def after_step(self) -> None:
        self.write_back()

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the masters into the model's weights (rounding to their type)."""
        for master, target in zip(self.masters, self.targets):
            if master.data_ptr() != target.data_ptr():
                target.copy_(master)

    def _copies(self) -> bool:
        return any(m.data_ptr() != t.data_ptr() for m, t in zip(self.masters, self.targets))

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        if self._copies():
            state = {**state, "master_weights": [m.detach().clone() for m in self.masters]}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop("master_weights", None)
        self.optimizer.load_state_dict(state)
        self._keep_step_implementation()
        if saved is not None and self._copies():
            for master, value in zip(self.masters, saved):
                master.copy_(value)
            self.write_back()

    def _keep_step_implementation(self) -> None:
        """torch's `load_state_dict` takes the saved groups' foreach / fused flags (which another
        device, or an older paratron, chose): put back the ones for these masters, and their step
        counts where those kernels read them."""
        implementation = step_implementation(self.masters)
        for group in self.optimizer.param_groups:
            group.update(implementation)
        for master in self.masters:
            state = self.optimizer.state.get(master, {})
            if "step" in state:
                state["step"] = step_counter(self.optimizer, master, state["step"])


NormWeight = Callable[[torch.Tensor], float]
"""A parameter's weight in the global gradient norm (`ParallelModel.norm_weight`)."""


def norm_weights(params: Sequence[torch.Tensor], norm_group: RankGroup, norm_weight: NormWeight) -> torch.Tensor | None:
    """Each parameter's weight in the global norm, when the norm is summed over several ranks."""
    if norm_group.size == 1 or not params:
        return None
    return torch.tensor([norm_weight(p) for p in params], device=local_tensor(params[0]).device)


class ParameterOptimizer(MasterWeightsOptimizer):
    """Masters that stand for whole parameters (or for FSDP2's shards of them): one per parameter."""

    def __init__(
        self,
        params: list[nn.Parameter],
        config: OptimizerConfig,
        norm_group: RankGroup,
        norm_weight: NormWeight,
        decoupled: Collection[int] = (),
    ) -> None:
        self.targets = params
        self.masters = [master_of(p) for p in params]
        self.optimizer = make_inner_optimizer(optimizer_groups(params, self.masters, config, decoupled), config)
        self.norm_group, self.norm_weights = norm_group, norm_weights(params, norm_group, norm_weight)

    def pieces(self) -> list[OptimizerPiece]:
        """Each parameter whole, or an FSDP2 shard's rows of it."""
        out = []
        for param, master in zip(self.targets, self.masters):
            local = local_tensor(param)
            first = (fsdp_rows(param) or (0, 0))[0]
            width = local[0].numel() if local.dim() > 0 and local.size(0) else 0
            start = first * width if local.dim() > 0 else 0
            out.append(OptimizerPiece(param, start, start + local.numel(), master, master is not param))
        return out


class ReplicatedOptimizer(ParameterOptimizer):
    """ZeRO stage 0: the whole model part; gradients are the main gradients of data parallelism
    (`main_grad(param)`: fp32, or bf16 under --grad-reduce-in-bf16, which the masters take as fp32
    copies)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        main_grad: Callable[[nn.Parameter], torch.Tensor],
        config: OptimizerConfig,
        norm_group: RankGroup,
        norm_weight: NormWeight,
        decoupled: Collection[int] = (),
    ) -> None:
        super().__init__(params, config, norm_group, norm_weight, decoupled)
        self._main_grad = main_grad
        self.prepare_grads()

    def prepare_grads(self) -> None:
        """Point each master's gradient at its parameter's main gradient: a view when both are fp32, an
        fp32 copy of a bf16 one (so that unscaling, clipping, the norm and the step all run in fp32)."""
        for master, param in zip(self.masters, self.targets):
            grad = self._main_grad(param)
            master.grad = grad if grad.dtype == master.dtype else grad.float()
            self.copies_grads = self.copies_grads or grad.dtype != master.dtype


class FullyShardedOptimizer(ParameterOptimizer):
    """ZeRO stage 3: FSDP2's fp32 shards are the masters and hold their reduce-scattered fp32
    gradients. (On one data-parallel rank there is nothing to shard: 16-bit weights get fp32
    masters whose gradients are fp32 copies of autograd's.)"""

    def prepare_grads(self) -> None:
        for master, param in zip(self.masters, self.targets):
            if master is not param:
                master.grad = param.grad.float() if param.grad is not None else None

    def grads_for_norm(self) -> GradsForNorm:
        grads = [
            local_tensor(m.grad) if m.grad is not None else torch.zeros_like(local_tensor(m)) for m in self.masters
        ]
        return GradsForNorm(grads, self.norm_weights, self.norm_group)
