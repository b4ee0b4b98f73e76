"""Data: corpora, tokenizers, samples and their order, micro-batches."""

from paratron.data.build import DataBundle, build_data
from paratron.data.datasets import MockTokens, ShuffledSamples, TokenWindows
from paratron.data.loader import BatchPlan, micro_batches
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe

__all__ = ["DataBundle", "build_data", "MockTokens", "ShuffledSamples", "TokenWindows", "BatchPlan",
           "micro_batches", "Tokenizer", "train_byte_level_bpe"]
