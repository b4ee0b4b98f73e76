"""Text generation from a trained model."""

from paratron.inference.generate import generate, sample_next

__all__ = ["generate", "sample_next"]
