"""`paratron preprocess`: jsonl and text in, Megatron datasets out; workers agree; bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paratron.data.indexed import IndexedDataset
from paratron.data.preprocess import input_files, preprocess
from paratron.data.tokenizer import NullTokenizer, train_byte_level_bpe
from paratron.errors import DataError

DOCS = [f"def f{i}(x):\n    return x * {i}  # 数据 {i}\n" for i in range(700)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level_bpe(iter(DOCS), vocab_size=400)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.spawns  # (paratron starts the workers)
def test_jsonl_and_text_in_order_with_eod_and_workers_agree(tmp_path, tokenizer):
    corpus = tmp_path / "in"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(DOCS[:600])])
    (corpus / "b.txt").write_text(DOCS[600], encoding="utf-8")
    (corpus / ".hidden.jsonl").write_text("not read")
    files = input_files([str(corpus)])
    assert [f.name for f in files] == ["a.jsonl", "b.txt"]
    one = preprocess(files, str(tmp_path / "one"), tokenizer, append_eod=True, workers=1, progress=False)
    two = preprocess(files, str(tmp_path / "two"), tokenizer, append_eod=True, workers=2, progress=False)
    assert one.documents == two.documents == 601 and one.tokens == two.tokens
    for suffix in (".bin", ".idx"):
        assert Path(one.prefixes[0] + suffix).read_bytes() == Path(two.prefixes[0] + suffix).read_bytes()
    ds = IndexedDataset(one.prefixes[0])
    assert one.prefixes[0].endswith("one_text_document")
    for i in (0, 599, 600):
        assert tokenizer.decode(ds[i]) == DOCS[i] + "<|endoftext|>"
    assert ds.dtype == np.uint16


def test_several_json_keys_make_several_datasets(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": f"question {i}", "a": f"answer {i}"} for i in range(10)])
    result = preprocess([path], str(tmp_path / "out"), tokenizer, json_keys=["q", "a"], progress=False)
    q, a = (IndexedDataset(p) for p in result.prefixes)
    assert tokenizer.decode(q[3]) == "question 3" and tokenizer.decode(a[9]) == "answer 9"


BAD_LINES = [
    (
        b'{"text": "ok"}\n{"text": "unterminated\n',
        r"bad.jsonl:2: not valid JSON \(Invalid control character at, column 23\)",
    ),
    (b'{"text": "ok"}\n{"body": "x"}\n', r"bad.jsonl:2: no key 'text'"),
    (b'{"text": "ok"}\n{"text": 5}\n', r"bad.jsonl:2: the value of 'text' is not a string"),
    (b'{"text": "ok"}\n{"text": ""}\n', r"bad.jsonl:2: empty document under 'text'"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"bad.jsonl:2: byte 28 of the file is not valid UTF-8"),
    (b'{"text": "ok"}\n\n', r"bad.jsonl:2: not valid JSON"),
]


@pytest.mark.parametrize("content, message", BAD_LINES)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, tokenizer, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        preprocess([tmp_path / "bad.jsonl"], str(tmp_path / "out"), tokenizer, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing half-written
    result = preprocess([tmp_path / "bad.jsonl"], str(tmp_path / "out"), tokenizer, skip_bad_lines=True, progress=False)
    assert (result.documents, result.skipped) == (1, 1)
    assert len(IndexedDataset(result.prefixes[0])) == 1


def test_bad_text_files_and_token_ids(tmp_path, tokenizer):
    (tmp_path / "latin1.txt").write_bytes("ok café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: byte 6 of the file is not valid UTF-8"):
        preprocess([tmp_path / "latin1.txt"], str(tmp_path / "o"), tokenizer, progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty.txt: empty document"):
        preprocess([tmp_path / "empty.txt"], str(tmp_path / "o"), tokenizer, progress=False)
    path = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}, {"text": "4 500"}])
    with pytest.raises(DataError, match=r"ids.jsonl:2: NullTokenizer: an id is outside \[0, 100\)"):
        preprocess([path], str(tmp_path / "o"), NullTokenizer(100), progress=False)
    with pytest.raises(DataError, match=r"--input .*missing: no such file or directory"):
        input_files([str(tmp_path / "missing")])


@pytest.mark.spawns  # (paratron starts the workers)
def test_a_late_error_leaves_nothing_behind(tmp_path, tokenizer):
    records = [{"text": t} for t in DOCS] + [{"nope": 1}]  # fails after several batches were written
    path = write_jsonl(tmp_path / "late.jsonl", records)
    with pytest.raises(DataError, match=r"late.jsonl:701: no key 'text'"):
        preprocess([path], str(tmp_path / "out"), tokenizer, workers=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.jsonl"]


def test_skipping_keeps_several_keys_aligned_and_surrogates_are_refused(tmp_path, tokenizer):
    records = [{"q": "question 0", "a": "answer 0"}, {"q": "question 1", "a": ""}, {"q": "question 2", "a": "answer 2"}]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    result = preprocess(
        [path], str(tmp_path / "out"), tokenizer, json_keys=["q", "a"], skip_bad_lines=True, progress=False
    )
    q, a = (IndexedDataset(p) for p in result.prefixes)
    assert (result.documents, result.skipped, len(q), len(a)) == (2, 1, 2, 2)
    assert tokenizer.decode(q[1]) == "question 2" and tokenizer.decode(a[1]) == "answer 2"
    (tmp_path / "s.jsonl").write_text('{"text": "ok"}\n{"text": "bad \\ud800 half"}\n')
    with pytest.raises(DataError, match=r"s.jsonl:2: character 4 is a lone surrogate"):
        preprocess([tmp_path / "s.jsonl"], str(tmp_path / "o"), tokenizer, progress=False)
    with pytest.raises(DataError, match="a key is named twice"):
        preprocess([path], str(tmp_path / "o"), tokenizer, json_keys=["q", "q"], progress=False)
