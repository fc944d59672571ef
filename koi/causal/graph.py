"""The closed-world causal graph X → V → Y and its seed confidence table.

Whitepaper, "The Causal Substrate": nodes are the registered variables of
:mod:`koi.variables`; an edge is either X→V or V→Y (no X→Y shortcut, no V→V); the
registered edge set E ⊆ (X×V) ∪ (V×Y) is fixed when Koi starts (overview §2.3). The
agent may compose new mechanisms over E but never adds edges (Appendix D).

The seed table lives in ``koi/causal/data/edges.yaml``: every edge with a confidence
bin (Appendix B) and one short physical reason. A malformed file is an error that
names the offending edge.

Choices: deferred variables (``VARIABLES[n].deferred``) may not appear in an edge,
because no deployment exercises them and an untestable edge would only inflate EIG.
"""

from __future__ import annotations

from collections import defaultdict
from enum import StrEnum
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from koi import variables
from koi.causal.beta import Belief, ConfidenceBin
from koi.domain.common import FrozenModel
from koi.variables import Kind

#: libyaml's safe loader when available (the pure-Python one takes ~1 s on the seed tables)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

class GraphError(ValueError):
    """A bad edge file or an edge outside the registered set."""


class EdgeLayer(StrEnum):
    """Which half of an X→V→Y path an edge is: the update tables treat them differently."""

    XV = "XV"
    VY = "VY"


class Edge(FrozenModel):
    edge_id: str
    src: str
    dst: str
    layer: EdgeLayer
    bin: ConfidenceBin
    reason: str = Field(min_length=1)

    @property
    def prior(self) -> Belief:
        return Belief.of_bin(self.bin)


def make_edge(edge_id: str, bin: ConfidenceBin | str, reason: str) -> Edge:
    """Validate one edge against the registry: a clear error naming it otherwise."""
    try:
        src, dst = variables.split_edge_id(edge_id)
    except ValueError as exc:
        raise GraphError(str(exc)) from None
    for name in (src, dst):
        try:
            v = variables.get(name)
        except variables.UnknownVariableError as exc:
            raise GraphError(f"edge {edge_id!r}: {exc}") from None
        if v.deferred:
            raise GraphError(f"edge {edge_id!r}: {name!r} is a deferred variable and may not appear in an edge")
    ks, kd = variables.kind_of(src), variables.kind_of(dst)
    if not variables.is_legal_edge(src, dst):
        hint = "X→Y shortcut" if (ks, kd) == (Kind.X, Kind.Y) else f"{ks.value}→{kd.value}"
        raise GraphError(
            f"edge {edge_id!r} is illegal ({hint}): only X→V and V→Y edges exist, every effect passes through a mediator"
        )
    try:
        b = ConfidenceBin(str(bin).upper())
    except ValueError:
        raise GraphError(f"edge {edge_id!r}: unknown confidence bin {bin!r}; use one of {[x.value for x in ConfidenceBin]}") from None
    if not reason or not str(reason).strip():
        raise GraphError(f"edge {edge_id!r}: a seed edge needs a short physical reason")
    layer = EdgeLayer.XV if ks is Kind.X else EdgeLayer.VY
    return Edge(edge_id=variables.edge_id(src, dst), src=src, dst=dst, layer=layer, bin=b, reason=str(reason))


class CausalGraph:
    """The registered edge set with adjacency for walks. Immutable after construction."""

    def __init__(self, edges: list[Edge]) -> None:
        seen: dict[str, Edge] = {}
        for e in edges:
            if e.edge_id in seen:
                raise GraphError(f"edge {e.edge_id!r} is registered twice")
            seen[e.edge_id] = e
        self._edges: dict[str, Edge] = dict(sorted(seen.items()))
        parents: dict[str, list[str]] = defaultdict(list)
        children: dict[str, list[str]] = defaultdict(list)
        for e in self._edges.values():
            parents[e.dst].append(e.edge_id)
            children[e.src].append(e.edge_id)
        self._in = {k: tuple(sorted(v)) for k, v in parents.items()}
        self._out = {k: tuple(sorted(v)) for k, v in children.items()}

    # ---- lookup ----------------------------------------------------------------------------
    @property
    def edges(self) -> dict[str, Edge]:
        return dict(self._edges)

    @property
    def edge_ids(self) -> tuple[str, ...]:
        return tuple(self._edges)

    def __contains__(self, edge_id: object) -> bool:
        return edge_id in self._edges

    def __len__(self) -> int:
        return len(self._edges)

    def edge(self, edge_id: str) -> Edge:
        try:
            return self._edges[edge_id]
        except KeyError:
            raise GraphError(f"edge {edge_id!r} is not registered (the graph is closed-world)") from None

    def nodes(self, kind: Kind | None = None) -> tuple[str, ...]:
        names = {e.src for e in self._edges.values()} | {e.dst for e in self._edges.values()}
        if kind is not None:
            names = {n for n in names if variables.kind_of(n) is kind}
        return tuple(sorted(names))

    def in_edges(self, node: str) -> tuple[Edge, ...]:
        return tuple(self._edges[i] for i in self._in.get(node, ()))

    def out_edges(self, node: str) -> tuple[Edge, ...]:
        return tuple(self._edges[i] for i in self._out.get(node, ()))

    def priors(self) -> dict[str, Belief]:
        """Seed Beta of every edge (Appendix D, "Seed")."""
        return {k: e.prior for k, e in self._edges.items()}

    # ---- walks -------------------------------------------------------------------------------
    def paths_to(self, outcome: str) -> list[tuple[Edge, Edge]]:
        """Every X→V→Y path ending at ``outcome``: (X→V edge, V→Y edge) pairs, sorted."""
        if variables.kind_of(outcome) is not Kind.Y:
            raise GraphError(f"{outcome!r} is not an outcome (Y) variable")
        out: list[tuple[Edge, Edge]] = []
        for vy in self.in_edges(outcome):
            for xv in self.in_edges(vy.src):
                out.append((xv, vy))
        return out

    def paths_from(self, decision: str) -> list[tuple[Edge, Edge]]:
        """Every X→V→Y path starting at ``decision``."""
        if variables.kind_of(decision) is not Kind.X:
            raise GraphError(f"{decision!r} is not a decision/context (X) variable")
        return [(xv, vy) for xv in self.out_edges(decision) for vy in self.out_edges(xv.dst)]


def _parse(data: Any, source: str) -> list[Edge]:
    if not isinstance(data, dict) or not isinstance(data.get("edges"), list):
        raise GraphError(f"{source}: expected a mapping with an 'edges' list")
    edges: list[Edge] = []
    for i, row in enumerate(data["edges"]):
        if not isinstance(row, dict) or "edge" not in row:
            raise GraphError(f"{source}: entry #{i} needs 'edge', 'bin' and 'reason'")
        eid = str(row["edge"])
        if "bin" not in row:
            raise GraphError(f"{source}: edge {eid!r} has no confidence bin")
        edges.append(make_edge(eid, row["bin"], row.get("reason", "")))
    return edges


def load_graph(path: str | Path | None = None) -> CausalGraph:
    """Load an edge table (default: the shipped seed table). Errors name the bad edge."""
    if path is None:
        text = resources.files("koi.causal").joinpath("data", "edges.yaml").read_text(encoding="utf-8")
        source = "koi/causal/data/edges.yaml"
    else:
        text = Path(path).read_text(encoding="utf-8")
        source = str(path)
    try:
        data = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        raise GraphError(f"{source}: not valid YAML: {exc}") from None
    return CausalGraph(_parse(data, source))


@cache
def default_graph() -> CausalGraph:
    """The shipped graph, loaded once."""
    return load_graph()
