"""The command line: ``lab2-train`` (``main``), ``lab2-train plan`` (``plan``), the flags built
from the settings' fields (``flags``), and the checks of the machine made before any rank
starts (``checks``).

May import: every subpackage.
"""
