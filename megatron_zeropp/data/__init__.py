"""Data side: Megatron-LM-compatible tokenizers, preprocessing, datasets and micro-batches.

- ``tokenizers``: ``build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)`` (megatron-core's
  classes), ``padded_vocab_size``.
- ``tokenizer_training``: train a SentencePiece model (``tools/train_tokenizer.py``).
- ``preprocess``: jsonl -> ``.bin``/``.idx`` (``tools/preprocess_data.py``).
- ``sample_corpus``: a corpus from text shipped with Python; ``prepare_sample_data(work_dir)``.
- ``datasets``: ``DataConfig`` + ``build_gpt_datasets`` (megatron-core's dataset builder).
- ``batches``: ``make_batch_iterator`` (DP-sharded, resumable micro-batches).

Submodules are not imported here: most of them import megatron-core, which takes seconds.
"""
