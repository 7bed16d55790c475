"""Serving checkpoints, one module per format, each both ways (`compressed_tensors`, `hf_fp8`, and
`gguf_file`: one GGUF file llama.cpp runs, FP4 as ggml's own blocks); what they share: the tensors' reader and codes (`tensors`), the writer
(`export`), the reader into `QuantizedLinear` layers (`load`), and `load_model` over every kind
of model folder or file (`loaders`)."""
