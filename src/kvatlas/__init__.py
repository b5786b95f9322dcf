"""kvatlas: find and share reusable LLM KV caches across a fleet of inference servers."""

__version__ = "0.1.0"
