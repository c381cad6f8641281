"""Test support shared by the members' tests (not shipped in any wheel)."""

from lab2_testing.dist import RankFailed, run_ranks

__all__ = ["RankFailed", "run_ranks"]
