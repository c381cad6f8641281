"""Test support shared by the members' tests (not shipped in any wheel).

``dist`` runs functions on Gloo ranks, ``cli`` runs console entry points; ``ddp_testkit``
and ``rank_programs`` serve minddp's distributed tests, ``tn_numerics`` the RMSNorm
references and tolerances.
"""

from lab2_testing.dist import RankFailed, run_ranks

__all__ = ["RankFailed", "run_ranks"]
