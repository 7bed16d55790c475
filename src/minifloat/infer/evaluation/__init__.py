"""Evaluation: the quality figures (`metrics`: perplexity, KL, top-1, tokens/s) and the jobs
behind `minifloat quantize` and `minifloat eval` (`pipeline`)."""
