"""Text: tokens in and out. ``tokenizer`` (tokenizers + the chat template), ``detokenizer``
(incremental, never splits a character), ``stops`` (stop strings with hold-back), ``output``
(token events -> text deltas). Start at ``output``."""
