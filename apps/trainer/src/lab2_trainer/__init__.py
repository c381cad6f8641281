"""lab2-trainer."""

__version__ = "0.6.0"
