"""The encoder family's core: fill-mask and sentence embeddings, batched (see ``core``)."""

from model.encoder.core import EncoderCore, EncoderJob

__all__ = ["EncoderCore", "EncoderJob"]
