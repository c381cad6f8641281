"""lab2-trainer."""

__version__ = "0.4.0"
