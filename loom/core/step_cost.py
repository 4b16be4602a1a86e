"""How long a step takes, predicted from what it computes: the scheduler's time budget.

A step's forward costs about

    ms = fixed + per_token * tokens + per_attention * attention / 1000

where `attention` sums, over the step's chunks, each chunk's tokens times the mean context
they attend to (a chunk of n tokens starting at position s: n * (s + n / 2)). The three
coefficients are fitted by least squares over the last `window` measured steps (a ridge
keeps the fit defined while the steps are alike) and never go negative; a per-token cost the
fit cannot tell from noise is bounded from above instead (never zero); until `min_samples`
steps were measured the model is not calibrated and the scheduler uses its token budget
alone. Pure arithmetic: the engine core times the steps and feeds them in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol


def attention_units(num_new: int, start: int) -> float:
    """A chunk's attention work: its tokens times the mean context they attend to."""
    return num_new * (start + num_new / 2)


class StepCost(Protocol):
    """What the scheduler asks a cost model (a fake one in tests)."""

    @property
    def calibrated(self) -> bool:
        """Whether predictions mean anything yet."""

    def fixed_ms(self) -> float:
        """A step's cost that does not depend on its tokens."""

    def chunk_ms(self, num_new: int, start: int) -> float:
        """A chunk's predicted cost beyond the fixed one."""

    def tokens_within(self, ms: float, start: int) -> int:
        """The most tokens a chunk starting at `start` may have to cost at most `ms`."""

    def observe(self, tokens: int, attention: float, ms: float) -> None:
        """One measured step: its tokens, attention units and wall milliseconds."""


# The least a token is taken to cost (ms) where the steps' times show no per-token cost.
_MIN_PER_TOKEN_MS = 1e-6


@dataclass
class _Sample:
    tokens: float
    attention: float
    ms: float


class LinearStepCost:
    """`fixed + per_token * tokens + per_attention * attention / 1000`, refitted from the
    measured steps (see the module docstring)."""

    def __init__(self, window: int = 64, min_samples: int = 4) -> None:
        self.window, self.min_samples = window, min_samples
        self._samples: deque[_Sample] = deque(maxlen=window)
        self.fixed, self.per_token, self.per_attention = 0.0, 0.0, 0.0

    @property
    def calibrated(self) -> bool:
        return len(self._samples) >= self.min_samples and self.per_token > 0

    def observe(self, tokens: int, attention: float, ms: float) -> None:
        """One measured step: its tokens, attention units and wall milliseconds."""
        if tokens <= 0 or not math.isfinite(ms) or ms < 0:
            return
        self._samples.append(_Sample(float(tokens), attention / 1000.0, ms))
        if len(self._samples) >= self.min_samples:
            self._fit()

    def _fit(self) -> None:
        """Least squares of ms on [1, tokens, attention], a small ridge, then coefficients
        clamped at zero (a negative one is refitted without that feature)."""
        rows = [(1.0, s.tokens, s.attention, s.ms) for s in self._samples]
        active = [0, 1, 2]
        while True:
            coef = _solve(rows, active)
            negative = [i for i, c in zip(active, coef, strict=True) if c < 0 and i != 1]
            if not negative or len(active) == 1:
                break
            active.remove(negative[0])
        values = dict(zip(active, coef, strict=True))
        self.fixed = max(values.get(0, 0.0), 0.0)
        self.per_token = max(values.get(1, 0.0), 0.0)
        self.per_attention = max(values.get(2, 0.0), 0.0)
        if self.per_token == 0.0:
            # A token's cost is below the steps' noise (a tiny model): bound it from above
            # by the most any step left past its fixed and attention cost, a token (a
            # budget cut by it errs towards shorter steps), never zero: a token is never free.
            self.per_token = max(max((s.ms - self.fixed - self.per_attention * s.attention)
                                     / s.tokens for s in self._samples), _MIN_PER_TOKEN_MS)

    def fixed_ms(self) -> float:
        return self.fixed

    def chunk_ms(self, num_new: int, start: int) -> float:
        return self.per_token * num_new + self.per_attention * attention_units(
            num_new, start) / 1000.0

    def tokens_within(self, ms: float, start: int) -> int:
        if ms <= 0:
            return 0
        # per_attention / 2000 * n^2 + (per_token + per_attention * start / 1000) * n <= ms
        a = self.per_attention / 2000.0
        b = self.per_token + self.per_attention * start / 1000.0
        if a <= 0:
            return int(ms / b) if b > 0 else 1 << 30
        return int((-b + math.sqrt(b * b + 4 * a * ms)) / (2 * a))


def _solve(rows: list[tuple[float, float, float, float]], active: list[int]) -> list[float]:
    """Ridge least squares over the `active` feature columns (Gaussian elimination)."""
    k = len(active)
    scale = [max(max(abs(r[i]) for r in rows), 1e-12) for i in active]
    m = [[0.0] * (k + 1) for _ in range(k)]
    for r in rows:
        x = [r[i] / s for i, s in zip(active, scale, strict=True)]
        for p in range(k):
            for q in range(k):
                m[p][q] += x[p] * x[q]
            m[p][k] += x[p] * r[3]
    for p in range(k):
        m[p][p] += 1e-6 * len(rows)
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(m[i][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-18:
            continue
        for i in range(k):
            if i != col:
                f = m[i][col] / m[col][col]
                for j in range(col, k + 1):
                    m[i][j] -= f * m[col][j]
    return [(m[i][k] / m[i][i] if abs(m[i][i]) > 1e-18 else 0.0) / scale[i]
            for i in range(k)]
