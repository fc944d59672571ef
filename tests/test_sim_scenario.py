"""Scenario files: the demo ships and validates; bad input fails with an error naming the problem."""

from __future__ import annotations

import copy

import pytest
import yaml

from koi.sim.scenario import ScenarioError, demo_path, load_demo, load_scenario, parse_scenario
from koi.sim.testing import chat_job

BASE = {
    "name": "t",
    "duration_s": 60,
    "pools": [
        {"name": "h100", "cloud": "aws", "region": "us-east-1", "market": "on_demand",
         "instance_type": "p5.48xlarge", "instances": 1},
    ],
}  # fmt: skip


def with_(**kw):
    d = copy.deepcopy(BASE)
    d.update(kw)
    return d


def test_demo_meets_its_brief():
    sc = load_demo()
    clouds = {p.cloud for p in sc.pools}
    markets = {p.market.value for p in sc.pools}
    gpus = {sc.instance_type(p).gpu_type for p in sc.pools}
    assert len(clouds) >= 2
    assert markets == {"on_demand", "reserved", "spot"}
    assert len(gpus) >= 3
    assert 32 <= sc.total_gpus <= 64
    assert sc.online_jobs and sc.batch_jobs
    assert any(e.kind == "spot_reclaim" for e in sc.events)
    assert any(h.kind == "engine_change" for h in sc.hidden)


def test_yaml_roundtrip_of_demo(tmp_path):
    raw = yaml.safe_load(demo_path().read_text())
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert load_scenario(p).name == "demo"


def test_unknown_model_is_named():
    with pytest.raises(ScenarioError, match="unknown model 'llama-9000'"):
        parse_scenario(with_(jobs=[chat_job(model="llama-9000")]))


def test_unknown_gpu_is_named():
    it = {"cloud": "onprem", "name": "box", "gpu_type": "Z9000", "gpu_count": 8, "vcpus": 8, "memory_gb": 64,
          "interconnect": "nvlink", "prices": [{"region": "dc1", "on_demand_hourly": 10}], "price_date": "2025-01-01",
          "source": "test"}  # fmt: skip
    d = with_(instance_types=[it])
    d["pools"].append({"cloud": "onprem", "region": "dc1", "market": "on_demand", "instance_type": "box", "instances": 1})
    with pytest.raises(ScenarioError, match="unknown GPU 'Z9000'"):
        parse_scenario(d)


def test_unknown_instance_type_and_region():
    d = with_()
    d["pools"][0]["instance_type"] = "p9.huge"
    with pytest.raises(ScenarioError, match="p9.huge"):
        parse_scenario(d)
    d = with_()
    d["pools"][0]["region"] = "mars-1"
    with pytest.raises(ScenarioError, match="not offered in region 'mars-1'"):
        parse_scenario(d)


def test_deployment_that_does_not_fit_memory():
    job = chat_job(model="llama-3.1-70b", deploy=[{"pool": "h100", "config": {"tp": 1}, "n_replicas": 1}])
    with pytest.raises(ScenarioError, match="does not fit") as exc:
        parse_scenario(with_(jobs=[job]))
    assert "jobs.chat.deploy[0]" in str(exc.value)


def test_tp_that_does_not_divide_heads():
    job = chat_job(model="phi-4", deploy=[{"pool": "h100", "config": {"tp": 4}, "n_replicas": 1}])
    with pytest.raises(ScenarioError, match="does not divide the 10 KV heads"):
        parse_scenario(with_(jobs=[job]))


def test_references_and_values_are_checked():
    with pytest.raises(ScenarioError, match="unknown pool 'nope'"):
        parse_scenario(with_(events=[{"at_s": 5, "kind": "spot_reclaim", "pool": "nope"}]))
    with pytest.raises(ScenarioError, match="reclaim_rate_per_hour applies to spot pools only"):
        d = with_()
        d["pools"][0]["reclaim_rate_per_hour"] = 0.1
        parse_scenario(d)
    with pytest.raises(ScenarioError, match="throughput_factor"):
        parse_scenario(with_(hidden=[{"kind": "engine_change", "start_s": 5}]))
    with pytest.raises(ScenarioError, match="duration_s"):
        parse_scenario({k: v for k, v in BASE.items() if k != "duration_s"})


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("pools: [unclosed")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(p)
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.yaml")
