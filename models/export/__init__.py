"""The harness's GPT out of the harness: Hugging Face ``transformers``
(:mod:`models.export.hf`, with the model code :mod:`models.export.modeling_normgeo` for the
arms no built-in class holds), the GPT-2 tokenizer from tiktoken's BPE
(:mod:`models.export.tokenizer`), TransformerLens and nnsight (:mod:`models.export.lens`)."""
