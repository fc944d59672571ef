"""Exploration: EIG per candidate and the saturating Expl(P) per plan (whitepaper,
"Exploration: Expected Information Gain"; overview §2.4).

    EIG(L)  = Σ_e a_e(L) U(α_e, β_e) + ω_m Σ_m a_m(L) U(α_m, β_m)
    Expl(P) = Σ_e A_e(P) U_e + ω_m Σ_m A_m(P) U_m,   A_e(P) = 1 − Π_i (1 − a_e(L_i))

An edge tested by several ranks of a plan counts once (saturation).

The masks a_e, a_m ("eligibility gates"): a ladder exercises mechanism m when m's
scope applies to at least one of its ranks (:func:`koi.causal.mechanisms.applies` on
:func:`koi.causal.features.rank_features`) and m has a *testable* X→V→Y path — a path
whose mediator V is observable (not ``deferred`` in :mod:`koi.variables`). It
exercises edge e when e lies on a testable path of a mechanism it exercises. Edges
that belong to no applicable mechanism are not counted: nothing in the plan states a
hypothesis that would test them, and S2 only tests applicable mechanisms.

Choice: the spec's "enough samples exist" gate is not applied at planning time — a
ladder that runs for a tick produces its sub-tick samples; S2's ICP power gate decides
later whether they were enough.

Scale (a choice: the spec fixes neither β's range nor EIG's scale). EIG is a sum over up to
~100 edges and mechanisms, each U ∈ [0, 1], while J, p_brk and the switch cost are O(1):
unnormalised, a new ladder's EIG of 5–40 made β·EIG (β_0 = 0.05) several times any
difference in J − γ p_brk, and exploration decided nearly every placement and swap (on
hetero-3h a 235B job went to a three-rank split ladder for its EIG of 6.7 and breached
its TTFT target through half the run; Koi swapped 3× more than the MILP). With
``normalise`` (what the planner uses) every U is divided by the EIG of a ladder exercising
the whole testable graph at U = 1, so EIG and Expl(P) are the share of the graph's
uncertainty a ladder or plan would test, in [0, 1], and β ∈ [β_min, β_max] weighs it on
the same scale as the exploit terms.

Doubt (overview §2: "uncertain relationships identify informative deployments to test but
increase estimated risk"). Besides U, each edge and mechanism has a *doubt*
d = max(U(α, β), 1 − c), c = α/(α+β): high while the relationship is untested (U) and high
once evidence contradicts it (1 − c; a mechanism's β grows with Q4 rows, evaluations in its
scope where mediators and outcomes both diverged from the prediction, so 1 − c estimates
how often predictions in that scope fail). A ladder's *excess doubt*
x(L) = Σ_{m∈L} (d_m − d̄) sums, over the testable mechanisms it exercises (the activation EIG
uses), how much more doubted each story is than the average testable mechanism (d̄); 0 for a
ladder exercising nothing. The planner widens the ladder's DRO radius by it
(:mod:`koi.planning.candidates`, "Causal risk"). Choices: (1) mechanisms, not edges — a
mechanism's Beta is the belief in its whole scoped story, updated once per evaluation
(Q1/Q4), while an edge's is shared by every story through it; (2) a sum, not a mean — on
hetero-3h ten seed mechanisms apply to every ladder of every job and a mean over them left
the ladders of one job within ±0.03 of each other (no signal); in the sum such universal
stories add one constant per job while a scoped story (fp8 KV, PP, multi-node, a GPU family)
moves its ladders by its own d_m − d̄; (3) relative to d̄: the slow loop calibrates ε on the
fleet's realised coverage, i.e. on the average story, so a story as doubted as the average
leaves the radius alone, a better-supported one narrows it ("high-confidence relationships
support exploitation") and a more doubted one widens it. (4) d̄ is the average story *as the
fleet exercises it* (:meth:`ExplorationModel.exercised_doubt`): the mean of d_m over the pairs
(running ladder, mechanism it exercises), so the running ladders' x sum to 0 — the ladders whose
coverage ε was calibrated on sit, on average, at ε. The registry's plain mean (``doubt_mean``)
is the fallback when nothing runs. Measured: it counts stories no ladder exercises, which stay
untested (high U), so on hetero-3h every running ladder's x fell to −0.5 to −0.8 by tick 10 —
below −1/κ, i.e. radius 0 — and the widening had become a uniform narrowing.
(5) The doubt reads the *seed* belief of each story, not the learned one: ``doubt_evidence``
(:class:`koi.scoring.params.PlanningKnobs`) caps the pseudo-counts of evidence the doubt admits
(:func:`tempered`: the prior plus the evidence gained since, scaled down to the cap at the
evidence's own rate), and the planner's cap is 0. EIG, confidence and the named hypothesis
still read the whole posterior. Why: S3 updates *every* applicable story from every
EvidenceRow, and consecutive rows of one ladder are nearly the same observation, so a story
that applies broadly gains hundreds of pseudo-counts per run and its 1 − c converges on the
contradiction rate of whatever ran in its scope; by tick 35 the learned and the seed doubts
ranked hetero-3h's 38 stories with Spearman 0.10. Measured (hetero-3h, Koi, seeds 0–5): the
whole posterior 88.80, a cap of 10 pseudo-counts 88.87, of 3 88.88, the prior (cap 0) 89.02 —
+0.22 over the posterior (5 of 6 seeds), $28 less a run, p99 windows 93.4% against 92.6%, 45
swaps against 49. The gain is not better miss prediction: on the same kept ladders (seeds
0–2, ``benchmarks/doubt_vs_misses.py``) the posterior's x correlates 0.07 with a missed p99
window and the prior's 0.02. Our reading: a doubt that drifts with every tick's evidence moves
the running ladders' breach risk from tick to tick (more repairs, more swaps), while the
seed library's ordering — EVEN > PLAUSIBLE > LIKELY > STRONG > CERTAIN, i.e. how sure the
authors of a story were — is a stable, scoped prior on where surprises live. A runtime-proposed
story enters at Beta(1, 1), the most doubted.

Choice: keep and defer exercise nothing (they contribute 0 to Φ in the spec, "The
Cluster Objective"); only ladder-bearing actions count toward Expl(P).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from koi import variables
from koi.variables import Kind

Features = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class MechanismView:
    """What exploration needs of a mechanism: its edges, its Beta state and its scope test."""

    mechanism_id: str
    edge_ids: tuple[str, ...]
    alpha: float
    beta: float
    applies: Callable[[Features], bool]
    #: the seed Beta the posterior (α, β) grew from; None = unknown (the doubt reads the posterior as is)
    prior: tuple[float, float] | None = None


def uncertainty(alpha: np.ndarray | float, beta: np.ndarray | float) -> np.ndarray:
    """U(α, β) = 12αβ/((α+β)²(α+β+1)); U(1, 1) = 1."""
    a = np.asarray(alpha, dtype=float)
    b = np.asarray(beta, dtype=float)
    n = a + b
    return 12.0 * a * b / (n * n * (n + 1.0))


def tempered(alpha: np.ndarray, beta: np.ndarray, prior: np.ndarray, cap: float | None) -> tuple[np.ndarray, np.ndarray]:
    """The Beta the doubt reads: the prior plus the evidence gained since, scaled down to at most ``cap``
    pseudo-counts (module docstring, "Doubt", choice 5). ``prior`` is (n, 2); a row of NaN = unknown
    prior (the posterior as is). ``cap`` None = the posterior; 0 = the prior."""
    a = np.asarray(alpha, dtype=float)
    b = np.asarray(beta, dtype=float)
    if cap is None or a.size == 0:
        return a, b
    pa, pb = prior[:, 0], prior[:, 1]
    known = np.isfinite(pa) & np.isfinite(pb)
    pa, pb = np.where(known, pa, a), np.where(known, pb, b)
    ga, gb = np.maximum(a - pa, 0.0), np.maximum(b - pb, 0.0)
    n = ga + gb
    w = np.where(n > cap, cap / np.where(n > 0, n, 1.0), 1.0)
    return pa + w * ga, pb + w * gb


def _priors(mechs: Sequence[MechanismView]) -> np.ndarray:
    nan = (float("nan"), float("nan"))
    return np.array([m.prior if m.prior is not None else nan for m in mechs], dtype=float).reshape(-1, 2)


def testable_edges(edge_ids: Iterable[str]) -> tuple[str, ...]:
    """The edges of ``edge_ids`` lying on an X→V→Y path (inside the set) through an observable V."""
    ids = sorted(set(edge_ids))
    into: dict[str, list[str]] = {}
    out_of: dict[str, list[str]] = {}
    for e in ids:
        src, dst = variables.split_edge_id(e)
        if variables.kind_of(dst) is Kind.V and variables.kind_of(src) is Kind.X:
            into.setdefault(dst, []).append(e)
        elif variables.kind_of(src) is Kind.V and variables.kind_of(dst) is Kind.Y:
            out_of.setdefault(src, []).append(e)
    keep: set[str] = set()
    for v in set(into) & set(out_of):
        if variables.VARIABLES[v].deferred:
            continue
        keep.update(into[v])
        keep.update(out_of[v])
    return tuple(sorted(keep))


def saturate(a: np.ndarray) -> np.ndarray:
    """A(P) = 1 − Π_i (1 − a_i) along axis 0 (rows are the plan's ladders)."""
    a = np.asarray(a, dtype=float)
    if a.ndim == 1 or a.shape[0] == 0:
        return np.clip(a if a.ndim == 1 else np.zeros(a.shape[1:]), 0.0, 1.0)
    return 1.0 - np.prod(1.0 - np.clip(a, 0.0, 1.0), axis=0)


@dataclass(frozen=True, slots=True)
class Activation:
    """The edges and mechanisms one ladder exercises (indices into an :class:`ExplorationModel`)."""

    edges: frozenset[int] = frozenset()
    mechanisms: frozenset[int] = frozenset()

    def union(self, other: Activation) -> Activation:
        return Activation(self.edges | other.edges, self.mechanisms | other.mechanisms)


EMPTY = Activation()


@dataclass
class ExplorationModel:
    """Edges and mechanisms indexed once per tick, with U precomputed.

    ``edge_beliefs`` maps edge id → (α, β); edges of a mechanism missing from it count at
    U(1, 1) = 1 (an edge nobody has seeded is maximally uncertain).
    """

    edge_beliefs: Mapping[str, tuple[float, float]]
    mechanisms: Sequence[MechanismView]
    omega_m: float = 1.0
    #: U as a share of the graph's total (module docstring, "Scale"): the planner's setting
    normalise: bool = False
    #: pseudo-counts of evidence the doubt admits per mechanism (:func:`tempered`); None = all of it
    doubt_evidence: float | None = None
    edge_ids: tuple[str, ...] = field(init=False)
    mechanism_ids: tuple[str, ...] = field(init=False)
    u_edge: np.ndarray = field(init=False)
    u_mech: np.ndarray = field(init=False)
    #: doubt d = max(U, 1 − c) per edge / mechanism, unnormalised (module docstring, "Doubt")
    d_edge: np.ndarray = field(init=False)
    d_mech: np.ndarray = field(init=False)
    #: the testable mechanisms' mean doubt: d̄ when no running ladder exercises any (module docstring, "Doubt")
    doubt_mean: float = field(init=False)
    _mech_edges: list[frozenset[int]] = field(init=False)
    _testable: list[bool] = field(init=False)
    _cache: dict[tuple, Activation] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        mechs = sorted(self.mechanisms, key=lambda m: m.mechanism_id)
        self.mechanisms = mechs
        self.mechanism_ids = tuple(m.mechanism_id for m in mechs)
        testable = {m.mechanism_id: testable_edges(m.edge_ids) for m in mechs}
        ids = sorted(set(self.edge_beliefs) | {e for t in testable.values() for e in t})
        self.edge_ids = tuple(ids)
        pos = {e: i for i, e in enumerate(ids)}
        ab = np.array([self.edge_beliefs.get(e, (1.0, 1.0)) for e in ids], dtype=float).reshape(-1, 2)
        self.u_edge = uncertainty(ab[:, 0], ab[:, 1]) if len(ids) else np.zeros(0)
        ma, mb = np.array([m.alpha for m in mechs], dtype=float), np.array([m.beta for m in mechs], dtype=float)
        self.u_mech = uncertainty(ma, mb)
        self.d_edge = np.maximum(self.u_edge, ab[:, 1] / (ab[:, 0] + ab[:, 1])) if len(ids) else np.zeros(0)
        ta, tb = tempered(ma, mb, _priors(mechs), self.doubt_evidence)
        self.d_mech = np.maximum(uncertainty(ta, tb), tb / (ta + tb)) if mechs else np.zeros(0)
        self._mech_edges = [frozenset(pos[e] for e in testable[m.mechanism_id]) for m in mechs]
        self._testable = [bool(testable[m.mechanism_id]) for m in mechs]
        every = [i for i, t in enumerate(self._testable) if t]
        self.doubt_mean = float(self.d_mech[every].mean()) if every else 0.0
        if self.normalise:
            total = len(ids) + self.omega_m * sum(self._testable)  # EIG of testing all of it, untested
            if total > 0:
                self.u_edge = self.u_edge / total
                self.u_mech = self.u_mech / total
        self._cache = {}

    @classmethod
    def empty(cls) -> ExplorationModel:
        return cls(edge_beliefs={}, mechanisms=())

    # ---- masks -----------------------------------------------------------------------------
    def applicable(self, features: Features, key: tuple | None = None) -> Activation:
        """The activation of one rank with this feature context (cached on ``key`` when given)."""
        if key is not None:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
        edges: set[int] = set()
        mechs: set[int] = set()
        for i, m in enumerate(self.mechanisms):
            if self._testable[i] and m.applies(features):
                mechs.add(i)
                edges.update(self._mech_edges[i])
        act = Activation(frozenset(edges), frozenset(mechs))
        if key is not None:
            self._cache[key] = act
        return act

    # ---- values ----------------------------------------------------------------------------
    def eig(self, act: Activation) -> float:
        """EIG of one ladder (its own activation, no saturation against others)."""
        e = sum(float(self.u_edge[i]) for i in act.edges)
        m = sum(float(self.u_mech[i]) for i in act.mechanisms)
        return e + self.omega_m * m

    def doubt(self, act: Activation, centre: float | None = None) -> float:
        """x(L) = Σ_{m∈L} (d_m − d̄): the excess doubt of the mechanisms one ladder exercises over the
        average story ``centre`` (default: the registry's mean); 0 for a ladder exercising nothing
        (module docstring, "Doubt")."""
        if not act.mechanisms:
            return 0.0
        d_bar = self.doubt_mean if centre is None else centre
        return float((self.d_mech[list(act.mechanisms)] - d_bar).sum())

    def exercised_doubt(self, acts: Iterable[Activation]) -> float | None:
        """d̄ as the fleet exercises it: the mean of d_m over the pairs (ladder, mechanism it exercises) of
        ``acts`` (the running ladders), so their x(L) sum to 0; None when no ladder exercises any."""
        idx = [i for a in acts for i in a.mechanisms]
        return float(self.d_mech[idx].mean()) if idx else None

    def expl(self, acts: Iterable[Activation]) -> float:
        """Expl(P) with binary masks: the saturation 1 − Π(1 − a) is the union."""
        edges: set[int] = set()
        mechs: set[int] = set()
        for a in acts:
            edges |= a.edges
            mechs |= a.mechanisms
        return float(self.u_edge[list(edges)].sum() if edges else 0.0) + self.omega_m * float(
            self.u_mech[list(mechs)].sum() if mechs else 0.0
        )

    def best_mechanism(self, act: Activation, confidence: bool = True) -> str | None:
        """The applicable mechanism an action names as its hypothesis.

        Choice: the highest confidence c = α/(α+β), ties by higher U then id. The
        mechanism_id is the plan's stated reason why the ladder should perform; S2 tests
        *every* applicable mechanism anyway (one EvidenceRow, N Beta updates), so the label
        does not change what is learned and the best-supported story is the honest one.
        """
        if not act.mechanisms:
            return None

        def key(i: int) -> tuple[float, float, str]:
            m = self.mechanisms[i]
            c = m.alpha / (m.alpha + m.beta)
            return (-c if confidence else -float(self.u_mech[i]), -float(self.u_mech[i]), m.mechanism_id)

        return self.mechanisms[min(act.mechanisms, key=key)].mechanism_id


def views_from_causal(mechanisms: Mapping[str, object], beliefs: object | None = None) -> list[MechanismView]:
    """Adapter: :class:`koi.causal.mechanisms.Mechanism` objects (+ an optional BeliefState
    or mapping id → Belief/(α, β)) as :class:`MechanismView`."""
    from koi.causal.mechanisms import applies

    mb: Mapping[str, object] = {}
    if beliefs is not None:
        mb = getattr(beliefs, "mechanisms", beliefs)  # type: ignore[assignment]
    out: list[MechanismView] = []
    for mid in sorted(mechanisms):
        m = mechanisms[mid]
        if not getattr(m, "is_active", True):
            continue
        prior = getattr(m, "prior", None)
        a, bb = _ab(mb.get(mid, prior))
        out.append(MechanismView(mid, tuple(m.edge_ids), a, bb, (lambda f, _m=m: applies(_m, f)),  # type: ignore[attr-defined]
                                 None if prior is None else _ab(prior)))
    return out


def edge_beliefs_from(beliefs: object) -> dict[str, tuple[float, float]]:
    """Adapter: a BeliefState, or a mapping id → Belief/(α, β), as id → (α, β)."""
    eb = getattr(beliefs, "edges", beliefs)
    return {k: _ab(v) for k, v in dict(eb).items()}  # type: ignore[arg-type]


def _ab(b: object) -> tuple[float, float]:
    if b is None:
        return (1.0, 1.0)
    if isinstance(b, tuple | list):
        return (float(b[0]), float(b[1]))
    return (float(b.alpha), float(b.beta))  # type: ignore[attr-defined]
