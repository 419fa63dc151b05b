"""Measurements over the engine: bench, perplexity, the quant report."""
