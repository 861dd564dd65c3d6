"""Text contracts both halves compute identically: the tokenizer and chat template, the chat text-part join, the
prefix-block hashes, the bundled model's file."""
