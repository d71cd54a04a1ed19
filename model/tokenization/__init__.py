"""Tokenizers (byte-level BPE and SentencePiece vocabularies, GGUF vocabularies rebuilt as
``tokenizers`` objects) and chat templates rendered in a sandbox."""
