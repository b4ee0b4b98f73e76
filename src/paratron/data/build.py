"""From DataConfig to train and validation samples.

Sources, in Megatron-LM's terms: `--data-path` (one blend, cut into train/valid/test by
`--split`), or `--train-data-path` / `--valid-data-path` / `--test-data-path` (one blend
each). A blend is `PREFIX ...` or `WEIGHT PREFIX ...`; PREFIX names a .bin/.idx pair. A
text or jsonl file or directory in its place is preprocessed into the cache first, as is
`--corpus stdlib`. `--mock-data` needs nothing.

Expensive artifacts (a trained tokenizer, preprocessed corpora, sample indices) are cached
under a hash of everything that shapes them, built by local rank 0 while the others
wait, and written to temporary paths renamed into place.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from paratron.config.schema import Config
from paratron.data.blending import Blend, BlendedDataset, component_sizes, parse_blend, split_ranges
from paratron.data.corpus import files_signature, stdlib_files
from paratron.data.datasets import MockTokens, SampleSource
from paratron.data.fim import FIMSamples, FIMTransform, fim_sentinels, fim_transform
from paratron.data.gpt_dataset import GPTDataset, StreamWindows
from paratron.data.indexed import IndexedDataset, dataset_exists
from paratron.data.loader import DocumentLayout, LoaderSource
from paratron.data.preprocess import PreprocessResult, input_files, preprocess, read_documents
from paratron.data.sft.dataset import SFTDataset
from paratron.data.sft.sources import sft_sources, unique_task_names, whole_tasks
from paratron.data.tokenizer import AnyTokenizer, NullTokenizer, Tokenizer, tokenizer_for, train_byte_level_bpe
from paratron.data.vision import MockVisionSamples
from paratron.data.vision.settings import image_token_id, with_image_token
from paratron.distributed.init import raise_any_failure
from paratron.errors import DataError
from paratron.storage import temporary_beside

DEFAULT_BPE_VOCAB = 8192
MOCK_VOCAB = 4096
Log = Callable[[str], None]


@dataclass
class DataBundle:
    train: SampleSource
    valid: SampleSource | None
    tokenizer: AnyTokenizer | None
    vocab_size: int
    valid_tasks: dict[str, SampleSource] | None = None
    """With several fine-tuning files: each one's validation samples, evaluated (and reported) apart."""
    image_token_id: int | None = None
    """With a vision model and files: the image placeholder's id the tokenizer declares (the model's must match)."""
    truncated: tuple[int, int] | None = None
    """With --sft: (training conversations cut to --seq-length, training conversations)."""


def cache_root(config: Config) -> Path:
    return cache_folder(config.data.data_cache_path)


def cache_folder(data_cache_path: str | None) -> Path:
    """The data cache: --data-cache-path, else PARATRON_CACHE, else ~/.cache/paratron."""
    return Path(data_cache_path or os.environ.get("PARATRON_CACHE") or "~/.cache/paratron").expanduser()


def build_once(path: Path, build: Callable[[Path], None], local_rank: int, log: Log) -> None:
    """Make `path` exist: local rank 0 builds it (into a temp path, then renames); all ranks wait.

    If the build fails, every rank learns it (instead of waiting for a timeout): the builder
    raises its error, the others raise PeerFailure. With a cache shared between machines the
    local rank 0 of each builds, into a temporary name of its own (`storage.temporary_beside`); the first
    rename wins.
    """
    failure: BaseException | None = None
    if local_rank == 0 and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_beside(path)
        start = time.perf_counter()
        try:
            build(tmp)
            try:
                tmp.replace(path)
            except OSError:
                if not path.exists():
                    raise  # otherwise another job built the same thing first: keep theirs
            log(f"built {path} in {time.perf_counter() - start:.1f}s")
        except Exception as exc:
            failure = exc
        finally:  # nothing half-built stays behind
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            tmp.unlink(missing_ok=True)
    raise_any_failure(failure, f"another rank failed to build {path}")


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def samples_per_split(config: Config, global_batch_size: int) -> tuple[int, int, int]:
    """Megatron-LM's counts: train iters x batch; one evaluation per interval plus the final one; one test. An
    evaluation of the whole validation split (--sft without --eval-iters) reads no count of samples: 0."""
    t = config.training
    evaluations = t.train_iters // t.eval_interval + 1
    batches = t.eval_batches(config.data.sft) or 0
    return (
        t.train_iters * global_batch_size,
        evaluations * batches * global_batch_size,
        batches * global_batch_size,
    )


class _Builder:
    """Holds what building the datasets of one run shares: cache, rank, log, tokenizer."""

    def __init__(self, config: Config, local_rank: int, log: Log) -> None:
        self.config, self.local_rank, self.log = config, local_rank, log
        self.cache = cache_root(config)
        self.once = partial(build_once, local_rank=local_rank, log=log)
        self.fim: FIMTransform | None = None
        """With --fim-data: what rewrites every pretraining sample (set once the tokenizer is known)."""

    # -- raw text -------------------------------------------------------------------------

    def raw_sources(self) -> list[tuple[list[Path], bool]]:
        """Text inputs to preprocess: (files, strict) for --corpus and for each raw --*-data-path entry."""
        d = self.config.data
        if d.corpus == "stdlib":
            return [(stdlib_files(), False)]
        out = []
        for values, flag in d.blend_flags():
            for path in parse_blend(values, flag).paths:
                if not dataset_exists(path):
                    out.append((input_files([path], flag), True))
        return out

    def tokenizer(self, saved: Tokenizer | None = None) -> tuple[AnyTokenizer, str]:
        """The run's tokenizer and an identity string for cache keys. `saved` is the tokenizer of
        the checkpoint a run starts from, used unless another tokenizer is named."""
        d, m = self.config.data, self.config.model
        kind = d.resolved_tokenizer_type
        if kind == "ByteLevelBPE" and saved is not None:
            return saved, _digest(saved.spec())
        if kind == "ByteLevelBPE" and d.sft:
            raise DataError(
                "--sft needs an existing tokenizer: --load a checkpoint saved with one, or give "
                "--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH"
            )
        if kind != "ByteLevelBPE":
            tokenizer = tokenizer_for(d, m.vocab_size)
            return tokenizer, _digest(tokenizer.spec())
        sources = self.raw_sources()
        if not sources:
            raise DataError(
                "--tokenizer-type ByteLevelBPE trains on text, but the data is preprocessed already; "
                "name its tokenizer (HuggingFaceTokenizer --tokenizer-model, GPT2BPETokenizer "
                "--vocab-file/--merge-file, or NullTokenizer --vocab-size)"
            )
        target = m.vocab_size or DEFAULT_BPE_VOCAB
        signature = _digest(*(files_signature(files) for files, _ in sources))
        special = fim_sentinels(d) if d.fim_data else ()  # (a run that rewrites its samples needs them)
        path = self.cache / f"tokenizer-bpe{target}-{_digest(signature, target, *special)}.json"

        def texts():
            for files, strict in sources:
                for document in read_documents(files, ["text"], PreprocessResult([]), skip_bad_lines=not strict):
                    yield document.texts[0]

        self.once(path, lambda tmp: train_byte_level_bpe(texts(), target, special).save(tmp))
        return Tokenizer.from_file(path), path.stem

    def tokenizer_and_vocabulary(self, saved: Tokenizer | None) -> tuple[AnyTokenizer, str, int]:
        """The tokenizer, its cache identity and the model's vocabulary size (the tokenizer's unless
        --vocab-size asks for more; with --add-image-token the tokenizer's `<image>` counts)."""
        tokenizer, tokenizer_id = self.tokenizer(saved)
        grown = self.config.model.add_image_token  # (the checkpoint's rows grow to the vocabulary as they load)
        if grown and self.config.model.image_token_id is None:  # (one named, by a flag or the checkpoint, is kept)
            tokenizer = with_image_token(tokenizer)
            tokenizer_id = _digest(tokenizer.spec())
        if isinstance(tokenizer, NullTokenizer):
            vocab = tokenizer.vocab_size  # --vocab-size ids plus the end-of-document id, as in Megatron
        else:
            vocab = self.config.model.vocab_size or tokenizer.vocab_size
            vocab = max(vocab, tokenizer.vocab_size) if grown else vocab
        if vocab < tokenizer.vocab_size:
            grow = (
                ", add --add-image-token to grow the checkpoint's vocabulary to it"
                if self.config.model.has_vision
                else ""
            )
            raise DataError(
                f"--vocab-size {vocab} (given, or the loaded checkpoint's) is smaller than the tokenizer's "
                f"{tokenizer.vocab_size}; raise it{grow}, or use the checkpoint's own tokenizer"
            )
        return tokenizer, tokenizer_id, vocab

    def resolve(self, path: str, flag: str, tokenizer: AnyTokenizer, tokenizer_id: str) -> str:
        """A dataset prefix as given, or the cached preprocessed form of text files."""
        if dataset_exists(path):
            return path
        return self.preprocessed(input_files([path], flag), True, tokenizer, tokenizer_id)

    def preprocessed(self, files: list[Path], strict: bool, tokenizer: AnyTokenizer, tokenizer_id: str) -> str:
        """Prefix of the cached indexed dataset of these files (preprocessed on first use)."""
        folder = self.cache / f"corpus-{_digest(files_signature(files), tokenizer_id, strict)}"

        def build(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            preprocess(files, str(tmp / "data"), tokenizer, append_eod=True, skip_bad_lines=not strict, progress=False)

        self.once(folder, build)
        return str(folder / "data_text_document")

    # -- datasets -------------------------------------------------------------------------

    def gpt_dataset(self, prefix: str, documents: np.ndarray, num_samples: int | None) -> GPTDataset | FIMSamples:
        """One split of one dataset's samples (rewritten for fill-in-the-middle with --fim-data)."""
        samples = GPTDataset(
            IndexedDataset(prefix, self.config.data.mmap_bin_files),
            documents,
            self.config.data.seq_length,
            num_samples,
            self.config.training.seed,
            self.cache / "indices",
            lambda path, build: self.once(path, build),
        )
        return samples if self.fim is None else FIMSamples(samples, self.fim, self.config.training.seed)

    def blend(
        self, prefixes: list[str], ranges: list[np.ndarray], weights: list[float] | None, size: int, what: str
    ) -> SampleSource:
        """Megatron-LM's blend of one split: a single dataset as is; weighted datasets for
        sum(ceil(size x w)) samples; unweighted ones for one epoch each, weighted by length."""
        for prefix, documents in zip(prefixes, ranges):
            if len(documents) == 0:
                raise DataError(
                    f"{prefix}: no documents fall in the {what} split; change --split or give that split its own data"
                )
        if len(prefixes) == 1 and weights is None:
            return self.gpt_dataset(prefixes[0], ranges[0], size)
        if weights is None:
            datasets = [self.gpt_dataset(p, r, None) for p, r in zip(prefixes, ranges)]
            lengths = [len(ds) for ds in datasets]
            if sum(lengths) < size:
                raise DataError(
                    f"the {what} data holds {sum(lengths)} samples in one epoch but {size} are needed; "
                    "give --data-path weights (WEIGHT PREFIX ...) to repeat it"
                )
            weights, total = (np.asarray(lengths, np.float64) / sum(lengths)).tolist(), size
        else:
            targets = [math.ceil(size * w) for w in weights]
            datasets = [self.gpt_dataset(p, r, n) for p, r, n in zip(prefixes, ranges, component_sizes(weights, size))]
            total = sum(targets)
        names = [f"{prefix}[{documents[0]}:{documents[-1] + 1}]" for prefix, documents in zip(prefixes, ranges)]
        return BlendedDataset(
            datasets, weights, total, self.cache / "indices", lambda path, build: self.once(path, build), names
        )


def build_data(
    config: Config,
    global_batch_size: int,
    local_rank: int = 0,
    log: Log = print,
    saved_tokenizer: Tokenizer | None = None,
) -> DataBundle:
    """The run's tokenizer, training and validation samples (`saved_tokenizer`: see `_Builder.tokenizer`)."""
    d, seed = config.data, config.training.seed
    train_samples, valid_samples, _ = samples_per_split(config, global_batch_size)
    if d.mock_data:
        vocab = config.model.vocab_size or MOCK_VOCAB
        cyclic = d.dataloader_type == "cyclic"  # (as Megatron's mock dataset: as many samples as the run reads)
        sizes = (max(train_samples, 1), max(valid_samples, 1)) if cyclic else (1 << 40, 1 << 40)
        mock_train, mock_valid = (_mock(config, vocab, seed + i, size) for i, size in enumerate(sizes))
        return DataBundle(_ordered(config, mock_train, True), _ordered(config, mock_valid, False), None, vocab)

    builder = _Builder(config, local_rank, log)
    tokenizer, tokenizer_id, vocab = builder.tokenizer_and_vocabulary(saved_tokenizer)

    if d.sft:
        sft = sft_sources(config, tokenizer, train_samples, valid_samples, builder.cache / "indices", builder.once, log)
        image_token = image_token_id(config, tokenizer) if config.model.has_vision else None  # type: ignore[arg-type]
        train, valid = _ordered(config, sft.train, True), _ordered(config, sft.valid, False)
        return DataBundle(train, valid, tokenizer, vocab, sft.valid_tasks, image_token, sft.truncated)

    if d.fim_data:
        builder.fim = fim_transform(d, tokenizer)
    if d.corpus == "stdlib":
        blends = {"--data-path": Blend([builder.preprocessed(stdlib_files(), False, tokenizer, tokenizer_id)], None)}
    else:
        blends = {}
        for values, flag in d.blend_flags():
            blend = parse_blend(values, flag)
            prefixes = [builder.resolve(p, flag, tokenizer, tokenizer_id) for p in blend.paths]
            blends[flag] = Blend(prefixes, blend.weights)

    def sequences(prefix: str) -> int:
        return len(IndexedDataset(prefix))

    if "--data-path" in blends:  # one blend, each dataset cut by --split
        blend = blends["--data-path"]
        cuts = [split_ranges(sequences(p), d.split) for p in blend.paths]
        train_parts = (blend.paths, [c[0] for c in cuts], blend.weights)
        valid_parts = (blend.paths, [c[1] for c in cuts], blend.weights)
    else:  # a blend per split, used whole

        def whole(flag: str) -> tuple:
            blend = blends.get(flag, Blend([], None))
            return blend.paths, [np.arange(sequences(p), dtype=np.int32) for p in blend.paths], blend.weights

        train_parts, valid_parts = whole("--train-data-path"), whole("--valid-data-path")

    train = builder.blend(*train_parts, train_samples, "train")
    valid = builder.blend(*valid_parts, valid_samples, "validation") if config.training.eval_iters != 0 else None
    return DataBundle(_ordered(config, train, True), _ordered(config, valid, False), tokenizer, vocab)


def _mock(config: Config, vocab: int, seed: int, size: int) -> SampleSource:
    """--mock-data: progressions of tokens, with random images for a vision-language model."""
    m, seq_length = config.model, config.data.seq_length
    if not m.has_vision:
        return MockTokens(vocab, seq_length, seed, size)
    placeholder = m.with_changes(vocab_size=vocab).placeholder_id
    return MockVisionSamples(vocab, seq_length, placeholder, m.image_tokens, (m.img_h, m.img_w), seed, size)


def _ordered(config: Config, samples: SampleSource | None, training: bool) -> SampleSource | None:
    """Samples read as --dataloader-type says, the training ones by --num-workers worker processes
    (validation batches are few: read in the training process)."""
    d = config.data
    workers = d.num_workers if training else 0
    if samples is None or (d.dataloader_type == "single" and workers == 0):
        return samples
    return LoaderSource(samples, d.dataloader_type, workers, d.data_sharding)


def evaluation_sources(
    config: Config, local_rank: int = 0, log: Log = print, saved_tokenizer: Tokenizer | None = None
) -> tuple[AnyTokenizer, int, dict[str, SampleSource]]:
    """For `paratron evaluate`: the tokenizer, the vocabulary size and every --data-path file's
    samples by task name, whole and in order: with --sft each conversation once (cut to
    --seq-length as --sft-truncation says); otherwise the file's token stream in windows
    (`StreamWindows`), so that every token but the first is scored once. A file with nothing to
    score is refused, naming it."""
    d = config.data
    builder = _Builder(config, local_rank, log)
    tokenizer, tokenizer_id, vocab = builder.tokenizer_and_vocabulary(saved_tokenizer)
    paths = parse_blend(d.data_path).paths
    names = unique_task_names(paths)
    documents = DocumentLayout.of(d, config.model, tokenizer.eod_id)
    tasks: dict[str, SampleSource] = {}
    if d.sft:
        for name, path, task in zip(names, paths, whole_tasks(config, tokenizer, paths, names)):
            _check_scored_conversations(path, task, d.seq_length)
            if task.truncated:
                log(
                    f"{name}: {task.truncated} conversation(s) longer than --seq-length {d.seq_length} were "
                    "truncated (--sft-truncation truncate); only their first --seq-length positions are scored"
                )
            tasks[name] = task
        return tokenizer, vocab, tasks
    for name, path in zip(names, paths):
        prefix = builder.resolve(path, "--data-path", tokenizer, tokenizer_id)
        windows = StreamWindows(IndexedDataset(prefix, d.mmap_bin_files), d.seq_length, documents)
        if windows.trained_tokens_per_epoch == 0:
            count = windows.num_tokens
            raise DataError(
                f"{path}: holds {count} token{'' if count == 1 else 's'}; a score needs at least 2 (one read, "
                "one predicted); give it more text or leave it out of --data-path"
            )
        tasks[name] = windows
    return tokenizer, vocab, tasks


def _check_scored_conversations(path: str, task: SFTDataset, seq_length: int) -> None:
    """Refuse a conversation file none of whose scored positions is an assistant token."""
    if task.trained_tokens_per_epoch == 0:
        raise DataError(
            f"{path}: none of its {len(task.conversations)} conversation(s) has an assistant token within "
            f"--seq-length {seq_length}, so nothing is scored; give it assistant turns or leave it out of --data-path"
        )
