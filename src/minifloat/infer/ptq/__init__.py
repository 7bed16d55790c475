"""PTQ algorithms: `QuantConfig` (`config`), calibration observers, scale searches, round to
nearest, GPTQ, rotations, smoothing, the sequential calibrator; each takes a weight and its
statistics and returns quantized parts. The driver that walks a model is `minifloat.infer.quantize`."""
