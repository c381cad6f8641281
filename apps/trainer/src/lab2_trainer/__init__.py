"""lab2-trainer."""

__version__ = "0.7.0"
