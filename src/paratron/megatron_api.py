"""Megatron-LM's entry points for scripts written against it: `initialize_megatron` and `get_args`.

The returned args object carries every setting under Megatron's attribute names
(`args.tensor_model_parallel_size`, `args.micro_batch_size`, `args.fp16`, ...) plus the
typed `args.config` and this rank's `args.topology`. It is the one module-level state in
paratron, kept only for this compatibility.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from paratron.config.fields import all_fields
from paratron.config.loading import build_config
from paratron.config.megatron import from_megatron_dict
from paratron.config.precision import PRECISION_DTYPES
from paratron.config.validation import validate
from paratron.distributed.init import env_world_size, initialize, seed_everything
from paratron.distributed.topology import Topology

_ARGS: SimpleNamespace | None = None


def initialize_megatron(
    args: dict[str, Any] | None = None, *, args_defaults: dict[str, Any] | None = None, init_distributed: bool = True
) -> SimpleNamespace:
    """Build and validate the config from Megatron-style keys, join the process group, seed, and
    make the result available through `get_args()`.

    `args_defaults` holds defaults (as in Megatron's signature) that `args` overrides.
    """
    global _ARGS
    overrides = from_megatron_dict({**(args_defaults or {}), **(args or {})})
    config = build_config(overrides)
    world = env_world_size()
    layout = validate(config, world, check_data=False)
    namespace = SimpleNamespace(
        **{name: getattr(getattr(config, info.section), name) for name, info in all_fields().items()}
    )
    p = config.parallel
    topology = Topology(layout.dims)
    if init_distributed:
        ctx = initialize(p.distributed_backend)
        topology = Topology(topology.dims, ctx.rank)
        topology.create_groups()
        namespace.rank, namespace.device = ctx.rank, ctx.device
    seed_everything(config.training.seed)
    precision = config.training.precision
    namespace.fp16, namespace.bf16 = precision == "fp16", precision == "bf16"
    namespace.params_dtype = PRECISION_DTYPES[precision]
    namespace.use_distributed_optimizer = p.zero_stage >= 1  # Megatron's name for ZeRO-1 and above
    namespace.world_size = world
    namespace.data_parallel_size = layout.dp
    namespace.config, namespace.topology = config, topology
    _ARGS = namespace
    return namespace


def get_args() -> SimpleNamespace:
    """The arguments of the run initialized by `initialize_megatron`."""
    if _ARGS is None:
        raise RuntimeError("paratron.get_args() called before paratron.initialize_megatron()")
    return _ARGS
