"""prl: asynchronous reinforcement learning for large language models, mixture-of-experts first."""

__version__ = "0.2.0"
