"""The benchmark runner (issue 8): one run through the tick pipeline, its trace and metrics, the cache,
determinism, the parallel suite and the ``koi bench run`` command.

A tiny scenario (two pools, two online jobs and one batch job arriving at the second tick) and two
test policies built on the pipeline's builtin deterministic proposer: ``test-det`` (S2 and S3 on,
a learning policy) and ``test-static`` (S2/S3 skipped). Both are registered when this module is
imported, so the suite's worker processes find them too (``KOI_BENCH_POLICY_MODULES``); the
report and Temporal tests import them from here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from koi.bench.cache import RUNNER_VERSION, RunCache
from koi.bench.evaluator import FORMULAS
from koi.bench.policy import Family, PolicySpec, register
from koi.bench.runner import load, n_ticks_for, run_key, run_one
from koi.sim.records import RECORD_DTYPE

LN = {"kind": "lognormal"}
TINY = {
    "name": "bench-tiny",
    "seed": 3,
    "duration_s": 900,
    "sample_s": 30,
    "lifecycle": {"provision_s": 30, "load_gbps": 4.0, "warmup_s": 10},
    "pools": [
        {"name": "aws-l40s", "cloud": "aws", "region": "us-east-1", "zone": "us-east-1a", "market": "on_demand",
         "instance_type": "g6e.12xlarge", "instances": 2},
        {"name": "gcp-l4", "cloud": "gcp", "region": "us-central1", "zone": "us-central1-c", "market": "reserved",
         "instance_type": "g2-standard-48", "instances": 1},
    ],
    "hidden": [{"kind": "efficiency", "match": {"cloud": "gcp"}, "step_time_factor": 1.1}],
    "jobs": [
        {"job_id": "chat-8b", "model": "llama-3.1-8b", "job_class": "online",
         "workload": {"kind": "chat", "input_len": {**LN, "mean": 600, "std": 300, "min": 16, "max": 2048},
                      "output_len": {**LN, "mean": 120, "std": 60, "min": 8, "max": 512},
                      "arrival": {"process": "poisson", "rate_rps": 3}},
         "slo": {"p99_ttft_ms": 1500, "p99_tpot_ms": 80}},
        {"job_id": "moderation", "model": "llama-3.2-1b", "job_class": "online",
         "workload": {"kind": "moderation", "input_len": {"kind": "normal", "mean": 300, "std": 80, "min": 32,
                                                          "max": 1024},
                      "output_len": {"kind": "fixed", "mean": 8, "min": 8, "max": 8},
                      "arrival": {"process": "constant", "rate_rps": 4}},
         "slo": {"p99_ttft_ms": 400, "p99_tpot_ms": 50}},
        {"job_id": "extract", "model": "llama-3.2-1b", "job_class": "batch", "submitted_at": 300,
         "workload": {"kind": "extraction", "input_len": {**LN, "mean": 800, "std": 300, "min": 64, "max": 2048},
                      "output_len": {**LN, "mean": 60, "std": 20, "min": 8, "max": 256}},
         "slo": {"deadline_s": 1200, "num_requests": 1500}},
    ],
}
HOURS = 600 / 3600  # two ticks


def _deterministic(ctx):  # noqa: ANN001, ANN202 - BenchContext -> proposer
    from koi.pipeline.delegates import builtin_proposer

    return builtin_proposer("deterministic")


def _register(spec: PolicySpec) -> PolicySpec:
    from koi.bench.policy import POLICIES

    return POLICIES.get(spec.name) or register(spec)


DET = _register(PolicySpec(name="test-det", label="Test deterministic", family=Family.KOI,
                           make_proposer=_deterministic, run_s2=True, run_s3=True))
STATIC = _register(PolicySpec(name="test-static", label="Test static", family=Family.NON_LEARNING,
                              make_proposer=_deterministic))


def _stalled(ctx):  # noqa: ANN001, ANN202 - a proposer that takes ten minutes to think
    import time

    inner = _deterministic(ctx)

    def propose(c):  # noqa: ANN001, ANN202
        time.sleep(600)
        return inner(c)

    return propose


STALLED = _register(PolicySpec(name="test-stalled", label="Test stalled", family=Family.NON_LEARNING,
                               make_proposer=_stalled))


def write_tiny(directory: Path) -> Path:
    p = directory / "bench-tiny.yaml"
    p.write_text(yaml.safe_dump(TINY, sort_keys=False), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("scenario"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-cache")


@pytest.fixture(scope="module")
def det_run(tiny, cache_dir):
    return run_one(tiny, DET, 1, hours=HOURS, cache_dir=cache_dir)


def test_ticks_cover_the_horizon():
    sc, _ = load("demo")
    assert n_ticks_for(sc, None) == (1.0, 12)
    assert n_ticks_for(sc, 0.25) == (0.25, 3)
    assert n_ticks_for(sc, 0.26)[1] == 4  # a partial interval still gets its tick


def test_a_run_commits_every_tick_and_records_its_trace(det_run):
    r = det_run
    assert r.meta.n_ticks == 2 and r.meta.ticks_committed == 2 and r.meta.ticks_fallback == 0
    assert r.meta.horizon_s == 600.0 and r.meta.via == "in-process" and r.meta.runner_version == RUNNER_VERSION
    assert r.meta.clock_bound == []  # HiGHS proved every tick's selection within its time limit
    assert [t.tick for t in r.trace] == [0, 1] and [t.t for t in r.trace] == [0.0, 300.0]
    t0, t1 = r.trace
    # tick 0 places the two jobs present; tick 1 places the batch job that arrived at 300 s
    assert t0.places == 2 and t0.swaps == 0 and set(t0.actions.values()) == {"place"}
    assert {"chat-8b", "moderation"} <= set(t0.gpus_by_job)
    assert all(sum(g.values()) > 0 for g in t0.gpus_by_job.values())
    assert t1.actions.get("extract") == "place" and t1.places >= 1
    assert set(t1.serving_jobs) >= {"chat-8b", "moderation"}  # up by the second tick
    assert r.plans[0] is not None and r.plans[1] is not None and r.plans[0] != r.plans[1]
    # a learning policy: ε, mechanisms and U each tick
    assert all(t.dro_radius is not None and t.dro_radius > 0 for t in r.trace)
    assert all(t.active_mechanisms is not None and t.active_mechanisms > 0 for t in r.trace)
    # tick 1's windows all hold their ranks' launch (placed at tick 0): S2 judges none of them, so no
    # mechanism is decided yet and there is no mean U of exercised mechanisms
    assert t0.cumulative_mechanisms == t1.cumulative_mechanisms == 0 and t1.mean_u is None
    # attainment of the requests that arrived in each tick's interval
    assert all(t.ttft_attainment is not None and 0.0 <= t.ttft_attainment <= 100.0 for t in r.trace)
    assert [j.job_id for j in r.jobs] == ["chat-8b", "moderation", "extract"]


def test_the_runs_metrics_follow_the_evaluator(det_run, tiny, cache_dir):
    m = det_run.metrics
    assert m.online_admission_pct == 100.0 and m.batch_admission_pct == 100.0
    assert m.online_requests > 0 and m.batch_requests == 1500
    assert 0.0 < m.composite <= 100.0 and m.goodput_tok_s > 0 and math.isfinite(m.cost_per_slo_token)
    assert m.fleet_cost_usd > 0 and m.swaps == sum(t.swaps for t in det_run.trace)
    # recomputing from the cached records gives the same numbers
    from koi.bench.evaluator import EvalInputs, evaluate
    from koi.sim.world import World

    sc, _ = load(tiny)
    cache = RunCache(cache_dir)
    rec = cache.records(det_run.key)
    assert rec is not None and rec.dtype == RECORD_DTYPE and len(rec) >= m.online_requests
    jobs = [j.job for j in sc.jobs]
    again = evaluate(EvalInputs(jobs=jobs, records=rec, horizon_s=600.0, fleet_cost_usd=m.fleet_cost_usd,
                                reserved_cost_usd=_reserved(World(sc, seed=1), 600.0), trace=det_run.trace,
                                admitted_jobs={j.job_id for j in jobs}))
    assert again == m


def _reserved(world, horizon: float) -> float:  # noqa: ANN001
    return world.fleet.reserved_commitment(horizon)[0]


def test_a_second_call_is_a_cache_hit(det_run, tiny, cache_dir):
    cache = RunCache(cache_dir)
    key = run_key(load(tiny)[0], "test-det", 1, HOURS)
    assert cache.json_path(key).is_file() and cache.records_path(key).is_file()
    assert str(cache.json_path(key)).startswith(str(cache_dir / "bench-tiny" / "runs" / "test-det"))
    ticks: list[tuple[int, int]] = []
    again = run_one(tiny, DET, 1, hours=HOURS, cache_dir=cache_dir, on_tick=lambda d, n: ticks.append((d, n)))
    assert again.cached and not det_run.cached
    assert again.metrics == det_run.metrics and again.trace == det_run.trace and again.plans == det_run.plans
    assert ticks == [(2, 2)]
    # another seed, horizon or scenario digest is another run
    assert cache.load(key.model_copy(update={"seed": 2})) is None
    assert cache.load(key.model_copy(update={"hours": 1.0})) is None
    assert cache.load(key.model_copy(update={"scenario_digest": "0" * 64})) is None


def test_the_same_seed_gives_identical_results(det_run, tiny, tmp_path):
    fresh = run_one(tiny, DET, 1, hours=HOURS, cache_dir=tmp_path, fresh=True)
    assert not fresh.cached
    assert fresh.plans == det_run.plans
    assert fresh.metrics == det_run.metrics
    assert fresh.trace == det_run.trace


def test_the_incremental_s2_writes_the_rows_koi_evidence_writes(tiny, tmp_path):
    """The runner's S2 keeps the ICP history across ticks; koi.evidence.run_s2 rebuilds it each tick."""
    from koi.store import get_evidence, make_engine, session_scope

    hours = 900 / 3600  # three ticks: tick 2 validates against a history of two ticks
    a = run_one(tiny, DET, 4, hours=hours, cache_dir=tmp_path / "a", keep_store=True, s2="incremental")
    b = run_one(tiny, DET, 4, hours=hours, cache_dir=tmp_path / "b", keep_store=True, s2="store")
    rows = []
    for r in (a, b):
        eng = make_engine(f"sqlite:///{r.meta.store}")
        with session_scope(eng) as s:
            rows.append([[e.model_dump(mode="json") for e in get_evidence(s, r.meta.cluster_id, tick=n)]
                         for n in range(3)])
        eng.dispose()
    assert sum(len(x) for x in rows[0]) > 0 and any(e["mechanisms"] for x in rows[0][1:] for e in x)
    assert rows[0] == rows[1]
    assert a.plans == b.plans and a.trace == b.trace and a.metrics == b.metrics


def test_a_policy_without_s2_s3_has_no_learning_trace(tiny, cache_dir):
    r = run_one(tiny, STATIC, 1, hours=HOURS, cache_dir=cache_dir)
    assert r.meta.ticks_committed == 2
    assert all(t.dro_radius is None and t.mean_u is None and t.active_mechanisms is None for t in r.trace)
    assert r.metrics.online_requests > 0


def test_an_unreadable_or_stale_document_is_a_miss(det_run, cache_dir, tmp_path):
    cache = RunCache(tmp_path)
    cache.save(det_run, np.zeros(0, RECORD_DTYPE))
    assert cache.load(det_run.key) is not None
    p = cache.json_path(det_run.key)
    data = json.loads(p.read_text())
    data["meta"]["runner_version"] = RUNNER_VERSION + 1
    p.write_text(json.dumps(data))
    assert cache.load(det_run.key) is None
    p.write_text("{ not json")
    assert cache.load(det_run.key) is None


def _stale_copy(det_run, cache_dir: Path, root: Path, edit) -> tuple[RunCache, Path]:  # noqa: ANN001
    """det_run saved under ``root`` with its records, its document edited by ``edit(data)``."""
    cache = RunCache(root)
    cache.save(det_run, RunCache(cache_dir).records(det_run.key))
    p = cache.json_path(det_run.key)
    data = json.loads(p.read_text())
    edit(data)
    p.write_text(json.dumps(data))
    return cache, p


def test_a_run_of_another_evaluator_version_is_rescored_from_its_records_not_rerun(det_run, cache_dir, tmp_path):
    from koi.bench.evaluator import EVAL_VERSION

    assert det_run.meta.eval_version == EVAL_VERSION and det_run.eval_inputs is not None
    assert det_run.eval_inputs.admitted_jobs == ["chat-8b", "extract", "moderation"]
    assert det_run.eval_inputs.fleet_cost_usd == det_run.metrics.fleet_cost_usd

    def older(data: dict) -> None:  # metrics of an older evaluator: other numbers, a field it did not have
        data["meta"]["eval_version"] = EVAL_VERSION - 1
        data["metrics"] = {**data["metrics"], "composite": 1.0, "ttft_attainment_pct": 3.0}
        del data["metrics"]["p99_windows_pct"]
        for t in data["trace"]:
            t["ttft_attainment"] = t["tpot_attainment"] = None

    cache, p = _stale_copy(det_run, cache_dir, tmp_path / "old", older)
    got = cache.load(det_run.key)
    assert got is not None and got.cached
    assert got.metrics == det_run.metrics and got.trace == det_run.trace and got.plans == det_run.plans
    assert got.meta.eval_version == EVAL_VERSION and got.meta.rescored_at
    assert got.meta.wall_s == det_run.meta.wall_s  # not run again
    on_disk = json.loads(p.read_text())  # rewritten: the next read is a plain hit
    assert on_disk["meta"]["eval_version"] == EVAL_VERSION and on_disk["metrics"]["composite"] == det_run.metrics.composite
    assert [r.key for r in cache.runs(det_run.key.scenario)] == [det_run.key]

    # the same edit under the current version is taken as written (only a version change re-scores)
    def tampered(data: dict) -> None:
        data["metrics"]["composite"] = 1.0

    cache, _ = _stale_copy(det_run, cache_dir, tmp_path / "same", tampered)
    assert cache.load(det_run.key).metrics.composite == 1.0


def test_a_run_of_a_newer_evaluator_is_rescored_for_this_reader_but_not_overwritten(det_run, cache_dir, tmp_path):
    """A checkout behind another that shares the cache reads the run under its own formulas and leaves
    the newer document on disk untouched (no ping-pong of scores between two checkouts)."""
    from koi.bench.evaluator import EVAL_VERSION

    def newer(data: dict) -> None:
        data["meta"]["eval_version"] = EVAL_VERSION + 1
        data["metrics"]["composite"] = 99.0

    cache, p = _stale_copy(det_run, cache_dir, tmp_path / "new", newer)
    before = p.read_text()
    got = cache.load(det_run.key)
    assert got is not None and got.metrics == det_run.metrics and got.meta.eval_version == EVAL_VERSION
    assert p.read_text() == before


def test_a_stale_run_that_cannot_be_rescored_is_a_miss(det_run, cache_dir, tmp_path):
    from koi.bench.evaluator import EVAL_VERSION

    def no_inputs(data: dict) -> None:  # written before the evaluator's inputs were stored
        data["meta"]["eval_version"] = EVAL_VERSION - 1
        data.pop("eval_inputs")

    cache, _ = _stale_copy(det_run, cache_dir, tmp_path / "a", no_inputs)
    assert cache.load(det_run.key) is None

    def stale(data: dict) -> None:
        data["meta"]["eval_version"] = EVAL_VERSION - 1

    cache, _ = _stale_copy(det_run, cache_dir, tmp_path / "b", stale)
    cache.records_path(det_run.key).unlink()
    assert cache.load(det_run.key) is None


def test_the_formulas_are_the_evaluators():
    assert "online admission %" in FORMULAS and "composite = geometric mean" in FORMULAS


# ---- the CLI ---------------------------------------------------------------------------------------------------
def test_bench_run_in_two_processes_then_from_the_cache(tiny, tmp_path, monkeypatch):
    """`koi bench run --jobs 2`: two runs in worker processes; the second invocation recomputes nothing."""
    from typer.testing import CliRunner

    from koi.cli import app

    monkeypatch.setenv("KOI_BENCH_POLICY_MODULES", "test_bench_runner")
    args = ["bench", "run", "--scenario", str(tiny), "--policies", "test-static", "--seeds", "2",
            "--hours", str(HOURS), "--jobs", "2", "--cache-dir", str(tmp_path), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert sorted((b["seed"], b["cached"]) for b in doc["runs"]) == [(0, False), (1, False)]
    assert doc["report"]["policies"]["test-static"]["n_runs"] == 2
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc2 = json.loads(res.stdout)
    assert all(b["cached"] for b in doc2["runs"])
    assert doc2["report"]["policies"] == doc["report"]["policies"]


def test_the_llm_rows_through_the_cli_record_their_model_and_another_model_is_another_run(tiny, tmp_path, monkeypatch):
    """`koi bench run --policies llm-only` against an OpenAI-compatible server on loopback: the row says
    which model planned and how many ticks were its plans. The model, the reply cap and the decoding
    are part of the run's key: a call configured with another one runs again (both runs stay cached),
    the report reads the current setup's run, and going back to the first model finds it cached."""
    from fakes.openai_server import FakeOpenAIServer
    from typer.testing import CliRunner

    from koi.cli import app
    from koi.config import get_settings

    plan = '```json\n{"tick_rationale": "wait and see", "actions": []}\n```'
    args = ["bench", "run", "--scenario", str(tiny), "--policies", "llm-only", "--seeds", "1", "--hours", str(HOURS),
            "--jobs", "1", "--cache-dir", str(tmp_path), "--json"]

    def run_with(**env: str) -> dict:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    try:
        with FakeOpenAIServer(responder=lambda messages, body: plan) as srv:
            monkeypatch.setenv("KOI_LLM_BASE_URL", srv.url)
            doc = run_with(KOI_LLM_MODEL="model-a")
            row = doc["report"]["policies"]["llm-only"]
            assert row["llm"]["model"] == "model-a" and row["llm"]["model_plans"] == row["llm"]["ticks"] == 2
            assert row["llm"]["usage"]["calls"] == len(srv.requests) == 2
            assert row["llm"]["caps"] == {"max_tokens": 8192} and srv.requests[0]["body"]["max_tokens"] == 8192
            assert "## Language models" in (tmp_path / "bench-tiny" / "report" / "report.md").read_text()

            doc = run_with(KOI_LLM_MODEL="model-b")  # another model: another run
            assert [b["cached"] for b in doc["runs"]] == [False] and len(srv.requests) == 4
            assert {r["body"]["model"] for r in srv.requests[2:]} == {"model-b"}
            row = doc["report"]["policies"]["llm-only"]
            assert row["n_runs"] == 1 and row["llm"]["model"] == "model-b"

            doc = run_with(KOI_LLM_MODEL="model-a")  # back to the first: cached, and reported
            assert [b["cached"] for b in doc["runs"]] == [True] and len(srv.requests) == 4
            assert doc["report"]["policies"]["llm-only"]["llm"]["model"] == "model-a"

            doc = run_with(KOI_LLM_MAX_TOKENS="512")  # the same model, another reply cap
            assert [b["cached"] for b in doc["runs"]] == [False] and len(srv.requests) == 6
            assert doc["report"]["policies"]["llm-only"]["llm"]["caps"] == {"max_tokens": 512}
            monkeypatch.delenv("KOI_LLM_MAX_TOKENS")

            doc = run_with(KOI_LLM_RESPONSE_FORMAT="json_schema")  # the same model, constrained decoding
            assert [b["cached"] for b in doc["runs"]] == [False] and len(srv.requests) == 8
            assert "response_format" in srv.requests[-1]["body"]
            assert doc["report"]["policies"]["llm-only"]["llm"]["decoding"] == "json_schema"
            runs = sorted((tmp_path / "bench-tiny" / "runs" / "llm-only").glob("*.json"))
            assert len(runs) == 4 and all("-llm" in p.name for p in runs)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def _llm_only_run(tiny, tmp_path, monkeypatch, respond) -> tuple[dict, list[dict]]:
    """`koi bench run --policies llm-only` (json_object decoding, model-a) against a loopback server answering with
    ``respond``: the report's row and the requests the server saw."""
    from fakes.openai_server import FakeOpenAIServer
    from typer.testing import CliRunner

    from koi.cli import app
    from koi.config import get_settings

    args = ["bench", "run", "--scenario", str(tiny), "--policies", "llm-only", "--seeds", "1", "--hours", str(HOURS),
            "--jobs", "1", "--cache-dir", str(tmp_path), "--json"]
    try:
        with FakeOpenAIServer(responder=respond) as srv:
            monkeypatch.setenv("KOI_LLM_BASE_URL", srv.url)
            monkeypatch.setenv("KOI_LLM_MODEL", "model-a")
            monkeypatch.setenv("KOI_LLM_RESPONSE_FORMAT", "json_object")
            get_settings.cache_clear()
            res = CliRunner().invoke(app, args)
            assert res.exit_code == 0, res.output
            return json.loads(res.stdout)["report"]["policies"]["llm-only"], list(srv.requests)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def test_llm_only_with_constrained_decoding_sends_the_ticks_schema_and_records_it(tiny, tmp_path, monkeypatch):
    """KOI_LLM_RESPONSE_FORMAT=json_object: every request carries the plan's schema for that tick (its jobs, its
    pools), a bare JSON reply (no fence, as a grammar-constrained server answers) is the model's plan, and the
    row says how the replies were decoded."""
    import jsonschema

    from koi.bench.runner import load

    jobs = {j.job.job_id for j in load(tiny)[0].jobs}

    def respond(messages, body):
        schema = body["response_format"]["schema"]
        plan = {"actions": []}
        jsonschema.validate(plan, schema)
        return json.dumps(plan)

    row, requests = _llm_only_run(tiny, tmp_path, monkeypatch, respond)
    assert row["llm"]["decoding"] == "json_object" and row["llm"]["model_plans"] == row["llm"]["ticks"] == 2
    assert len(requests) == 2
    for r in requests:
        fmt = r["body"]["response_format"]
        assert fmt["type"] == "json_object"
        enum = {j for b in fmt["schema"]["properties"]["actions"]["items"]["anyOf"]
                for j in b["properties"]["job_id"]["enum"]}
        assert enum and enum <= jobs
    assert "model-a (json_object)" in (tmp_path / "bench-tiny" / "report" / "report.md").read_text()


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigterm_to_bench_run_stops_its_workers(tiny, tmp_path):
    """An operator's `kill` of a suite must not leave its workers computing runs for nobody: SIGTERM is
    handled like Ctrl-C (queued runs dropped, running workers terminated), and a worker whose suite
    process is gone exits on its own."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "KOI_BENCH_POLICY_MODULES": "test_bench_runner",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'koi'; from koi.cli import main; main()",
           "bench", "run", "--scenario", str(tiny), "--policies", "test-stalled", "--seeds", "2",
           "--hours", str(HOURS), "--jobs", "2", "--cache-dir", str(tmp_path), "--no-report"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            workers = [c for c in _children(proc.pid)
                       if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() and _children(c) == []]
            if len(workers) >= 2 and any(Path(tmp_path).rglob("koi.db")):  # both started, a run is under way
                break
            time.sleep(0.2)
        assert proc.poll() is None and len(workers) >= 2, proc.stderr.read().decode() if proc.poll() else workers
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), "a worker outlived its suite"
        assert not list(Path(tmp_path).rglob("seed*.json"))  # nothing half-run was cached
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:  # a failed check must not leave them sleeping
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_a_bench_worker_exits_when_its_suite_process_is_gone():
    """The watchdog (for SIGKILL or a crash of the suite process, which no handler sees): a worker told
    that its parent is a process it is not a child of behaves as if reparented, and exits."""
    import subprocess
    import sys
    import time

    code = ("import time; from koi.cli.bench import _exit_with_parent; _exit_with_parent(-1); time.sleep(60); "
            "raise SystemExit(0)")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert res.returncode == 143, res.stderr.decode()
    assert time.monotonic() - t0 < 30


def test_bench_run_rejects_an_unknown_policy(tiny, tmp_path):
    from typer.testing import CliRunner

    from koi.cli import app

    res = CliRunner().invoke(app, ["bench", "run", "--scenario", str(tiny), "--policies", "no-such-policy",
                                   "--cache-dir", str(tmp_path)])
    assert res.exit_code != 0 and "unknown policy" in res.output


# ---- speed: the planner's memo changes nothing ----------------------------------------------------------------
def _records(n_ticks: int = 8):  # noqa: ANN202 - PerfRecords over the tiny fleet, observed = physics × noise
    from koi import variables
    from koi.domain import ChainConfig, Rank
    from koi.sim.scenario import parse_scenario
    from koi.sim.world import World
    from koi.store import PerfRecord
    from koi.surrogate import default_surrogate

    sc = parse_scenario(TINY)
    pools = World(sc, seed=0).capacity().pools
    rng = np.random.default_rng(7)
    sur = default_surrogate()
    out = []
    for t in range(n_ticks):
        for js in sc.jobs[:2]:
            for pool in pools:
                rank = Rank(env=pool.env, config=ChainConfig(tp=1, instance_type=pool.instance_type), n_replicas=1)
                b = sur.predict_many(js.job, [rank.chain], offered_rps=js.job.workload.arrival.rate_rps, n_replicas=1,
                                     with_capacity=False)  # fmt: skip
                base = {k: float(v[0]) for k, v in b.base_values.items() if math.isfinite(float(v[0]))}
                obs = {k: v * float(rng.lognormal(0.1, 0.2)) for k, v in base.items()}
                v = {k: x for k, x in obs.items() if k in variables.V_NAMES}
                y = {k: x for k, x in obs.items() if k in variables.Y_NAMES}
                out.append(PerfRecord.of("c", t, js.job, rank, observed_v=v, observed_y=y, predicted=base, n_samples=20))
    return sc, pools, out


def test_the_memoized_residual_model_answers_exactly_what_the_fitted_one_does():
    from koi.planning import surrogate_adapter as sa
    from koi.surrogate import Surrogate
    from koi.surrogate.residual import ResidualModel, scope_of_record

    _sc, _pools, recs = _records()
    plain = ResidualModel.fit(recs)
    memo = sa.memo_residuals(plain)
    assert plain.n_records == len(recs) and type(memo) is not type(plain)
    scopes = [scope_of_record(r) for r in recs]
    for s in scopes:
        for q in [*plain.effects, "cost_per_token"]:
            for skip in ((), ("gpu", "env")):
                assert memo.factor(q, s, skip) == plain.factor(q, s, skip) == memo.factor(q, s, skip)
        assert memo.speed(s) == plain.speed(s) and memo.support(s) == plain.support(s)
        for obj in plain.history:
            for n in (1, 5, 10 ** 6):
                assert np.array_equal(memo.residuals(obj, s, min_count=n), plain.residuals(obj, s, min_count=n))
            assert np.array_equal(memo.residuals(obj, s), plain.residuals(obj, s))
    # whole predictions through the surrogate: the same with and without the memo
    from koi.domain import Chain, ChainConfig

    sc, pools, _ = _records(1)
    chains = [Chain(env=p.env, config=ChainConfig(tp=tp, instance_type=p.instance_type)) for p in pools
              for tp in (1, 2, 4) if tp <= p.gpus_per_instance]
    a = sa.SurrogatePredictor(Surrogate(residuals=plain))
    b = sa.SurrogatePredictor(Surrogate(residuals=memo))
    for js in sc.jobs:
        feas = [c for c, (ok, _) in zip(chains, a.feasible(js.job, chains), strict=True) if ok]
        sa.MEMO = False
        try:
            ea = a.estimate(js.job, feas)
            la = a.latency(js.job, feas, np.full(len(feas), 1.5))
        finally:
            sa.MEMO = True
        assert b.estimate(js.job, feas) == ea == b.estimate(js.job, feas[::-1])[::-1]
        lb = b.latency(js.job, feas, np.full(len(feas), 1.5))
        assert np.array_equal(lb[0], la[0]) and np.array_equal(lb[1], la[1])


def test_s4_and_s5_share_one_fit_per_record_set(monkeypatch):
    import koi.store
    from koi.planning import tick

    _sc, _pools, recs = _records(3)
    monkeypatch.setattr(koi.store, "query_perf", lambda session, cluster_id=None, **kw: list(recs))
    p1 = tick.fitted_predictor(None, "c")  # type: ignore[arg-type]
    assert tick.fitted_predictor(None, "c") is p1  # type: ignore[arg-type]
    assert p1.surrogate.residuals.n_records == len(recs)
    recs.pop()  # a new record set is a new fit
    assert tick.fitted_predictor(None, "c") is not p1  # type: ignore[arg-type]


def test_the_parallel_runner_starts_the_costliest_runs_first():
    """Longest processing time first: Koi-family runs (about 3× a first-fit baseline's wall time)
    start before the baselines, so a suite does not end on one long run; ties keep their order."""
    from koi.bench.policy import get_policy
    from koi.bench.runner import RunSpec
    from koi.cli.bench import longest_first

    todo = [RunSpec("hetero-3h", p, s, None) for p in ("fcfs", "milp", "evo", "koi", "oracle") for s in (0, 1)]
    order = [(r.policy, r.seed) for r in longest_first(todo)]
    assert order[:2] == [("koi", 0), ("koi", 1)] and order[-4:] == [("fcfs", 0), ("fcfs", 1), ("milp", 0), ("milp", 1)]
    costs = [get_policy(p).relative_cost for p, _ in order]
    assert costs == sorted(costs, reverse=True)


def test_a_runs_code_digest_is_read_when_the_run_starts(tiny, tmp_path):
    """The digest names the code the run imported: read before the first tick (an edit made during a
    long run is not credited to it)."""
    from koi.bench.cache import code_digest

    code_digest.cache_clear()
    cached_at_tick: list[int] = []
    res = run_one(tiny, DET, 5, hours=HOURS, cache_dir=tmp_path,
                  on_tick=lambda done, total: cached_at_tick.append(code_digest.cache_info().currsize))
    assert cached_at_tick and cached_at_tick[0] == 1
    assert res.meta.code_digest == code_digest()


@pytest.mark.parametrize("cut_after", ["one action", "nothing"])
def test_llm_only_keeps_the_whole_actions_of_a_reply_cut_at_its_token_cap(tiny, tmp_path, monkeypatch, cut_after):
    """A reply stopped by max_tokens (finish_reason "length") ends inside an action. With one action written in
    full, that action is the model's plan (the rest are omitted jobs) and no repair turn is spent; cut before
    any action was complete, the repair turn says the reply was cut and to write fewer actions."""
    from koi.bench.runner import load

    job = sorted(j.job.job_id for j in load(tiny)[0].jobs)[0]
    head = '{"actions": [' + ('{"job_id": ' + json.dumps(job) + ', "type": "defer", "ladder": []}, '
                              if cut_after == "one action" else "")

    def respond(messages, body):
        if "was cut at the cap of" in messages[-1]["content"]:
            return '{"actions": []}'  # the repair turn, told why
        return {"content": head + '{"job_id": "zz-job", "type": "pla', "finish_reason": "length"}

    row, requests = _llm_only_run(tiny, tmp_path, monkeypatch, respond)
    assert row["llm"]["model_plans"] == row["llm"]["ticks"] == 2
    assert len(requests) == (2 if cut_after == "one action" else 4)
    assert row["llm"]["cut_plans"] == (2 if cut_after == "one action" else 0)
    table = (tmp_path / "bench-tiny" / "report" / "report.md").read_text()
    assert ("2/2 (100%), 2 cut" in table) is (cut_after == "one action")


def test_a_run_records_its_numeric_kernels_and_bench_run_warns_of_cached_runs_made_with_others(
        det_run, cache_dir, tmp_path, monkeypatch):
    """Runs made with other numeric kernels may differ in the last digits and, through the simulation,
    beyond (koi.numerics): each run records its kernels, and `bench run` says when cached runs were made
    with others."""
    from typer.testing import CliRunner

    from koi.cli import app
    from koi.numerics import kernels, simd_level

    assert det_run.meta.kernels == kernels() and simd_level() in det_run.meta.kernels
    monkeypatch.setenv("KOI_BENCH_POLICY_MODULES", "test_bench_runner")
    args = ["bench", "run", "--scenario", str(det_run.meta.scenario_path), "--policies", DET.name, "--seeds", "1",
            "--first-seed", "1", "--hours", str(HOURS), "--cache-dir"]
    _stale_copy(det_run, cache_dir, tmp_path / "same", lambda d: None)
    res = CliRunner().invoke(app, [*args, str(tmp_path / "same")])
    assert res.exit_code == 0, res.output
    assert "numeric kernels" not in res.output
    assert kernels() in " ".join(res.output.split())  # the header names this process's kernels
    _stale_copy(det_run, cache_dir, tmp_path / "other", lambda d: d["meta"].update(kernels="numpy AVX512_SPR, OpenBLAS SapphireRapids"))
    res = CliRunner().invoke(app, [*args, str(tmp_path / "other")])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())  # rich wraps the line to the terminal's width
    assert f"1 cached run(s) were made with other numeric kernels (numpy AVX512_SPR, OpenBLAS SapphireRapids; here: {kernels()})" in said

