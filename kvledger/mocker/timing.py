"""Dynamo's step-time model for the mock engine, so that its TTFT and TPOT can be compared with
Dynamo's mocker (``run_mocker_trace_replay`` in ``ai-dynamo-runtime``) on the same trace.

Dynamo's mocker charges an engine pass two polynomial terms, both in milliseconds:

- prefill: ``a*T**2 + b*T + c`` where ``T`` is the number of uncached prompt tokens the pass
  computes (0, and no charge, in a pass without prefill);
- decode: ``max(1, d2*p**2 + d1*p + d0)`` where ``p = min(1, K / (G1 blocks x block size))``
  and ``K`` is the context length summed over the sequences that sample a token in the pass
  (no charge when none does).

The pass costs their sum divided by a speed-up ratio. The curve grows with load, so unlike
the linear ``StepCosts`` a busy engine slows down the way a real one does; that is what makes
TTFT under load comparable with Dynamo's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DynamoTiming:
    """The polynomial pass cost of Dynamo's mocker (its defaults), divided by ``speedup_ratio``."""

    speedup_ratio: float = 1.0
    prefill_quadratic: float = 4.209989e-7
    prefill_linear: float = 0.01518344
    prefill_constant: float = 16.50142
    decode_quadratic: float = -25.74
    decode_linear: float = 54.01
    decode_constant: float = 5.74

    def __post_init__(self) -> None:
        if not self.speedup_ratio > 0:
            raise ValueError(f"speedup_ratio must be > 0, got {self.speedup_ratio}")

    def prefill_ms(self, tokens: int) -> float:
        """Compute time of ``tokens`` uncached prompt tokens in one pass (0 for none)."""
        if tokens <= 0:
            return 0.0
        ms = (
            self.prefill_quadratic * tokens * tokens
            + self.prefill_linear * tokens
            + self.prefill_constant
        )
        return ms / self.speedup_ratio

    def decode_ms(self, context_tokens: int, capacity_tokens: int) -> float:
        """Time of one decode pass over sequences holding ``context_tokens`` in all, on a G1 of
        ``capacity_tokens`` (blocks x block size)."""
        # (comparisons rather than min() and max(): this runs at every decode step, and the
        # builtins cost more than the rest of it; the values are the same)
        p = context_tokens / capacity_tokens
        if p > 1.0:
            p = 1.0
        ms = self.decode_quadratic * p * p + self.decode_linear * p + self.decode_constant
        if ms < 1.0:
            ms = 1.0
        return ms / self.speedup_ratio
