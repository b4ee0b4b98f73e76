"""--dump-batches: the dumped global batches are the loader's own (at any data-parallel size), with document
boundaries, reset positions and masked end-of-document losses shown for pretraining, the prompt masked and the
assistant's turns trained for fine-tuning conversations, and the train command writing both files."""

from __future__ import annotations

import json

import numpy as np
import torch

from paratron.cli import main
from paratron.config import build_config
from paratron.config.dims import ParallelDims
from paratron.config.layout import BatchPlan, Layout, PipelinePlan
from paratron.data.build import build_data
from paratron.data.loader import DocumentLayout, micro_batches
from paratron.data.tokenizer import Tokenizer
from paratron.debugging.batches import RECORDS, TEXT, BatchSource, dump_batches, sample_record, sample_text
from paratron.model.batch import IGNORE_INDEX, Batch

from tiny import write_conversations

EOD, SEQ = 0, 12


def data_parallel(micro_batch_size: int, dp: int) -> Layout:
    """The layout of `dp` data-parallel ranks of one stage each, at `micro_batch_size`."""
    return Layout(ParallelDims(dp), micro_batch_size, micro_batch_size * dp, PipelinePlan((1,), 1, None))


def documents_source() -> list[np.ndarray]:
    """Samples of SEQ + 1 tokens; sample i has end-of-document tokens at positions 3 + i % 2 and 8."""
    out = []
    for i in range(16):
        tokens = np.arange(10 + i, 10 + i + SEQ + 1, dtype=np.int64)
        tokens[[3 + i % 2, 8]] = EOD
        out.append(tokens)
    return out


def test_pretraining_dump_is_the_loaders_batches_with_documents(tmp_path):
    samples = documents_source()
    layout = DocumentLayout(eod_id=EOD, reset_position_ids=True, eod_mask_loss=True)
    dumps = {}
    for dp in (1, 2):
        source = BatchSource(samples, data_parallel(2, dp), lambda _: 4, layout)
        text = dump_batches(source, 2, 4, tmp_path / f"dp{dp}", first_step=2)
        dumps[dp] = [json.loads(line) for line in open(tmp_path / f"dp{dp}" / RECORDS)]
        assert text == tmp_path / f"dp{dp}" / TEXT
    assert dumps[1] == [dict(r, dp_rank=0, micro_batch=r["micro_batch"]) for r in dumps[1]]
    strip = [{k: v for k, v in r.items() if k not in ("dp_rank", "micro_batch")} for r in dumps[2]]
    assert strip == [{k: v for k, v in r.items() if k not in ("dp_rank", "micro_batch")} for r in dumps[1]]
    assert [r["sample"] for r in dumps[1]] == list(range(4, 12)) and [r["step"] for r in dumps[1]] == [2] * 4 + [3] * 4
    # the loader's own micro-batches, rank by rank
    for rank in (0, 1):
        batches = micro_batches(samples, BatchPlan(4, 2, 2, rank), 4, torch.device("cpu"), layout)
        mine = [r for r in dumps[2] if r["dp_rank"] == rank and r["step"] == 2]
        assert [r["input_ids"] for r in mine] == [row.tolist() for b in batches for row in b.input_ids]
        assert [r["labels"] for r in mine] == [row.tolist() for b in batches for row in b.labels]
        assert [r["position_ids"] for r in mine] == [row.tolist() for b in batches for row in b.position_ids]
    first = dumps[1][0]  # sample 4: end-of-document tokens at 3 and 8
    assert first["document_starts"] == [4, 9]
    assert first["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]
    assert [t for t, m in enumerate(first["loss_mask"]) if not m] == [3, 8]  # (--eod-mask-loss)
    assert first["pieces"][:4] == ["14", "15", "16", "0"]
    text = (tmp_path / "dp1" / TEXT).read_text()
    assert "steps 2..3" in text and "position ids reset per document: on" in text
    assert "end-of-document loss masked: on" in text and "== step 3 (global batch at consumed sample 8) ==" in text
    # token 4 (after the end-of-document at 3) is not trained: its prediction at 3 is masked
    assert "-- sample 4 (data-parallel rank 0, micro-batch 0): 10/12 positions trained, 3 document(s)\n" in text
    assert "\n14 15 16 0 ‖ ⟦18⟧ 19 20 21 0 ‖ ⟦23⟧ 24 25 26\n" in text


def sft_config(tmp_path):
    write_conversations(tmp_path / "data", chats=8, pairs=0)
    data = tmp_path / "data"
    return build_config(
        dict(
            sft=True,
            data_path=[str(data / "chat.jsonl")],
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(data / "tokenizer.json"),
            chat_template="chatml",
            seq_length=64,
            micro_batch_size=2,
            global_batch_size=4,
            train_iters=2,
            eval_iters=0,
            run_dir=str(tmp_path / "run"),
            data_cache_path=str(tmp_path / "cache"),
        )
    )


def test_sft_dump_masks_the_prompt_and_trains_the_assistant(tmp_path):
    config = sft_config(tmp_path)
    data = build_data(config, 4, log=lambda *_: None)
    assert isinstance(data.tokenizer, Tokenizer)
    source = BatchSource(data.train, data_parallel(2, 1), lambda _: 4, DocumentLayout(), data.tokenizer)
    text = dump_batches(source, 1, 0, tmp_path / "run").read_text()
    records = [json.loads(line) for line in open(tmp_path / "run" / RECORDS)]
    assert len(records) == 4
    for record in records:
        ids, labels = record["input_ids"], record["labels"]
        trained = [labels[t] for t in range(len(ids)) if labels[t] != IGNORE_INDEX]
        assert trained and record["loss_mask"] == [int(label != IGNORE_INDEX) for label in labels]
        targets = data.tokenizer.decode(trained)
        assert "user" not in targets and "system" not in targets and "<|im_end|>" in targets
    for sample in text.split("\n-- sample ")[1:]:
        body = sample.split("\n", 1)[1]
        outside = "".join(part.split("⟧")[-1] for part in body.split("⟦"))
        inside = "".join(part.split("⟧")[0] for part in body.split("⟦")[1:])
        assert "<|im_start|>user" in inside and "<|im_start|>system" in inside
        assert "user" not in outside and "system" not in outside and "<|im_end|>" in outside


def test_train_command_writes_the_dump(tmp_path, capsys):
    args = ["train", "--config", "debug", "--mock-data", "--train-iters", "1", "--micro-batch-size", "2"]
    args += ["--global-batch-size", "4", "--seq-length", "16", "--hidden-size", "32", "--eval-iters", "0"]
    args += ["--run-dir", str(tmp_path), "--dump-batches", "2", "--no-progress-bar"]
    assert main(args + ["--data-cache-path", str(tmp_path / "cache")]) == 0
    assert f"batches: {tmp_path / TEXT}" in capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / RECORDS)]
    assert [r["sample"] for r in records] == list(range(8)) and {len(r["input_ids"]) for r in records} == {16}
    assert (tmp_path / TEXT).read_text().count("\n-- sample ") == 8


def test_image_placeholders_and_targets_past_the_inputs():
    """A vision row: its run of image tokens is one mark, untrained like the prompt; a conversation's last target
    (not the next input) and the row's last label are shown where they are predicted."""
    image = 9
    ids = torch.tensor([[1, image, image, image, 5, 6, 7, 3, 3]])
    labels = torch.tensor([[-100, -100, -100, -100, 6, 7, 2, -100, -100]])
    segments = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1]])
    source = BatchSource([], data_parallel(1, 1), lambda _: 1, image_token_id=image)
    record = sample_record(source, 1, (0, 0, 0), Batch(ids, labels, segment_ids=segments), 0)
    assert record.image_tokens == [[1, 4]] and record.document_starts == [7]
    assert record.loss_mask == [0, 0, 0, 0, 1, 1, 1, 0, 0]
    assert sample_text(record, " ", str) == "⟦1 <image x3> 5⟧ 6 7 2 ‖ ⟦3 3⟧"
    labels[0, -1] = 4  # (a trained last label: the token after the row)
    record = sample_record(source, 1, (0, 0, 0), Batch(ids, labels, segment_ids=segments), 0)
    assert sample_text(record, " ", str).endswith("‖ ⟦3 3⟧ 4")
