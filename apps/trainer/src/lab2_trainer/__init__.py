"""lab2-trainer."""

__version__ = "0.12.0"
