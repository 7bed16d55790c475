"""The quantized modules inference swaps in (`QuantizedLinear`, `QuantizedEmbedding`) and the
bytes a model and its layers hold (`accounting`)."""
