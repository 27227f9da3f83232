"""Model sources: Hugging Face directories (``hf``), GGUF files (``gguf``: file, config, tensors, tokenizer) and lcx
training runs (``sources`` tells them apart and loads any of them). Both checkpoint formats build on ``hf_config``
(the ``config.json`` dialect: ``config_from_hf``, ``config_to_hf``, ``with_dtype``) and on
``lcx.model.families.assemble`` (the parameter table read from HF-named tensors); ``hf`` re-exports GGUF's
``load_gguf`` beside ``load_hf``, and neither format imports the other's internals."""
