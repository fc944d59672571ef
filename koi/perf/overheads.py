"""Engine overheads per iteration: what the operator tables do not see.

Operator tables time GPU kernels. A serving engine adds CPU work to every iteration —
scheduling, input preparation, the sampler's bookkeeping, detokenisation and streaming —
that the kernels do not include. Koi does not guess these: they are *fitted* on a held-out
split of the measured end-to-end data (``silicon_sample.csv``) by
:func:`koi.perf.fidelity.fit_overheads`, and stored with their provenance in
``koi/perf/data/engine_overheads.yaml``. Without that file every overhead is zero.

Model (per engine iteration, per DP rank)::

    overhead = per_step_s + per_seq_s · sequences
               + per_prefill_layer_s · layers · [iteration has prefill]
               + per_prefill_token_s · prefill_tokens

plus, outside the engine, ``request_s`` added to every request's TTFT (the serving
front end: HTTP, tokenisation, first-token detokenisation and streaming) — the engine's own
OpenAI server's; the front ends the measured benchmark clients went through are fitted
separately (``front_end`` in the yaml; :func:`engine_overheads` with ``client``). The per-layer
prefill term is the CPU dispatch of iterations that run outside CUDA graphs (mixed
prefill batches launch every layer's kernels from Python), so it scales with depth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

_FILE = "engine_overheads.yaml"


@dataclass(frozen=True)
class EngineOverheads:
    per_step_s: float = 0.0
    per_seq_s: float = 0.0
    per_prefill_layer_s: float = 0.0
    per_prefill_token_s: float = 0.0
    request_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@cache
def _load() -> dict[str, Any]:
    try:
        text = resources.files("koi.perf").joinpath("data", _FILE).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        return {}
    return yaml.safe_load(text) or {}


def engine_overheads(engine: str, client: str | None = None) -> EngineOverheads:
    """The fitted overheads of ``engine`` (vllm, sglang, trtllm); zeros when none are fitted.

    ``request_s`` is the engine's own OpenAI server's front-end time; with ``client`` (a
    benchmark client of :mod:`koi.perf.fidelity`) it is the front end that client measured
    through, when one was fitted.
    """
    doc = _load()
    row = dict((doc.get("engines") or {}).get(engine) or {})
    fe = ((doc.get("front_end") or {}).get(engine) or {}).get(client) if client else None
    if fe is not None:
        row["request_s"] = fe
    keys = EngineOverheads.__dataclass_fields__
    return EngineOverheads(**{k: float(v) for k, v in row.items() if k in keys})


def engine_desync_spread(engine: str) -> float:
    """The fitted output-length spread that emulates how ``engine``'s closed-loop clients
    (de)synchronise under an exact-length benchmark (see :func:`koi.perf.fidelity.fit_harness`);
    ±10% when none is fitted."""
    row = ((_load().get("harness") or {}).get("desync_spread") or {}).get(engine)
    return 0.1 if row is None else float(row)


def overheads_provenance() -> dict[str, Any]:
    """How the stored overheads were fitted (split, rows, objective, date)."""
    return dict(_load().get("provenance") or {})


def clear_cache() -> None:
    _load.cache_clear()
