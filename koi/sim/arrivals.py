"""Request streams: arrival times, input/output lengths and shared prefixes per job.

Each job draws from its own PCG64 stream seeded by ``(scenario seed, job id)``, so
adding a job does not move the others' requests. Arrivals are generated in fixed
blocks the moment the buffer runs dry, independently of the world's macro-step, so
the same seed gives the same requests whatever ``step_s`` is.

Choices where the workload profile is vague:
- ``lognormal`` lengths take ``mean``/``std`` as the moments of the distribution
  itself (not of its log); ``uniform`` spans ``mean ± std·√3`` (or ``[min, max]``
  when ``std`` is 0); every draw is rounded and clipped to ``[min, max]``;
- a request with a shared prefix (probability ``shared_prefix_fraction``) carries
  the job's one shared prefix (a system prompt) of ``shared_prefix_len`` tokens as
  the start of its input; its input is at least ``shared_prefix_len + 1`` tokens;
- ``constant`` arrivals start at a random phase in the first gap; ``gamma`` uses
  shape ``1/cv²`` (cv = 1 is Poisson);
- an online job's stream runs from ``submitted_at`` to ``submitted_at + lifetime_s``
  (forever without a lifetime); a batch job's ``num_requests`` all arrive at
  ``submitted_at``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from koi.domain import ArrivalProcess, Job, JobClass, LengthDist, LengthKind

_BLOCK_MIN = 256


def job_seed(seed: int, job_id: str) -> np.random.SeedSequence:
    digest = hashlib.sha256(job_id.encode()).digest()
    return np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little")])


def sample_lengths(rng: np.random.Generator, dist: LengthDist, n: int) -> np.ndarray:
    """``n`` token lengths from ``dist`` (int32, clipped to [min, max])."""
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    if dist.kind is LengthKind.FIXED or dist.std == 0 and dist.kind is not LengthKind.UNIFORM:
        x = np.full(n, dist.mean)
    elif dist.kind is LengthKind.UNIFORM:
        if dist.std == 0:
            x = rng.uniform(dist.min, dist.max, n)
        else:
            h = dist.std * np.sqrt(3.0)
            x = rng.uniform(dist.mean - h, dist.mean + h, n)
    elif dist.kind is LengthKind.NORMAL:
        x = rng.normal(dist.mean, dist.std, n)
    else:  # lognormal with the given moments
        s2 = np.log1p((dist.std / dist.mean) ** 2)
        x = rng.lognormal(np.log(dist.mean) - s2 / 2.0, np.sqrt(s2), n)
    return np.clip(np.rint(x), dist.min, dist.max).astype(np.int32)


@dataclass
class Batch:
    """Requests of one job in columnar form."""

    arrival: np.ndarray  # float64 seconds
    prompt: np.ndarray  # int32 tokens in
    output: np.ndarray  # int32 tokens out (the request's max_tokens; it stops there)
    prefix: np.ndarray  # int32 shared-prefix tokens (0: none)

    def __len__(self) -> int:
        return len(self.arrival)

    @classmethod
    def empty(cls) -> Batch:
        return cls(np.zeros(0), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))

    def take(self, k: int) -> tuple[Batch, Batch]:
        return (
            Batch(self.arrival[:k], self.prompt[:k], self.output[:k], self.prefix[:k]),
            Batch(self.arrival[k:], self.prompt[k:], self.output[k:], self.prefix[k:]),
        )

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Batch.empty()
        if len(parts) == 1:
            return parts[0]
        return Batch(
            np.concatenate([p.arrival for p in parts]),
            np.concatenate([p.prompt for p in parts]),
            np.concatenate([p.output for p in parts]),
            np.concatenate([p.prefix for p in parts]),
        )


class JobStream:
    """The request stream of one job; :meth:`until` returns arrivals in ``[previous, t)``."""

    def __init__(self, job: Job, seed: int, start: float | None = None):
        """``start``: when traffic begins (default ``job.submitted_at``; later for a job registered late)."""
        self.job = job
        self.rng = np.random.Generator(np.random.PCG64(job_seed(seed, job.job_id)))
        self.start = job.submitted_at if start is None else max(start, job.submitted_at)
        self.end = np.inf if job.lifetime_s is None else job.submitted_at + job.lifetime_s
        self.buffer = Batch.empty()
        self.clock = self.start  # the last generated arrival time
        self.generated = 0
        self.exhausted = False
        self.exhausted_taken = job.job_class is not JobClass.BATCH  # batch: whether its set was taken
        self._first = True
        if job.job_class is JobClass.BATCH:
            n = int(job.slo.num_requests or 0)
            self.buffer = self._draw(np.full(n, self.start))
            self.generated = n
            self.exhausted = True

    # ---- drawing ------------------------------------------------------------------------------
    def _draw(self, times: np.ndarray) -> Batch:
        w = self.job.workload
        n = len(times)
        prompt = sample_lengths(self.rng, w.input_len, n)
        output = sample_lengths(self.rng, w.output_len, n)
        prefix = np.zeros(n, dtype=np.int32)
        if w.shared_prefix_fraction > 0 and w.shared_prefix_len > 0:
            has = self.rng.random(n) < w.shared_prefix_fraction
            prefix[has] = w.shared_prefix_len
            prompt = np.where(has, np.maximum(prompt, w.shared_prefix_len + 1), prompt).astype(np.int32)
        return Batch(times, prompt, output, prefix)

    def _gaps(self, n: int) -> np.ndarray:
        a = self.job.workload.arrival
        rate = a.rate_rps
        if a.process is ArrivalProcess.POISSON:
            return self.rng.exponential(1.0 / rate, n)
        if a.process is ArrivalProcess.CONSTANT:
            gaps = np.full(n, 1.0 / rate)
            if self._first:
                gaps[0] = self.rng.uniform(0.0, 1.0 / rate)
            return gaps
        k = 1.0 / (a.cv**2)
        return self.rng.gamma(k, 1.0 / (rate * k), n)

    def _extend(self, t: float) -> None:
        rate = self.job.workload.arrival.rate_rps
        parts = [self.buffer]
        while not self.exhausted and self.clock < t:
            n = max(_BLOCK_MIN, int(rate * 60.0))
            times = self.clock + np.cumsum(self._gaps(n))
            self._first = False
            times = times[times < self.end]
            if len(times) < n:
                self.exhausted = True
            if len(times):
                parts.append(self._draw(times))
                self.clock = float(times[-1])
                self.generated += len(times)
        self.buffer = Batch.concat(parts)

    def until(self, t: float) -> Batch:
        """Requests arriving before ``t`` not returned before."""
        if self.job.job_class is JobClass.ONLINE and self.job.workload.arrival.rate_rps > 0:
            self._extend(t)
        k = int(np.searchsorted(self.buffer.arrival, t, side="left"))
        out, self.buffer = self.buffer.take(k)
        return out

    def next_arrival(self) -> float:
        if len(self.buffer):
            return float(self.buffer.arrival[0])
        return np.inf if self.exhausted else self.clock
