"""Data: tokenizers, preprocessing into Megatron indexed datasets, GPT samples, blending, micro-batches."""

from paratron.data.blending import BlendedDataset, parse_blend
from paratron.data.build import DataBundle, build_data
from paratron.data.datasets import MockTokens, SampleSource
from paratron.data.gpt_dataset import GPTDataset, build_sample_indices
from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter
from paratron.data.loader import BatchPlan, micro_batches
from paratron.data.preprocess import preprocess
from paratron.data.tokenizer import NullTokenizer, Tokenizer, load_tokenizer, train_byte_level_bpe

__all__ = ["BlendedDataset", "parse_blend", "DataBundle", "build_data", "MockTokens", "SampleSource", "GPTDataset",
           "build_sample_indices", "IndexedDataset", "IndexedDatasetWriter", "BatchPlan", "micro_batches",
           "preprocess", "NullTokenizer", "Tokenizer", "load_tokenizer", "train_byte_level_bpe"]
