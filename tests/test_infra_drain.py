"""infra.drain: a torn-down rank's handover, drain and release, as a pure rule (the clouds' contract is in
tests/test_infra_fleet_contract.py)."""

from __future__ import annotations

from infra.drain import (
    HANDOVER_TIMEOUT_S,
    VALUE_MAX,
    Drain,
    RankView,
    begin,
    phase,
    replacement_serves,
    sweep,
)


def test_the_handover_timeout_is_the_simulators():
    from koi.sim.world import HANDOVER_TIMEOUT_S as SIM

    assert HANDOVER_TIMEOUT_S == SIM


def test_the_record_round_trips_fits_a_tag_and_a_bad_one_drains_now():
    d = Drain(at=100.0, drain_s=30.0, handover=True, awaited=("r-new",))
    assert Drain.decode(d.encode()) == d
    many = Drain(at=1.0, drain_s=2.0, handover=True, awaited=tuple(f"rank-{i:040d}" for i in range(20)))
    text = many.encode()
    assert len(text) <= VALUE_MAX and Drain.decode(text).awaited == many.awaited[:len(Drain.decode(text).awaited)]
    assert Drain.decode(None) is None and Drain.decode("") is None
    bad = Drain.decode("{not json")
    assert bad is not None and phase(bad, 0.0) == "done"


def test_a_handover_awaits_the_ranks_booting_at_the_teardown():
    views = {"old": RankView("j", 2, 2), "new": RankView("j", 2, 0), "kept": RankView("j", 1, 1),
             "other-job": RankView("k", 1, 0)}
    d = begin("old", views, 100.0, 30.0, handover=True)
    assert d.awaited == ("new",) and d.started is None  # the kept rank serving does not end the handover
    views["old"] = RankView("j", 2, 2, d)
    assert sweep(views, 200.0) == ({}, [])
    views["new"] = RankView("j", 2, 1)  # one replica of the replacement serves: the drain starts now
    start, done = sweep(views, 250.0)
    assert start == {"old": Drain(100.0, 30.0, True, ("new",), 250.0)} and done == []
    views["old"] = RankView("j", 2, 2, start["old"])
    assert sweep(views, 279.0) == ({}, []) and phase(start["old"], 279.0) == "draining"
    assert sweep(views, 280.0) == ({}, ["old"])


def test_without_a_booting_replacement_any_other_serving_rank_of_the_job_will_do():
    views = {"old": RankView("j", 1, 1), "kept": RankView("j", 1, 1)}
    d = begin("old", views, 0.0, 30.0, handover=True)
    assert d.started == 0.0  # serves already: the drain starts at once
    alone = begin("solo", {"solo": RankView("j", 1, 1)}, 0.0, 30.0, handover=True)
    assert alone.started is None
    views = {"solo": RankView("j", 1, 1, alone), "failed": RankView("j", 1, 0)}
    assert not replacement_serves("solo", views)
    start, done = sweep(views, HANDOVER_TIMEOUT_S)  # a replacement that never comes: the drain starts anyway
    assert start["solo"].started == HANDOVER_TIMEOUT_S and done == []
    draining_other = {"solo": RankView("j", 1, 1, alone), "leaving": RankView("j", 1, 1, Drain(0.0, 9.0, False))}
    assert not replacement_serves("solo", draining_other)  # a rank that is itself leaving is no replacement


def test_a_plain_drain_starts_at_once_and_zero_is_released_at_once():
    d = begin("r", {"r": RankView("j", 1, 1)}, 50.0, 30.0, handover=False)
    assert d.started == 50.0 and phase(d, 60.0) == "draining" and phase(d, 80.0) == "done"
    assert phase(begin("r", {"r": RankView("j", 1, 1)}, 50.0, 0.0, handover=False), 50.0) == "done"
