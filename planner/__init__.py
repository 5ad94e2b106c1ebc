"""Checkpoint placement for sparse prefix caching (see docs/DESIGN.md, Placement).

    from planner import place, expected_recompute
    positions = place(pmf, budget=16)                 # exact optimum (O(N M) DP)
    cost = expected_recompute(pmf, positions)         # expected tokens recomputed per request
"""

from planner.dp import Frontier, frontier
from planner.estimate import (DecayingHistogram, EmpiricalHistogram, Replanner, regret_bound,
                              tv_distance)
from planner.lagrangian import LagrangianResult, place_lagrangian
from planner.placement import expected_recompute, max_gap
from planner.priced import PricedResult, place_priced
from planner.strategies import STRATEGIES, place

__all__ = [
    "STRATEGIES", "DecayingHistogram", "EmpiricalHistogram", "Frontier", "LagrangianResult",
    "PricedResult", "Replanner", "expected_recompute", "frontier", "max_gap", "place",
    "place_lagrangian", "place_priced", "regret_bound", "tv_distance",
]
