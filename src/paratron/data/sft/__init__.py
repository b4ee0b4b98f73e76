"""Supervised fine-tuning data: chat conversations from jsonl, rendered with a chat template,
tokenized with the assistant tokens marked, and packed into fixed-length samples whose loss
covers only what the assistant says."""

from paratron.data.sft.conversations import ROLES, Message, messages_of, read_conversations
from paratron.data.sft.dataset import (
    ConversationStore,
    SFTDataset,
    preprocess_sft,
    sft_dataset_exists,
    write_sft_dataset,
)
from paratron.data.sft.packing import (
    IGNORE_INDEX,
    TRUNCATIONS,
    SFTSample,
    Truncation,
    build_sample,
    pack_bins,
    positions_of,
)
from paratron.data.sft.templates import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    chat_stop_ids,
    load_chat_template,
    tokenizer_chat_template,
)
from paratron.data.sft.tokenize import (
    TokenizedConversation,
    assistant_spans,
    iter_tokenized,
    tokenize_conversation,
    tokenize_file,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "IGNORE_INDEX",
    "ROLES",
    "TRUNCATIONS",
    "ChatTemplate",
    "ChatTemplateError",
    "ConversationStore",
    "Message",
    "SFTDataset",
    "SFTSample",
    "TokenizedConversation",
    "Truncation",
    "assistant_spans",
    "build_sample",
    "chat_stop_ids",
    "iter_tokenized",
    "load_chat_template",
    "messages_of",
    "pack_bins",
    "positions_of",
    "preprocess_sft",
    "read_conversations",
    "sft_dataset_exists",
    "tokenize_conversation",
    "tokenize_file",
    "tokenizer_chat_template",
    "write_sft_dataset",
]
