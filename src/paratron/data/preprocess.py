"""Text and jsonl into Megatron-LM indexed datasets: `paratron preprocess`.

Reading, tokenizing and writing stream: the main process reads documents and writes
finished batches in order, N worker processes tokenize, and at most 2 x N batches are in
flight, so memory stays flat however large the input. Outputs are written under
temporary names and renamed at the end.

Inputs: `.jsonl` / `.json` / `.ndjson` files hold one JSON object per line, whose
--json-keys fields are documents (one output dataset per key); any other file is one
plain-text document. Directories are read recursively (hidden entries skipped).
Bad input (bytes that are not UTF-8, a line that is not JSON or lacks the key, an empty
document) stops with the file and line, or is skipped and counted with --skip-bad-lines.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from paratron.data.indexed import HEADER_BYTES, OUTPUT_FIX, IndexedDatasetWriter, optimal_dtype
from paratron.data.tokenizer import AnyTokenizer, Tokenizer, tokenizer_from_spec
from paratron.errors import DataError
from paratron.storage import write_text_atomic

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
BATCH_DOCUMENTS = 256
BATCH_BYTES = 4 << 20


@dataclass
class Document:
    texts: list[str]
    """One text per json key."""
    where: str
    """'file:line N' or 'file', for error messages."""
    nbytes: int


@dataclass
class PreprocessResult:
    prefixes: list[str]
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    skipped: int = 0
    seconds: float = 0.0
    skipped_examples: list[str] = field(default_factory=list)


def input_files(paths: Sequence[str], flag: str = "--input") -> list[Path]:
    """Files and directories (recursively, hidden entries skipped) -> files, in a fixed order."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            out.extend(
                sorted(
                    p
                    for p in path.rglob("*")
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
                )
            )
        elif path.is_file():
            out.append(path)
        else:
            raise DataError(f"{flag} {raw}: no such file or directory")
    if not out:
        raise DataError(f"{flag} {' '.join(paths)}: no files found")
    return out


class _BadInput(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)


def _decode(data: bytes, where: str, base_offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _BadInput(f"{where}: byte {base_offset + exc.start} of the file is not valid UTF-8") from None


def _check_text(text: str, where: str) -> None:
    """JSON can smuggle in lone surrogates (\\ud800), which are not text any tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _BadInput(f"{where}: character {exc.start} is a lone surrogate, not valid Unicode text") from None


def _documents_of(path: Path, json_keys: Sequence[str]) -> Iterator[Document | _BadInput]:
    if path.suffix.lower() not in JSON_SUFFIXES:  # a whole file is one document (use jsonl for huge ones)
        data = path.read_bytes()
        try:
            text = _decode(data, str(path), 0)
            if not text:
                raise _BadInput(f"{path}: empty document")
            yield Document([text] * len(json_keys), str(path), len(data))
        except _BadInput as bad:
            yield bad
        return
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                text = _decode(line, where, offset)
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise _BadInput(f"{where}: not valid JSON ({exc.msg}, column {exc.colno})") from None
                texts = []
                for key in json_keys:
                    if not isinstance(record, dict) or key not in record:
                        raise _BadInput(f"{where}: no key {key!r}")
                    if not isinstance(record[key], str):
                        raise _BadInput(f"{where}: the value of {key!r} is not a string")
                    if not record[key]:
                        raise _BadInput(f"{where}: empty document under {key!r}")
                    _check_text(record[key], where)
                    texts.append(record[key])
                yield Document(texts, where, len(line))
            except _BadInput as bad:
                yield bad
            offset += len(line)


def read_documents(
    files: Sequence[Path], json_keys: Sequence[str], result: PreprocessResult, skip_bad_lines: bool
) -> Iterator[Document]:
    for path in files:
        for item in _documents_of(path, json_keys):
            if isinstance(item, _BadInput):
                _reject(str(item), result, skip_bad_lines)
            else:
                yield item


def _reject(message: str, result: PreprocessResult, skip: bool) -> None:
    if not skip:
        raise DataError(message + " (--skip-bad-lines skips such lines)")
    result.skipped += 1
    if len(result.skipped_examples) < 3:
        result.skipped_examples.append(message)


# ---------------------------------------------------------------- tokenizing (in workers)

_WORKER_TOKENIZER: AnyTokenizer | None = None


def _init_worker(spec: dict) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER_TOKENIZER = tokenizer_from_spec(spec)


def _encode(
    texts_per_key: list[list[str]], tokenizer: AnyTokenizer | None = None
) -> list[tuple[np.ndarray, np.ndarray, list[tuple[int, str]]]]:
    """For each key: (tokens of all documents concatenated, each document's length, errors)."""
    tokenizer = tokenizer or _WORKER_TOKENIZER
    assert tokenizer is not None
    out = []
    for texts in texts_per_key:
        errors: list[tuple[int, str]] = []
        try:
            encoded = tokenizer.encode_batch(texts)
        except (ValueError, TypeError):  # find the offending document(s)
            encoded = []
            for i, text in enumerate(texts):
                try:
                    encoded.append(tokenizer.encode(text))
                except (ValueError, TypeError) as exc:
                    errors.append((i, str(exc)))
                    encoded.append([])
        lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
        flat = (
            np.concatenate([np.asarray(ids, dtype=np.int64) for ids in encoded]) if encoded else np.zeros(0, np.int64)
        )
        out.append((flat, lengths, errors))
    return out


def _with_eod(tokens: np.ndarray, lengths: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(lengths)
    return np.insert(tokens, ends, eod), lengths + 1


def _projected_bytes(tokens: int, documents: int, dtype: type, share: float) -> int:
    """The finished .bin and .idx of a dataset that has `tokens` and `documents` once `share` of
    the input is read: what a full disk's line says it needs."""
    done = tokens * np.dtype(dtype).itemsize + documents * 20  # (.idx: a length, a pointer, a document entry)
    return HEADER_BYTES + 8 + int(done / max(share, 1e-12))


def save_trained_tokenizer(tokenizer: Tokenizer, output_prefix: str) -> Path:
    """OUTPUT_PREFIX_tokenizer.json, the BPE `paratron preprocess` trained on its input: through a
    temporary file, so a full disk says so in one line and leaves nothing behind."""
    path = Path(f"{output_prefix}_tokenizer.json")
    write_text_atomic(path, tokenizer.hf.to_str(pretty=True), "the trained tokenizer", OUTPUT_FIX)
    return path


# ---------------------------------------------------------------- the pipeline


def preprocess(
    files: Sequence[Path],
    output_prefix: str,
    tokenizer: AnyTokenizer,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> PreprocessResult:
    """Write OUTPUT_PREFIX_{key}_document.bin/.idx for each json key; returns the counts.

    A document that is bad under any key is skipped under all of them (with --skip-bad-lines),
    so the datasets of several keys stay aligned document by document."""
    if len(set(json_keys)) != len(json_keys):
        raise DataError(f"--json-keys {' '.join(json_keys)}: a key is named twice")
    start = time.perf_counter()
    prefixes = [f"{output_prefix}_{key}_document" for key in json_keys]
    result = PreprocessResult(prefixes)
    total_bytes = sum(p.stat().st_size for p in files)
    output = _Output(result, tokenizer, append_eod, skip_bad_lines, total_bytes, start)
    tokenizing = None
    try:
        output.open()
        if progress:
            output.bar = _progress_bar(total_bytes)
        tokenizing = _Tokenizing(output, tokenizer, workers, len(json_keys))
        for batch in _batches(read_documents(files, json_keys, result, skip_bad_lines)):
            tokenizing.submit(batch)
        tokenizing.finish()
        if result.documents == 0:
            raise DataError(f"{' '.join(map(str, files))}: no documents to write")
        output.finalize()
    except BaseException:
        output.abort()
        raise
    finally:
        if tokenizing is not None:
            tokenizing.close()
        output.close_bar()
    result.seconds = time.perf_counter() - start
    return result


def _batches(documents: Iterator[Document]) -> Iterator[list[Document]]:
    """Documents in batches of BATCH_DOCUMENTS, or fewer that reach BATCH_BYTES."""
    batch: list[Document] = []
    batch_bytes = 0
    for document in documents:
        batch.append(document)
        batch_bytes += document.nbytes
        if len(batch) >= BATCH_DOCUMENTS or batch_bytes >= BATCH_BYTES:
            yield batch
            batch, batch_bytes = [], 0
    if batch:
        yield batch


def _progress_bar(total_bytes: int) -> Any:
    """The bar of the input read so far, in bytes."""
    from tqdm import tqdm  # (lazy for start-up speed of the tokenizing workers, docs/architecture.md)

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="preprocess", dynamic_ncols=True)


class _Output:
    """The datasets being written, one per json key, with the counts so far and the progress bar: each tokenized
    batch goes to every key's dataset, less the documents that are bad under any key."""

    def __init__(
        self,
        result: PreprocessResult,
        tokenizer: AnyTokenizer,
        append_eod: bool,
        skip_bad_lines: bool,
        total_bytes: int,
        start: float,
    ) -> None:
        self.result, self.tokenizer = result, tokenizer
        self.append_eod, self.skip_bad_lines = append_eod, skip_bad_lines
        self.total_bytes, self.start = total_bytes, start
        self.dtype = optimal_dtype(tokenizer.vocab_size)
        self.writers: list[IndexedDatasetWriter] = []
        self.written = [[0, 0] for _ in result.prefixes]  # tokens and documents of each key's dataset so far
        self.bar: Any = None

    def open(self) -> None:
        for prefix in self.result.prefixes:
            self.writers.append(IndexedDatasetWriter(prefix, self.dtype))

    def write(self, batch: list[Document], encoded: list) -> None:
        """A batch's tokens (`_encode`'s, one entry per key) appended to the datasets, its bad documents rejected."""
        bad = self._reject_bad(batch, encoded)
        keep = np.ones(len(batch), dtype=bool)
        keep[list(bad)] = False
        share = (self.result.input_bytes + sum(d.nbytes for d in batch)) / max(self.total_bytes, 1)
        for writer, (tokens, lengths, _), counts in zip(self.writers, encoded, self.written):
            if bad:
                tokens, lengths = _kept(tokens, lengths, keep)
            self._add(writer, tokens, lengths, counts, share)
        self.result.documents += int(keep.sum())
        self._advance(sum(d.nbytes for d in batch))

    def _reject_bad(self, batch: list[Document], encoded: list) -> dict[int, str]:
        """The batch's documents that are bad under any key (an error, no tokens), each rejected (`_reject`)."""
        bad: dict[int, str] = {}
        for _, lengths, errors in encoded:
            bad.update(errors)
            bad.update(
                {int(i): "the document has no tokens" for i in np.flatnonzero(lengths == 0) if int(i) not in bad}
            )
        for i in sorted(bad):
            _reject(f"{batch[i].where}: {bad[i]}", self.result, self.skip_bad_lines)
        return bad

    def _add(
        self, writer: IndexedDatasetWriter, tokens: np.ndarray, lengths: np.ndarray, counts: list[int], share: float
    ) -> None:
        """One key's documents appended (with the end-of-document token if asked), with the dataset's projected
        size for a full disk's line (`share`: of the input read once this batch is written)."""
        if self.append_eod:
            tokens, lengths = _with_eod(tokens, lengths, self.tokenizer.eod_id)
        counts[0] += tokens.size
        counts[1] += lengths.size
        writer.expected_bytes = _projected_bytes(counts[0], counts[1], self.dtype, share)
        try:
            writer.add_documents(tokens, lengths)
        except ValueError as exc:  # ids beyond what the tokenizer's vocabulary size promised
            raise DataError(
                f"{writer.prefix}: {exc}; the tokenizer's vocabulary size is {self.tokenizer.vocab_size}"
            ) from None
        self.result.tokens += int(lengths.sum())

    def _advance(self, nbytes: int) -> None:
        """The input read so far, on the bar with the documents per second."""
        self.result.input_bytes += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix(docs_s=f"{self.result.documents / elapsed:,.0f}", refresh=False)

    def finalize(self) -> None:
        for writer in self.writers:
            writer.finalize()

    def abort(self) -> None:
        for writer in self.writers:
            writer.abort()

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _kept(tokens: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documents `keep` marks, of a batch's concatenated tokens and their lengths."""
    pieces = np.split(tokens, np.cumsum(lengths)[:-1])
    tokens = np.concatenate([t for t, k in zip(pieces, keep) if k]) if keep.any() else tokens[:0]
    return tokens, lengths[keep]


class _Tokenizing:
    """Batches tokenized here (one worker) or by a pool of N processes with at most 2 x N batches in flight,
    written in the order they were read."""

    def __init__(self, output: _Output, tokenizer: AnyTokenizer, workers: int, keys: int) -> None:
        self.output, self.tokenizer, self.workers, self.keys = output, tokenizer, workers, keys
        self.in_flight: deque = deque()
        self.pool = None
        if workers > 1:
            self.pool = multiprocessing.get_context("spawn").Pool(
                workers, initializer=_init_worker, initargs=(tokenizer.spec(),)
            )

    def submit(self, batch: list[Document]) -> None:
        texts = [[d.texts[k] for d in batch] for k in range(self.keys)]
        if self.pool is None:
            self.output.write(batch, _encode(texts, self.tokenizer))
            return
        self.in_flight.append((batch, self.pool.apply_async(_encode, (texts,))))
        while len(self.in_flight) >= 2 * self.workers:
            done, job = self.in_flight.popleft()
            self.output.write(done, job.get())

    def finish(self) -> None:
        """The batches still in flight, written."""
        while self.in_flight:
            done, job = self.in_flight.popleft()
            self.output.write(done, job.get())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
