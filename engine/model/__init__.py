"""The model and its weights: the Llama decoder, its attention and projections, loading (HF, GGUF), precision."""
