"""zero1."""

__version__ = "0.1.0"
