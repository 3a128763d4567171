"""meshforge: train transformer language models across a device mesh."""

__version__ = "0.1.0"
