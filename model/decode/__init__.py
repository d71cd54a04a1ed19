"""The decode step: which one a model runs (the Python step, the native C++ step), the Triton
decode-attention kernel for CUDA, and the thread policy of small steps."""
