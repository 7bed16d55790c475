"""Serving checkpoints, one module per format, each both ways (`compressed_tensors`, `hf_fp8`; the
GGUF writer comes next); what they share: the tensors' reader and codes (`tensors`), the writer
(`export`), the reader into `QuantizedLinear` layers (`load`), and `load_model` over every kind
of model folder or file (`loaders`)."""
