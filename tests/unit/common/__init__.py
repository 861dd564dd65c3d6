"""The torch-free contracts both halves share."""
