"""Fill-in-the-middle samples (--fim-data): the transform against its definition and samples drawn by hand, the
random stream per (seed, sample index), the settings' and tokenizer's one-line refusals, and a run's samples at
two data-parallel layouts and after a rebuild."""

from __future__ import annotations

import numpy as np
import pytest

from paratron.commands.train import train_config
from paratron.config import build_config, validate
from paratron.config.layout import BatchPlan
from paratron.data.build import build_data
from paratron.data.fim import FIMRates, FIMSamples, FIMTokens, FIMTransform, fim_transform, sample_stream
from paratron.data.tokenizer import NullTokenizer, Tokenizer, train_byte_level_bpe
from paratron.errors import ConfigError, DataError

SENTINELS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>"]
TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n", "print('héllo wörld')\n"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    trained = train_byte_level_bpe(iter(TEXTS * 20), 300)
    trained.hf.add_special_tokens(SENTINELS)
    return Tokenizer(trained.hf, "test tokenizer")


def ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {text: tokenizer.hf.token_to_id(text) for text in SENTINELS}


def transform(tokenizer: Tokenizer, rate=1.0, spm=0.0, split=False, fragment=None, no_prefix=None) -> FIMTransform:
    t = ids(tokenizer)
    tokens = FIMTokens(
        t["<fim_prefix>"], t["<fim_middle>"], t["<fim_suffix>"], t["<fim_pad>"], tokenizer.eod_id,
        t["<file_sep>"] if split else None,
    )  # fmt: skip
    decode = lambda ids: tokenizer.hf.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    return FIMTransform(FIMRates(rate, spm, fragment, no_prefix), tokens, tokenizer.encode, decode)


def sample_of(tokenizer: Tokenizer, *documents: str, length: int | None = None) -> np.ndarray:
    """Documents joined by end-of-document tokens, as a GPT sample holds them."""
    out: list[int] = []
    for i, text in enumerate(documents):
        out += tokenizer.encode(text) + ([tokenizer.eod_id] if i < len(documents) - 1 else [])
    return np.asarray(out[:length] if length else out, dtype=np.int64)


def by_hand(tokenizer: Tokenizer, text: str, rng: np.random.Generator, rate: float, spm_rate: float) -> list[int]:
    """One document as the transform's definition rewrites it, drawing from `rng` in its order."""
    t = ids(tokenizer)
    if not rng.binomial(1, rate):
        return tokenizer.encode(text)
    low, high = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
    p, m, s = (tokenizer.encode(x) for x in (text[:low], text[low:high], text[high:]))
    if rng.binomial(1, spm_rate):
        return [t["<fim_prefix>"], t["<fim_suffix>"], *s, t["<fim_middle>"], *p, *m]
    return [t["<fim_prefix>"], *p, t["<fim_suffix>"], *s, t["<fim_middle>"], *m]


def fitted(out: list[int], length: int, pad: int) -> list[int]:
    return (out + [pad] * length)[:length]


def test_rate_zero_leaves_every_sample_as_it_is(tokenizer):
    sample = sample_of(tokenizer, *TEXTS)
    for k in range(20):
        assert np.array_equal(transform(tokenizer, rate=0.0)(sample, sample_stream(3, k)), sample)


@pytest.mark.parametrize("spm_rate", [0.0, 1.0, 0.5])
def test_rate_one_rewrites_each_document_as_drawn_by_hand(tokenizer, spm_rate):
    sample = sample_of(tokenizer, *TEXTS)
    pad, eod = ids(tokenizer)["<fim_pad>"], tokenizer.eod_id
    orders = set()
    for k in range(12):
        out = transform(tokenizer, spm=spm_rate)(sample, sample_stream(7, k))
        rng = sample_stream(7, k)
        expected: list[int] = []
        for i, text in enumerate(TEXTS):
            expected += by_hand(tokenizer, text, rng, 1.0, spm_rate) + ([eod] if i < len(TEXTS) - 1 else [])
        assert out.tolist() == fitted(expected, len(sample), pad), k
        assert out.dtype == np.int64 and len(out) == len(sample)
        orders.add(int(out[1] == ids(tokenizer)["<fim_suffix>"]))  # SPM puts <suffix> right after <prefix>
    assert orders == ({0} if spm_rate == 0 else {1} if spm_rate == 1 else {0, 1})


def test_psm_and_spm_hold_the_three_parts_of_the_text(tokenizer):
    text = TEXTS[0]
    sample = sample_of(tokenizer, text)
    t = ids(tokenizer)
    for spm_rate in (0.0, 1.0):
        rng = sample_stream(1, 4)
        rewritten = transform(tokenizer, spm=spm_rate)._permute(sample, 1.0, rng)
        parts = rewritten.tolist()
        assert [parts.count(t[s]) for s in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")] == [1, 1, 1]
        p_at, s_at, m_at = (parts.index(t[s]) for s in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
        decode = tokenizer.decode
        if spm_rate == 0:  # <prefix> prefix <suffix> suffix <middle> middle
            assert p_at == 0 and p_at < s_at < m_at
            prefix, suffix, middle = parts[1:s_at], parts[s_at + 1 : m_at], parts[m_at + 1 :]
        else:  # <prefix> <suffix> suffix <middle> prefix middle: the prefix and middle run on as text
            assert (p_at, s_at) == (0, 1) and s_at < m_at
            suffix, rest = parts[2:m_at], parts[m_at + 1 :]
            prefix, middle = rest, []
        assert decode(prefix) + decode(middle) + decode(suffix) == text


def test_fragments_are_rewritten_each_with_the_fragment_rate(tokenizer):
    t = ids(tokenizer)
    sep = t["<file_sep>"]
    files = ["a = 1\n", "b = 2\n", "c = 3\n"]
    document = np.asarray(
        tokenizer.encode(files[0]) + [sep] + tokenizer.encode(files[1]) + [sep] + tokenizer.encode(files[2])
    )
    for k in range(8):
        out = transform(tokenizer, split=True, fragment=1.0)(document, sample_stream(5, k))
        # every fragment opened by <prefix>, and the split tokens kept (until the length cut)
        rng = sample_stream(5, k)
        assert rng.binomial(1, 1.0) == 1  # (the document's draw comes first)
        expected = by_hand(tokenizer, files[0], rng, 1.0, 0.0) + [sep] + by_hand(tokenizer, files[1], rng, 1.0, 0.0)
        expected += [sep] + by_hand(tokenizer, files[2], rng, 1.0, 0.0)
        assert out.tolist() == fitted(expected, len(document), t["<fim_pad>"])
        kept = transform(tokenizer, split=True, fragment=0.0)(document, sample_stream(5, k))
        assert np.array_equal(kept, document)  # the document drawn, but no fragment
    not_drawn = transform(tokenizer, rate=0.0, split=True, fragment=1.0)(document, sample_stream(5, 0))
    assert np.array_equal(not_drawn, document)  # fragments only in documents drawn at --fim-rate


def test_no_prefix_documents_are_left_alone(tokenizer):
    sample = sample_of(tokenizer, "#skip this\n", TEXTS[0])
    out = transform(tokenizer, no_prefix="#skip")(sample, sample_stream(2, 0))
    first = len(tokenizer.encode("#skip this\n"))
    assert np.array_equal(out[: first + 1], sample[: first + 1])  # the document and its end-of-document token
    assert out[first + 1] == ids(tokenizer)["<fim_prefix>"]


def test_each_sample_has_its_own_stream_whatever_the_order(tokenizer):
    source = [sample_of(tokenizer, TEXTS[k % 3], TEXTS[(k + 1) % 3]) for k in range(16)]
    fim = FIMSamples(source, transform(tokenizer, rate=0.5, spm=0.5), seed=9)
    forward = [fim[k] for k in range(16)]
    backward = [fim[k] for k in reversed(range(16))][::-1]
    shuffled = {k: fim[k] for k in np.random.default_rng(0).permutation(16).tolist()}
    assert all(np.array_equal(forward[k], backward[k]) and np.array_equal(forward[k], shuffled[k]) for k in range(16))
    again = FIMSamples(source, transform(tokenizer, rate=0.5, spm=0.5), seed=9)
    assert all(np.array_equal(forward[k], again[k]) for k in range(16))
    other = FIMSamples(source, transform(tokenizer, rate=0.5, spm=0.5), seed=10)
    assert any(not np.array_equal(forward[k], other[k]) for k in range(16))
    rewritten = sum(int((forward[k] == ids(tokenizer)["<fim_prefix>"]).any()) for k in range(16))
    assert 0 < rewritten < 16  # (rate 0.5: some samples rewritten, some not)


def test_megatron_flags_configure_it_and_bad_settings_are_one_line():
    config = train_config(
        ["--data-path", "x", "--fim-data", "--fim-rate", "0.9", "--fim-spm-rate", "0.1", "--fim-split-sample",
         "<file_sep>", "--fim-fragment-rate", "0.5", "--fim-no-prefix", "<|", "--fim-prefix-token", "<P>",
         "--fim-middle-token", "<M>", "--fim-suffix-token", "<S>", "--fim-pad-token", "<PAD>", "--fim-eod-token",
         "<EOD>"]
    )  # fmt: skip
    d = config.data
    assert (d.fim_data, d.fim_rate, d.fim_spm_rate, d.fim_split_sample, d.fim_fragment_rate) == (
        True, 0.9, 0.1, "<file_sep>", 0.5,
    )  # fmt: skip
    assert (d.fim_no_prefix, d.fim_prefix_token, d.fim_middle_token, d.fim_suffix_token) == ("<|", "<P>", "<M>", "<S>")
    assert (d.fim_pad_token, d.fim_eod_token) == ("<PAD>", "<EOD>")
    base = dict(data_path=["x"], fim_data=True)
    for settings, message in (
        (dict(fim_rate=1.5), r"^--fim-rate 1.5: a probability, so in \[0, 1\]"),
        (dict(fim_split_sample="<file_sep>"), "^--fim-split-sample cuts documents .* give --fim-fragment-rate too"),
        (dict(fim_fragment_rate=0.5), "^--fim-fragment-rate applies to fragments; add --fim-split-sample"),
        (dict(data_path=[], mock_data=True), "^--fim-data rewrites the text of pretraining documents, which --mock"),
    ):
        with pytest.raises(ConfigError, match=message) as e:
            validate(build_config({**base, **settings}), 1)
        assert "\n" not in str(e.value)


def test_a_tokenizer_without_the_sentinels_is_one_line(tokenizer):
    d = build_config(dict(data_path=["x"], fim_data=True)).data
    assert fim_transform(d, tokenizer).tokens.prefix == ids(tokenizer)["<fim_prefix>"]
    plain = train_byte_level_bpe(iter(TEXTS), 280)
    with pytest.raises(DataError, match=r"has no token '<fim_prefix>' \(--fim-prefix-token\); use a tokenizer") as e:
        fim_transform(d, plain)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="--fim-data needs a tokenizer with named tokens .* HuggingFaceTokenizer"):
        fim_transform(d, NullTokenizer(100))
    renamed = build_config(dict(data_path=["x"], fim_data=True, fim_pad_token="<nothing>")).data
    with pytest.raises(DataError, match="no token '<nothing>' \\(--fim-pad-token\\)"):
        fim_transform(renamed, tokenizer)


def _samples(config, dp: int, steps: int) -> list[list[int]]:
    """Every sample of the first `steps` global batches (4 samples, micro-batches of 2), in order, as `dp`
    data-parallel ranks read them: each rank with data of its own, built apart, reading only its share."""
    ranks = [(BatchPlan(4, 2, dp, r), build_data(config, global_batch_size=4, log=lambda _: None)) for r in range(dp)]
    out = []
    for step in range(steps):
        for m in range(ranks[0][0].num_micro_batches):
            for plan, bundle in ranks:
                out += [bundle.train[i].tolist() for i in plan.sample_indices(step * 4)[m]]
    return out


def test_a_runs_samples_are_the_same_at_every_data_parallel_layout(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    (tmp_path / "tok").mkdir()
    tokenizer.save(tmp_path / "tok" / "tokenizer.json")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"f{i}.py").write_text(TEXTS[i % 3] * 3 + f"# {i}\n")
    settings = dict(
        data_path=[str(corpus)], tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"),
        seq_length=32, split="100,0,0", eval_iters=0, train_iters=6, fim_data=True, fim_rate=0.7,
    )  # fmt: skip
    config = build_config(settings)
    validate(config, 2)
    single, two = _samples(config, 1, 6), _samples(config, 2, 6)
    assert single == two and len(single) == 24
    assert _samples(config, 1, 6) == single  # rebuilt (a resumed run): the same samples
    plain = _samples(build_config({**settings, "fim_data": False}), 1, 6)
    prefix = ids(tokenizer)["<fim_prefix>"]
    changed = [a != b for a, b in zip(single, plain)]
    assert any(changed) and not all(changed)  # (rate 0.7: most samples rewritten)
    assert all(prefix in a for a, c in zip(single, changed) if c)


def test_a_tokenizer_trained_for_the_run_gets_the_sentinels(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRON_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"f{i}.py").write_text(TEXTS[i % 3] * 3)
    settings = dict(data_path=[str(corpus)], seq_length=32, split="100,0,0", eval_iters=0, train_iters=2)
    config = build_config({**settings, "fim_data": True, "fim_rate": 1.0, "fim_split_sample": "<file_sep>",
                           "fim_fragment_rate": 0.5})  # fmt: skip
    bundle = build_data(config, global_batch_size=2, log=lambda _: None)
    sentinels = [bundle.tokenizer.hf.token_to_id(text) for text in SENTINELS]
    assert None not in sentinels
    assert any(sentinels[0] in bundle.train[k].tolist() for k in range(4))
    plain = build_data(build_config(settings), global_batch_size=2, log=lambda _: None).tokenizer
    assert plain.hf.token_to_id("<fim_prefix>") is None  # (a run without FIM trains without them)
