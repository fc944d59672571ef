"""Temporal workflow definitions: the cluster, its ticks, and planner trajectories.

Workflows hold no domain logic and import nothing heavy: stages run as activities
(``activities/``); domain models pass through the sandbox.
"""

from workflows.cluster import ClusterWorkflow
from workflows.tick import TickWorkflow
from workflows.trajectory import TrajectoryWorkflow

WORKFLOWS = [ClusterWorkflow, TickWorkflow, TrajectoryWorkflow]

__all__ = ["WORKFLOWS", "ClusterWorkflow", "TickWorkflow", "TrajectoryWorkflow"]
