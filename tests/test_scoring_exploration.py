"""Exploration: masks, EIG and the saturating Expl(P) (whitepaper, "Exploration: EIG")."""

from __future__ import annotations

import numpy as np
import pytest

from koi.scoring import ExplorationModel, MechanismView, saturate, uncertainty
from koi.scoring import testable_edges as _testable

PP_MECH = ("pp->pipeline_bubble_fraction", "max_num_batched_tokens->pipeline_bubble_fraction",
           "pipeline_bubble_fraction->throughput_tokens_per_sec", "pipeline_bubble_fraction->p99_tpot_ms")
KV_MECH = ("kvcache_dtype->kv_cache_util", "kv_cache_util->p99_tpot_ms")


def _model(omega: float = 1.0, normalise: bool = False) -> ExplorationModel:
    mechs = [
        MechanismView("M_pp", PP_MECH, 1.0, 1.0, lambda f: f.get("pp", 1) > 1),
        MechanismView("M_kv", KV_MECH, 9.0, 1.0, lambda f: True),
        # a path through a deferred mediator is not testable
        MechanismView("M_pd", ("pd_enabled->pd_inbalance", "pd_inbalance->p99_ttft_ms"), 1.0, 1.0, lambda f: True),
    ]
    beliefs = {e: (1.0, 1.0) for e in PP_MECH} | {KV_MECH[0]: (4.0, 1.0), KV_MECH[1]: (9.0, 1.0)}
    return ExplorationModel(edge_beliefs=beliefs, mechanisms=mechs, omega_m=omega, normalise=normalise)


def test_uncertainty_kernel() -> None:
    assert float(uncertainty(1, 1)) == pytest.approx(1.0)
    assert float(uncertainty(9, 1)) == pytest.approx(12 * 9 / (100 * 11))
    assert float(uncertainty(50, 50)) < 0.05


def test_testable_edges_need_an_observable_mediator_on_a_full_path() -> None:
    assert _testable(PP_MECH) == tuple(sorted(PP_MECH))
    assert _testable(("pd_enabled->pd_inbalance", "pd_inbalance->p99_ttft_ms")) == ()
    assert _testable(("pp->pipeline_bubble_fraction",)) == ()  # no V→Y edge: no path


def test_masks_follow_scope_and_testability() -> None:
    ex = _model()
    flat = ex.applicable({"pp": 1})
    deep = ex.applicable({"pp": 2})
    ids = lambda act: {ex.mechanism_ids[i] for i in act.mechanisms}  # noqa: E731
    assert ids(flat) == {"M_kv"} and ids(deep) == {"M_kv", "M_pp"}  # M_pd never: untestable
    assert len(deep.edges) == len(PP_MECH) + len(KV_MECH)


def test_eig_sums_edge_and_mechanism_uncertainty() -> None:
    ex = _model(omega=0.5)
    act = ex.applicable({"pp": 2})
    u_e = 4 * 1.0 + float(uncertainty(4, 1)) + float(uncertainty(9, 1))
    u_m = 1.0 + float(uncertainty(9, 1))
    assert ex.eig(act) == pytest.approx(u_e + 0.5 * u_m)


def test_normalised_eig_is_the_share_of_the_graphs_uncertainty_a_ladder_tests() -> None:
    """The planner's scale: U divided by the EIG of testing every testable edge and mechanism
    untested (6 edges + 0.5 × 2 testable mechanisms here), so EIG and Expl lie in [0, 1]."""
    raw, norm = _model(omega=0.5), _model(omega=0.5, normalise=True)
    act = raw.applicable({"pp": 2})
    assert norm.eig(norm.applicable({"pp": 2})) == pytest.approx(raw.eig(act) / (6 + 0.5 * 2))
    assert norm.expl([norm.applicable({"pp": 2}), norm.applicable({"pp": 1})]) <= 1.0
    assert ExplorationModel(edge_beliefs={}, mechanisms=(), normalise=True).expl([]) == 0.0


def test_expl_counts_an_edge_once_across_the_plan() -> None:
    ex = _model()
    a = ex.applicable({"pp": 2})
    b = ex.applicable({"pp": 4})
    assert ex.expl([a, b]) == pytest.approx(ex.eig(a))  # the second ladder tests nothing new
    assert ex.expl([a, b]) < ex.eig(a) + ex.eig(b)
    assert ex.expl([]) == 0.0


def test_saturation_formula() -> None:
    a = np.array([[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]])
    assert saturate(a).tolist() == pytest.approx([1.0, 0.0, 0.75])


def test_best_mechanism_is_the_most_confident() -> None:
    ex = _model()
    act = ex.applicable({"pp": 2})
    assert ex.best_mechanism(act) == "M_kv"  # c = 0.9 beats 0.5
    assert ex.best_mechanism(ex.applicable({"pp": 2}), confidence=False) == "M_pp"  # highest U
    assert ex.best_mechanism(ex.applicable({})) == "M_kv"


def test_adapter_over_the_causal_package() -> None:
    from koi.causal.mechanisms import default_mechanisms
    from koi.causal.updates import initial_beliefs
    from koi.scoring import edge_beliefs_from, views_from_causal

    mechs = default_mechanisms()
    state = initial_beliefs("c", mechs)
    ex = ExplorationModel(edge_beliefs=edge_beliefs_from(state), mechanisms=views_from_causal(mechs, state))
    assert len(ex.mechanism_ids) == len([m for m in mechs.values() if m.is_active])
    assert np.all((ex.u_edge >= 0) & (ex.u_edge <= 1))


def test_adapter_carries_each_seed_prior_for_the_doubt() -> None:
    """views_from_causal hands every mechanism its seed Beta, so with ``doubt_evidence`` = 0 the doubt is the seed
    belief's however far the learned one has moved, while EIG (U) reads the learned one (exploration, "Doubt", (5))."""
    from koi.causal.mechanisms import default_mechanisms
    from koi.scoring import views_from_causal

    mechs = {k: m for k, m in default_mechanisms().items() if m.is_active}
    learned = {k: (m.prior.alpha + 10.0, m.prior.beta + 290.0) for k, m in mechs.items()}  # heavily contradicted
    views = views_from_causal(mechs, learned)
    assert [v.prior for v in views] == [(mechs[v.mechanism_id].prior.alpha, mechs[v.mechanism_id].prior.beta)
                                        for v in views]
    seed = ExplorationModel(edge_beliefs={}, mechanisms=views, doubt_evidence=0.0)
    posterior = ExplorationModel(edge_beliefs={}, mechanisms=views)
    pa, pb = np.array([v.prior for v in seed.mechanisms]).T
    assert seed.d_mech == pytest.approx(np.maximum(uncertainty(pa, pb), pb / (pa + pb)))
    la, lb = np.array([learned[m] for m in posterior.mechanism_ids]).T
    assert posterior.d_mech == pytest.approx(lb / (la + lb))  # 1 − c ≈ 0.96 of the learned posterior
    assert (seed.d_mech < posterior.d_mech - 0.2).sum() == int((pa + pb > 2).sum())  # all but the EVEN seed
    assert np.array_equal(seed.u_mech, posterior.u_mech)
