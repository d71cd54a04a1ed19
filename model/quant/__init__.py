"""Quantization: int8 decode-step projections with per-projection smoothing."""
