"""llama.cpp and nothing above it: loading, tokens, the per-token step, batching, metrics."""
