"""lab2-trainer."""

__version__ = "0.13.0"
