"""lab2-trainer."""

__version__ = "0.9.0"
