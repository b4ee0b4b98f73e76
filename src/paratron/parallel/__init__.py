"""Parallelism applied to the plain model: one folder or module per kind, and `parallelize`."""

from paratron.parallel.data import DataParallel, unwrap
from paratron.parallel.parallelize import parallelize

__all__ = ["DataParallel", "unwrap", "parallelize"]
