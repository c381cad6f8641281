"""lab2-trainer."""

__version__ = "0.8.0"
