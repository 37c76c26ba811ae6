"""softmoe-serve HTTP server: decode -> preprocess -> deterministic batcher -> backend -> postprocess."""
