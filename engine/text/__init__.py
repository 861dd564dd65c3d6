"""Text constraints on generation: response_format parsing and the grammar token masks of structured outputs."""
