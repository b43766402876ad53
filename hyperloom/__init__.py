"""hyperloom: a PyTorch framework for training large transformer models."""

__version__ = "0.1.0"
