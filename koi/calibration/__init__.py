"""S3 and the slow loop: Beta fan-out, then regret, β, B, λ, ε, z*, w and CUSUM recalibration.

Public API::

    from koi.calibration import initial_slow_state, slow_update, SlowInputs, run_s3, convergence_report

    slow = slow_update(slow_prev, SlowInputs(tick=t, evidence=rows, outcomes=..., swaps=..., coverage=...))
    summary = run_s3(session, cluster_id, tick)   # beliefs + slow state from the store, persisted
"""

from koi.calibration.convergence import (
    ConvergenceReport,
    ConvergenceTolerances,
    Criterion,
    convergence_report,
)
from koi.calibration.slow import (
    OutcomeObservation,
    SlowInputs,
    initial_slow_state,
    meta_recalibrate,
    q_counts,
    r2_gradient,
    r2_indicator,
    regret_signal,
    slow_update,
    update_beta,
    update_epsilon,
    update_lambda,
    update_weights,
    update_z_star,
)
from koi.calibration.state import CoveragePoint, KnobPoint, QPoint, SlowConfig, SlowState, SwapPoint
from koi.calibration.store import load_slow, run_beliefs, run_s3, run_slow

__all__ = [
    "ConvergenceReport", "ConvergenceTolerances", "CoveragePoint", "Criterion", "KnobPoint", "OutcomeObservation",
    "QPoint", "SlowConfig", "SlowInputs", "SlowState", "SwapPoint", "convergence_report", "initial_slow_state",
    "load_slow", "meta_recalibrate", "q_counts", "r2_gradient", "r2_indicator", "regret_signal", "run_beliefs",
    "run_s3", "run_slow", "slow_update", "update_beta", "update_epsilon", "update_lambda", "update_weights",
    "update_z_star",
]
