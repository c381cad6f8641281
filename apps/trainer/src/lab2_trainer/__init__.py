"""lab2-trainer."""

__version__ = "0.10.0"
