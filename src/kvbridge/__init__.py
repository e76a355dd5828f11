"""kvbridge: the KV-cache transfer plane between prefill and decode workers."""

__version__ = "0.1.0"
