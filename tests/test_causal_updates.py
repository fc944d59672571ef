"""S3 fan-out: the update tables, the XV/VY split, idempotence and determinism."""

from __future__ import annotations

import pytest
import yaml
from test_causal_support import CLUSTER, mech

from koi.causal.graph import EdgeLayer, default_graph
from koi.causal.updates import (
    UpdateTables,
    apply_evidence,
    default_update_tables,
    initial_beliefs,
    load_update_tables,
    plan_updates,
)
from koi.domain.telemetry import EvidenceRow, IcpVerdict, MechanismEvidence, Quadrant, Verdict

XV, VY = "isl_token_avg->kv_pressure_score", "kv_pressure_score->p99_ttft_ms"
XV2 = "max_num_seqs->kv_pressure_score"


def me(m, q: Quadrant) -> MechanismEvidence:
    v = Verdict.MATCHED if q in (Quadrant.Q1, Quadrant.Q2) else Verdict.DIVERGED
    y = Verdict.MATCHED if q in (Quadrant.Q1, Quadrant.Q3) else Verdict.DIVERGED
    return MechanismEvidence(mechanism_id=m.mechanism_id, v_verdict=v, y_verdict=y, quadrant=q, edges=list(m.edge_ids))


def row(tick: int, rank: str, evs: list[MechanismEvidence], icp: dict | None = None) -> EvidenceRow:
    edges = {e for x in evs for e in x.edges}
    return EvidenceRow(cluster_id=CLUSTER, tick=tick, job_id="j", rank_id=rank, env_id="aws:r:z:on_demand:H100",
                       n_samples=40, mechanisms=evs,
                       icp=icp if icp is not None else {e: IcpVerdict.UNDECIDED for e in edges})


def test_tables_are_complete_data_and_follow_the_spec() -> None:
    t = default_update_tables()
    # Q1 supports, Q4 contradicts, whatever ICP says (edges) and alone (mechanisms)
    for icp in (IcpVerdict.ACCEPT, IcpVerdict.UNDECIDED):
        for layer in EdgeLayer:
            a, b = t.edge_delta(icp, Quadrant.Q1, layer)
            assert a > 0 and b == 0
    for icp in IcpVerdict:
        for layer in EdgeLayer:
            a, b = t.edge_delta(icp, Quadrant.Q4, layer)
            assert a == 0 and b > 0
    # accept earns α even on weaker quadrants; reject costs β regardless
    for q in (Quadrant.Q2, Quadrant.Q3):
        for layer in EdgeLayer:
            assert t.edge_delta(IcpVerdict.ACCEPT, q, layer)[0] > 0
    for q in Quadrant:
        for layer in EdgeLayer:
            assert t.edge_delta(IcpVerdict.REJECT, q, layer) [1] > 0
            assert t.edge_delta(IcpVerdict.REJECT, q, layer)[0] == 0
    # undecided never freezes learning and is never larger than a decided row
    for q in Quadrant:
        for layer in EdgeLayer:
            u = t.edge_delta(IcpVerdict.UNDECIDED, q, layer)
            assert sum(u) > 0
            assert sum(u) <= max(sum(t.edge_delta(IcpVerdict.ACCEPT, q, layer)),
                                 sum(t.edge_delta(IcpVerdict.REJECT, q, layer)))
    # Q2: X→V held, V→Y is the suspect; Q3 the other way round
    assert t.edge_delta(IcpVerdict.UNDECIDED, Quadrant.Q2, EdgeLayer.XV)[0] > 0
    assert t.edge_delta(IcpVerdict.UNDECIDED, Quadrant.Q2, EdgeLayer.VY)[1] > 0
    assert t.edge_delta(IcpVerdict.UNDECIDED, Quadrant.Q3, EdgeLayer.XV)[1] > 0
    assert t.mechanism_delta(Quadrant.Q1) == (1.0, 0.0)
    assert t.mechanism_delta(Quadrant.Q4)[1] > 0 and t.mechanism_delta(Quadrant.Q3)[1] > 0


def test_incomplete_table_is_an_error(tmp_path) -> None:
    data = yaml.safe_load(default_update_tables().model_dump_json())
    del data["edge"]["reject"]["Q3"]
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="reject, Q3"):
        load_update_tables(p)
    data = yaml.safe_load(default_update_tables().model_dump_json())
    data["mechanism"]["Q2"] = [0.0, 0.0]
    with pytest.raises(ValueError, match="never freeze"):
        UpdateTables.model_validate(data)


def test_q1_supports_q4_contradicts_and_q2_splits_the_layers() -> None:
    m = mech([XV, VY], name="kv")
    mechs = {m.mechanism_id: m}
    b0 = initial_beliefs(CLUSTER, mechs)
    q1 = apply_evidence(b0, [row(1, "r1", [me(m, Quadrant.Q1)])], mechanisms=mechs)
    q4 = apply_evidence(b0, [row(1, "r1", [me(m, Quadrant.Q4)])], mechanisms=mechs)
    q2 = apply_evidence(b0, [row(1, "r1", [me(m, Quadrant.Q2)])], mechanisms=mechs)
    mid = m.mechanism_id
    assert q1.mechanisms[mid].c > b0.mechanisms[mid].c > q4.mechanisms[mid].c
    assert q1.edges[XV].c > b0.edges[XV].c and q1.edges[VY].c > b0.edges[VY].c
    assert q4.edges[XV].c < b0.edges[XV].c and q4.edges[VY].c < b0.edges[VY].c
    assert q2.edges[XV].c > b0.edges[XV].c and q2.edges[VY].c < b0.edges[VY].c
    # untouched edges keep their seed
    assert q1.edges["tp->comm_overhead_pct"] == b0.edges["tp->comm_overhead_pct"]
    assert q1.tick == 1


def test_icp_modulates_the_edge_update() -> None:
    m = mech([XV, VY], name="kv")
    mechs = {m.mechanism_id: m}
    b0 = initial_beliefs(CLUSTER, mechs)
    rej = apply_evidence(b0, [row(1, "r1", [me(m, Quadrant.Q1)], {XV: IcpVerdict.REJECT, VY: IcpVerdict.ACCEPT})],
                         mechanisms=mechs)
    assert rej.edges[XV].c < b0.edges[XV].c  # reject costs β even in Q1
    acc = apply_evidence(b0, [row(1, "r1", [me(m, Quadrant.Q3)], {XV: IcpVerdict.ACCEPT, VY: IcpVerdict.ACCEPT})],
                         mechanisms=mechs)
    assert acc.edges[XV].c > b0.edges[XV].c  # accept earns α even in the lucky-arm quadrant
    assert acc.mechanisms[m.mechanism_id].c < b0.mechanisms[m.mechanism_id].c  # the mechanism: quadrant alone


def test_reapplying_evidence_is_a_noop_and_duplicates_count_once() -> None:
    m = mech([XV, VY], name="kv")
    mechs = {m.mechanism_id: m}
    b0 = initial_beliefs(CLUSTER, mechs)
    rows = [row(1, "r1", [me(m, Quadrant.Q1)]), row(1, "r2", [me(m, Quadrant.Q2)])]
    b1 = apply_evidence(b0, rows, mechanisms=mechs)
    assert apply_evidence(b1, rows, mechanisms=mechs) == b1
    assert apply_evidence(b1, rows, tick=1, mechanisms=mechs) == b1
    # the same row twice in one batch is one update (key: tick, rank, mechanism)
    assert apply_evidence(b0, rows + [rows[0]], mechanisms=mechs) == b1
    # order of rows does not change the result (sorted keys)
    assert apply_evidence(b0, list(reversed(rows)), mechanisms=mechs) == b1
    # a later tick folds only its own rows
    b2 = apply_evidence(b1, rows + [row(2, "r1", [me(m, Quadrant.Q4)])], mechanisms=mechs)
    assert b2.tick == 2
    assert b2.mechanisms[m.mechanism_id].beta == pytest.approx(b1.mechanisms[m.mechanism_id].beta + 1.0)


def test_shared_edge_is_updated_once_per_row_with_the_mean_cell() -> None:
    a = mech([XV, VY], name="a")
    b = mech([XV, XV2, VY], name="b")
    mechs = {a.mechanism_id: a, b.mechanism_id: b}
    b0 = initial_beliefs(CLUSTER, mechs)
    ups = plan_updates([row(1, "r1", [me(a, Quadrant.Q1), me(b, Quadrant.Q4)])], graph=default_graph())
    edge_ups = [u for u in ups if u.target == "edge" and u.target_id == XV]
    assert len(edge_ups) == 1
    t = default_update_tables()
    q1, q4 = t.edge_delta(IcpVerdict.UNDECIDED, Quadrant.Q1, EdgeLayer.XV), t.edge_delta(
        IcpVerdict.UNDECIDED, Quadrant.Q4, EdgeLayer.XV)
    assert (edge_ups[0].d_alpha, edge_ups[0].d_beta) == pytest.approx(((q1[0] + q4[0]) / 2, (q1[1] + q4[1]) / 2))
    assert len([u for u in ups if u.target == "mechanism"]) == 2  # one row → N mechanism updates
    new = apply_evidence(b0, [row(1, "r1", [me(a, Quadrant.Q1), me(b, Quadrant.Q4)])], mechanisms=mechs)
    assert new.edges[XV2].beta > b0.edges[XV2].beta


def test_new_mechanisms_enter_at_their_prior() -> None:
    m = mech([XV, VY], name="kv")
    b0 = initial_beliefs(CLUSTER, {})
    b1 = apply_evidence(b0, [row(1, "r1", [me(m, Quadrant.Q1)])], mechanisms={m.mechanism_id: m})
    assert b1.mechanisms[m.mechanism_id].alpha == pytest.approx(m.prior.alpha + 1.0)
