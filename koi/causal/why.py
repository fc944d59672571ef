"""Why-queries: what the specialists and the operators ask the causal state.

- :func:`why_outcome` walks the graph backward from an outcome Y: which mediators V feed
  it (V→Y edges) and which decisions X move those mediators (X→V edges), with each
  edge's confidence c and uncertainty U (overview §2.6: "given a target SLO, the
  specialist traces which X decisions affect it through which V mediators").
- :func:`why_rank` / :func:`why_job`: the mechanisms whose scope a deployed rank
  satisfies, their belief (c, U) and their evidence history (quadrant per tick).
- :func:`why_mechanism`: one mechanism's definition, belief and history.

Pure functions over (graph, beliefs, mechanisms, evidence rows); the ``*_from_store``
variants load those for a cluster.

Ranking choice: a decision's influence on an outcome is its strongest path,
c(X→V) · c(V→Y) (both links must hold for the effect to pass), ties broken by name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import Field
from sqlmodel import Session

from koi import variables
from koi.causal.beta import Belief
from koi.causal.graph import CausalGraph, Edge, default_graph
from koi.causal.mechanisms import Mechanism, applies
from koi.domain.common import KoiModel
from koi.domain.telemetry import EvidenceRow, Quadrant, Verdict
from koi.variables import Kind


class EdgeView(KoiModel):
    edge_id: str
    src: str
    dst: str
    layer: str
    seed_bin: str
    reason: str
    alpha: float
    beta: float
    c: float
    u: float


class MediatorPath(KoiModel):
    mediator: str
    edge: EdgeView = Field(description="the V→Y edge")
    decisions: list[EdgeView] = Field(default_factory=list, description="X→V edges into the mediator, by confidence")


class DecisionInfluence(KoiModel):
    decision: str
    controllable: bool
    via: list[str]
    path_confidence: float


class OutcomeExplanation(KoiModel):
    outcome: str
    direction: str
    mediators: list[MediatorPath]
    decisions: list[DecisionInfluence]
    mechanisms: list[str] = Field(default_factory=list, description="mechanisms with an edge into the outcome")


class QuadrantPoint(KoiModel):
    tick: int
    rank_id: str
    env_id: str
    quadrant: Quadrant
    v_verdict: Verdict
    y_verdict: Verdict


class MechanismView(KoiModel):
    mechanism_id: str
    name: str
    narrative: str
    edges: list[str]
    scope: dict[str, Any]
    status: str
    origin: str
    prior: tuple[float, float]
    alpha: float
    beta: float
    c: float
    u: float
    quadrants: dict[str, int] = Field(default_factory=dict)
    history: list[QuadrantPoint] = Field(default_factory=list)
    belief_history: list[tuple[int, float, float]] = Field(default_factory=list)


class RankExplanation(KoiModel):
    rank_id: str
    job_id: str
    env_id: str
    features: dict[str, Any] = Field(default_factory=dict)
    mechanisms: list[MechanismView] = Field(default_factory=list)
    icp: dict[str, str] = Field(default_factory=dict, description="edge → newest ICP verdict on this rank")


class JobExplanation(KoiModel):
    job_id: str
    ranks: list[RankExplanation]


def edge_view(edge: Edge, belief: Belief | None = None) -> EdgeView:
    b = belief or edge.prior
    return EdgeView(edge_id=edge.edge_id, src=edge.src, dst=edge.dst, layer=edge.layer.value, seed_bin=edge.bin.value,
                    reason=edge.reason, alpha=b.alpha, beta=b.beta, c=b.c, u=b.u)


def why_outcome(
    outcome: str,
    graph: CausalGraph | None = None,
    edge_beliefs: Mapping[str, Belief] | None = None,
    mechanisms: Mapping[str, Mechanism] | None = None,
    *,
    knobs_only: bool = False,
) -> OutcomeExplanation:
    """The backward walk Y ← V ← X with edge confidences; ``knobs_only`` keeps controllable X."""
    graph = graph or default_graph()
    var = variables.get(outcome)
    if var.kind is not Kind.Y:
        raise ValueError(f"{outcome!r} is a {var.kind.value} variable; why-outcome takes an outcome: {variables.Y_NAMES}")
    eb = edge_beliefs or {}
    paths: list[MediatorPath] = []
    best: dict[str, tuple[float, set[str]]] = {}
    for vy in graph.in_edges(outcome):
        vyv = edge_view(vy, eb.get(vy.edge_id))
        decs = []
        for xv in graph.in_edges(vy.src):
            if knobs_only and not variables.VARIABLES[xv.src].controllable:
                continue
            xvv = edge_view(xv, eb.get(xv.edge_id))
            decs.append(xvv)
            pc = xvv.c * vyv.c
            cur = best.get(xv.src, (0.0, set()))
            best[xv.src] = (max(cur[0], pc), cur[1] | {vy.src})
        decs.sort(key=lambda e: (-e.c, e.src))
        paths.append(MediatorPath(mediator=vy.src, edge=vyv, decisions=decs))
    paths.sort(key=lambda p: (-p.edge.c, p.mediator))
    influences = [
        DecisionInfluence(decision=x, controllable=variables.VARIABLES[x].controllable, via=sorted(v), path_confidence=c)
        for x, (c, v) in best.items()
    ]
    influences.sort(key=lambda d: (-d.path_confidence, d.decision))
    mids = sorted(m.mechanism_id for m in (mechanisms or {}).values() if outcome in m.y_bundle)
    return OutcomeExplanation(outcome=outcome, direction=var.direction.value, mediators=paths, decisions=influences,
                              mechanisms=mids)


def mechanism_history(rows: Iterable[EvidenceRow], mechanism_id: str) -> list[QuadrantPoint]:
    out = []
    for r in sorted(rows, key=lambda r: (r.tick, r.rank_id)):
        for me in r.mechanisms:
            if me.mechanism_id == mechanism_id:
                out.append(QuadrantPoint(tick=r.tick, rank_id=r.rank_id, env_id=r.env_id, quadrant=me.quadrant,
                                         v_verdict=me.v_verdict, y_verdict=me.y_verdict))
    return out


def why_mechanism(
    mechanism: Mechanism,
    belief: Belief | None = None,
    rows: Iterable[EvidenceRow] = (),
    belief_history: Iterable[tuple[int, float, float]] = (),
) -> MechanismView:
    b = belief or mechanism.prior
    hist = mechanism_history(rows, mechanism.mechanism_id)
    counts = Counter(p.quadrant.value for p in hist)
    return MechanismView(
        mechanism_id=mechanism.mechanism_id, name=mechanism.name, narrative=mechanism.narrative,
        edges=list(mechanism.edge_ids), scope=mechanism.scope.model_dump(mode="json"), status=mechanism.status.value,
        origin=mechanism.origin.value, prior=(mechanism.prior.alpha, mechanism.prior.beta), alpha=b.alpha, beta=b.beta,
        c=b.c, u=b.u, quadrants={q.value: counts.get(q.value, 0) for q in Quadrant}, history=hist,
        belief_history=list(belief_history),
    )


def why_rank(
    rank_id: str,
    job_id: str,
    env_id: str,
    features: Mapping[str, Any],
    mechanisms: Mapping[str, Mechanism],
    mechanism_beliefs: Mapping[str, Belief] | None = None,
    rows: Iterable[EvidenceRow] = (),
) -> RankExplanation:
    """Applicable mechanisms of one rank with their belief and this rank's evidence history."""
    mine = [r for r in rows if r.rank_id == rank_id]
    mb = mechanism_beliefs or {}
    views = [
        why_mechanism(m, mb.get(m.mechanism_id), mine)
        for m in sorted(mechanisms.values(), key=lambda m: m.mechanism_id) if applies(m, features)
    ]
    views.sort(key=lambda v: (-v.c, v.mechanism_id))
    icp: dict[str, str] = {}
    for r in sorted(mine, key=lambda r: r.tick):
        icp.update({k: v.value for k, v in r.icp.items()})
    feats = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(features.items())}
    return RankExplanation(rank_id=rank_id, job_id=job_id, env_id=env_id, features=feats, mechanisms=views,
                           icp=dict(sorted(icp.items())))


# ---- store-backed --------------------------------------------------------------------------------------
def _beliefs(session: Session, cluster_id: str):  # noqa: ANN202 - (registry, BeliefState)
    from koi.causal.store import load_beliefs, load_registry

    reg = load_registry(session, cluster_id, None)
    return reg, load_beliefs(session, cluster_id, None, reg)


def why_outcome_from_store(session: Session, cluster_id: str, outcome: str, *, knobs_only: bool = False) -> OutcomeExplanation:
    reg, st = _beliefs(session, cluster_id)
    return why_outcome(outcome, edge_beliefs=st.edges, mechanisms=reg, knobs_only=knobs_only)


def find_mechanism(registry: Mapping[str, Mechanism], key: str) -> Mechanism:
    """By id, or by a seed's name."""
    if key in registry:
        return registry[key]
    hits = [m for m in registry.values() if m.name == key]
    if len(hits) == 1:
        return hits[0]
    raise KeyError(f"no mechanism {key!r} (give an id like M_0123456789ab or a seed name)")


def why_mechanism_from_store(session: Session, cluster_id: str, key: str) -> MechanismView:
    from koi.store import get_evidence
    from koi.store.repos._query import fresh
    from koi.store.tables import MechanismBeliefRow

    reg, st = _beliefs(session, cluster_id)
    m = find_mechanism(reg, key)
    stmt = fresh(MechanismBeliefRow).where(MechanismBeliefRow.cluster_id == cluster_id,
                                           MechanismBeliefRow.mechanism_id == m.mechanism_id).order_by(MechanismBeliefRow.tick)
    hist = [(r.tick, r.alpha, r.beta) for r in session.exec(stmt)]
    rows = get_evidence(session, cluster_id, start=0)
    return why_mechanism(m, st.mechanisms.get(m.mechanism_id), rows, hist)


def _rank_explanations(session: Session, cluster_id: str, deployments: list, reg, st) -> list[RankExplanation]:  # noqa: ANN001
    from koi import catalog
    from koi.causal.features import rank_features
    from koi.store import get_evidence, get_job

    out = []
    for d in deployments:
        js = get_job(session, cluster_id, d.job_id)
        feats: dict[str, Any] = {}
        if js is not None:
            try:
                feats = rank_features(js.job, d.rank, catalog.model(js.job.model))
            except Exception:
                feats = {}
        rows = get_evidence(session, cluster_id, start=0, rank_id=d.rank_id)
        out.append(why_rank(d.rank_id, d.job_id, d.rank.env.env_id, feats, reg, st.mechanisms, rows))
    return out


def why_rank_from_store(session: Session, cluster_id: str, rank_id: str) -> RankExplanation:
    from koi.store import get_deployments

    deps = [d for d in get_deployments(session, cluster_id) if d.rank_id == rank_id]
    if not deps:
        raise KeyError(f"no rank {rank_id!r} in cluster {cluster_id!r}")
    reg, st = _beliefs(session, cluster_id)
    return _rank_explanations(session, cluster_id, deps, reg, st)[0]


def why_job_from_store(session: Session, cluster_id: str, job_id: str) -> JobExplanation:
    from koi.store import get_deployments, get_job

    if get_job(session, cluster_id, job_id) is None:
        raise KeyError(f"no job {job_id!r} in cluster {cluster_id!r}")
    deps = get_deployments(session, cluster_id, job_id=job_id)
    reg, st = _beliefs(session, cluster_id)
    return JobExplanation(job_id=job_id, ranks=_rank_explanations(session, cluster_id, deps, reg, st))
