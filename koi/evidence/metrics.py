"""Learning metrics for reports (overview §3.3; paper digest: decisive tests, ICP acceptance, median U).

Definitions (the paper names these figures without defining them; ours):
- **Q1 rate**: decided evidence–mechanism pairs in Q1 / all decided pairs.
- **decisive test**: a decided pair whose edges all have a decided ICP verdict (accept or
  reject) in that row, so its quadrant is backed by an invariance test on every link;
  it **supports the predicted path** when it is Q1 and no edge was rejected.
- **ICP acceptance rate**: accepted / all (row, edge) verdicts, undecided included (the
  share of tests that established invariance); also reported over decided verdicts only.
- **exercised**: an edge or mechanism that appears in at least one decided pair; U is
  taken from the given belief state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np
from pydantic import Field

from koi.causal.updates import BeliefState
from koi.domain.common import KoiModel
from koi.domain.telemetry import EvidenceRow, IcpVerdict, Quadrant


class LearningMetrics(KoiModel):
    n_rows: int = 0
    n_decided: int = 0
    quadrants: dict[str, int] = Field(default_factory=dict)
    q1_rate: float | None = None
    decisive_tests: int = 0
    decisive_support_share: float | None = None
    icp_verdicts: int = 0
    icp_accept_rate: float | None = None
    icp_reject_rate: float | None = None
    icp_accept_rate_decided: float | None = None
    exercised_edges: int = 0
    mean_u_edges: float | None = None
    median_u_edges: float | None = None
    exercised_mechanisms: int = 0
    mean_u_mechanisms: float | None = None
    median_u_mechanisms: float | None = None


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def learning_metrics(rows: Iterable[EvidenceRow], beliefs: BeliefState | None = None) -> LearningMetrics:
    rows = list(rows)
    q = Counter()
    decisive = support = 0
    icp = Counter()
    edges: set[str] = set()
    mechs: set[str] = set()
    for r in rows:
        for v in r.icp.values():
            icp[v] += 1
        for me in r.mechanisms:
            q[me.quadrant] += 1
            mechs.add(me.mechanism_id)
            edges.update(me.edges)
            verdicts = [r.icp.get(e, IcpVerdict.UNDECIDED) for e in me.edges]
            if verdicts and all(v is not IcpVerdict.UNDECIDED for v in verdicts):
                decisive += 1
                if me.quadrant is Quadrant.Q1 and all(v is IcpVerdict.ACCEPT for v in verdicts):
                    support += 1
    n = sum(q.values())
    n_icp = sum(icp.values())
    n_icp_decided = icp[IcpVerdict.ACCEPT] + icp[IcpVerdict.REJECT]
    m = LearningMetrics(
        n_rows=len(rows), n_decided=n, quadrants={k.value: q.get(k, 0) for k in Quadrant},
        q1_rate=_ratio(q[Quadrant.Q1], n), decisive_tests=decisive, decisive_support_share=_ratio(support, decisive),
        icp_verdicts=n_icp, icp_accept_rate=_ratio(icp[IcpVerdict.ACCEPT], n_icp),
        icp_reject_rate=_ratio(icp[IcpVerdict.REJECT], n_icp),
        icp_accept_rate_decided=_ratio(icp[IcpVerdict.ACCEPT], n_icp_decided),
        exercised_edges=len(edges), exercised_mechanisms=len(mechs),
    )
    if beliefs is not None:
        ue = np.array([beliefs.edges[e].u for e in sorted(edges) if e in beliefs.edges])
        um = np.array([beliefs.mechanisms[k].u for k in sorted(mechs) if k in beliefs.mechanisms])
        if ue.size:
            m.mean_u_edges, m.median_u_edges = float(ue.mean()), float(np.median(ue))
        if um.size:
            m.mean_u_mechanisms, m.median_u_mechanisms = float(um.mean()), float(np.median(um))
    return m
