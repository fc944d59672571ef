"""Pydantic models of the domain: what every room of Koi speaks."""

from koi.domain.chain import Chain, ChainConfig, Ladder, Rank, Role
from koi.domain.cluster import ClusterSnapshot, Deployment, DeploymentState, Pool, ResourceMap, carry_since
from koi.domain.common import DType, Interconnect, JobClass, KoiModel, Market, stable_hash
from koi.domain.hardware import Environment, GpuSpec, InstanceType, RegionPrice
from koi.domain.job import (
    BATCH_WEIGHTS,
    ONLINE_WEIGHTS,
    Job,
    JobState,
    JobStatus,
    ObjectiveWeights,
    Slo,
)
from koi.domain.model import ModelArch
from koi.domain.plan import LADDER_ACTIONS, ROOT_ONLY_ACTIONS, Action, ActionType, Issuer, Plan
from koi.domain.telemetry import (
    CusumResult,
    EvidenceRow,
    IcpVerdict,
    MechanismEvidence,
    Prediction,
    Quadrant,
    TelemetryWindow,
    Verdict,
)
from koi.domain.workload import Arrival, ArrivalProcess, LengthDist, LengthKind, WorkloadProfile

__all__ = [
    "BATCH_WEIGHTS", "LADDER_ACTIONS", "ONLINE_WEIGHTS", "ROOT_ONLY_ACTIONS",
    "Action", "ActionType", "Arrival", "ArrivalProcess", "Chain", "ChainConfig", "ClusterSnapshot",
    "CusumResult", "DType", "Deployment", "DeploymentState", "Environment", "EvidenceRow", "GpuSpec",
    "IcpVerdict", "InstanceType", "Interconnect", "Issuer", "Job", "JobClass", "JobState", "JobStatus",
    "KoiModel", "Ladder", "LengthDist", "LengthKind", "Market", "MechanismEvidence", "ModelArch",
    "ObjectiveWeights", "Plan", "Pool", "Prediction", "Quadrant", "Rank", "RegionPrice", "ResourceMap",
    "Role", "Slo", "TelemetryWindow", "Verdict", "WorkloadProfile", "carry_since", "stable_hash",
]
