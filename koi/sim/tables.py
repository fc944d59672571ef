"""Per-rank step-time tables on shared axes, stacked so every replica is looked up at once.

The replica engine never calls the step model inside its hot loop: when a rank is
created, :mod:`koi.sim.physics` samples koi.perf's step model on a fixed grid of
batch compositions (decode batch × mean context; decode batch × prefill length) and
stores the result here. Each macro-step then interpolates all replicas (and all
queued prefills) with a handful of vectorised gathers. The axes are shared by all
ranks so the fractional indices are computed once per step.

Interpolation is piecewise linear on the grid (iteration time is close to affine in
batch size and in context between grid points; the prefill work is cumulative in
prompt length and convex, so linear interpolation between √2-spaced points errs by a
few percent at most, always on the slow side).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: decode batch sizes (sequences in the running batch)
B_AXIS = np.array(
    [0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096],
    dtype=float,
)
#: mean context (tokens) of the decoding sequences
C_AXIS = np.array(
    [16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144], dtype=float
)
#: prompt position (tokens) for the cumulative prefill work; √2 spacing above 16
L_AXIS = np.concatenate([[0.0], np.round(16 * np.sqrt(2.0) ** np.arange(0, 29))]).astype(float)


@dataclass
class RankTables:
    """What the engine needs of one rank's physics (one engine = one TP×PP model copy).

    Times are seconds on an unimpaired replica; hidden effects multiply them per replica.
    """

    dec_time: np.ndarray  # [nB, nC] one decode iteration
    dec_comm: np.ndarray  # [nB, nC] seconds of collectives inside it
    dec_bubble: np.ndarray  # [nB, nC] idle share of pipeline stages
    dec_comm_bytes: np.ndarray  # [nB] collective bytes per iteration (per engine)
    pre_work: np.ndarray  # [nB, nL] marginal seconds to prefill positions 0..L next to B decodes
    pre_comm: np.ndarray  # [nB, nL] collective seconds inside pre_work
    pre_comm_bytes: np.ndarray  # [nL] collective bytes to prefill positions 0..L
    kv_blocks: int
    block_size: int
    max_seqs: int
    budget: int  # max_num_batched_tokens
    chunked: bool
    gpus: int
    vram_bytes: float
    static_bytes: float  # weights + activations + reserve per GPU (bottleneck stage)
    kv_bytes_per_token: float  # per GPU (bottleneck stage)
    policy: int = 0  # scheduler policy: 0 vLLM, 1 TRT-LLM, 2 SGLang (koi.sim.engine)
    request_s: float = 0.0  # serving front end per request (HTTP, tokenisation): before the engine sees it
    meta: dict = field(default_factory=dict)


class Stack:
    """All ranks' tables stacked along a leading rank axis."""

    def __init__(self) -> None:
        self.tables: list[RankTables] = []
        self._dirty = True

    def add(self, t: RankTables) -> int:
        self.tables.append(t)
        self._dirty = True
        return len(self.tables) - 1

    def _build(self) -> None:
        ts = self.tables
        # decode channels fused: [rank, B, C, (iteration s, collective s, bubble, collective bytes)]
        self.dec = np.stack(
            [
                np.stack(
                    [t.dec_time, t.dec_comm, t.dec_bubble, np.broadcast_to(t.dec_comm_bytes[:, None], t.dec_time.shape)],
                    axis=-1,
                )
                for t in ts
            ]
        )
        # prefill channels fused: [rank, B, L, (work s, collective s, collective bytes)]
        self.pre = np.stack(
            [np.stack([t.pre_work, t.pre_comm, np.broadcast_to(t.pre_comm_bytes, t.pre_work.shape)], axis=-1) for t in ts]
        )
        self._dec_flat = np.ascontiguousarray(self.dec.reshape(-1, self.dec.shape[-1]))
        self._pre_flat = np.ascontiguousarray(self.pre.reshape(-1, self.pre.shape[-1]))
        self.kv_blocks = np.array([t.kv_blocks for t in ts], dtype=np.int64)
        self.policy = np.array([t.policy for t in ts], dtype=np.int8)
        self.request_s = np.array([t.request_s for t in ts], dtype=np.float64)
        self.block_size = np.array([t.block_size for t in ts], dtype=np.int64)
        self.max_seqs = np.array([t.max_seqs for t in ts], dtype=np.int64)
        self.budget = np.array([t.budget if t.chunked else 1 << 30 for t in ts], dtype=np.float64)
        self.vram = np.array([t.vram_bytes for t in ts])
        self.static_bytes = np.array([t.static_bytes for t in ts])
        self.kv_bpt = np.array([t.kv_bytes_per_token for t in ts])
        self._dirty = False

    def ensure(self) -> None:
        if self._dirty and self.tables:
            self._build()

    # ---- lookups -------------------------------------------------------------------------------
    @staticmethod
    def frac(axis: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Index of the left grid point and the weight of the right one (clamped to the axis)."""
        x = np.minimum(np.maximum(x, axis[0]), axis[-1])
        i = np.minimum(axis.searchsorted(x, side="right") - 1, len(axis) - 2)
        lo = axis[i]
        w = (x - lo) / (axis[i + 1] - lo)
        return i, w

    def decode(self, rank: np.ndarray, b: np.ndarray, ctx: np.ndarray) -> tuple[np.ndarray, ...]:
        """(iteration s, collective s, bubble fraction, collective bytes) per replica."""
        ib, wb = self.frac(B_AXIS, b)
        ic, wc = self.frac(C_AXIS, ctx)
        nb, nc = len(B_AXIS), len(C_AXIS)
        flat = self._dec_flat
        i00 = (rank * nb + ib) * nc + ic
        wb = wb[:, None]
        wc = wc[:, None]
        lo = flat.take(i00, axis=0) * (1 - wc) + flat.take(i00 + 1, axis=0) * wc
        hi = flat.take(i00 + nc, axis=0) * (1 - wc) + flat.take(i00 + nc + 1, axis=0) * wc
        v = lo * (1 - wb) + hi * wb
        return v[:, 0], v[:, 1], v[:, 2], v[:, 3]

    def prefill(self, rank: np.ndarray, ib: np.ndarray, wb: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Cumulative prefill (seconds of work, seconds of collectives, collective bytes) from 0 to ``pos``: [k, 3]."""
        il, wl = self.frac(L_AXIS, pos)
        nb, nl = len(B_AXIS), len(L_AXIS)
        flat = self._pre_flat
        i00 = (rank * nb + ib) * nl + il
        wb = wb[:, None]
        wl = wl[:, None]
        lo = flat.take(i00, axis=0) * (1 - wb) + flat.take(i00 + nl, axis=0) * wb
        hi = flat.take(i00 + 1, axis=0) * (1 - wb) + flat.take(i00 + nl + 1, axis=0) * wb
        return lo * (1 - wl) + hi * wl
