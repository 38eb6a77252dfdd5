"""vlmrl: reinforcement learning for vision-language models."""

__version__ = "0.1.0"
