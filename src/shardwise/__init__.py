"""shardwise: plan, run and profile LLM inference split across a cluster of boxes."""

__version__ = "0.1.0"
