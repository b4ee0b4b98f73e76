"""The GPT model family as single-device code, and a registry of named sizes."""

from paratron.model.gpt import GPT, build_model
from paratron.model.init import init_parameter
from paratron.model.registry import MODELS, count_parameters, model_config

__all__ = ["GPT", "build_model", "init_parameter", "MODELS", "count_parameters", "model_config"]
