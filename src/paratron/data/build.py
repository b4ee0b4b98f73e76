"""From DataConfig to train/validation samples: tokenizer, tokenized corpus, split, order.

Expensive artifacts (a trained tokenizer, the tokenized corpus) are cached on disk under
a hash of everything that shapes them, built by local rank 0 while the others wait, and
written to temporary paths renamed into place, so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from paratron.config.schema import Config
from paratron.config.validation import parse_split
from paratron.data.corpus import files_signature, read_documents, stdlib_files, text_files
from paratron.data.datasets import MockTokens, ShuffledSamples, TokenWindows
from paratron.data.tokenizer import Tokenizer, train_byte_level_bpe
from paratron.distributed.init import collective_device
from paratron.errors import DataError, PeerFailure, UserError

DEFAULT_BPE_VOCAB = 8192
MOCK_VOCAB = 4096


@dataclass
class DataBundle:
    train: ShuffledSamples
    valid: ShuffledSamples | None
    tokenizer: Tokenizer | None
    vocab_size: int


def cache_root(config: Config) -> Path:
    path = config.data.data_cache_path or os.environ.get("PARATRON_CACHE") or "~/.cache/paratron"
    return Path(path).expanduser()


def build_once(path: Path, build: Callable[[Path], None], local_rank: int, log: Callable[[str], None]) -> None:
    """Make `path` exist: local rank 0 builds it (into a temp path, then renames); all ranks wait.

    If the build fails on a user error, every rank learns it (instead of waiting forever): the
    builder raises the error, the others raise PeerFailure.
    """
    failure: UserError | None = None
    if local_rank == 0 and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        start = time.perf_counter()
        try:
            build(tmp)
            try:
                tmp.replace(path)
            except OSError:
                if not path.exists():
                    raise  # otherwise another job built the same thing first: keep theirs
            log(f"built {path} in {time.perf_counter() - start:.1f}s")
        except UserError as exc:
            failure = exc
        finally:  # nothing half-built stays behind
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            tmp.unlink(missing_ok=True)
    if dist.is_initialized():
        failed = torch.tensor([failure is not None], dtype=torch.int32, device=collective_device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and failure is None:
            raise PeerFailure(f"another rank failed to build {path}")
    if failure is not None:
        raise failure


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _tokenize_corpus(files: list[Path], tokenizer: Tokenizer, strict: bool, out_dir: Path) -> None:
    out_dir.mkdir(parents=True)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max else np.int32
    chunks, offsets = [], [0]
    docs = read_documents(files, strict)
    batch: list[str] = []
    for text in docs:
        batch.append(text)
        if len(batch) == 256:
            _append(tokenizer, batch, chunks, offsets, dtype)
            batch = []
    if batch:
        _append(tokenizer, batch, chunks, offsets, dtype)
    np.save(out_dir / "tokens.npy", np.concatenate(chunks) if chunks else np.zeros(0, dtype))
    np.save(out_dir / "doc_offsets.npy", np.asarray(offsets, dtype=np.int64))


def _append(tokenizer: Tokenizer, texts: list[str], chunks: list, offsets: list[int], dtype) -> None:
    for ids in tokenizer.encode_batch(texts):
        if not ids:
            continue  # an empty document contributes nothing, not even its EOD
        chunks.append(np.asarray(ids + [tokenizer.eod_id], dtype=dtype))
        offsets.append(offsets[-1] + len(ids) + 1)


def build_data(config: Config, local_rank: int = 0, log: Callable[[str], None] = print) -> DataBundle:
    d, seed = config.data, config.training.seed
    if d.mock_data:
        vocab = config.model.vocab_size or MOCK_VOCAB
        return DataBundle(ShuffledSamples(MockTokens(vocab, d.seq_length, seed), seed, shuffle=False),
                          ShuffledSamples(MockTokens(vocab, d.seq_length, seed + 1), seed, shuffle=False),
                          None, vocab)

    strict = d.corpus is None
    files = stdlib_files() if d.corpus == "stdlib" else text_files(d.data_path)
    signature = files_signature(files)
    cache = cache_root(config)

    if d.tokenizer_type == "HuggingFaceTokenizer":
        tokenizer = Tokenizer.from_file(d.tokenizer_model)  # type: ignore[arg-type]
        tokenizer_id = _digest(Path(d.tokenizer_model).read_bytes())  # type: ignore[arg-type]
    else:
        target = config.model.vocab_size or DEFAULT_BPE_VOCAB
        tokenizer_path = cache / f"tokenizer-bpe{target}-{_digest(signature, target)}.json"
        build_once(tokenizer_path,
                   lambda tmp: train_byte_level_bpe(read_documents(files, strict), target).save(tmp),
                   local_rank, log)
        tokenizer = Tokenizer.from_file(tokenizer_path)
        tokenizer_id = tokenizer_path.stem

    corpus_dir = cache / f"corpus-{_digest(signature, tokenizer_id)}"
    build_once(corpus_dir, lambda tmp: _tokenize_corpus(files, tokenizer, strict, tmp), local_rank, log)
    tokens = np.load(corpus_dir / "tokens.npy", mmap_mode="r")
    offsets = np.load(corpus_dir / "doc_offsets.npy")

    vocab = config.model.vocab_size or tokenizer.vocab_size
    if vocab < tokenizer.vocab_size:
        raise DataError(f"--vocab-size {vocab} is smaller than the tokenizer's {tokenizer.vocab_size}; raise it")

    # Split by documents, in order (Megatron's --split semantics).
    fractions = parse_split(d.split)
    n_docs = len(offsets) - 1
    bounds = [0]
    for f in fractions:
        bounds.append(min(n_docs, bounds[-1] + int(round(f * n_docs))))
    bounds[-1] = n_docs
    train_tokens = tokens[offsets[bounds[0]] : offsets[bounds[1]]]
    valid_tokens = tokens[offsets[bounds[1]] : offsets[bounds[2]]]
    train = TokenWindows(train_tokens, d.seq_length)
    if len(train) == 0:
        raise DataError(f"the training split holds {len(train_tokens)} tokens, fewer than one sample of "
                        f"--seq-length {d.seq_length}; add data or lower --seq-length")
    valid = TokenWindows(valid_tokens, d.seq_length)
    if len(valid) == 0 and config.training.eval_iters > 0:
        raise DataError(f"the validation split of --split {d.split} holds {len(valid_tokens)} tokens, fewer than "
                        f"one sample of --seq-length {d.seq_length}; give it a larger share or set --eval-iters 0")
    return DataBundle(
        ShuffledSamples(train, seed),
        ShuffledSamples(valid, seed + 1) if len(valid) > 0 else None,
        tokenizer,
        vocab,
    )
