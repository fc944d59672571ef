"""Causal risk: a ladder's DRO radius moved by the doubt of the stories it rests on (overview §2:
uncertain relationships "identify informative deployments to test but increase estimated risk").

A ladder's radius is moved by the excess doubt x(L) of the mechanisms it exercises
(:meth:`koi.scoring.exploration.ExplorationModel.doubt`: Σ over its stories of d_m − d̄,
d = max(U, 1 − c) of the story's *seed* belief — how sure the library's authors were; the learned
posterior drives EIG, not the risk: ``doubt_evidence`` = 0, :mod:`koi.scoring.exploration`, "Doubt",
choice 5):

    ε_L = ε·(1 + κ·x),   x clipped to [−1/κ, 1],   κ = ``knobs.causal_risk``

A ladder resting on more doubted stories than average is judged on a wider band, one resting on
better-supported stories on a narrower one. ``evaluate_ladders`` computes p_brk at ε and at ε(1 + κ)
in one pass (the kernel density is shared); a kept candidate's p_brk is the linear interpolation in
the radius (:func:`widened`), exact in the residual regime while the ladder's worst objective does not
change (the inflation ε·Lip·σ̂ is linear in ε), first-order on the cold band; it is clipped to [0, 1].
The activation is the one EIG already uses, so there is no extra per-candidate feature work.

Choices:

1. d̄, the average story, is the one the fleet's running ladders exercise (:func:`fleet_centre`):
   the slow loop calibrates ε on their realised coverage, so they sit at ε on average (their x sum
   to 0). The registry's mean over every testable mechanism (the first form) counts stories no
   ladder exercises, which stay untested: on hetero-3h it put every running ladder's x at −0.5 to
   −0.8 by tick 10 (seed 1, ``koi plan replay``), past −1/κ, so most ladders were judged at radius 0
   and the widening had become a uniform narrowing — leaner ladders, more repairs; Koi scored 0.21
   ± 0.10 below its no-DAG ablation over six seeds. The registry mean remains the fallback when
   nothing runs (the first tick).
2. The moved p_brk enters σ (γ·p_brk) and is what the plan reports, but C3 stays on the slow loop's
   radius ε (``c3_ok``; the validator and the selector's reservation rule read that flag): C3 is the
   spec's chance constraint under *prediction* uncertainty, and gating on a belief-moved radius would
   defer jobs whose only ladders rest on doubted stories.
3. It is applied after C3 and dominance pruning, to the candidates kept (:mod:`koi.planning.candidates`),
   so pruning sees the plain σ.
4. It only moves p_brk where a prediction is near its target (where ε·Lip·σ̂ ≠ 0), so most ladders
   are untouched.
5. It moves untried ladders only. The running ladder (the keep) and a candidate every rank of which
   runs a chain the job already runs (its scale-outs and scale-ins) are judged at ε: their chains are
   observed — the residual learner has fitted them and their own windows set the keep's risk — and ε
   is calibrated on exactly those ladders' coverage. Doubt is about how an untried deployment will
   behave; widening an observed chain by its stories made a running ladder on doubted stories look
   riskier than an untried one on trusted stories, and Koi swapped away from what it had measured
   (hetero-3h seeds 0–5: 89.03 → 89.10, the no-DAG ablation 89.13, the frozen one 88.72; the frozen
   ablation, which has the exploration model but no observed risk, lost most of its lead with it:
   ``benchmarks/results/hetero-3h/README.md``, top section).

κ is discussed in :class:`koi.scoring.params.PlanningKnobs`. Without an exploration model (no
mechanisms: ``koi-nodag``) or with κ = 0 nothing changes: the second radius is not even computed.
"""

from __future__ import annotations

from collections.abc import Iterable

from koi.scoring.exploration import Activation, ExplorationModel


def fleet_centre(exploration: ExplorationModel, running: Iterable[Activation]) -> float:
    """d̄: the mean doubt over the (running ladder, mechanism it exercises) pairs; the registry's mean
    when no running ladder exercises any (choice 1)."""
    c = exploration.exercised_doubt(running)
    return exploration.doubt_mean if c is None else c


def widened(p0: float, p_hi: float, x: float, kappa: float) -> float:
    """p_brk at ε(1 + κ·x), x clipped to [−1/κ, 1], from p_brk at ε (``p0``) and at ε(1 + κ) (``p_hi``)."""
    if kappa <= 0:
        return p0
    x = min(max(x, -1.0 / kappa), 1.0)
    return min(max(p0 + x * (p_hi - p0), 0.0), 1.0)
