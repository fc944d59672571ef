"""``koi agent sandbox-audit|tools|demo``: the RLM planner's sandbox, tools and a demo run.

- ``sandbox-audit`` runs the escape-and-abuse corpus against the real sandbox and prints
  contained / total (exit status 1 when anything escaped); operators run it after
  upgrades of Python, the kernel or the container runtime;
- ``tools`` lists the REPL's tools, by family;
- ``demo`` plans one tick of the small demo cluster with a scripted policy (offline) or
  with the configured OpenAI-compatible endpoint (``--endpoint``, from ``KOI_LLM_*``).
"""

from __future__ import annotations

import typer

from koi.cli.output import emit, err_console, fail

app = typer.Typer(help="The RLM planner: sandbox audit, tool registry, demo.", no_args_is_help=True)

JSON = typer.Option(False, "--json", help="print one JSON document")


@app.command("sandbox-audit")
def sandbox_audit(
    json_out: bool = JSON,
    case: list[str] = typer.Option([], "--case", help="only these case ids (repeatable)"),
    no_end_to_end: bool = typer.Option(False, "--no-end-to-end", help="skip the hostile-trajectory check"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="one line per case on stderr as it runs"),
) -> None:
    """Run the sandbox audit corpus; print contained / total."""
    from koi.agent.audit import run_audit
    from koi.agent.audit_corpus import CORPUS

    chosen = None
    if case:
        known = {c.case_id: c for c in CORPUS}
        unknown = [c for c in case if c not in known]
        if unknown:
            fail(f"unknown case id(s): {unknown}")
        chosen = [known[c] for c in case]

    def progress(r) -> None:  # noqa: ANN001
        if verbose:
            mark = "[green]contained[/]" if r.contained else "[bold red]ESCAPED[/]"
            err_console.print(f"{mark} {r.case_id}: {r.outcome[:120]}")

    report = run_audit(cases=chosen, end_to_end=not no_end_to_end, progress=progress)
    if json_out:
        emit(report.model_dump(mode="json"), True)
    else:
        rows = [{"case": r.case_id, "kind": r.kind, "category": r.category,
                 "contained": "yes" if r.contained else "NO", "outcome": r.outcome[:100]} for r in report.results]
        emit(rows, False, title=f"sandbox audit: {report.contained} / {report.total} contained")
        emit(report.layers, False, title=f"OS layers (euid {report.euid}, Python {report.python}, {report.platform})")
        err_console.print(f"{report.contained} / {report.total} contained")
    if not report.all_contained:
        raise typer.Exit(1)


@app.command()
def tools(json_out: bool = JSON) -> None:
    """The tools the planner's REPL offers, by family."""
    from koi.agent.tools import TOOLS

    rows = [{"family": t.family, "signature": t.signature, "returns": t.doc} for t in TOOLS]
    emit(rows, json_out, title=f"{len(rows)} tools")


@app.command()
def demo(
    policy: str = typer.Option("baseline", help="scripted policy: baseline, budget-first, invalid, keep-or-swap, bench, garbage"),
    endpoint: bool = typer.Option(False, "--endpoint", help="use KOI_LLM_BASE_URL / KOI_LLM_MODEL instead of a script"),
    trajectories: int = typer.Option(1, "--kp", min=1, max=16, help="independent trajectories (K_P)"),
    turns: int = typer.Option(64, "--kmax", min=1, max=512, help="turns per trajectory (K_MAX)"),
    no_anchor: bool = typer.Option(False, "--no-anchor", help="the deterministic plan does not compete"),
    max_tokens: int = typer.Option(2048, "--max-tokens", min=16, help="completion tokens per model call"),
    timeout: float = typer.Option(240.0, "--timeout", min=1, help="wall clock per trajectory, seconds"),
    request_timeout: float = typer.Option(120.0, "--request-timeout", min=1, help="one model call, seconds"),
    seed: int = typer.Option(0),
    json_out: bool = JSON,
) -> None:
    """Plan one tick of the demo cluster with the RLM planner."""
    from koi.agent import demo as demo_cluster
    from koi.agent.llm import CallableChatModel, OpenAIChatModel
    from koi.agent.planner import plan_with_rlm
    from koi.agent.scripted import POLICIES
    from koi.agent.trajectory import RlmConfig
    from koi.config import get_settings

    s = get_settings()
    if endpoint:
        if not s.llm_base_url or not s.llm_model:
            fail("--endpoint needs KOI_LLM_BASE_URL and KOI_LLM_MODEL")
        model = OpenAIChatModel(s.llm_base_url, s.llm_model, s.llm_api_key, system_role=s.llm_system_role,
                                timeout_s=request_timeout)
    else:
        if policy not in POLICIES:
            fail(f"unknown policy {policy!r}; known: {sorted(POLICIES)}")
        model = CallableChatModel(POLICIES[policy], name=f"scripted:{policy}")
    backend = demo_cluster.backend()
    cfg = RlmConfig(k_p=trajectories, k_max=turns, anchor_deterministic=not no_anchor, max_tokens=max_tokens,
                    timeout_s=timeout)
    plan, report = plan_with_rlm(backend.snapshot, backend, model=model, config=cfg, seed=seed,
                                 price_in=s.llm_price_per_mtok_in, price_out=s.llm_price_per_mtok_out)
    verdict = backend.validate(plan)
    if json_out:
        emit({"plan": plan.model_dump(mode="json"), "valid": verdict["valid"], "report": report.summary(),
              "turns": [[t.model_dump(mode="json") for t in tr.turns] for tr in report.trajectories]}, True)
        return
    for tr in report.trajectories:
        for t in tr.turns:
            err_console.print(f"[bold]trajectory {tr.index} turn {t.index}[/] tools={t.tool_calls}")
            if t.code:
                err_console.print(t.code[:1500], markup=False, highlight=False)
            if t.output:
                err_console.print("→ " + t.output[:800], markup=False, highlight=False)
            if t.error or t.llm_error:
                err_console.print("! " + (t.error or t.llm_error or "")[:400], markup=False, highlight=False)
    emit([{"job": a.job_id, "action": a.type.value, "gpus": a.ladder.total_gpus if a.ladder else None,
           "rationale": a.rationale[:90]} for a in plan.actions], False,
         title=f"chosen: {report.chosen_source} ({report.reason}); valid={verdict['valid']}")
    emit(report.summary() | {"trajectories": len(report.trajectories)}, False, title="RLM report")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="agent")
