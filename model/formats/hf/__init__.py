"""Hugging Face directories: the shared reading machinery (``format``), one importer per
architecture (``gpt2``, ``llama``, ``bert``, ``marian``) and the dispatch (``importer``)."""
