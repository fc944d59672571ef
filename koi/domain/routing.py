"""The gateway's integer weights: one rule for the simulator's router and a real gateway (infra/gateway.py).

A job's replicas share its traffic in proportion to a capacity each (the planner's ``Rank.route_weight`` when every
serving rank of the job carries one, else a nominal capacity). Gateways take small integer weights, and
weighted round-robin over a few slots per cycle interleaves better than over hundreds, so each capacity becomes
``round(4 · c / c_min)`` clipped to 1–16: the smallest replica gets 4 slots, a replica can get at most 4× the
smallest's share, and none is starved. (The simulator's router has used this rule since its first version; a real
gateway must apply the same split for evidence from the fleet to mean what the simulator's means.)
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_WEIGHT, MAX_WEIGHT, SLOTS_OF_SMALLEST = 1, 16, 4.0


def gateway_weights(capacities: Sequence[float]) -> list[int]:
    """Integer weights for one job's replicas, in order; [] for none."""
    if not capacities:
        return []
    lo = min(capacities)
    if not lo > 0:
        raise ValueError(f"capacities must be positive, got {min(capacities)}")
    return [max(MIN_WEIGHT, min(MAX_WEIGHT, round(SLOTS_OF_SMALLEST * c / lo))) for c in capacities]
