"""The one headroom rule: does a plan hold the requested sequences with the safety margin?

Stages 2 (memory) and 4 (parallel, through every layout's memory plan) and preflight all
decide with ``assess``; nothing else answers the question.

The rule, per device of the binding pipeline stage:

  margin  = headroom_fraction x (sum of the estimated terms: activations, buffers, CUDA graphs,
            framework overhead, MXFP4 padding and workspace)           -> ``margin_bytes``
  pool    = budget - (weights + estimated terms + margin)              (budget = utilization x memory)
  free    = pool - requested sequences x KV bytes per sequence
  passes  when free >= 0: every requested sequence of the full context fits at once, after the margin.

Verdict words: "fits" (passes), "fits-fewer-sequences" (vLLM starts; fewer than requested fit at
once: fails the gate), "does-not-fit" (not even one sequence: vLLM refuses to start).
"""

from __future__ import annotations

from dataclasses import dataclass

FITS, FEWER, DOES_NOT_FIT = "fits", "fits-fewer-sequences", "does-not-fit"


def margin_bytes(estimated_bytes: float, fraction: float) -> float:
    """The headroom term (bytes): ``fraction`` of the estimated terms' sum (bytes)."""
    return fraction * estimated_bytes


@dataclass(frozen=True)
class Headroom:
    """The rule's answer for one device.

    verdict: FITS | FEWER | DOES_NOT_FIT; passes: verdict == FITS
    pool_bytes: budget minus every non-KV term, margin included (what the KV cache gets; may be < 0)
    free_bytes: pool minus the KV of the requested sequences (< 0: they do not all fit)
    concurrent_sequences: full-context sequences the pool holds; requested_sequences: per replica
    """

    verdict: str
    pool_bytes: float
    free_bytes: float
    concurrent_sequences: int
    requested_sequences: int

    @property
    def passes(self) -> bool:
        return self.verdict == FITS

    def describe(self, budget_bytes: int) -> str:
        gib = 2**30
        return (f"{self.concurrent_sequences} of {self.requested_sequences} requested sequence(s) fit; "
                f"{self.free_bytes / gib:,.2f} GiB ({self.free_bytes / budget_bytes:+.1%} of the budget) "
                "left after the margin and the requested KV cache")


def assess(non_kv_terms: dict[str, float], *, budget_bytes: float, kv_bytes_per_sequence: float,
           requested_sequences: int) -> Headroom:
    """Apply the rule. non_kv_terms: bytes per device of every term but the KV cache, the
    ``headroom`` margin (``margin_bytes``) included; budget_bytes: utilization x device memory;
    kv_bytes_per_sequence: one full-context sequence (bytes); requested_sequences: per replica."""
    pool = budget_bytes - sum(non_kv_terms.values())
    if kv_bytes_per_sequence > 0:
        concurrent = int(pool // kv_bytes_per_sequence) if pool > 0 else 0
    else:
        concurrent = requested_sequences if pool > 0 else 0
    free = pool - requested_sequences * kv_bytes_per_sequence
    if pool <= 0 or concurrent < 1:
        verdict = DOES_NOT_FIT
    elif free < 0:
        verdict = FEWER
    else:
        verdict = FITS
    return Headroom(verdict, pool, free, concurrent, requested_sequences)
