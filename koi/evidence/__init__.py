"""S2: residuals, CUSUM, quadrants, ICP → EvidenceRow; learning metrics.

Public API::

    from koi.evidence import ValidateInputs, validate, run_s2

    rows = validate(ValidateInputs(cluster_id=..., tick=t, ranks=..., predictions=..., telemetry=...,
                                   mechanisms=..., cusum_table=..., icp_history=...))   # pure
    summary = run_s2(session, cluster_id, tick)        # load from the store, validate, persist
"""

from koi.evidence.cusum import CusumConfig, CusumEntry, CusumTable, robust_noise_sigma, run_cusum
from koi.evidence.icp import (
    IcpConfig,
    IcpResult,
    IcpSample,
    icp_history_from,
    icp_samples_for_row,
    icp_test,
    icp_verdicts,
)
from koi.evidence.metrics import LearningMetrics, learning_metrics
from koi.evidence.store import build_inputs, rank_contexts, run_s2
from koi.evidence.validate import (
    RankContext,
    ValidateInputs,
    ValidationOutput,
    bundle_verdict,
    cusum_history_from_rows,
    evaluate_mechanism,
    validate,
    validate_detailed,
)

__all__ = [
    "CusumConfig", "CusumEntry", "CusumTable", "IcpConfig", "IcpResult", "IcpSample", "LearningMetrics",
    "RankContext", "ValidateInputs", "ValidationOutput", "build_inputs", "bundle_verdict", "cusum_history_from_rows",
    "evaluate_mechanism", "icp_history_from", "icp_samples_for_row", "icp_test", "icp_verdicts", "learning_metrics",
    "rank_contexts", "robust_noise_sigma", "run_cusum", "run_s2", "validate", "validate_detailed",
]
