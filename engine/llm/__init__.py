"""Language-model text plumbing: GGUF tokenizers, chat templates and the SFT data pipeline."""
