"""Hugging Face interop: `config.json` + safetensors <-> paratron checkpoints.

Supported: Llama (grouped-query attention, any rotary theta, tied or untied embeddings),
Mistral (the same layers, with its sliding window when `sliding_window` is set), Qwen2 (biases
on the query, key and value projections), Qwen3 (a norm on each head's queries and keys), GPT-2
(learned positions, LayerNorm, tanh GELU, fused QKV stored as Conv1D, i.e. transposed), and the
mixtures of experts Mixtral (softmax over the top-k router logits) and Qwen2-MoE (softmax before
the top-k, a shared expert with a sigmoid gate, dense layers where `decoder_sparse_step` and
`mlp_only_layers` say) and Qwen3-MoE (Qwen2-MoE's routing with Qwen3's query/key norms, no
shared expert). A sliding window carries over both ways when every layer has it; a config whose
layers mix windowed and full attention is refused. Experts are stored one by one on the Hub and
stacked in paratron (`experts.w_in` = [gate; up] of every expert, `experts.w_out` = their down
projections). The vision-language LLaVA (LlavaForConditionalGeneration: a CLIP or SigLIP vision tower and a
Linear-GELU-Linear projector before a Llama, Mistral or Qwen2) converts both ways as paratron's vision encoder and
projector (`llava`); a released language model folder and a released CLIP or SigLIP encoder folder combine into
one such model with a new projector (`combine`).

`config.json` is read as transformers reads it: a field the file leaves out takes transformers'
default for its model type (the tables of `hf_defaults`). The weights (model.safetensors, or the
shards model.safetensors.index.json names) are checked against the model the file describes, by
name and shape, before any is loaded; a mismatch, or a weights file that is missing, empty, cut
short or not safetensors, is refused in one line naming the file, and the left-out field whose
default is to blame.

One `Family` row each (`families.FAMILIES`) says what a family is; `settings` maps config.json both
ways, `weights` the tensors, `read` and `write` the directories (the reader and writer of
`checkpoint.formats`).

A converted checkpoint is an ordinary paratron checkpoint at iteration 0 marked "weights only"
(no optimizer state): `paratron train --load` starts from its weights at any layout, and
`paratron.load_pretrained` loads it; `paratron train --load DST --finetune` builds its model without model
flags. The converter also writes `model.yaml`, a recipe with the model's shape.
"""

from paratron.checkpoint.hf.combine import read_combined, read_hf_folder
from paratron.checkpoint.hf.families import ARCHITECTURES, FAMILIES, FAMILY_NAMES, PEFT_FAMILIES
from paratron.checkpoint.hf.family import Family
from paratron.checkpoint.hf.read import INDEX, config_for_hf, model_from_hf, read_hf, read_hf_config, read_hf_model
from paratron.checkpoint.hf.settings import family_of, hf_config, model_settings, model_type_of
from paratron.checkpoint.hf.weights import weights_from_hf, weights_to_hf
from paratron.checkpoint.hf.write import HF_MODEL, MAX_SHARD_BYTES, write_hf

__all__ = [
    "ARCHITECTURES",
    "FAMILIES",
    "FAMILY_NAMES",
    "HF_MODEL",
    "INDEX",
    "MAX_SHARD_BYTES",
    "PEFT_FAMILIES",
    "Family",
    "config_for_hf",
    "family_of",
    "hf_config",
    "model_from_hf",
    "model_settings",
    "model_type_of",
    "read_combined",
    "read_hf",
    "read_hf_config",
    "read_hf_folder",
    "read_hf_model",
    "weights_from_hf",
    "weights_to_hf",
    "write_hf",
]
