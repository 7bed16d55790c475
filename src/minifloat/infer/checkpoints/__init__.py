"""Checkpoint formats serving tools read, one module each where they differ (`export`: write
compressed-tensors or hf-fp8; `load`: read them back), and `load_model` over every kind."""
