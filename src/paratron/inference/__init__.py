"""Using a trained model: the batched inference engine (`Engine`, built by `open_engine` or `engine_for_model`),
its requests (`SamplingParams`) and a one-prompt convenience (`generate`)."""

from paratron.inference.engine import Engine
from paratron.inference.generate import generate
from paratron.inference.loading import engine_for_model, open_engine
from paratron.inference.params import RequestError, RequestOutput, SamplingParams

__all__ = ["Engine", "RequestError", "RequestOutput", "SamplingParams", "engine_for_model", "generate", "open_engine"]
