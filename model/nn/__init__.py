"""The networks: layers, the three model families (encoder-decoder, decoder, encoder) and the
KV cache they write. Imports nothing from ``decode``, ``formats`` or ``engine``."""
