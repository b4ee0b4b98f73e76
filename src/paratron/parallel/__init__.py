"""Parallelism applied to the plain model: one folder or module per kind, `parallelize`, and the
`ParallelModel` it returns."""

from paratron.parallel.model import ParallelModel
from paratron.parallel.parallelize import parallelize

__all__ = ["ParallelModel", "parallelize"]
