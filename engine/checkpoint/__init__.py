"""Checkpoints: the local model cache, HF folders and GGUF files read and converted, tokenizers."""
