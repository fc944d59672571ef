"""The language-model planners: an LLM alone (no tools), and Koi's RLM planner with a real model.

Both need an OpenAI-compatible endpoint (``KOI_LLM_BASE_URL``, ``KOI_LLM_MODEL``), so both are
``needs_llm=True``: :func:`koi.bench.policy.all_policies` lists them only when one is configured.
A test or a benchmark can pass its own model instead: ``BenchContext.options["llm_model"]`` (a
:class:`koi.agent.llm.ChatModel`, or for ``koi-llm`` a factory ``k -> ChatModel``).

``llm-only`` — "LLM only (no tools)", the paper's GPT-only baseline. Each tick the model gets a
text rendering of the frozen snapshot — every pool (environment, instance shape, GPUs per
instance, free/total instances, price), the catalogue facts a planner needs (GPU memory and
interconnect per GPU type; model size, layers, heads, KV heads, native dtype), every live job
(class, status, model, mean request lengths, rate, SLO or deadline and progress, what it runs
now) — the plan format (the white paper's plan JSON, :data:`koi.agent.prompts.PLAN_EXAMPLE`) and
the rules (one action per job, capacity, TP dividing the heads, a swap budget), and answers with
one JSON plan. No tools, no predictions, no scores. A reply that does not parse or shape-check
(:func:`koi.agent.parse.parse_plan`) gets **one** repair turn listing every problem; a second
failure keeps what it can: the actions of the jobs the reply wrote without a problem stand, every action of
a job with one is dropped (a job written twice loses both: which was meant cannot be told;
:func:`koi.agent.parse.salvage_plan`; the stage output says ``salvaged``), and only a reply with no such
action, or one unreadable as a whole, gives keep/defer for everyone. (Under the plan's schema SmolLM2
loses about one tick in 36 to a degenerate reply: one job's action written over and over, the first
copy different from the rest, until the token cap, in both turns — nothing is left to keep, and the
tick falls back; replayed on hetero-3h seed 1, tick 2.) Jobs the plan omits keep (running) or defer
(pending). A reply
cut at the token cap (``finish_reason == "length"``) keeps the actions it wrote in full
(:func:`koi.agent.parse.salvage_cut_plan`: the cut one and those after it are omitted jobs, no
repair turn; the stage output says ``cut``); one cut before any action was complete gets the repair
turn, told to write fewer actions. (Under a schema keyed by job, SmolLM2 at a 768-token cap was cut on 2
of 18 ticks, and on 26 of 36 when every job had to appear; see :mod:`koi.agent.plan_schema`.)
Then S5 validates it like any plan (an invalid action is reverted, a wrongly deferred job
admitted — the same net for all). Temperature 0, the endpoint's ``seed`` from the run seed.
Token use and dollars are stored per tick as the stage output ``S4_llm/a<attempt>`` (the same
:class:`koi.agent.llm.Usage` the RLM reports carry). With ``KOI_LLM_RESPONSE_FORMAT`` (or option
``response_format``) set to ``json_schema`` or ``json_object`` the endpoint decodes under the plan's
JSON Schema for this tick (:mod:`koi.agent.plan_schema`), on both turns; the prompt is unchanged, so
the two rows differ only in how the reply is decoded. The run records which (``decoding``).
No PerfDB, S2/S3 off: it learns nothing (what it sees of the past is the current deployments in the
snapshot).

``koi-llm`` — "Koi with LLM": :class:`koi.agent.planner.RlmProposer` with the configured model
(sandboxed REPL, the deterministic tools, specialists, the selection with the deterministic plan
as anchor), and Koi's whole learning loop (S2, S3, PerfDB). Option ``rlm_config``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from koi import catalog
from koi.agent.plan_schema import check_response_format, plan_schema, response_format
from koi.bench.policies._common import PolicyProposer
from koi.bench.policies.koi_variants import rlm_config
from koi.bench.policy import BenchContext, Family, PolicySpec, register
from koi.domain import ClusterSnapshot, Plan

#: the LLM-only planner's reply cap when ``KOI_LLM_MAX_TOKENS`` is unset (a whole fleet's plan is long)
LLM_ONLY_MAX_TOKENS = 8192

SYSTEM = """\
You plan the deployments of a fleet of LLM inference jobs on heterogeneous, multi-cloud GPUs. \
Once per planning tick you write ONE cluster-wide plan: an action for every job. You have no \
tools: decide from the description of the cluster below.

PLAN FORMAT (answer with exactly one ```json block holding this object, nothing else matters)
{plan_example}
- type: place (a pending job gets a ladder), keep (an active job keeps what it runs), swap (an \
active job moves to a new ladder), defer (a pending job waits). place/swap carry a ladder; keep \
and defer carry none. One action per job; jobs you omit keep (active) or defer (pending).
- A ladder is a list of ranks; a rank runs n_replicas copies of one chain: env = [market, cloud, \
region, zone, gpu_type] of a pool below, config.instance_type = that pool's instance type, and \
tp x pp GPUs per replica (tp <= GPUs per instance; tp must divide the model's attention heads \
and KV heads, pp its layer count).
- Capacity: a replica of g GPUs on instances of G GPUs takes G/g replicas per instance when \
g <= G, else g/G instances. A pool's free instances bound what you can add to it; a swap into \
another pool needs the full new ladder while the old one still runs.
- The weights (bytes per parameter: 2 for bf16, 1 for fp8) plus the KV cache must fit the \
replica's GPU memory; fp8 weights (config.weight_dtype = "fp8") only on GPUs with fp8.
- At most {swap_budget} active jobs may change (swap) per tick.
- Goals: every online job meets its p99 TTFT/TPOT targets at its request rate, every batch job \
finishes its requests before its deadline, at the lowest cost; admit every job you can.
"""

REPAIR = """\
Your plan could not be used:
{problems}
Answer again with ONE ```json block holding the corrected plan. This is your only repair."""


def _gpu_facts(names: list[str]) -> list[str]:
    out = []
    for g in sorted(set(names)):
        try:
            s = catalog.gpu(g)
        except Exception:  # noqa: BLE001 - an unknown GPU is described by name only
            out.append(f"- {g}")
            continue
        out.append(f"- {g}: {s.memory_gb:g} GB, {s.mem_bw_gbs:g} GB/s, {s.bf16_tflops:g} bf16 TFLOPS"
                   f"{', fp8' if s.supports_fp8 else ''}, {getattr(s.interconnect, 'value', s.interconnect)}")
    return out


def _model_facts(names: list[str]) -> list[str]:
    out = []
    for m in sorted(set(names)):
        try:
            a = catalog.model(m)
        except Exception:  # noqa: BLE001
            out.append(f"- {m}")
            continue
        moe = f", MoE {a.num_experts} experts ({a.num_experts_active} active)" if a.num_experts else ""
        out.append(f"- {a.name}: {a.params_b:g}B parameters{moe}, {a.num_layers} layers, {a.num_heads} heads, "
                   f"{a.num_kv_heads} KV heads, native {a.native_dtype.value}, context {a.max_context}")
    return out


def render_snapshot(snapshot: ClusterSnapshot, swap_budget: int) -> str:
    """The frozen snapshot as text (the only input of the LLM-only planner)."""
    res = snapshot.resources
    lines = [f"Tick {snapshot.tick}, cluster time {snapshot.now:.0f} s. {res.free_gpus} of {res.total_gpus} GPUs free. "
             f"Swap budget this tick: {swap_budget}.", "", "POOLS (env; instance type; GPUs per instance; "
             "free/total instances; $/hour per instance):"]
    for p in sorted(res.pools, key=lambda p: p.pool_id):
        e = p.env
        env = json.dumps([e.market.value, e.cloud, e.region, e.zone, e.gpu_type])
        lines.append(f"- {env} {p.instance_type}; {p.gpus_per_instance} GPUs; {p.free_instances}/{p.total_instances} "
                     f"free; ${p.hourly_price:.2f}/h")
    lines += ["", "GPU TYPES:", *_gpu_facts([p.env.gpu_type for p in res.pools])]
    jobs = sorted(snapshot.jobs, key=lambda js: js.job.job_id)
    lines += ["", "MODELS:", *_model_facts([js.job.model for js in jobs]), "", "JOBS:"]
    for js in jobs:
        j = js.job
        w = j.workload
        if j.job_class.value == "online":
            goal = (f"{w.arrival.rate_rps:g} req/s; SLO p99 TTFT <= {j.slo.p99_ttft_ms:g} ms, "
                    f"p99 TPOT <= {j.slo.p99_tpot_ms:g} ms")
        else:
            left = (j.deadline_at - snapshot.now) if j.deadline_at is not None else float("inf")
            goal = (f"{j.slo.num_requests} requests, {js.completed_requests} done, deadline in {left:.0f} s")
        ladder = snapshot.ladder_of(j.job_id)
        runs = "; ".join(
            f"{r.n_replicas}x tp{r.config.tp} pp{r.config.pp} {r.config.weight_dtype.value} on "
            f"{json.dumps([r.env.market.value, r.env.cloud, r.env.region, r.env.zone, r.env.gpu_type])} "
            f"{r.config.instance_type}" for r in ladder.ranks) if ladder is not None else "nothing"
        lines.append(f"- {j.job_id} [{js.status.value}, {j.job_class.value}, priority {j.priority}, tenant {j.tenant}] "
                     f"model {j.model}; {w.kind}: mean input {w.isl:.0f}, output {w.osl:.0f} tokens; {goal}; "
                     f"runs: {runs}")
    lines += ["", "Write the plan for this tick."]
    return "\n".join(lines)


def extract_plan_json(text: str) -> str | None:
    """The plan object of a reply: a ```json block with "actions", else the first JSON object in the text."""
    from koi.agent.parse import parse_reply

    parsed = parse_reply(text)
    if parsed.json_plans:
        return parsed.json_plans[-1]
    dec = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            obj, end = dec.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict) and "actions" in obj:
            return text[start:end]  # the text as written: the parser names a key written twice, a re-dump would hide it
        start = text.find("{", start + 1)
    return None


class LlmOnly(PolicyProposer):
    policy = "llm-only"

    def __init__(self, bench: BenchContext) -> None:
        super().__init__(bench)
        from koi.config import get_settings

        self.settings = get_settings()
        self._model = self.option("llm_model", None)
        self.max_tokens = int(self.option("max_tokens", configured_caps(self.policy, self.settings)["max_tokens"]))
        # an unknown format fails here, before the first tick, not inside one
        self.decoding = check_response_format(str(self.option("response_format", self.settings.llm_response_format)))

    def model(self) -> Any:
        if self._model is None:
            from koi.agent.llm import OpenAIChatModel

            self._model = OpenAIChatModel.from_settings(self.settings)
        return self._model

    def propose(self, ctx: Any) -> Plan:
        from koi.agent.llm import ChatMessage, MeteredModel
        from koi.agent.parse import (
            PlanParseError,
            keep_defer_plan,
            parse_plan,
            salvage_cut_plan,
            salvage_plan,
        )
        from koi.agent.prompts import PLAN_EXAMPLE
        from koi.planning.tick import load_planning_context

        snap = ctx.snapshot
        budget = load_planning_context(ctx.session, ctx.cluster_id, ctx.tick).knobs.swap_budget
        system = SYSTEM.format(plan_example=json.dumps(PLAN_EXAMPLE, indent=1), swap_budget=budget)
        user = render_snapshot(snap, budget)
        if ctx.feedback:
            user += "\n\nThe previous plan of this tick was rejected by validation:\n" + "\n".join(
                f"  * {f}" for f in list(ctx.feedback)[:20])
        messages = [ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)]
        metered = MeteredModel(self.model(), self.settings.llm_price_per_mtok_in, self.settings.llm_price_per_mtok_out)
        seed = self.llm_seed(ctx)
        fmt = response_format(self.decoding, plan_schema(snap)) if self.decoding != "none" else None  # no schema built for free text
        plan: Plan | None = None
        problems: list[str] = []
        cut = False
        for turn in range(2):
            reply = metered.complete(messages, temperature=0.0, max_tokens=self.max_tokens, seed=seed,
                                     response_format=fmt)
            raw = extract_plan_json(reply.content)
            cut = raw is None and reply.finish_reason == "length"
            if cut:
                raw = salvage_cut_plan(reply.content)
            try:
                if raw is None:
                    raise PlanParseError([
                        f"the reply was cut at the cap of {self.max_tokens} tokens before one action was complete: "
                        "write fewer actions (jobs you omit keep running or keep waiting)" if cut else
                        "no JSON object with 'actions' found in the reply"])
                plan = parse_plan(raw, snap, proposer=self.policy)
                break
            except PlanParseError as exc:
                problems = list(exc.problems)
                if turn == 0:
                    messages += [ChatMessage(role="assistant", content=reply.content),
                                 ChatMessage(role="user", content=REPAIR.format(
                                     problems="\n".join(f"  * {p}" for p in problems[:25])))]
        salvaged = False
        if plan is None and raw is not None:  # the repair failed too: keep the jobs it wrote cleanly
            try:
                kept, _dropped = salvage_plan(raw, snap, proposer=self.policy)
            except PlanParseError:
                kept = None
            if kept is not None and kept.actions:
                plan, salvaged = kept, True
        status = "parsed" if plan is not None else "malformed"
        if plan is None:
            plan = keep_defer_plan(snap, proposer=self.policy,
                                   rationale="llm-only: no usable plan after one repair: " + "; ".join(problems[:5]))
        self._persist(ctx, status, problems, metered.usage, metered.name, cut=cut and status == "parsed",
                      salvaged=salvaged)
        return plan

    def _persist(self, ctx: Any, status: str, problems: list[str], usage: Any, model: str, *, cut: bool,
                 salvaged: bool) -> None:
        if ctx.session is None:
            return
        from koi.store.repos.stages import digest, save_stage_output

        save_stage_output(ctx.session, ctx.cluster_id, ctx.tick, f"S4_llm/a{ctx.attempt}",
                          {"policy": self.policy, "model": model, "caps": {"max_tokens": self.max_tokens},
                           "decoding": self.decoding, "cut": cut, "salvaged": salvaged,
                           "status": status, "problems": problems[:20],
                           "usage": usage.model_dump(mode="json")},
                          input_digest=digest({"attempt": ctx.attempt}))


class KoiLlm(PolicyProposer):
    """Koi's RLM planner with the configured model (or ``options["llm_model"]``)."""

    policy = "koi-llm"

    def __init__(self, bench: BenchContext) -> None:
        super().__init__(bench)
        from koi.agent.planner import RlmProposer

        self.inner = RlmProposer(self.option("llm_model", None), rlm_config(self.options))

    def propose(self, ctx: Any) -> Plan:
        return self.inner(dataclasses.replace(ctx, seed=self.llm_seed(ctx)))


def configured_caps(policy: str, settings: Any) -> dict[str, float]:
    """The bounds ``policy`` would run under with these settings (compared with a cached run's ``LlmUse.caps``)."""
    if policy == "llm-only":
        return {"max_tokens": settings.llm_max_tokens or LLM_ONLY_MAX_TOKENS}
    from koi.agent.planner import rlm_caps
    from koi.agent.trajectory import RlmConfig

    return rlm_caps(RlmConfig.from_settings(settings))


def llm_setup(policy: str, settings: Any) -> dict[str, Any]:
    """What a language-model policy's results depend on beyond the scenario and seed: the model, the caps it
    runs under and (LLM-only) its decoding. The endpoint's address is left out: the same model served
    elsewhere is the same setup."""
    return {"model": settings.llm_model or "", "caps": configured_caps(policy, settings),
            "decoding": settings.llm_response_format if policy == "llm-only" else None}


def llm_setup_tag(policy: str, settings: Any) -> str:
    """sha256 (16 hex) of :func:`llm_setup`: the part of a run's cache key that tells two models' runs apart."""
    raw = json.dumps(llm_setup(policy, settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _make(cls: type[PolicyProposer]) -> Any:
    def make(bench: BenchContext) -> PolicyProposer:
        return cls(bench)

    return make


LLM_ONLY = register(PolicySpec(
    name="llm-only", label="LLM only (no tools)", family=Family.LLM, make_proposer=_make(LlmOnly), needs_llm=True,
    stochastic=True, relative_cost=3.0,
    description="The configured model writes the plan JSON from a text rendering of the snapshot; no tools; one "
                "repair on malformed output; omitted jobs keep/defer.",
))
KOI_LLM = register(PolicySpec(
    name="koi-llm", label="Koi with LLM", family=Family.LLM, make_proposer=_make(KoiLlm), run_s2=True, run_s3=True,
    needs_llm=True, stochastic=True, relative_cost=3.0,
    description="Koi's RLM planner (sandboxed REPL, deterministic tools, specialists) with the configured model, "
                "and Koi's learning loop.",
))
