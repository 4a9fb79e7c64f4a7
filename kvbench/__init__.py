"""kvbench: prove, time and size the attention KV cache of decoder-only transformers."""

__version__ = "0.1.0"
