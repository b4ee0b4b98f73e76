"""`paratron preprocess`: text, jsonl or conversations tokenized into Megatron-LM indexed datasets (.bin/.idx).
The pipeline itself is `data.preprocess`; this is its flags, the tokenizer they name (or train) and the report.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from paratron.config.arguments import ArgumentParser
from paratron.config.fields import all_fields
from paratron.config.schema import DataConfig
from paratron.data.preprocess import PreprocessResult, input_files, preprocess, read_documents, save_trained_tokenizer
from paratron.data.tokenizer import AnyTokenizer, Tokenizer, tokenizer_for, train_byte_level_bpe
from paratron.errors import DataError, UserError


def parser() -> argparse.ArgumentParser:
    """The inputs and the output prefix, Megatron-LM's tokenizer flags, the pipeline's and --sft's own."""
    parser = ArgumentParser(
        prog="paratron preprocess",
        allow_abbrev=False,
        description="Tokenize jsonl (one JSON object per line) and plain-text files into "
        "OUTPUT_PREFIX_{key}_document.bin/.idx, Megatron-LM's indexed format.",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="jsonl/json/ndjson files (one document per line), other files (one document each), "
        "or directories of them.",
    )
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX", help="Output path prefix.")
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="Keys to extract from each JSON line (one output dataset per key; default: text).",
    )
    add_tokenizer_arguments(parser)
    parser.add_argument("--append-eod", action="store_true", help="End every document with the end-of-document token.")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="Tokenizing processes (default: 1).")
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="Skip and count bad lines (not JSON, no key, empty, not UTF-8) instead of stopping.",
    )
    parser.add_argument("--no-progress-bar", action="store_true", help="No progress bar.")
    parser.add_argument(
        "--sft",
        action="store_true",
        help="The input is .jsonl conversations: render them with --chat-template and write their token ids and "
        "which tokens are trained (OUTPUT_PREFIX_input_ids_document and OUTPUT_PREFIX_trained_document), for "
        "`paratron train --sft --data-path OUTPUT_PREFIX`.",
    )
    parser.add_argument(
        "--chat-template",
        default="tokenizer",
        metavar="TEMPLATE",
        help="With --sft: tokenizer (the tokenizer folder's own template), chatml, llama3 or a jinja file.",
    )
    return parser


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's tokenizer flags, with the meaning `paratron train` gives them (see DataConfig)."""
    parser.add_argument(
        "--tokenizer-type",
        choices=all_fields()["tokenizer_type"].choices,
        metavar="TYPE",
        help="The tokenizer (one of "
        + ", ".join(all_fields()["tokenizer_type"].choices or ())
        + ") (default: GPT2BPETokenizer when --vocab-file/--merge-file are given, as Megatron-LM's "
        "pretrain_gpt.py, else ByteLevelBPE, trained on the input and saved as OUTPUT_PREFIX_tokenizer.json).",
    )
    parser.add_argument(
        "--tokenizer-model",
        metavar="PATH",
        help="tokenizer.json or its folder (HuggingFaceTokenizer), SentencePiece .model (GPTSentencePieceTokenizer, "
        "Llama2Tokenizer) or Megatron's tiktoken vocabulary .json (TikTokenizer).",
    )
    parser.add_argument("--vocab-file", metavar="FILE", help="GPT-2 vocab.json for GPT2BPETokenizer.")
    parser.add_argument("--merge-file", metavar="FILE", help="GPT-2 merges.txt for GPT2BPETokenizer.")
    parser.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="Vocabulary size: of the trained BPE (default 8192), of NullTokenizer's ids, or TikTokenizer's (default "
        "131072).",
    )
    parser.add_argument(
        "--tiktoken-pattern", choices=["v1", "v2"], metavar="v1|v2", help="TikTokenizer's regex (default v2)."
    )
    parser.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        metavar="N",
        help="TikTokenizer's special ids (default 1000).",
    )
    for name in ("--tiktoken-special-tokens", "--tokenizer-special-tokens"):
        parser.add_argument(name, nargs="+", metavar="TOKEN", help="TikTokenizer's named special tokens, in id order.")
    parser.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="Megatron-LM's older tokenizer classes: Llama2Tokenizer starts documents with <s>; TikTokenizer reads "
        "special-token text as plain text.",
    )
    parser.add_argument(
        "--vocab-extra-ids", type=int, default=0, metavar="N", help="T5/BERT sentinel tokens: only 0 is accepted."
    )


def tokenizer_type_of(args: argparse.Namespace) -> str:
    """The tokenizer type `add_tokenizer_arguments`' flags name (ByteLevelBPE: to be trained)."""
    if args.vocab_extra_ids:
        raise DataError(f"--vocab-extra-ids {args.vocab_extra_ids}: sentinel tokens are for T5/BERT; remove it")
    return args.tokenizer_type or ("GPT2BPETokenizer" if args.vocab_file or args.merge_file else "ByteLevelBPE")


def tokenizer_from_arguments(args: argparse.Namespace) -> AnyTokenizer:
    """The existing tokenizer `add_tokenizer_arguments`' flags name."""
    data = DataConfig(
        tokenizer_type=tokenizer_type_of(args),
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tiktoken_special_tokens=args.tiktoken_special_tokens,
        tokenizer_special_tokens=args.tokenizer_special_tokens,
        legacy_tokenizer=args.legacy_tokenizer,
    )
    return tokenizer_for(data, args.vocab_size)


def run(argv: list[str]) -> int:
    """`paratron preprocess ARGV`: the datasets written, with a report of what went in."""
    args = parser().parse_args(argv)
    if args.sft:
        return _preprocess_conversations(args)
    if args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be at least 1")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise UserError(f"--vocab-size {args.vocab_size}: must be at least 1")
    files = input_files(args.input)
    tokenizer = _tokenizer(args, files)
    result = preprocess(
        files,
        args.output_prefix,
        tokenizer,
        args.json_keys,
        args.append_eod,
        args.workers,
        args.skip_bad_lines,
        progress=not args.no_progress_bar,
    )
    _report(result)
    return 0


def _tokenizer(args: argparse.Namespace, files: list[Path]) -> AnyTokenizer:
    """The tokenizer the flags name; without one, a byte-level BPE trained on the input (the first json key's
    documents) and saved beside the datasets."""
    if tokenizer_type_of(args) != "ByteLevelBPE":
        return tokenizer_from_arguments(args)
    texts = (d.texts[0] for d in read_documents(files, args.json_keys[:1], PreprocessResult([]), args.skip_bad_lines))
    tokenizer = train_byte_level_bpe(texts, args.vocab_size or 8192)
    path = save_trained_tokenizer(tokenizer, args.output_prefix)
    print(f"trained a {tokenizer.vocab_size}-entry byte-level BPE: {path}")
    return tokenizer


def _report(result: PreprocessResult) -> None:
    """What went in, how fast, what was skipped and what was written."""
    mb = result.input_bytes / 1e6
    print(
        f"{result.documents:,} documents, {result.tokens:,} tokens from {mb:,.1f} MB in {result.seconds:.1f}s "
        f"({mb / result.seconds:,.2f} MB/s, {result.tokens / result.seconds:,.0f} tokens/s)"
    )
    if result.skipped:
        print(f"skipped {result.skipped} bad lines, e.g. {result.skipped_examples[0]}")
    for prefix in result.prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")


def _preprocess_conversations(args: argparse.Namespace) -> int:
    """`paratron preprocess --sft`: conversations -> token ids and trained-token flags."""
    from paratron.data.sft import preprocess_sft, tokenizer_chat_template  # (start-up speed: --sft only)

    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise UserError(
            "--sft needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH (the model's tokenizer)"
        )
    tokenizer = Tokenizer.from_file(args.tokenizer_model)
    template = tokenizer_chat_template(args.chat_template, tokenizer)
    start = time.perf_counter()
    conversations, tokens = preprocess_sft(input_files(args.input), args.output_prefix, template, tokenizer)
    print(
        f"{conversations:,} conversations, {tokens:,} tokens in {time.perf_counter() - start:.1f}s; "
        f"train on them with: paratron train --sft --data-path {args.output_prefix} ..."
    )
    return 0
