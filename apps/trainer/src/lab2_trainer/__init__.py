"""lab2-trainer."""

__version__ = "0.1.2"
