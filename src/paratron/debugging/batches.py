"""--dump-batches N: the first N global training batches, exactly as the loader feeds steps 1..N, written as text
(RUN_DIR/batches.txt) and as records (RUN_DIR/batches.jsonl) before training starts, so that what the model is
taught can be read: the decoded tokens, which of them are trained, where documents or conversations meet.

A global batch is gathered as the data-parallel ranks together read it (`data.loader`: micro-batch after
micro-batch, rank after rank, each through the same `collate` and `DocumentLayout`), so the dump is the same at
every layout. The loss mask is the labels' (`model.batch.IGNORE_INDEX` untrained): position t predicts token t+1,
so in the text a token is marked untrained when its prediction is not trained (a prompt's tokens, padding, the
token after an end-of-document with --eod-mask-loss); a trained target that is not the next input (a packed
conversation's last token, a row's last label) is shown where it is predicted.

Only reads: the samples are indexed as the loader indexes them, nothing is consumed or cached (no step is spent).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paratron.config.layout import BatchPlan, Layout
from paratron.data.datasets import SampleSource
from paratron.data.loader import DocumentLayout, LoaderSource, collate
from paratron.data.tokenizer import AnyTokenizer, Tokenizer
from paratron.model.batch import IGNORE_INDEX, Batch
from paratron.storage import write_text_atomic

TEXT, RECORDS = "batches.txt", "batches.jsonl"
UNTRAINED_OPEN, UNTRAINED_CLOSE, BOUNDARY = "⟦", "⟧", "‖"
"""The text's marks: ⟦untrained tokens⟧, and ‖ where a new document or conversation starts."""


@dataclass(frozen=True)
class BatchSource:
    """What the loader draws a run's global batches from, and how it lays them out."""

    samples: SampleSource
    layout: Layout
    """The run's layout: its data-parallel ranks and micro-batch size."""
    global_batch_at: Callable[[int], int]
    """The global batch size of the step that starts after this many samples (--rampup-batch-size)."""
    documents: DocumentLayout = DocumentLayout()
    tokenizer: AnyTokenizer | None = None
    image_token_id: int | None = None


@dataclass
class SampleRecord:
    """One row of a global batch, as batches.jsonl holds it."""

    step: int
    sample: int
    """Its global sample index."""
    dp_rank: int
    micro_batch: int
    input_ids: list[int]
    labels: list[int]
    loss_mask: list[int]
    """1 where the prediction at this position (of the next token) is trained."""
    pieces: list[str]
    document_starts: list[int]
    """Positions where a new document (or packed conversation) starts, after the first."""
    position_ids: list[int] | None = None
    segment_ids: list[int] | None = None
    image_tokens: list[list[int]] | None = None
    """[start, end) of each run of image placeholder tokens (vision-language samples)."""


def global_batch_rows(source: BatchSource, consumed: int) -> Iterator[tuple[int, int, int, Batch, int]]:
    """(global sample index, data-parallel rank, micro-batch, the collated micro-batch, row) of every sample of the
    global batch at `consumed`, in the loader's order."""
    size = source.global_batch_at(consumed)
    plans = [source.layout.batches(rank, size) for rank in range(source.layout.dp)]
    per_rank = [_indices(source.samples, plan, consumed) for plan in plans]
    for micro in range(plans[0].num_micro_batches):
        for rank, indices in enumerate(per_rank):
            batch = collate([source.samples[i] for i in indices[micro]], source.documents)
            for row, index in enumerate(indices[micro]):
                yield index, rank, micro, batch, row


def _indices(samples: SampleSource, plan: BatchPlan, consumed: int) -> list[list[int]]:
    if isinstance(samples, LoaderSource):  # (--dataloader-type cyclic reorders)
        return samples.sample_indices(plan, consumed)
    return plan.sample_indices(consumed)


def sample_record(source: BatchSource, step: int, where: tuple[int, int, int], batch: Batch, row: int) -> SampleRecord:
    """One row of a micro-batch decoded, with its mask, boundaries and image placeholders."""
    ids = batch.input_ids[row].tolist()
    labels = batch.labels[row].tolist()
    positions = None if batch.position_ids is None else batch.position_ids[row].tolist()
    segments = None if batch.segment_ids is None else batch.segment_ids[row].tolist()
    record = SampleRecord(
        step,
        *where,
        input_ids=ids,
        labels=labels,
        loss_mask=[int(label != IGNORE_INDEX) for label in labels],
        pieces=[_piece(source.tokenizer, i) for i in ids],
        document_starts=_document_starts(ids, segments, source.documents.eod_id),
        position_ids=positions,
        segment_ids=segments,
    )
    if source.image_token_id is not None:
        record.image_tokens = _runs(np.asarray(ids) == source.image_token_id)
    return record


def _piece(tokenizer: AnyTokenizer | None, token_id: int) -> str:
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id])


def _document_starts(ids: list[int], segments: list[int] | None, eod_id: int | None) -> list[int]:
    """Where a new document starts: the segment numbers change (packing, --reset-attention-mask), or else the token
    after an end-of-document token."""
    if segments is not None:
        return [t for t in range(1, len(segments)) if segments[t] != segments[t - 1]]
    if eod_id is None:
        return []
    return [t + 1 for t in range(len(ids) - 1) if ids[t] == eod_id]


def _runs(flags: np.ndarray) -> list[list[int]]:
    """[start, end) of every run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])]


def shown_tokens(record: SampleRecord, piece: Callable[[int], str]) -> list[tuple[str, bool, bool]]:
    """(piece, trained, starts a document) of each token the text shows: the inputs, token t trained when position
    t - 1 is trained to predict it (a row's first token, never predicted, marked as its next); and where a trained
    target is not the next input (a conversation's last token, the row's last label) that target itself, trained."""
    ids, labels, n = record.input_ids, record.labels, len(record.input_ids)
    starts = set(record.document_starts)
    shown: list[tuple[str, bool, bool]] = []
    for t in range(n):
        if t and labels[t - 1] != IGNORE_INDEX and labels[t - 1] != ids[t]:
            shown.append((piece(labels[t - 1]), True, False))
        trained = labels[t - 1] == ids[t] if t else n > 1 and labels[0] == ids[1]
        shown.append((record.pieces[t], trained, t in starts))
    if n and labels[-1] != IGNORE_INDEX:
        shown.append((piece(labels[-1]), True, False))
    return shown


def sample_text(record: SampleRecord, joiner: str, piece: Callable[[int], str]) -> str:
    """The sample as text: ⟦untrained⟧ runs, ‖ at document starts, image placeholders collapsed; pieces joined by
    `joiner` (nothing for a text tokenizer's pieces, a space for bare ids)."""
    images = {start: end for start, end in record.image_tokens or []}
    image_piece = piece(record.input_ids[next(iter(images))]) if images else None
    out: list[str] = []
    run: list[str] = []
    run_trained = True

    def flush() -> None:
        if run:
            text = joiner.join(run)
            out.append(text if run_trained else f"{UNTRAINED_OPEN}{text}{UNTRAINED_CLOSE}")
            run.clear()

    count = 0
    for text, trained, starts in shown_tokens(record, piece):
        is_image = image_piece is not None and text == image_piece  # (a run of placeholders shown as one mark)
        if count and not is_image:
            run.append(f"<image x{count}>")
            count = 0
        if starts:
            flush()
            out.append(BOUNDARY if joiner else f" {BOUNDARY} ")
        if trained != run_trained:
            flush()
            run_trained = trained
        if is_image:
            count += 1
        else:
            run.append(text)
    if count:
        run.append(f"<image x{count}>")
    flush()
    return joiner.join(out)


def header(source: BatchSource, count: int, first_step: int, seq_length: int) -> list[str]:
    d = source.documents
    eod = d.eod_id if d.eod_id is not None else "none"
    on = {True: "on", False: "off"}
    return [
        f"# the first {count} global training batch(es), steps {first_step}..{first_step + count - 1}, "
        f"{seq_length} tokens per sample, as the loader feeds them",
        f"# {UNTRAINED_OPEN}...{UNTRAINED_CLOSE}: tokens not trained (no loss on predicting them); "
        f"{BOUNDARY}: a new document or conversation starts; <image xN>: N image placeholder tokens",
        f"# end-of-document id {eod}; position ids reset per document: {on[d.reset_position_ids]}; attention reset "
        f"per document: {on[d.reset_attention_mask]}; end-of-document loss masked: {on[d.eod_mask_loss]}",
    ]


def dump_batches(source: BatchSource, count: int, consumed: int, run_dir: Path, first_step: int = 1) -> Path:
    """Write the `count` global batches from `consumed` samples on to run_dir/batches.txt and batches.jsonl (each
    whole or not at all); returns the text file. Reads only: the run's data order is untouched."""
    joiner = "" if isinstance(source.tokenizer, Tokenizer) else " "
    lines: list[str] = []
    records: list[dict[str, Any]] = []
    seq_length = 0
    for step in range(first_step, first_step + count):
        lines.append(f"\n== step {step} (global batch at consumed sample {consumed}) ==")
        for index, rank, micro, batch, row in global_batch_rows(source, consumed):
            record = sample_record(source, step, (index, rank, micro), batch, row)
            seq_length = len(record.input_ids)
            trained, documents = sum(record.loss_mask), len(record.document_starts) + 1
            lines.append(
                f"-- sample {index} (data-parallel rank {rank}, micro-batch {micro}): {trained}/{seq_length} "
                f"positions trained, {documents} document(s)"
            )
            lines.append(sample_text(record, joiner, lambda token: _piece(source.tokenizer, token)))
            records.append(vars(record))
        consumed += source.global_batch_at(consumed)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "\n".join(header(source, count, first_step, seq_length) + lines) + "\n"
    fix = "free space or choose another --run-dir"
    write_text_atomic(run_dir / RECORDS, "".join(json.dumps(r) + "\n" for r in records), "the batch dump", fix)
    write_text_atomic(run_dir / TEXT, text, "the batch dump", fix)
    return run_dir / TEXT
