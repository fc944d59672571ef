"""Scoring (whitepaper, "Exploitation" to "The Cluster Objective"; overview §2.4).

Pure, vectorised functions over predictions:

- :func:`tchebycheff` / :func:`gaps` / :func:`reference_point` — exploitation J;
- :class:`ExplorationModel` — masks a_e/a_m, EIG per candidate, saturating Expl(P);
- :func:`dro_band` / :func:`breach_probability` / :func:`combine` — DRO risk;
- :func:`switch_cost` — churn price (cold + parallel + kill + risk);
- :func:`candidate_score` (σ), :func:`plan_score` (Φ), :func:`unserved_penalty`;
- :class:`PlanningKnobs` — β, B, λ, ε, γ, τ, ρ, ω_m and class weights, with cold-start defaults.
"""

from koi.scoring.exploration import (
    Activation,
    ExplorationModel,
    MechanismView,
    edge_beliefs_from,
    saturate,
    testable_edges,
    uncertainty,
    views_from_causal,
)
from koi.scoring.objective import candidate_score, plan_score, plan_value, unserved_penalty
from koi.scoring.params import PlanningKnobs
from koi.scoring.risk import breach_probability, combine, dro_band
from koi.scoring.switching import (
    SwitchBreakdown,
    SwitchItem,
    SwitchParams,
    cold_start_seconds,
    switch_cost,
    switch_cost_items,
)
from koi.scoring.tchebycheff import ReferencePoint, gaps, outcome_vector, reference_point, tchebycheff

__all__ = [
    "Activation", "ExplorationModel", "MechanismView", "PlanningKnobs", "ReferencePoint", "SwitchBreakdown",
    "SwitchItem", "SwitchParams", "breach_probability", "candidate_score", "cold_start_seconds", "combine", "dro_band",
    "edge_beliefs_from", "gaps", "outcome_vector", "plan_score", "plan_value", "reference_point", "saturate",
    "switch_cost", "switch_cost_items", "tchebycheff", "testable_edges", "uncertainty", "unserved_penalty", "views_from_causal",
]
