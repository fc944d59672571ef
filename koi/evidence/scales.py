"""Per-variable scales: the unit-aware floor under CUSUM's σ and the normaliser of ICP residuals.

Whitepaper "CUSUM on Mediators and Outcomes": δ and h are multiples of each variable's
residual σ "so the test is unit-aware and works for milliseconds and for tokens/sec
without hand-tuning". Two places still need a scale the data cannot give:

- a **σ floor**: a noise-free (or very smooth) residual series has σ̂ ≈ 0, and CUSUM
  would then flag any sub-percent model error. We floor σ at ``rel_floor × scale``
  (default 5%, :class:`koi.evidence.cusum.CusumConfig`), the practical resolution of
  five-minute telemetry windows.
- **ICP normalisation**: environments differ in scale (the same model's TTFT is 4× on an
  L4 than on an H100), so an edge's residuals are compared *relative to the prediction*:
  r / scale(prediction). A surrogate that is "10% slow everywhere" is then invariant.

``scale(var, pred) = max(|pred|, floor[var])``; the floor keeps predictions near zero
(no queue, no bubbles at pp = 1, no preemptions) from blowing relative residuals up.
Floors are set per unit at a level below which differences are not operationally
meaningful.
"""

from __future__ import annotations

from koi import variables

#: Scale floor by unit (Appendix C units as registered in koi.variables).
UNIT_FLOOR: dict[str, float] = {
    "fraction": 0.1,
    "%": 10.0,
    "tokens": 16.0,
    "GB": 1.0,
    "": 0.1,
    "B/token": 1024.0,
    "seqs": 1.0,
    "requests": 1.0,
    "1/s": 0.1,
    "tok/s": 10.0,
    "ms": 5.0,
    "$/tok": 1e-8,
}

DEFAULT_FLOOR = 1e-6


def scale_floor(variable: str) -> float:
    return UNIT_FLOOR.get(variables.get(variable).unit, DEFAULT_FLOOR)


def scale(variable: str, predicted: float) -> float:
    """max(|prediction|, unit floor): the size a residual of ``variable`` is measured against."""
    return max(abs(float(predicted)), scale_floor(variable))


def relative(variable: str, residual: float, predicted: float) -> float:
    """A residual as a fraction of the variable's scale at this prediction."""
    return float(residual) / scale(variable, predicted)
