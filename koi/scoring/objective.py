"""Per-candidate σ and the plan score Φ (whitepaper, "The Cluster Objective"; overview §2.4).

    σ_i(L)  = J_i − γ p_brk,i − λ SwitchCost_i  (+ β EIG(L) when a candidate is scored alone)
    Φ(P)    = Σ_{ladder actions} [J_i − γ p_i − λ Switch_i] + β Expl(P)

EIG enters Φ once per plan through Expl(P) (saturating), never per candidate, so that an
edge tested by several ranks is not counted twice.

The joint selector additionally prices *unserved demand* (overview §2.6: "accounting
for unserved demand, improvement over active deployments"): a kept ladder is valued at
its own σ (J and risk of the running deployment, no switch cost) so a swap must beat it,
and a job left deferred or short costs W · priority · unserved share. Those terms are
the selector's (:mod:`koi.planning.selector`); :func:`plan_value` adds them to Φ.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from koi.scoring.params import PlanningKnobs


def candidate_score(
    j: ArrayLike, p_brk: ArrayLike, switch: ArrayLike, knobs: PlanningKnobs, eig: ArrayLike | None = None
) -> np.ndarray:
    """σ per candidate; pass ``eig`` only for a standalone score (not inside Φ)."""
    s = np.asarray(j, dtype=float) - knobs.gamma * np.asarray(p_brk, dtype=float) - knobs.lam * np.asarray(
        switch, dtype=float
    )
    if eig is not None:
        s = s + knobs.beta * np.asarray(eig, dtype=float)
    return s


def plan_score(sigmas: ArrayLike, expl: float, knobs: PlanningKnobs) -> float:
    """Φ(P): the σ (without EIG) of the plan's ladder actions plus β·Expl(P)."""
    return float(np.sum(np.asarray(sigmas, dtype=float))) + knobs.beta * float(expl)


def unserved_penalty(priority: ArrayLike, unserved_share: ArrayLike, knobs: PlanningKnobs) -> np.ndarray:
    """W · max(priority, 0.25) · share (see :mod:`koi.scoring.params`)."""
    pr = np.maximum(np.asarray(priority, dtype=float), 0.25)
    return knobs.unserved_weight * pr * np.clip(np.asarray(unserved_share, dtype=float), 0.0, 1.0)


def plan_value(phi: float, penalties: ArrayLike) -> float:
    """The selector's objective: Φ minus the unserved-demand penalties."""
    return float(phi) - float(np.sum(np.asarray(penalties, dtype=float)))
