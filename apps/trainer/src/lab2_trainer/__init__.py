"""lab2-trainer."""

__version__ = "0.14.1"
