"""Mechanisms: scoped causal stories over registered edges, with admission and promotion.

Whitepaper "Mechanisms": M = (E_M, S_M, η_M, B_M) — a set of registered edges forming one
or more X→V→Y paths, a scope where the story claims to hold, a narrative and a Beta
belief. Overview §2.3: the LLM proposes mechanisms; one is admitted only if it forms a
valid, non-duplicate X→V→Y path set over registered edges, and starts at Beta(1, 1).
Appendix D: seed → propose → learn → promote.

Choices where the spec is vague:
- **Legal path set.** Every edge registered; at least one X→V and one V→Y edge; every
  mediator in the set has an edge in *and* an edge out inside the set (no dangling
  mediator: a V with no outcome is untestable, a V with no decision explains nothing);
  and the edges are connected (overview §2.3: "a connected subgraph") — two unrelated
  stories are two mechanisms.
- **Scope.** ``x`` and ``v`` are the X and V nodes of the edges; a proposal may omit them
  or list a subset, but naming a node no edge touches is a bad scope. Stored scopes are
  normalised to the full node sets so they are redundant with the edges.
- **Identity.** ``M_<12 hex>`` of (sorted edges, workload_type, model_type, canonical
  conditions). x/v are left out of the hash (they follow from the edges) and the
  narrative too: the same edges under the same scope are the same hypothesis however it
  is worded, so the duplicate test is an id lookup.
- **Applicability.** A condition on a feature the rank context lacks is false: a
  mechanism applies only where its scope can be checked.
- **Promotion.** "Enough evidence" is measured in pseudo-counts gained since the prior
  ((α+β) now − (α+β) at seed), which the update tables make comparable across
  quadrants; the written-back bin is the strongest whose mean does not exceed the
  posterior mean (:func:`koi.causal.beta.bin_for_confidence`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from enum import StrEnum
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from koi import variables
from koi.causal.beta import Belief, ConfidenceBin, bin_for_confidence
from koi.causal.features import MODEL_TYPES, WORKLOAD_TYPES, FeatureValue, feature_names
from koi.causal.graph import CausalGraph, EdgeLayer, GraphError, default_graph
from koi.domain.common import FrozenModel, KoiModel, stable_hash
from koi.variables import Kind

Op = Literal[">", ">=", "<", "<=", "==", "!=", "in"]
OPS: tuple[str, ...] = (">", ">=", "<", "<=", "==", "!=", "in")
Scalar = bool | int | float | str


#: libyaml's safe loader when available (the pure-Python one takes ~1 s on the seed tables)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

class MechanismError(ValueError):
    """A malformed seed mechanism (named) or a bad mechanism definition."""


class Condition(FrozenModel):
    feature: str
    op: Op
    value: Scalar | list[Scalar]

    def canonical(self) -> dict[str, Any]:
        v: Any = self.value
        if isinstance(v, list):
            v = sorted(v, key=lambda x: json.dumps(x))
        return {"feature": self.feature, "op": self.op, "value": v}


class Scope(FrozenModel):
    x: tuple[str, ...] = ()
    v: tuple[str, ...] = ()
    workload_type: str = "any"
    model_type: str = "any"
    conditions: tuple[Condition, ...] = ()

    def key(self) -> dict[str, Any]:
        conds = sorted((c.canonical() for c in self.conditions), key=lambda d: json.dumps(d, sort_keys=True))
        return {"workload_type": self.workload_type, "model_type": self.model_type, "conditions": conds}


class MechanismStatus(StrEnum):
    ACTIVE = "active"
    RETIRED = "retired"


class Origin(StrEnum):
    SEED = "seed"
    PROPOSED = "proposed"


class Mechanism(FrozenModel):
    """One admitted mechanism. ``prior`` is its seed Beta; the live posterior is in the belief state."""

    mechanism_id: str
    name: str = ""
    edge_ids: tuple[str, ...]
    scope: Scope
    narrative: str
    prior: Belief
    status: MechanismStatus = MechanismStatus.ACTIVE
    origin: Origin = Origin.SEED
    admitted_tick: int | None = None

    @cached_property
    def x_nodes(self) -> tuple[str, ...]:
        return _nodes_of(self.edge_ids, Kind.X)

    @cached_property
    def v_bundle(self) -> tuple[str, ...]:
        """The mediators whose CUSUM verdicts make the mechanism's V verdict."""
        return _nodes_of(self.edge_ids, Kind.V)

    @cached_property
    def y_bundle(self) -> tuple[str, ...]:
        """The outcomes whose CUSUM verdicts make the mechanism's Y verdict."""
        return _nodes_of(self.edge_ids, Kind.Y)

    @property
    def is_active(self) -> bool:
        return self.status is MechanismStatus.ACTIVE


class MechanismProposal(KoiModel):
    """What the agent may submit (``set_new_mechanisms``): edges over E, a scope and a narrative."""

    edge_ids: list[str] = Field(min_length=1)
    scope: dict[str, Any] = Field(default_factory=dict)
    narrative: str = ""
    name: str = ""


class AdmissionCode(StrEnum):
    ADMITTED = "admitted"
    UNREGISTERED_EDGE = "unregistered_edge"
    ILLEGAL_EDGE = "illegal_edge"
    NO_PATH = "no_path"
    DANGLING = "dangling"
    DISCONNECTED = "disconnected"
    DUPLICATE = "duplicate"
    BAD_SCOPE = "bad_scope"


class AdmissionResult(KoiModel):
    admitted: bool
    code: AdmissionCode
    reason: str
    mechanism: Mechanism | None = None
    mechanism_id: str | None = None


# ---- structure checks ------------------------------------------------------------------------------
def _nodes_of(edge_ids: Iterable[str], kind: Kind) -> tuple[str, ...]:
    out: set[str] = set()
    for e in edge_ids:
        for n in variables.split_edge_id(e):
            if variables.kind_of(n) is kind:
                out.add(n)
    return tuple(sorted(out))


def check_path_set(edge_ids: Iterable[str], graph: CausalGraph) -> tuple[AdmissionCode, str] | None:
    """``None`` when the edges form a legal, connected X→V→Y path set; else (code, reason)."""
    ids = list(dict.fromkeys(edge_ids))
    if not ids:
        return AdmissionCode.NO_PATH, "a mechanism needs at least one X→V and one V→Y edge"
    for eid in ids:
        try:
            src, dst = variables.split_edge_id(eid)
            variables.get(src), variables.get(dst)
        except (ValueError, variables.UnknownVariableError) as exc:
            return AdmissionCode.UNREGISTERED_EDGE, f"edge {eid!r}: {exc}"
        if not variables.is_legal_edge(src, dst):
            ks, kd = variables.kind_of(src), variables.kind_of(dst)
            what = "an X→Y shortcut" if (ks, kd) == (Kind.X, Kind.Y) else f"a {ks.value}→{kd.value} edge"
            return AdmissionCode.ILLEGAL_EDGE, (
                f"edge {eid!r} is {what}: only X→V and V→Y edges exist, every effect passes through a mediator"
            )
        if eid not in graph:
            return AdmissionCode.UNREGISTERED_EDGE, (
                f"edge {eid!r} is not registered; mechanisms compose existing edges and never add one"
            )
    layers = {graph.edge(e).layer for e in ids}
    if layers != {EdgeLayer.XV, EdgeLayer.VY}:
        missing = "V→Y" if EdgeLayer.VY not in layers else "X→V"
        return AdmissionCode.NO_PATH, f"no X→V→Y path: the edges have no {missing} edge"
    ins: dict[str, int] = {}
    outs: dict[str, int] = {}
    for e in ids:
        edge = graph.edge(e)
        if edge.layer is EdgeLayer.XV:
            ins[edge.dst] = ins.get(edge.dst, 0) + 1
        else:
            outs[edge.src] = outs.get(edge.src, 0) + 1
    for v in sorted(set(ins) | set(outs)):
        if v not in outs:
            return AdmissionCode.DANGLING, f"mediator {v!r} has an edge in but no edge out to an outcome"
        if v not in ins:
            return AdmissionCode.DANGLING, f"mediator {v!r} has an edge out but no decision edge into it"
    # connectivity over the undirected edge set (union-find)
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent.setdefault(a, a) != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for e in ids:
        s, d = variables.split_edge_id(e)
        parent[find(s)] = find(d)
    roots = {find(n) for n in parent}
    if len(roots) > 1:
        return AdmissionCode.DISCONNECTED, (
            f"the edges form {len(roots)} disconnected stories; propose each as its own mechanism"
        )
    return None


def parse_scope(raw: Mapping[str, Any] | Scope | None, edge_ids: Iterable[str]) -> Scope:
    """Validate a scope against the registry and the edges; normalise x/v. Raises MechanismError."""
    ids = list(edge_ids)
    xs, vs = set(_nodes_of(ids, Kind.X)), set(_nodes_of(ids, Kind.V))
    if isinstance(raw, Scope):
        raw = raw.model_dump(mode="json")
    raw = dict(raw or {})
    unknown = sorted(set(raw) - {"x", "v", "workload_type", "model_type", "conditions"})
    if unknown:
        raise MechanismError(f"scope has unknown key(s) {unknown}")
    for key, allowed in (("x", xs), ("v", vs)):
        listed = raw.get(key) or []
        if isinstance(listed, str):
            listed = [listed]
        bad = sorted(set(listed) - allowed)
        if bad:
            raise MechanismError(f"scope.{key} names {bad}, which no edge of the mechanism touches")
    wt = str(raw.get("workload_type") or "any")
    if wt not in WORKLOAD_TYPES:
        raise MechanismError(f"scope.workload_type {wt!r} is not one of {list(WORKLOAD_TYPES)}")
    mt = str(raw.get("model_type") or "any")
    if mt not in MODEL_TYPES:
        raise MechanismError(f"scope.model_type {mt!r} is not one of {list(MODEL_TYPES)}")
    known = set(feature_names())
    conds: list[Condition] = []
    for i, c in enumerate(raw.get("conditions") or []):
        if not isinstance(c, Mapping):
            raise MechanismError(f"scope.conditions[{i}] must be a mapping {{feature, op, value}}")
        feat = c.get("feature")
        if feat not in known:
            raise MechanismError(f"scope.conditions[{i}]: unknown feature {feat!r} (registry X names or derived features)")
        op = c.get("op")
        if op not in OPS:
            raise MechanismError(f"scope.conditions[{i}]: unknown op {op!r}; use one of {list(OPS)}")
        val = c.get("value")
        if op == "in":
            if not isinstance(val, list) or not val:
                raise MechanismError(f"scope.conditions[{i}]: op 'in' needs a non-empty list value")
        elif op in (">", ">=", "<", "<="):
            if isinstance(val, bool) or not isinstance(val, int | float) or not math.isfinite(float(val)):
                raise MechanismError(f"scope.conditions[{i}]: op {op!r} needs a finite number, got {val!r}")
        elif val is None or isinstance(val, list | dict):
            raise MechanismError(f"scope.conditions[{i}]: op {op!r} needs a scalar value")
        try:
            conds.append(Condition(feature=feat, op=op, value=val))
        except ValidationError as exc:
            raise MechanismError(f"scope.conditions[{i}]: {exc.errors()[0]['msg']}") from None
    return Scope(x=tuple(sorted(xs)), v=tuple(sorted(vs)), workload_type=wt, model_type=mt, conditions=tuple(conds))


def mechanism_id_for(edge_ids: Iterable[str], scope: Scope) -> str:
    """Deterministic id: ``M_`` + 12 hex of (sorted edges, scope key)."""
    return "M_" + stable_hash({"edges": sorted(set(edge_ids)), "scope": scope.key()}, 12)


def build_mechanism(
    edge_ids: Iterable[str],
    scope: Mapping[str, Any] | Scope | None,
    narrative: str,
    prior: Belief,
    *,
    graph: CausalGraph | None = None,
    name: str = "",
    origin: Origin = Origin.SEED,
    admitted_tick: int | None = None,
) -> Mechanism:
    """Validate and build; raises MechanismError with the reason."""
    graph = graph or default_graph()
    ids = sorted(dict.fromkeys(edge_ids))
    problem = check_path_set(ids, graph)
    if problem is not None:
        raise MechanismError(problem[1])
    sc = parse_scope(scope, ids)
    return Mechanism(
        mechanism_id=mechanism_id_for(ids, sc),
        name=name,
        edge_ids=tuple(ids),
        scope=sc,
        narrative=narrative.strip(),
        prior=prior,
        origin=origin,
        admitted_tick=admitted_tick,
    )


# ---- applicability ---------------------------------------------------------------------------------
def _norm(v: Any) -> Any:
    return v.lower() if isinstance(v, str) else v


def _holds(c: Condition, features: Mapping[str, FeatureValue]) -> bool:
    if c.feature not in features:
        return False
    f = features[c.feature]
    if c.op == "in":
        vals = {_norm(x) for x in c.value} if isinstance(c.value, list) else {_norm(c.value)}
        return _norm(f) in vals
    if c.op in ("==", "!="):
        if isinstance(f, bool) or isinstance(c.value, bool):
            eq = isinstance(f, bool) and isinstance(c.value, bool) and f == c.value
        elif isinstance(f, int | float) and isinstance(c.value, int | float):
            eq = float(f) == float(c.value)
        else:
            eq = _norm(str(f)) == _norm(str(c.value))
        return eq if c.op == "==" else not eq
    if isinstance(f, bool) or not isinstance(f, int | float):
        return False
    x, v = float(f), float(c.value)  # type: ignore[arg-type]
    return {">": x > v, ">=": x >= v, "<": x < v, "<=": x <= v}[c.op]


def applies(mechanism: Mechanism, features: Mapping[str, FeatureValue]) -> bool:
    """Does ``mechanism``'s scope hold for this rank context? Retired mechanisms never apply."""
    if not mechanism.is_active:
        return False
    sc = mechanism.scope
    if sc.model_type != "any" and features.get("model_type") != sc.model_type:
        return False
    if sc.workload_type != "any":
        tags = features.get("workload_types", ())
        if isinstance(tags, str):
            tags = (tags,)
        if sc.workload_type not in tags:  # type: ignore[operator]
            return False
    return all(_holds(c, features) for c in sc.conditions)


def applicable(mechanisms: Mapping[str, Mechanism] | Iterable[Mechanism],
               features: Mapping[str, FeatureValue]) -> list[Mechanism]:
    items = mechanisms.values() if isinstance(mechanisms, Mapping) else mechanisms
    return sorted((m for m in items if applies(m, features)), key=lambda m: m.mechanism_id)


# ---- admission (Appendix D, "Propose") -----------------------------------------------------------------
def admit(
    proposal: MechanismProposal | Mapping[str, Any],
    registry: Mapping[str, Mechanism],
    *,
    graph: CausalGraph | None = None,
    tick: int | None = None,
) -> AdmissionResult:
    """Deterministic admission of an agent-proposed mechanism; admitted ones start at Beta(1, 1).

    The proposer does not grade its own theory (Appendix D): any confidence it claims is
    ignored. The result always carries a human-readable reason.
    """
    graph = graph or default_graph()
    if not isinstance(proposal, MechanismProposal):
        try:
            proposal = MechanismProposal.model_validate(
                {k: v for k, v in dict(proposal).items() if k in MechanismProposal.model_fields}
            )
        except ValidationError as exc:
            return AdmissionResult(admitted=False, code=AdmissionCode.BAD_SCOPE, reason=f"malformed proposal: {exc}")
    ids = sorted(dict.fromkeys(proposal.edge_ids))
    problem = check_path_set(ids, graph)
    if problem is not None:
        return AdmissionResult(admitted=False, code=problem[0], reason=problem[1])
    try:
        scope = parse_scope(proposal.scope, ids)
    except MechanismError as exc:
        return AdmissionResult(admitted=False, code=AdmissionCode.BAD_SCOPE, reason=str(exc))
    mid = mechanism_id_for(ids, scope)
    if mid in registry:
        other = registry[mid]
        label = f" ({other.name})" if other.name else ""
        return AdmissionResult(
            admitted=False, code=AdmissionCode.DUPLICATE, mechanism_id=mid,
            reason=f"duplicate of {mid}{label}: same edge set under the same scope",
        )
    m = Mechanism(
        mechanism_id=mid, name=proposal.name, edge_ids=tuple(ids), scope=scope,
        narrative=proposal.narrative.strip(), prior=Belief.neutral(), origin=Origin.PROPOSED,
        admitted_tick=tick,
    )
    return AdmissionResult(
        admitted=True, code=AdmissionCode.ADMITTED, mechanism=m, mechanism_id=mid,
        reason=f"admitted as {mid} at Beta(1, 1): {len(ids)} registered edges, legal connected X→V→Y paths",
    )


# ---- seed table -------------------------------------------------------------------------------------------
def _parse_seed(data: Any, source: str, graph: CausalGraph) -> dict[str, Mechanism]:
    if not isinstance(data, dict) or not isinstance(data.get("mechanisms"), list):
        raise MechanismError(f"{source}: expected a mapping with a 'mechanisms' list")
    out: dict[str, Mechanism] = {}
    for i, row in enumerate(data["mechanisms"]):
        label = row.get("name", f"#{i}") if isinstance(row, dict) else f"#{i}"
        try:
            if not isinstance(row, dict):
                raise MechanismError("entry must be a mapping")
            b = ConfidenceBin(str(row.get("bin", "EVEN")).upper())
            m = build_mechanism(row.get("edges") or [], row.get("scope"), str(row.get("narrative", "")),
                                Belief.of_bin(b), graph=graph, name=str(row.get("name", "")))
            if not m.narrative:
                raise MechanismError("a seed mechanism needs a narrative")
        except (MechanismError, GraphError, ValueError) as exc:
            raise MechanismError(f"{source}: mechanism {label!r} is invalid: {exc}") from None
        if m.mechanism_id in out:
            raise MechanismError(f"{source}: mechanism {label!r} duplicates {out[m.mechanism_id].name!r}")
        out[m.mechanism_id] = m
    return dict(sorted(out.items()))


def load_seed_mechanisms(path: str | Path | None = None, graph: CausalGraph | None = None) -> dict[str, Mechanism]:
    """The seed mechanism table (default: the shipped one), validated like an admission."""
    graph = graph or default_graph()
    if path is None:
        text = resources.files("koi.causal").joinpath("data", "mechanisms.yaml").read_text(encoding="utf-8")
        source = "koi/causal/data/mechanisms.yaml"
    else:
        text = Path(path).read_text(encoding="utf-8")
        source = str(path)
    return _parse_seed(yaml.load(text, Loader=_LOADER), source, graph)


@cache
def _default_seed() -> tuple[Mechanism, ...]:
    return tuple(load_seed_mechanisms().values())


def default_mechanisms() -> dict[str, Mechanism]:
    """The shipped seed mechanisms (loaded once; a fresh dict each call)."""
    return {m.mechanism_id: m for m in _default_seed()}


# ---- promotion (Appendix D, "Promote") ---------------------------------------------------------------------
class PromotedMechanism(KoiModel):
    mechanism_id: str
    name: str
    bin: ConfidenceBin
    edges: list[str]
    scope: dict[str, Any]
    narrative: str
    evidence: float
    posterior: tuple[float, float]


def promote(
    mechanisms: Mapping[str, Mechanism],
    beliefs: Mapping[str, Belief],
    *,
    min_evidence: float = 10.0,
    min_confidence: float = 0.8,
) -> dict[str, Any]:
    """A new seed table of the mechanisms with ≥ ``min_evidence`` pseudo-counts gained and c ≥ ``min_confidence``.

    Returns ``{"mechanisms": [...]}`` in the shape of ``mechanisms.yaml`` (plus the evidence
    and posterior for the offline reviewer); :func:`render_seed_table` writes it as YAML.
    """
    rows: list[dict[str, Any]] = []
    for mid in sorted(mechanisms):
        m = mechanisms[mid]
        b = beliefs.get(mid, m.prior)
        gained = b.strength - m.prior.strength
        if gained < min_evidence or b.c < min_confidence:
            continue
        pm = PromotedMechanism(
            mechanism_id=mid, name=m.name or mid, bin=bin_for_confidence(b.c), edges=list(m.edge_ids),
            scope={"workload_type": m.scope.workload_type, "model_type": m.scope.model_type,
                   "conditions": [c.canonical() for c in m.scope.conditions]},
            narrative=m.narrative, evidence=round(gained, 6), posterior=(b.alpha, b.beta),
        )
        rows.append(pm.model_dump(mode="json"))
    return {"mechanisms": rows}


def render_seed_table(table: Mapping[str, Any]) -> str:
    """YAML text of a promoted seed table, loadable by :func:`load_seed_mechanisms`."""
    return yaml.safe_dump(dict(table), sort_keys=False, allow_unicode=True, width=110)
