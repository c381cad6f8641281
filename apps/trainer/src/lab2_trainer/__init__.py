"""lab2-trainer."""

__version__ = "0.3.0"
