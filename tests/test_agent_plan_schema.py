"""The plan's JSON Schema for constrained decoding: what it admits parses, what the parser refuses by name it refuses."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from koi.agent import demo
from koi.agent.parse import PlanParseError, parse_plan, salvage_cut_plan, salvage_plan
from koi.agent.plan_schema import RESPONSE_FORMATS, check_response_format, plan_schema, response_format


@pytest.fixture(scope="module")
def snap():
    return demo.backend().snapshot


def _env(p):
    return [p.env.market.value, p.env.cloud, p.env.region, p.env.zone, p.env.gpu_type]


def a_plan(snap):
    """Keep the active job, place each pending one on the H100 pool, a whole instance per replica."""
    pool = next(p for p in snap.resources.pools if p.env.gpu_type == "H100")
    rank = {"env": _env(pool), "config": {"instance_type": pool.instance_type, "tp": 8, "pp": 1}, "n_replicas": 1}
    return {"actions": [
        {"job_id": js.job.job_id, "type": "keep" if js.status.value == "active" else "place",
         "ladder": [] if js.status.value == "active" else [rank]}
        for js in sorted(snap.jobs, key=lambda js: js.job.job_id)
    ]}


def _objects(node):
    """Every object schema in ``node`` (through properties, items, anyOf and $defs)."""
    if isinstance(node, dict):
        if node.get("type") == "object":
            yield node
        for key in ("properties", "$defs"):
            for child in node.get(key, {}).values():
                yield from _objects(child)
        yield from _objects(node.get("items"))
        for child in node.get("anyOf", []):
            yield from _objects(child)


def test_the_schema_names_the_snapshots_jobs_and_pools(snap):
    s = plan_schema(snap)
    shapes = {b["properties"]["type"]["enum"][0]: b for b in s["properties"]["actions"]["items"]["anyOf"]}
    status = {js.job.job_id: js.status.value for js in snap.jobs}
    # one shape per action type, each over the jobs whose status allows it (C7), a ladder only where one is due
    assert sorted(shapes) == ["defer", "keep", "place", "swap"]
    for kind, st in (("place", "pending"), ("defer", "pending"), ("swap", "active"), ("keep", "active")):
        assert shapes[kind]["properties"]["job_id"]["enum"] == sorted(j for j, v in status.items() if v == st)
    assert shapes["place"]["properties"]["ladder"]["minItems"] == 1 and shapes["keep"]["properties"]["ladder"]["maxItems"] == 0
    assert shapes["swap"]["properties"]["ladder"]["items"] == {"$ref": "#/$defs/rank"}
    # one rank shape per pool: its environment with its own instance type, TP up to its GPUs per instance
    branches = s["$defs"]["rank"]["anyOf"]
    got = {(tuple(b["properties"]["env"]["enum"][0]), b["properties"]["config"]["properties"]["instance_type"]["enum"][0],
            max(b["properties"]["config"]["properties"]["tp"]["enum"])) for b in branches}
    assert got == {(tuple(_env(p)), p.instance_type, p.gpus_per_instance) for p in snap.resources.pools}
    assert s["properties"]["actions"]["maxItems"] == len(snap.jobs)
    # strict mode: every object closed, every property required
    objs = list(_objects(s))
    assert len(objs) == 1 + 4 + 2 + 2 * len(branches)  # plan, shapes, keep/defer's empty items, ranks and configs
    for obj in objs:
        assert obj["additionalProperties"] is False and sorted(obj["required"]) == sorted(obj["properties"])


def test_a_snapshot_with_no_pending_job_or_no_pool_leaves_those_shapes_out(snap):
    active_only = snap.model_copy(update={"jobs": [js for js in snap.jobs if js.status.value == "active"]})
    kinds = [b["properties"]["type"]["enum"][0] for b in plan_schema(active_only)["properties"]["actions"]["items"]["anyOf"]]
    assert kinds == ["swap", "keep"]
    no_pool = snap.model_copy(update={"resources": snap.resources.model_copy(update={"pools": []})})
    s = plan_schema(no_pool)
    assert [b["properties"]["type"]["enum"][0] for b in s["properties"]["actions"]["items"]["anyOf"]] == ["defer", "keep"]
    assert "$defs" not in s
    jsonschema.validate({"actions": [{"job_id": "chat-8b", "type": "keep", "ladder": []}]}, s)


def test_a_plan_the_schema_admits_parses_into_the_ticks_actions(snap):
    reply = a_plan(snap)
    jsonschema.validate(reply, plan_schema(snap))
    plan = parse_plan(json.dumps(reply), snap, proposer="llm-only")
    assert {a.job_id: a.type.value for a in plan.actions} == {"batch-8b": "place", "chat-70b": "place", "chat-8b": "keep"}
    keep = next(a for a in plan.actions if a.type.value == "keep")
    assert keep.ladder is None  # "ladder": [] is no ladder
    placed = next(a for a in plan.actions if a.job_id == "chat-70b")
    assert placed.ladder.ranks[0].config.tp == 8 and placed.ladder.ranks[0].env.gpu_type == "H100"


@pytest.mark.parametrize("mutate, refused_by_parser", [
    (lambda p: p["actions"][0].update(job_id="no-such-job"), True),
    (lambda p: p["actions"][0].update(type="migrate"), True),
    (lambda p: p["actions"][1]["ladder"][0].update(env=["spot", "aws", "mars-1", "x", "H100"]), False),
    (lambda p: p["actions"][1]["ladder"][0]["config"].update(tp=3), False),
    (lambda p: p["actions"][1]["ladder"][0]["config"].update(instance_type="g5.12xlarge"), False),  # another pool's
    (lambda p: p["actions"][1]["ladder"][0].update(n_replicas=0), True),
    (lambda p: p.update(tick_rationale="free text costs tokens"), False),
    (lambda p: p["actions"][0].pop("ladder"), False),
    (lambda p: p["actions"][1].update(ladder=[]), True),  # a place with no ladder
    (lambda p: p["actions"][2].update(ladder=copy.deepcopy(p["actions"][1]["ladder"])), False),  # a keep with one
    (lambda p: p["actions"][2].update(type="place", ladder=copy.deepcopy(p["actions"][1]["ladder"])), False),  # C7
    (lambda p: p["actions"][1].update(type="swap"), False),  # a swap of a pending job: C7
    (lambda p: p["actions"][0].update(type="keep", ladder=[]), False),  # keep a pending job: C7
    (lambda p: p["actions"][1]["ladder"].extend(copy.deepcopy(p["actions"][1]["ladder"]) * 2), False),  # 3 ranks
])
def test_what_the_schema_refuses(snap, mutate, refused_by_parser):
    """Each mutation leaves the schema; those the parser also names are refused there too (the grammar
    rules them out before a token is spent); the rest are left to S5 (C7 for an action the job's status
    does not allow) or are harmless to the parser."""
    bad = copy.deepcopy(a_plan(snap))
    mutate(bad)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, plan_schema(snap))
    if refused_by_parser:
        with pytest.raises(PlanParseError):
            parse_plan(json.dumps(bad), snap)


def test_the_two_wire_forms(snap):
    s = plan_schema(snap)
    assert response_format("none", s) is None
    assert response_format("json_schema", s) == {"type": "json_schema",
                                                 "json_schema": {"name": "koi_plan", "schema": s, "strict": True}}
    assert response_format("json_object", s) == {"type": "json_object", "schema": s}
    with pytest.raises(ValueError, match="unknown response format 'grammar'"):
        response_format("grammar", s)
    assert [check_response_format(k) for k in RESPONSE_FORMATS] == ["none", "json_schema", "json_object"]
    with pytest.raises(ValueError, match="expected one of none, json_schema, json_object"):
        check_response_format("json")


def test_a_plan_cut_at_the_token_cap_keeps_its_whole_actions(snap):
    """salvage_cut_plan: the actions before the cut, closed; a key written twice still reaches the parser;
    nothing when no action was complete or there is no plan at all."""
    text = json.dumps(a_plan(snap))
    cut = text[:text.index('"chat-8b"') + 20]  # inside chat-8b's action, after batch-8b's and chat-70b's
    plan = parse_plan(salvage_cut_plan("```json\n" + cut), snap)
    assert [a.job_id for a in plan.actions] == ["batch-8b", "chat-70b"]
    with pytest.raises(PlanParseError, match="key 'type' written twice"):
        parse_plan(salvage_cut_plan(cut.replace('"type": "place"', '"type": "place", "type": "swap"', 1)), snap)
    assert salvage_cut_plan(text[:text.index('"batch-8b"') + 25]) is None
    assert salvage_cut_plan("I would place chat-70b on H100s") is None


def test_a_key_written_twice_is_named_not_overwritten(snap):
    """json.loads keeps the last of two equal keys; the parser reads the text itself and refuses the plan."""
    text = json.dumps(a_plan(snap))
    with pytest.raises(PlanParseError, match="key 'type' written twice in one object"):
        parse_plan(text.replace('"type": "keep"', '"type": "keep", "type": "swap"'), snap)
    assert parse_plan(text, snap).actions  # the same text without the second key parses


def test_salvage_keeps_the_jobs_written_cleanly_and_drops_every_action_of_a_job_with_a_problem(snap):
    """After a failed repair: two actions for one job drop both (which was meant cannot be told), an
    unknown job and an action without a job id drop alone, unused plan fields are ignored; the other
    jobs' actions stand as written. A problem with the plan as a whole still refuses it."""
    plan = a_plan(snap)  # batch-8b place, chat-70b place, chat-8b keep
    plan["actions"].append({"job_id": "chat-70b", "type": "defer", "ladder": []})
    plan["actions"] += [{"job_id": "no-such-job", "type": "keep", "ladder": []}, {"type": "keep"}]
    plan["confidence"] = "high"
    text = json.dumps(plan)
    with pytest.raises(PlanParseError) as strict:
        parse_plan(text, snap)
    kept, problems = salvage_plan(text, snap, proposer="llm-only")
    assert {a.job_id: a.type.value for a in kept.actions} == {"batch-8b": "place", "chat-8b": "keep"}
    assert kept.proposer == "llm-only" and kept.tick == snap.tick
    assert problems == strict.value.problems  # the same problems, named the same way
    assert any("a second action for job 'chat-70b'" in p for p in problems)
    assert any("unknown job_id 'no-such-job'" in p for p in problems) and any("confidence" in p for p in problems)
    # a clean plan salvages to itself, with nothing to say
    clean, none = salvage_plan(json.dumps(a_plan(snap)), snap)
    assert clean.actions == parse_plan(json.dumps(a_plan(snap)), snap).actions and none == []
    # a key written twice cannot be tied to one action: the whole plan is refused, as is text that is not JSON
    with pytest.raises(PlanParseError, match="key 'type' written twice"):
        salvage_plan(text.replace('"type": "keep"', '"type": "keep", "type": "swap"', 1), snap)
    with pytest.raises(PlanParseError, match="not JSON"):
        salvage_plan(text[:-2], snap)
