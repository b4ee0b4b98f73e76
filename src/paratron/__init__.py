"""paratron: train large Transformer language models with tensor, pipeline and data parallelism.

Public API:
    initialize_megatron, get_args   Megatron-LM-style entry points (dict of Megatron argument names)
    build_config, Config            the typed configuration
    build_model, model_config, GPT  the model family and its named sizes
    load_pretrained                 a single-device model from a checkpoint
"""

from paratron.checkpoint.pretrained import load_pretrained
from paratron.config import Config, build_config
from paratron.megatron_api import get_args, initialize_megatron
from paratron.model import GPT, build_model, model_config

__version__ = "0.1.0"

__all__ = ["initialize_megatron", "get_args", "build_config", "Config", "build_model", "model_config", "GPT", "load_pretrained",
           "__version__"]
