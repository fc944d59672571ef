"""The closed-loop (fixed-concurrency) mode of :class:`~koi.surrogate.core.Surrogate` (a mixin).

``closed_loop`` predicts mean TTFT/TPOT for a fixed number of clients with fixed prompt and output
lengths, the silicon benchmark's workload, by koi.perf's closed-loop replay or the steady-state
queueing model; ``_client_protocol`` maps a benchmark client to its harness and front-end time. Kept
apart from :mod:`koi.surrogate.core` because the planner does not use it: only
:mod:`koi.surrogate.silicon` does (``koi surrogate eval``), to compare against measured silicon.

The mixin holds no state of its own: it calls the core's ``_physics``, ``_solve`` and ``_profile``
through ``self``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from koi import catalog
from koi.domain.chain import Chain
from koi.domain.model import ModelArch
from koi.surrogate.outputs import SurrogateError
from koi.surrogate.physics import WorkloadDigest


class ClosedLoopMixin:
    """``closed_loop`` (fixed concurrency, the silicon benchmark's mode)."""

    # ---- closed loop (fixed concurrency) -----------------------------------------------------------------
    def closed_loop(
        self,
        model: str | ModelArch,
        chains: Sequence[Chain],
        isl: float,
        osl: float,
        concurrency: Sequence[float] | np.ndarray,
        *,
        profile: bool = True,
        method: str = "replay",
        ca: float = 1.0,
        client: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Mean TTFT/TPOT (ms) of ``concurrency`` clients with fixed isl/osl, each sending its next
        request when its previous one finishes (the silicon benchmark's workload).

        ``method="replay"`` (default) schedules the engine iteration by iteration with koi.perf's
        closed-loop replay (continuous batching, token budget, KV blocks, the engine's scheduler
        policy) and times it with the same step model, under the silicon benchmark's protocol
        as koi.perf emulates it (every client starts at once, means over its rounds, the
        engine's per-request front-end time included); ``"analytic"`` uses the steady-state queueing model of
        the open-loop path with renewal arrivals of CV ``ca`` (fast, but blind to the initial
        burst and the wave synchronisation of a closed loop with fixed lengths). Both then apply the measured (or
        nearest-architecture) speed ratios when ``profile``. Infeasible chains give NaN.

        ``client`` names the benchmark client whose protocol the replay emulates (koi.perf's
        ``"genai-perf"`` or ``"benchmark_serving"``: prompt/output length spreads and the front end
        measured through it); None is koi.perf's default harness and the engine's own server front
        end. The workload is the client's, so knowing it is not peeking at the answer: the same
        model, GPU and config measured by the two clients differ by the client's behaviour alone.
        """
        arch = model if isinstance(model, ModelArch) else catalog.model(model)
        chains = list(chains)
        d = WorkloadDigest.fixed(isl, osl, ca)
        phys = self._physics(arch, chains, d)
        n = len(chains)
        out = {k: np.full(n, np.nan) for k in ("ttft_ms", "tpot_ms", "throughput_tps", "batch")}
        flags: list[tuple[str, ...]] = [tuple(p.flags) for p in phys]
        idx = np.flatnonzero([p.feas.ok for p in phys])
        conc_all = np.broadcast_to(np.asarray(concurrency, dtype=float), (n,))
        if len(idx) and method == "analytic":
            res, x, fl = self._solve(arch, d, [phys[i] for i in idx], np.full(len(idx), 1e-6),
                                     closed_concurrency=conc_all[idx], profile=profile)  # fmt: skip
            out["ttft_ms"][idx] = (res.ttft_mean + x["request_s"]) * 1e3
            out["tpot_ms"][idx] = res.t_step * 1e3
            out["throughput_tps"][idx] = res.lam_served * x["dp"] * osl
            out["batch"][idx] = res.batch
            for j, i in enumerate(idx):
                flags[i] = fl[j]
        elif len(idx):
            from koi.perf.memory import InfeasibleConfig
            from koi.perf.replay import closed_loop_estimate

            for i in idx:
                p = phys[i]
                cfg = p.chain_key[3]
                fp, fd, flag = self._profile(arch, p.chain_key[1], cfg.engine_name) if profile else (1.0, 1.0, None)
                harness, request_s = _client_protocol(client, cfg.engine_name)
                try:
                    # koi.perf's replay emulates the silicon benchmark's protocol (all clients start
                    # together, ten rounds) and adds the engine's per-request front-end time
                    r = closed_loop_estimate(arch, p.chain_key[1], cfg, int(round(isl)), int(round(osl)),
                                             int(round(conc_all[i])), links=p.links, step=p.step,
                                             harness=harness, request_s=request_s)  # fmt: skip
                except InfeasibleConfig:
                    continue
                out["ttft_ms"][i] = r.ttft_s * 1e3 * fp
                out["tpot_ms"][i] = r.tpot_s * 1e3 * fd
                out["throughput_tps"][i] = r.output_tps / fd
                out["batch"][i] = r.mean_batch
                flags[i] = tuple(p.flags) + ((flag,) if flag else ())
        elif method not in ("replay", "analytic"):
            raise SurrogateError(f"unknown closed-loop method {method!r}; expected 'replay' or 'analytic'")
        out["flags"] = np.array(flags + [()], dtype=object)[:-1] if n else np.zeros(0, dtype=object)
        return out


# ---- module helpers ------------------------------------------------------------------------------------------
def _client_protocol(client: str | None, engine: str):
    """(harness, front-end seconds) of benchmark ``client`` against ``engine``; (None, None) for the default."""
    if client is None:
        return None, None
    from koi.perf.fidelity import harness
    from koi.perf.overheads import engine_overheads

    try:
        h = harness(client, engine)
    except ValueError as exc:
        raise SurrogateError(f"closed_loop: {exc}; expected 'genai-perf' or 'benchmark_serving'") from None
    return h, engine_overheads(engine, client).request_s
