"""lab2-trainer."""

__version__ = "0.15.1"
