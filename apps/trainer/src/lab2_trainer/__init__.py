"""lab2-trainer."""

__version__ = "0.5.0"
