"""The decode step: which one a model runs, chosen in one place (``prepare``), held by the
engine's ``ModelRunner``, never by the model.

- ``step``: ``DecodeOptions``, the ``DecodeStep`` protocol, the Python step, ``prepare``;
- ``support``: which config values each fast path implements (every ``ModelConfig`` field);
- ``native`` + ``csrc/``: the C++ decode step (Llama architecture, CPU);
- ``triton_attention``: the Triton decode-attention kernel (CUDA; tested in the interpreter);
- ``threads``: the intra-op thread policy of small decode steps.
"""

from model.decode.step import DecodeOptions, DecodeStep, PythonStep, prepare, prepare_weights

__all__ = ["DecodeOptions", "DecodeStep", "PythonStep", "prepare", "prepare_weights"]
