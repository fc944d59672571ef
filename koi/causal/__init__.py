"""The causal substrate: the X → V → Y graph, Beta beliefs, mechanisms, S3 fan-out, why-queries.

Public API::

    from koi.causal import default_graph, default_mechanisms, initial_beliefs, apply_evidence

    graph = default_graph()                           # 150 registered edges with seed bins
    mechanisms = default_mechanisms()                 # the seeded mechanisms, by id
    beliefs = initial_beliefs("c1", mechanisms)       # Beta state before any evidence (tick −1)
    beliefs = apply_evidence(beliefs, rows, mechanisms=mechanisms)   # S3 fan-out, pure
    result = admit(proposal, mechanisms)              # agent proposals, admitted at Beta(1, 1)
"""

from koi.causal.beta import (
    Belief,
    ConfidenceBin,
    bin_for_confidence,
    confidence,
    uncertainty,
    uncertainty_array,
)
from koi.causal.features import DERIVED_FEATURES, feature_names, rank_features, workload_types
from koi.causal.graph import CausalGraph, Edge, EdgeLayer, GraphError, default_graph, load_graph, make_edge
from koi.causal.mechanisms import (
    AdmissionCode,
    AdmissionResult,
    Condition,
    Mechanism,
    MechanismError,
    MechanismProposal,
    MechanismStatus,
    Origin,
    Scope,
    admit,
    applicable,
    applies,
    build_mechanism,
    check_path_set,
    default_mechanisms,
    load_seed_mechanisms,
    mechanism_id_for,
    promote,
    render_seed_table,
)
from koi.causal.updates import (
    BeliefState,
    BeliefUpdate,
    UpdateTables,
    apply_evidence,
    changed,
    default_update_tables,
    initial_beliefs,
    load_update_tables,
    plan_updates,
)

__all__ = [
    "DERIVED_FEATURES", "AdmissionCode", "AdmissionResult", "Belief", "BeliefState", "BeliefUpdate", "CausalGraph",
    "Condition", "ConfidenceBin", "Edge", "EdgeLayer", "GraphError", "Mechanism", "MechanismError",
    "MechanismProposal", "MechanismStatus", "Origin", "Scope", "UpdateTables", "admit", "applicable", "applies",
    "apply_evidence", "bin_for_confidence", "build_mechanism", "changed", "check_path_set", "confidence",
    "default_graph", "default_mechanisms", "default_update_tables", "feature_names", "initial_beliefs", "load_graph",
    "load_seed_mechanisms", "load_update_tables", "make_edge", "mechanism_id_for", "plan_updates", "promote",
    "rank_features", "render_seed_table", "uncertainty", "uncertainty_array", "workload_types",
]
