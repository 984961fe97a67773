"""rlserve: an HTTP inference and scoring service for LLM RL post-training."""

__version__ = "0.1.0"
