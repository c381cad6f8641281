"""lab2-trainer."""

__version__ = "0.11.0"
