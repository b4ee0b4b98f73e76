"""Where the nodes of a run meet, and this node's place among them."""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.schema import ParallelConfig
from paratron.errors import ConfigError


def check_launch(parallel: ParallelConfig) -> None:
    """Where the nodes meet, and this node's place among them."""
    if parallel.node_rank >= parallel.nnodes:
        raise ConfigError(
            f"{flag.node_rank} {parallel.node_rank} is out of range for {flag.nnodes} {parallel.nnodes}: "
            f"use 0 to {parallel.nnodes - 1}"
        )
    if parallel.master_addr is not None and parallel.rdzv_endpoint is not None:
        raise ConfigError(
            f"{flag.master_addr} and {flag.rdzv_endpoint} are two ways to meet: give one "
            f"({flag.rdzv_endpoint} to restart the nodes together)"
        )
    if parallel.nnodes > 1 and parallel.master_addr is None and parallel.rdzv_endpoint is None:
        raise ConfigError(
            f"{flag.nnodes} {parallel.nnodes} needs where the nodes meet: {flag.master_addr} HOST "
            f"(node 0's address) or {flag.rdzv_endpoint} HOST:PORT"
        )
