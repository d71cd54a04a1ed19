"""Weight formats: our checkpoints, Hugging Face directories (``hf/``, one file per
architecture), GGUF files, sentence-transformers directories, manifests of pinned packages,
and ``load_model`` (``sources``), which tells them apart."""
