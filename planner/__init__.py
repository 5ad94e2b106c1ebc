"""Checkpoint placement for sparse prefix caching (see /work/shared/DESIGN.md, Placement).

    from planner import place, expected_recompute
    positions = place(pmf, budget=16)                 # exact optimum (O(N M) DP)
    cost = expected_recompute(pmf, positions)         # expected tokens recomputed per request
"""

from planner.dp import Frontier, frontier
from planner.estimate import (DecayingHistogram, EmpiricalHistogram, Replanner, regret_bound,
                              tv_distance)
from planner.lagrangian import LagrangianResult, place_lagrangian
from planner.placement import expected_recompute, max_gap
from planner.strategies import STRATEGIES, place

__all__ = [
    "STRATEGIES", "DecayingHistogram", "EmpiricalHistogram", "Frontier", "LagrangianResult",
    "Replanner", "expected_recompute", "frontier", "max_gap", "place", "place_lagrangian",
    "regret_bound", "tv_distance",
]
