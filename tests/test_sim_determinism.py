"""Same scenario and seed: identical per-request records; checkpoint then restore continues identically."""

from __future__ import annotations

import numpy as np
import pytest

from koi.domain import ChainConfig, Rank
from koi.sim.records import sort_records
from koi.sim.testing import batch_job, chat_job, tiny_scenario
from koi.sim.world import World


def scenario(seed: int = 3):
    jobs = [chat_job("chat", rate=5.0), chat_job("code", rate=2.0), batch_job("batch", n=300, submitted_at=40)]
    jobs[1]["workload"]["arrival"] = {"process": "gamma", "rate_rps": 2.0, "cv": 2.0}
    return tiny_scenario(
        seed=seed,
        jobs=jobs,
        lifecycle={"provision_s": 5, "load_gbps": 20.0, "warmup_s": 5, "materialize_fail_prob": 0.2,
                   "degraded_prob": 0.3},  # fmt: skip
        events=[{"at_s": 150, "kind": "spot_reclaim", "pool": "l40s", "instances": 1, "return_after_s": 60}],
        hidden=[{"kind": "noisy_neighbours", "match": {"market": "spot"}, "step_time_factor": 1.1, "jitter_cv": 0.2}],
    )


def drive(world: World, until: float) -> None:
    """A fixed little plan: two ranks at t=0, a batch rank at 40 s, a scale at 100 s."""
    sc = world.scenario

    def rank(pool: str, n: int, **cfg):
        p = sc.pools[sc.pool_index(pool)]
        return Rank(env=sc.environment(p), config=ChainConfig(instance_type=p.instance_type, **cfg), n_replicas=n)

    jobs = {j.job.job_id: j.job for j in sc.jobs}
    plan = [
        (0, lambda: world.launch(jobs["chat"], rank("l40s", 3), "p/chat")),
        (0, lambda: world.launch(jobs["code"], rank("h100", 2, tp=2), "p/code")),
        (40, lambda: world.launch(jobs["batch"], rank("h100", 2, tp=1), "p/batch")),
        (100, lambda: world.scale("chat", rank("l40s", 1).rank_id("chat"), 5, "p/scale")),
    ]
    for t, act in plan:
        if t >= until:
            break
        if world.now() < t:
            world.advance(t)
        if world.now() >= t and t >= world.now() - 1e-9:
            act()
    world.advance(until)


def _run(seed: int, until: float = 260) -> World:
    w = World(scenario(seed))
    drive(w, until)
    return w


def test_same_seed_same_records():
    a, b = _run(3), _run(3)
    ra, rb = sort_records(a.records()), sort_records(b.records())
    assert len(ra) > 1000
    assert ra.tobytes() == rb.tobytes()
    ta, tb = a.telemetry_columns(), b.telemetry_columns()
    for x, y in zip(ta, tb, strict=True):
        assert np.array_equal(x, y)
    assert a.events() == b.events()


def test_different_seed_different_records():
    ra, rb = _run(3).records(), _run(4).records()
    assert len(ra) != len(rb) or ra.tobytes() != rb.tobytes()


def _finish(w: World, cut: float) -> None:
    """The rest of :func:`drive`'s plan after ``cut``."""
    sc = w.scenario
    if cut < 100:
        w.advance(100)
        p = sc.pools[sc.pool_index("l40s")]
        rk = Rank(env=sc.environment(p), config=ChainConfig(instance_type=p.instance_type), n_replicas=1)
        w.scale("chat", rk.rank_id("chat"), 5, "p/scale")
    w.advance(260)


@pytest.mark.parametrize("cut", [95.0, 150.5])
def test_checkpoint_then_restore_continues_identically(cut):
    ref = World(scenario(3))  # the same calls without a checkpoint
    drive(ref, cut)
    _finish(ref, cut)
    w = World(scenario(3))
    drive(w, cut)
    data = w.checkpoint()
    assert isinstance(data, bytes)
    w2 = World.restore(data)
    del w
    sc = w2.scenario
    jobs = {j.job.job_id: j.job for j in sc.jobs}
    _finish(w2, cut)
    assert sort_records(w2.records()).tobytes() == sort_records(ref.records()).tobytes()
    for x, y in zip(w2.telemetry_columns(), ref.telemetry_columns(), strict=True):
        assert np.array_equal(x, y)
    assert w2.events() == ref.events()
    # a restored world still honours idempotency keys applied before the checkpoint
    assert w2.launch(jobs["chat"], Rank(env=sc.environment(sc.pools[1]), config=ChainConfig(), n_replicas=3),
                     "p/chat").status.value == "duplicate"  # fmt: skip


def test_steps_stay_on_the_grid_when_advancing_off_it():
    """Advancing to an off-grid time splits one step; later steps keep the same boundaries."""
    a, b = World(scenario(3)), World(scenario(3))
    drive(a, 260)
    drive(b, 150.5)
    b.advance(260)
    ra, rb = sort_records(a.records()), sort_records(b.records())
    assert len(ra) == len(rb)
    # only requests alive around the split step can differ, and only slightly
    both = np.isfinite(ra["finish"]) & np.isfinite(rb["finish"])
    assert np.mean(np.abs(ra["finish"][both] - rb["finish"][both]) < 1e-6) > 0.9


def test_restore_rejects_foreign_bytes():
    with pytest.raises(ValueError, match="not a koi.sim world checkpoint"):
        World.restore(b"hello")
