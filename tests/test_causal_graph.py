"""The registered graph, its seed table, Beta beliefs and the backward walk."""

from __future__ import annotations

import pytest

from koi import variables
from koi.causal.beta import Belief, ConfidenceBin, bin_for_confidence, uncertainty, uncertainty_array
from koi.causal.graph import EdgeLayer, GraphError, default_graph, load_graph
from koi.variables import Kind


def test_seed_graph_is_rich_and_legal() -> None:
    g = default_graph()
    assert 80 <= len(g) <= 150
    for e in g.edges.values():
        assert variables.is_legal_edge(e.src, e.dst)
        assert not variables.VARIABLES[e.src].deferred and not variables.VARIABLES[e.dst].deferred
        assert e.reason.strip()
        assert e.layer is (EdgeLayer.XV if variables.kind_of(e.src) is Kind.X else EdgeLayer.VY)
    # every observable mediator is reachable and leads somewhere
    for v in variables.OBSERVED_V:
        assert g.in_edges(v) and g.out_edges(v), v
    # every outcome has mediators
    for y in variables.Y_NAMES:
        assert g.in_edges(y), y


def test_priors_follow_bins() -> None:
    g = default_graph()
    e = g.edge("tp->comm_overhead_pct")
    assert e.bin is ConfidenceBin.STRONG
    assert (e.prior.alpha, e.prior.beta) == (4.0, 1.0)
    assert g.edge("pp->pipeline_bubble_fraction").prior == Belief(alpha=9.0, beta=1.0)


@pytest.mark.parametrize(
    ("edge", "needle"),
    [
        ("tp->p99_ttft_ms", "X→Y shortcut"),
        ("kv_pressure_score->queue_depth", "V→V"),
        ("tp->not_a_variable", "not_a_variable"),
        ("sp->comm_overhead_pct", "deferred"),
        ("p99_ttft_ms->queue_depth", "illegal"),
    ],
)
def test_bad_edge_file_names_the_edge(tmp_path, edge: str, needle: str) -> None:
    p = tmp_path / "edges.yaml"
    p.write_text(f'edges:\n  - {{edge: "tp->comm_overhead_pct", bin: STRONG, reason: ok}}\n'
                 f'  - {{edge: "{edge}", bin: LIKELY, reason: "some reason"}}\n')
    with pytest.raises(GraphError) as ei:
        load_graph(p)
    assert edge in str(ei.value) and needle in str(ei.value)


def test_duplicate_and_missing_fields_are_errors(tmp_path) -> None:
    p = tmp_path / "edges.yaml"
    p.write_text('edges:\n  - {edge: "tp->comm_overhead_pct", bin: STRONG, reason: a}\n'
                 '  - {edge: "tp->comm_overhead_pct", bin: STRONG, reason: b}\n')
    with pytest.raises(GraphError, match="registered twice"):
        load_graph(p)
    p.write_text('edges:\n  - {edge: "tp->comm_overhead_pct", bin: SURE, reason: a}\n')
    with pytest.raises(GraphError, match="unknown confidence bin"):
        load_graph(p)
    p.write_text('edges:\n  - {edge: "tp->comm_overhead_pct", bin: STRONG}\n')
    with pytest.raises(GraphError, match="physical reason"):
        load_graph(p)


def test_beta_confidence_and_uncertainty() -> None:
    assert uncertainty(1, 1) == pytest.approx(1.0)
    b = Belief(alpha=9, beta=1)
    assert b.c == pytest.approx(0.9)
    assert b.u == pytest.approx(12 * 9 / (100 * 11))
    assert uncertainty_array([1.0, 9.0], [1.0, 1.0]) == pytest.approx([1.0, b.u])
    # more evidence at the same mean → less uncertainty
    assert Belief(alpha=90, beta=10).u < b.u
    # a prior's strength grows with its confidence
    strengths = [Belief.of_bin(x).strength for x in ConfidenceBin]
    assert strengths == sorted(strengths, reverse=True)
    with pytest.raises(ValueError):
        b.updated(-1, 0)
    assert bin_for_confidence(0.85) is ConfidenceBin.STRONG
    assert bin_for_confidence(0.95) is ConfidenceBin.CERTAIN
    assert bin_for_confidence(0.55) is ConfidenceBin.EVEN


def test_backward_walk_of_ttft_reaches_decisions() -> None:
    g = default_graph()
    paths = g.paths_to("p99_ttft_ms")
    mediators = {vy.src for _, vy in paths}
    decisions = {xv.src for xv, _ in paths}
    assert {"kv_pressure_score", "queue_depth", "preemption_rate", "kvcache_hit_rate"} <= mediators
    assert {"tp", "gpu_mem_util", "max_num_seqs", "prefix_cache_enabled"} <= decisions
    with pytest.raises(GraphError):
        g.paths_to("kv_pressure_score")
    assert all(vy.src == xv.dst for xv, vy in g.paths_from("tp"))
