"""quill: run quantized language models on your own machine."""

__version__ = "0.1.0"
