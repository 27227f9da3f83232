"""Model sources: Hugging Face directories (``hf``), GGUF files (``gguf``: file, config, tensors, tokenizer) and lcx
training runs (``sources`` tells them apart and loads any of them)."""
