"""Hand-written GPU kernels for hot spots that PyTorch's own operators leave on the table.

Each kernel module keeps a pure-torch reference beside the kernel (what it is tested
against) and a dispatcher that falls back to the reference where the kernel cannot run.
Triton is optional: it is imported only when a kernel is about to be built, so ``model``
works without it (the CPU build of torch does not need it).
"""
