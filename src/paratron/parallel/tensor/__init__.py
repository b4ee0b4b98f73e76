"""Tensor and sequence parallelism: layers (`layers.py`), vocabulary-parallel cross-entropy
(`cross_entropy.py`) and the transform of the GPT model (`apply.py`)."""

from paratron.parallel.tensor.apply import apply_tensor_parallel
from paratron.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from paratron.parallel.tensor.layers import (
    ColumnParallelLinear,
    ColumnParallelProjections,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    VocabParallelOutput,
    padded_vocab_size,
)

__all__ = [
    "apply_tensor_parallel",
    "vocab_parallel_cross_entropy",
    "ColumnParallelLinear",
    "ColumnParallelProjections",
    "RowParallelLinear",
    "TPContext",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "padded_vocab_size",
]
