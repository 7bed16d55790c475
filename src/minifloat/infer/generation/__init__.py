"""Generation: the packed `KVCache` (`kvcache`), the cache a model takes (`cache`), the
transformers cache bridge (`hf_cache`), and decoding with speculative drafts (`decoding`)."""
