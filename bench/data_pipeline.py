"""Data pipeline benchmarks, each side by side with its reference on the same machine.

    python bench/data_pipeline.py throughput   # preprocess vs HF tokenizers' own encode_batch (the ceiling)
    python bench/data_pipeline.py memory       # peak memory of `paratron preprocess` as the input grows
    python bench/data_pipeline.py index        # GPT sample index over 1M documents vs megatron-core's C++
    python bench/data_pipeline.py all --output bench/results/data_pipeline.json
    python bench/data_pipeline.py all --smoke  # each part on a megabyte: does it still run?

Inputs are generated into a scratch folder (--scratch, default a temporary directory)
from the standard library's own source, so the numbers are reproducible anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common import add_smoke_argument, apply_smoke
from paratron.data.corpus import stdlib_files
from paratron.data.gpt_dataset import build_sample_indices
from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter
from paratron.data.preprocess import preprocess
from paratron.data.tokenizer import train_byte_level_bpe


def stdlib_texts(limit: int | None = None) -> list[str]:
    """The standard library's source files (the first `limit` of them), as texts."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in list(stdlib_files())[:limit]]
    return [t for t in texts if t]


def write_jsonl(path: Path, texts: list[str], target_bytes: int) -> int:
    """Repeat `texts` as jsonl lines until the file holds about `target_bytes`."""
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line.encode())
                if written >= target_bytes:
                    break
    return written


def throughput(scratch: Path, megabytes: int, files: int | None = None, vocab: int = 8192) -> dict:
    texts = stdlib_texts(files)
    data = scratch / "throughput.jsonl"
    write_jsonl(data, texts, megabytes << 20)
    tokenizer = train_byte_level_bpe(iter(texts), vocab)
    documents = [json.loads(line)["text"] for line in data.open(encoding="utf-8")]
    text_mb = sum(len(t.encode()) for t in documents) / 1e6
    result: dict = {"input_mb": data.stat().st_size / 1e6, "text_mb": text_mb}
    for name in ("encode_batch", "encode_batch_fast"):  # the ceiling is the faster of HF's two batch calls
        start = time.perf_counter()
        encodings = getattr(tokenizer.hf, name)(documents, add_special_tokens=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(e.ids) for e in encodings)
        del encodings
        result[f"hf_{name}"] = {"seconds": seconds, "mb_per_s": text_mb / seconds, "tokens_per_s": tokens / seconds}
    result["tokens"] = tokens
    ceiling_s = min(result["hf_encode_batch"]["seconds"], result["hf_encode_batch_fast"]["seconds"])
    del documents
    for workers in (1, 2):
        run = preprocess(
            [data], str(scratch / f"tp{workers}"), tokenizer, append_eod=True, workers=workers, progress=False
        )
        result[f"paratron_workers_{workers}"] = {
            "seconds": run.seconds,
            "mb_per_s": text_mb / run.seconds,
            "tokens_per_s": (run.tokens - run.documents) / run.seconds,
            "ratio_to_ceiling": ceiling_s / run.seconds,
        }
    return result


def _tree_rss_bytes(root: int) -> int:
    """Resident memory of a process and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def peak_memory_of(command: list[str]) -> tuple[int, float]:
    """Run a command; return the peak resident memory of its process tree and its wall time."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss_bytes(proc.pid))
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    done.set()
    watcher.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {err}")
    return peak, time.perf_counter() - start


def memory(
    scratch: Path, sizes_mb: list[int], bpe_sizes_mb: list[int], files: int | None = None, vocab: int = 8192
) -> dict:
    texts = stdlib_texts(files)
    tokenizer = train_byte_level_bpe(iter(texts), vocab)
    tokenizer.save(scratch / "tokenizer.json")
    rng = np.random.default_rng(0)
    id_texts = [" ".join(map(str, rng.integers(0, 50000, size=int(rng.integers(50, 2000))))) for _ in range(2000)]
    rows = []
    for kind, sizes, source in (
        ("NullTokenizer", sizes_mb, id_texts),
        ("HuggingFaceTokenizer (BPE 8192)", bpe_sizes_mb, texts),
    ):
        for mb in sizes:
            data = scratch / f"mem-{mb}.jsonl"
            write_jsonl(data, source, mb << 20)
            tokenizer_flags = (
                ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50000"]
                if kind == "NullTokenizer"
                else ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(scratch / "tokenizer.json")]
            )
            command = [
                sys.executable,
                "-m",
                "paratron",
                "preprocess",
                "--input",
                str(data),
                "--output-prefix",
                str(scratch / f"mem-{mb}"),
                "--workers",
                "2",
                "--append-eod",
                "--no-progress-bar",
                *tokenizer_flags,
            ]
            peak, seconds = peak_memory_of(command)
            rows.append(
                {
                    "tokenizer": kind,
                    "input_mb": data.stat().st_size / 1e6,
                    "peak_rss_mb": peak / 1e6,
                    "seconds": seconds,
                    "mb_per_s": data.stat().st_size / 1e6 / seconds,
                }
            )
            print(rows[-1], flush=True)
            data.unlink()
            for suffix in (".bin", ".idx"):
                Path(f"{scratch}/mem-{mb}_text_document{suffix}").unlink()
    return {"rows": rows}


def index(scratch: Path, documents: int, seq_length: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, size=documents).astype(np.int32)
    prefix = scratch / "million"
    writer = IndexedDatasetWriter(prefix, np.uint16)
    writer.lengths.extend(lengths.tolist())
    writer.finalize()
    with open(f"{prefix}.bin", "r+b") as f:  # a sparse file of the right size: only the index is read
        f.truncate(int(lengths.sum()) * 2)
    ds = IndexedDataset(prefix)
    train = np.arange(int(documents * 0.969), dtype=np.int32)
    samples = int(ds.sequence_lengths[train].sum()) // seq_length  # about one epoch
    ours_times, theirs_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours = build_sample_indices(ds.sequence_lengths, train, seq_length, samples, 1234)
        ours_times.append(time.perf_counter() - start)
        theirs_times.append(_megatron_index_seconds(ds, train, seq_length, ours))
    ours_s, theirs_s = statistics.median(ours_times), statistics.median(theirs_times)
    return {
        "documents": documents,
        "train_documents": len(train),
        "tokens": int(lengths.sum()),
        "samples": samples,
        "seq_length": seq_length,
        "repeats": repeats,
        "paratron_seconds": ours_s,
        "megatron_core_seconds": theirs_s,
        "ratio": ours_s / theirs_s,
    }


def _megatron_index_seconds(ds: IndexedDataset, train: np.ndarray, seq_length: int, ours: tuple) -> float:
    """megatron-core's own build of the same index (its C++ sample index); checks it equals ours."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers
        from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
    start = time.perf_counter()
    state = np.random.RandomState(1234)
    document_index = _build_document_index(train, 1, state, False)
    sample_index = helpers.build_sample_idx(
        ds.sequence_lengths, document_index, seq_length, 1, int(ds.sequence_lengths[train].sum()), True, 1
    )
    shuffle_index = _build_shuffle_index(sample_index.shape[0] - 1, sample_index.shape[0] - 1, state)
    theirs_s = time.perf_counter() - start
    assert np.array_equal(ours[1], sample_index) and np.array_equal(ours[2], shuffle_index)
    return theirs_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["throughput", "memory", "index", "all"])
    parser.add_argument("--scratch", type=Path, default=None)
    parser.add_argument("--throughput-mb", type=int, default=40)
    parser.add_argument("--memory-mb", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--bpe-memory-mb", type=int, nargs="+", default=[40, 400])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5, help="index: builds timed on each side")
    parser.add_argument("--files", type=int, default=None, help="standard-library files to read (default: all)")
    parser.add_argument("--vocab", type=int, default=8192, help="the BPE tokenizer's vocabulary")
    parser.add_argument("--output", type=Path, default=None)
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    tiny = dict(throughput_mb=1, memory_mb=[1], bpe_memory_mb=[], documents=20_000, repeats=1, files=40, vocab=512)
    apply_smoke(args, parser, **tiny)
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        results = {}
        if args.what in ("throughput", "all"):
            results["throughput"] = throughput(Path(scratch), args.throughput_mb, args.files, args.vocab)
            print(json.dumps(results["throughput"], indent=2), flush=True)
        if args.what in ("index", "all"):
            results["index"] = index(Path(scratch), args.documents, 2048, args.repeats)
            print(json.dumps(results["index"], indent=2), flush=True)
        if args.what in ("memory", "all"):
            results["memory"] = memory(Path(scratch), args.memory_mb, args.bpe_memory_mb, args.files, args.vocab)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
