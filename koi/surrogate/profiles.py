"""Measured profiles and the nearest-architecture rule (overview §2.3: "When a model has no
measured profile, it substitutes the nearest profiled architecture on that hardware and
rescales by its measured prefill and decode speed ratios").

Definitions (the spec leaves them open):

- a **profile** of (model, GPU) is measured end-to-end data of that model on that GPU: rows
  of aiconfigurator-core's ``silicon_sample.csv`` or PerfDB records. From it we keep two
  speed ratios, measured / operator-model: ``prefill`` (mean TTFT) and ``decode`` (mean TPOT),
  geometric means over the rows;
- a model **without** a profile on a GPU is predicted by the operator model for *its own*
  shape (so size, heads and layers are respected) and rescaled by the speed ratios of the
  **nearest profiled architecture on that GPU**. That is the spec's rule written as
  ``t_target = t_neighbour_measured × (t_target_op / t_neighbour_op)``: the operator model
  gives the ratio between the two architectures, the neighbour's measurement the level.
  Such predictions carry ``nearest_arch:<neighbour>`` and a wider uncertainty;
- a model **with** a profile uses its own ratios (silicon) or none (PerfDB: the residual
  learner corrects those scopes, so applying the ratios too would count the error twice);
- nearness: ``|ln active params| + 0.5·|ln total params| + 0.5·|ln layers| + |ln hidden|
  + 0.5·|ln GQA ratio| + 2·[dense vs MoE] + 0.25·[family differs]`` — compute per token and
  the width that sets GEMM efficiency dominate; MoE routing behaves differently enough to
  cost a lot.

Ratios are clipped to [1/3, 3]: a profile further off than that says more about the row
than about the architecture.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from koi.domain.model import ModelArch

RATIO_CLIP = (1.0 / 3.0, 3.0)


@dataclass(frozen=True, slots=True)
class Profile:
    model: str
    gpu: str
    engine: str
    prefill: float
    decode: float
    n: int
    source: str  # "silicon" | "perfdb"


def arch_distance(a: ModelArch, b: ModelArch) -> float:
    d = abs(math.log(a.active_params_b / b.active_params_b))
    d += 0.5 * abs(math.log(a.params_b / b.params_b))
    d += 0.5 * abs(math.log(a.num_layers / b.num_layers))
    d += abs(math.log(a.hidden_size / b.hidden_size))
    d += 0.5 * abs(math.log(a.gqa_ratio / b.gqa_ratio))
    d += 2.0 * (a.is_moe != b.is_moe)
    d += 0.25 * (a.family != b.family)
    return d


def _clip(x: float) -> float:
    return float(min(max(x, RATIO_CLIP[0]), RATIO_CLIP[1]))


@dataclass(frozen=True)
class ProfileBook:
    """(model, GPU) -> Profile; lookups apply the nearest-architecture rule."""

    profiles: dict[tuple[str, str, str], Profile] = field(default_factory=dict)

    @classmethod
    def from_ratios(cls, rows: Iterable[tuple[str, str, str, float, float, str]]) -> ProfileBook:
        """Rows of (model, gpu, engine, measured/predicted TTFT, measured/predicted TPOT, source)."""
        acc: dict[tuple[str, str, str, str], list[tuple[float, float]]] = defaultdict(list)
        for model, gpu, engine, rt, rd, src in rows:
            if rt > 0 and rd > 0 and math.isfinite(rt) and math.isfinite(rd):
                acc[(model, gpu, engine, src)].append((math.log(rt), math.log(rd)))
        out: dict[tuple[str, str, str], Profile] = {}
        for (model, gpu, engine, src), xs in sorted(acc.items()):
            pf = _clip(math.exp(sum(x for x, _ in xs) / len(xs)))
            dc = _clip(math.exp(sum(y for _, y in xs) / len(xs)))
            prev = out.get((model, gpu, engine))
            if prev is None or src == "silicon":
                out[(model, gpu, engine)] = Profile(model, gpu, engine, pf, dc, len(xs), src)
        return cls(out)

    @classmethod
    def from_residuals(cls, model) -> ProfileBook:  # noqa: ANN001 - a ResidualModel
        """Profiles from PerfDB records through a fitted ResidualModel: per (model, GPU, engine) the
        iteration-time factor each record's observed TPOT implies at its own load (the speed
        inversion of koi.surrogate.residual), for prefill and decode alike.

        Raw p99 ratios are not speed ratios: a replica run near saturation shows a TPOT (and TTFT)
        many times its prediction for a 15% speed difference, and borrowing such a ratio would
        tip every neighbour into overload.
        """
        return cls.from_ratios((m, g, e, f, f, "perfdb") for m, g, e, f in model.record_speeds)

    def to_json(self) -> list[dict]:
        return [
            {"model": p.model, "gpu": p.gpu, "engine": p.engine, "prefill": p.prefill, "decode": p.decode,
             "n": p.n, "source": p.source}
            for p in self.profiles.values()
        ]  # fmt: skip

    @classmethod
    def from_json(cls, rows: list[dict]) -> ProfileBook:
        return cls({(r["model"], r["gpu"], r["engine"]): Profile(**r) for r in rows})

    def merged(self, other: ProfileBook) -> ProfileBook:
        """This book plus ``other``'s profiles where this one has none."""
        return ProfileBook({**other.profiles, **self.profiles})

    def without_model(self, model: str) -> ProfileBook:
        """The book with every profile of ``model`` removed (leave-one-model-out evaluation)."""
        return ProfileBook({k: v for k, v in self.profiles.items() if k[0] != model})

    @staticmethod
    def _ratios(ps: list[Profile]) -> tuple[float, float, str]:
        """Pooled ratios of several profiles (geometric mean weighted by rows)."""
        n = sum(p.n for p in ps)
        pf = math.exp(sum(p.n * math.log(p.prefill) for p in ps) / n)
        dc = math.exp(sum(p.n * math.log(p.decode) for p in ps) / n)
        return pf, dc, ps[0].source

    def lookup(
        self, arch: ModelArch, gpu: str, catalog_models: Mapping[str, ModelArch], engine: str = "vllm"
    ) -> tuple[float, float, str | None]:
        """(prefill ratio, decode ratio, flag) for ``arch`` served by ``engine`` on ``gpu``.

        Order: the model's own profile on this GPU and engine, then on this GPU with any engine;
        else the nearest profiled architecture on this GPU and engine, then on this GPU.
        PerfDB-sourced own profiles give ratio 1 (the residual learner corrects those scopes).
        """
        for same_engine in (True, False):
            own = [p for (m, g, e), p in self.profiles.items() if m == arch.name and g == gpu and (e == engine or not same_engine)]
            if own:
                pf, dc, src = self._ratios(own)
                return (pf, dc, None) if src == "silicon" else (1.0, 1.0, None)
        for same_engine in (True, False):
            cands = [
                p for (m, g, e), p in self.profiles.items()
                if g == gpu and m in catalog_models and m != arch.name and (e == engine or not same_engine)
            ]
            if cands:
                best = min(cands, key=lambda p: (arch_distance(arch, catalog_models[p.model]), p.model))
                mine = [p for p in cands if p.model == best.model]
                pf, dc, _ = self._ratios(mine)
                return pf, dc, f"nearest_arch:{best.model}"
        return 1.0, 1.0, None

    def __len__(self) -> int:
        return len(self.profiles)
