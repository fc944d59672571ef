"""S3 fan-out: Beta updates of edges and mechanisms from evidence rows.

Whitepaper "Tick Algorithm": S2 only writes evidence, S3 reads it and applies the
updates; one EvidenceRow drives N Beta updates, one per applicable mechanism. The
edge update is indexed by ICP × quadrant (× the edge's layer, see
``data/update_tables.yaml`` for the table and why), the mechanism update by quadrant.

Idempotency (DESIGN.md, "Rules of the house"): beliefs at tick t are a pure function of
the beliefs at t−1 and the evidence rows of t. :func:`apply_evidence` folds only rows
newer than the state it is given, so applying the same evidence twice changes nothing,
and re-running S3 for tick t recomputes from t−1 and overwrites the same rows.

Choices:
- Each update is keyed by (tick, rank_id, mechanism_id) for mechanisms and
  (tick, rank_id, edge_id) for edges; duplicate keys in one batch are applied once.
- An edge shared by several applicable mechanisms of one row is updated once, with the
  mean of its per-mechanism cells: one rank-window is one observation of the edge, and
  counting it N times would let a popular edge's U collapse from correlated evidence.
- Deltas are summed in sorted key order so the floating-point result does not depend on
  the order rows were stored in (exact replay).
- A mechanism missing from the state (admitted since) enters at its own prior (Beta(1, 1)
  for proposed ones), an edge at its seed bin. Evidence about a mechanism that is in
  neither the state nor the given registry still updates its edges, but not itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, field_validator

from koi.causal.beta import Belief
from koi.causal.graph import CausalGraph, EdgeLayer, default_graph
from koi.causal.mechanisms import Mechanism
from koi.domain.common import KoiModel
from koi.domain.telemetry import EvidenceRow, IcpVerdict, Quadrant
from koi.logging import get_logger

log = get_logger(__name__)

Delta = tuple[float, float]


#: libyaml's safe loader when available (the pure-Python one takes ~1 s on the seed tables)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

class UpdateTables(KoiModel):
    """The 3×4×2 edge table and the 4-row mechanism table, as data."""

    edge: dict[IcpVerdict, dict[Quadrant, dict[EdgeLayer, Delta]]]
    mechanism: dict[Quadrant, Delta]

    @field_validator("edge")
    @classmethod
    def _complete_edge(cls, v: dict) -> dict:
        for icp in IcpVerdict:
            for q in Quadrant:
                for layer in EdgeLayer:
                    try:
                        d = v[icp][q][layer]
                    except KeyError:
                        raise ValueError(f"edge table lacks the cell ({icp.value}, {q.value}, {layer.value})") from None
                    _check_delta(d, f"edge[{icp.value}][{q.value}][{layer.value}]")
        return v

    @field_validator("mechanism")
    @classmethod
    def _complete_mech(cls, v: dict) -> dict:
        for q in Quadrant:
            if q not in v:
                raise ValueError(f"mechanism table lacks the row {q.value}")
            _check_delta(v[q], f"mechanism[{q.value}]")
        return v

    def edge_delta(self, icp: IcpVerdict, q: Quadrant, layer: EdgeLayer) -> Delta:
        return self.edge[icp][q][layer]

    def mechanism_delta(self, q: Quadrant) -> Delta:
        return self.mechanism[q]


def _check_delta(d: Delta, where: str) -> None:
    a, b = d
    if a < 0 or b < 0 or (a == 0 and b == 0):
        raise ValueError(f"{where} = {d}: deltas are non-negative pseudo-counts and not both zero (never freeze learning)")


def load_update_tables(path: str | Path | None = None) -> UpdateTables:
    if path is None:
        text = resources.files("koi.causal").joinpath("data", "update_tables.yaml").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return UpdateTables.model_validate(yaml.load(text, Loader=_LOADER))


@cache
def default_update_tables() -> UpdateTables:
    return load_update_tables()


# ---- belief state --------------------------------------------------------------------------------------
class BeliefState(KoiModel):
    """Beta beliefs of every edge and mechanism after tick ``tick`` (−1: the seed, before any evidence)."""

    cluster_id: str
    tick: int = Field(ge=-1)
    edges: dict[str, Belief] = Field(default_factory=dict)
    mechanisms: dict[str, Belief] = Field(default_factory=dict)

    def edge(self, edge_id: str) -> Belief:
        return self.edges[edge_id]

    def mechanism(self, mechanism_id: str) -> Belief:
        return self.mechanisms[mechanism_id]


def initial_beliefs(
    cluster_id: str,
    mechanisms: Mapping[str, Mechanism],
    graph: CausalGraph | None = None,
    tick: int = -1,
) -> BeliefState:
    """The seed state (Appendix D): edges at their bins, mechanisms at their priors."""
    graph = graph or default_graph()
    return BeliefState(
        cluster_id=cluster_id,
        tick=tick,
        edges=graph.priors(),
        mechanisms={k: m.prior for k, m in sorted(mechanisms.items())},
    )


class BeliefUpdate(KoiModel):
    """One applied update, for the audit trail and the why-queries."""

    tick: int
    rank_id: str
    target: str  # "edge" | "mechanism"
    target_id: str
    d_alpha: float
    d_beta: float
    quadrant: Quadrant | None = None
    icp: IcpVerdict | None = None

    @property
    def key(self) -> tuple[int, str, str, str]:
        return (self.tick, self.rank_id, self.target, self.target_id)


def plan_updates(
    rows: Iterable[EvidenceRow],
    tables: UpdateTables | None = None,
    graph: CausalGraph | None = None,
) -> list[BeliefUpdate]:
    """The updates one batch of evidence rows implies, sorted by key, duplicates dropped."""
    tables = tables or default_update_tables()
    graph = graph or default_graph()
    out: dict[tuple[int, str, str, str], BeliefUpdate] = {}
    for row in sorted(rows, key=lambda r: (r.tick, r.rank_id)):
        edge_cells: dict[str, list[Delta]] = defaultdict(list)
        edge_q: dict[str, set[Quadrant]] = defaultdict(set)
        for me in sorted(row.mechanisms, key=lambda m: m.mechanism_id):
            key = (row.tick, row.rank_id, "mechanism", me.mechanism_id)
            if key in out:
                continue
            da, db = tables.mechanism_delta(me.quadrant)
            out[key] = BeliefUpdate(tick=row.tick, rank_id=row.rank_id, target="mechanism",
                                    target_id=me.mechanism_id, d_alpha=da, d_beta=db, quadrant=me.quadrant)
            for eid in sorted(set(me.edges)):
                if eid not in graph:
                    log.warning("s3.unknown_edge", edge=eid, mechanism=me.mechanism_id, rank=row.rank_id, tick=row.tick)
                    continue
                icp = row.icp.get(eid, IcpVerdict.UNDECIDED)
                edge_cells[eid].append(tables.edge_delta(icp, me.quadrant, graph.edge(eid).layer))
                edge_q[eid].add(me.quadrant)
        for eid in sorted(edge_cells):
            key = (row.tick, row.rank_id, "edge", eid)
            if key in out:
                continue
            cells = edge_cells[eid]
            da = sum(c[0] for c in cells) / len(cells)
            db = sum(c[1] for c in cells) / len(cells)
            qs = edge_q[eid]
            out[key] = BeliefUpdate(tick=row.tick, rank_id=row.rank_id, target="edge", target_id=eid,
                                    d_alpha=da, d_beta=db, quadrant=next(iter(qs)) if len(qs) == 1 else None,
                                    icp=row.icp.get(eid, IcpVerdict.UNDECIDED))
    return [out[k] for k in sorted(out)]


def apply_evidence(
    prev: BeliefState,
    rows: Sequence[EvidenceRow],
    *,
    tick: int | None = None,
    mechanisms: Mapping[str, Mechanism] | None = None,
    tables: UpdateTables | None = None,
    graph: CausalGraph | None = None,
) -> BeliefState:
    """beliefs_t = apply_evidence(beliefs_{t−1}, evidence_t). Pure.

    Only rows with ``prev.tick < row.tick ≤ tick`` are folded (``tick`` defaults to the newest
    row's tick); rows at or before ``prev.tick`` are already in ``prev``, so re-applying them
    is a no-op. With nothing new, ``prev`` is returned unchanged (its tick advanced to
    ``tick`` when one is given and newer).
    """
    graph = graph or default_graph()
    target = tick if tick is not None else max((r.tick for r in rows), default=prev.tick)
    if target <= prev.tick:
        return prev
    fresh = [r for r in rows if prev.tick < r.tick <= target]
    edges = dict(prev.edges)
    mechs = dict(prev.mechanisms)
    for mid, m in sorted((mechanisms or {}).items()):
        mechs.setdefault(mid, m.prior)
    acc: dict[tuple[str, str], list[float]] = {}
    for u in plan_updates(fresh, tables, graph):
        slot = acc.setdefault((u.target, u.target_id), [0.0, 0.0])
        slot[0] += u.d_alpha
        slot[1] += u.d_beta
    for (kind, tid), (da, db) in sorted(acc.items()):
        if kind == "edge":
            base = edges.get(tid) or graph.edge(tid).prior
            edges[tid] = base.updated(da, db)
        else:
            base = mechs.get(tid)
            if base is None:  # evidence about a mechanism nobody registered: its edges learn, it does not
                log.warning("s3.unknown_mechanism", cluster=prev.cluster_id, mechanism=tid, tick=target)
                continue
            mechs[tid] = base.updated(da, db)
    return BeliefState(cluster_id=prev.cluster_id, tick=target, edges=dict(sorted(edges.items())),
                       mechanisms=dict(sorted(mechs.items())))


def changed(prev: BeliefState, new: BeliefState) -> tuple[dict[str, Belief], dict[str, Belief]]:
    """The edges and mechanisms whose Beta differs between two states (what S3 persists)."""
    e = {k: b for k, b in new.edges.items() if prev.edges.get(k) != b}
    m = {k: b for k, b in new.mechanisms.items() if prev.mechanisms.get(k) != b}
    return e, m


def beliefs_summary(state: BeliefState) -> dict[str, Any]:
    """Small JSON-able summary (Temporal payloads stay small)."""
    return {"tick": state.tick, "n_edges": len(state.edges), "n_mechanisms": len(state.mechanisms)}
