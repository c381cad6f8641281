"""lab2-trainer."""

__version__ = "0.2.0"
