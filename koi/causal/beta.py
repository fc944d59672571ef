"""Beta-Bernoulli beliefs (whitepaper, "The Beta-Bernoulli Confidence Model"; Appendix B).

Every edge and every mechanism carries p ~ Beta(α, β): α counts pseudo-successes, β
pseudo-failures. Confidence is the posterior mean c = α/(α+β); the normalised
uncertainty U(α, β) = 12αβ / ((α+β)²(α+β+1)) equals 1 at Beta(1, 1) and falls toward 0
as evidence accumulates (it is 12 × the Beta variance).

Seed bins (Appendix B, "Mechanism confidence bins"): CERTAIN (9, 1), STRONG (4, 1),
LIKELY (3, 1), PLAUSIBLE (2, 1), EVEN (1, 1). A prior's strength α+β grows with its
confidence, so a confident seed needs more contrary evidence to be overturned.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
from pydantic import Field

from koi.domain.common import FrozenModel


class ConfidenceBin(StrEnum):
    CERTAIN = "CERTAIN"
    STRONG = "STRONG"
    LIKELY = "LIKELY"
    PLAUSIBLE = "PLAUSIBLE"
    EVEN = "EVEN"

    @property
    def prior(self) -> tuple[float, float]:
        return _BIN_PRIORS[self]

    @property
    def mean(self) -> float:
        a, b = _BIN_PRIORS[self]
        return a / (a + b)


_BIN_PRIORS: dict[ConfidenceBin, tuple[float, float]] = {
    ConfidenceBin.CERTAIN: (9.0, 1.0),
    ConfidenceBin.STRONG: (4.0, 1.0),
    ConfidenceBin.LIKELY: (3.0, 1.0),
    ConfidenceBin.PLAUSIBLE: (2.0, 1.0),
    ConfidenceBin.EVEN: (1.0, 1.0),
}


def confidence(alpha: float, beta: float) -> float:
    """c = α/(α+β), the posterior mean."""
    return alpha / (alpha + beta)


def uncertainty(alpha: float, beta: float) -> float:
    """U(α, β) = 12αβ/((α+β)²(α+β+1)); U(1, 1) = 1."""
    n = alpha + beta
    return 12.0 * alpha * beta / (n * n * (n + 1.0))


def uncertainty_array(alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Vectorised :func:`uncertainty` for the hot paths (EIG over many edges)."""
    a = np.asarray(alpha, dtype=float)
    b = np.asarray(beta, dtype=float)
    n = a + b
    return 12.0 * a * b / (n * n * (n + 1.0))


def bin_for_confidence(c: float) -> ConfidenceBin:
    """The strongest bin whose mean does not exceed ``c`` (never seeds above the evidence).

    Used by promotion (Appendix D): a posterior at c = 0.85 is written back as STRONG
    (mean 0.8), not CERTAIN (0.9).
    """
    for b in (ConfidenceBin.CERTAIN, ConfidenceBin.STRONG, ConfidenceBin.LIKELY, ConfidenceBin.PLAUSIBLE):
        if c >= b.mean - 1e-12:
            return b
    return ConfidenceBin.EVEN


class Belief(FrozenModel):
    """One Beta(α, β) state. Immutable: updates return a new belief."""

    alpha: float = Field(gt=0)
    beta: float = Field(gt=0)

    @classmethod
    def of_bin(cls, b: ConfidenceBin | str) -> Belief:
        a, bb = ConfidenceBin(b).prior
        return cls(alpha=a, beta=bb)

    @classmethod
    def neutral(cls) -> Belief:
        """Beta(1, 1): what an admitted, runtime-proposed mechanism starts with (Appendix D)."""
        return cls(alpha=1.0, beta=1.0)

    @property
    def c(self) -> float:
        return confidence(self.alpha, self.beta)

    @property
    def u(self) -> float:
        return uncertainty(self.alpha, self.beta)

    @property
    def strength(self) -> float:
        return self.alpha + self.beta

    def updated(self, d_alpha: float, d_beta: float) -> Belief:
        if d_alpha < 0 or d_beta < 0:
            raise ValueError(f"Beta updates only add pseudo-counts, got (Δα={d_alpha}, Δβ={d_beta})")
        return Belief(alpha=self.alpha + d_alpha, beta=self.beta + d_beta)
