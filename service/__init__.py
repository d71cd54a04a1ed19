"""HTTP service: FastAPI app, engines with continuous batching, metrics.

Imports ``model`` only through the engine layer (engine, encoder_engine,
registry); routes stay thin.
"""
