"""Published A100 measurements the analytic cost model is calibrated against (issue 14).

Each :class:`RefPoint` is one measured number with its source: a step shape (``decodes``
decodes at ``context`` plus one chunk of ``chunk`` tokens after ``prefix``), the part of the
step it measured (``part``: the key of :meth:`AnalyticCostModel.breakdown` it is compared
with) and the time. They are measurement data with a citation, not code:

- Vidur (Agrawal et al., MLSys 2024), github.com/microsoft/vidur, per-kernel profiles taken on
  A100-80G with vLLM's kernels. ``linear``: the sum of one layer's operator medians (norms,
  QKV/O projections, rope, gated MLP, residual add; not the embedding) of Meta-Llama-3-8B at
  TP1 from ``data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv`` at commit
  7d47513363ec447a741ac5e47241580b47724fbf, times the 32 layers. ``attention``: FlashAttention
  decode / prefill medians (plus the reshapes) of one layer of the 8192-wide, 64-query-head,
  8-KV-head model at TP2 (Llama-2/3-70B's attention on each of 2 GPUs) from
  ``data/profiling/a100/attention.csv`` at commit e2d00e9afba96cec9f0e7ea560bbfc4a539fae6a
  (the only attention profile whose text is public there; the newer ones are LFS objects),
  times llama-3-70b's 80 layers. ``overhead``: vLLM's CPU time per step (schedule + sampler +
  prepare inputs + process outputs, medians) of Llama-2-7b at TP1 from
  ``data/profiling/a100/cpu_overheads.csv`` at commit 6d98aa8f71696520acc603d87439e77cc78160a7.
  Where the CSV holds two rows for one shape, the first is taken.
- DynaServe (``papers/dynaserve.md`` Sec. 4.2, Fig. 6): Llama-3.1-8B on an A100, a step of 29
  decodes at 1024 context plus a 512-token prefill chunk crosses the 50 ms line. A whole-step
  point the fit never sees (held out), so its error is a check of the model, not of the fit.

Pure: no torch, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams

VIDUR = "microsoft/vidur"
MLP_CSV = f"{VIDUR}@7d47513:data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv"
ATTN_CSV = f"{VIDUR}@e2d00e9:data/profiling/a100/attention.csv"
CPU_CSV = f"{VIDUR}@6d98aa8:data/profiling/a100/cpu_overheads.csv"
DYNASERVE = "DynaServe Sec. 4.2, Fig. 6 (Llama-3.1-8B, A100)"


@dataclass(frozen=True)
class RefPoint:
    name: str
    part: str  # "linear" | "attention" | "overhead" | "total": the breakdown key it is compared with
    model: str
    hardware: str
    tp: int
    measured_ms: float  # the number as published (per layer for the Vidur kernel profiles)
    layers: int  # measured_ms x layers = the step's part (1 for per-step numbers)
    source: str
    decodes: int = 0
    context: int = 0
    chunk: int = 0
    prefix: int = 0
    sample: bool = True
    held_out: bool = False  # not used by the fit

    @property
    def seconds(self) -> float:
        return self.measured_ms * self.layers / 1e3

    def plan(self) -> StepPlan:
        sp = SamplingParams()
        chunks = [ScheduledChunk(f"d{i}", (0,), self.context, (), self.sample, sp) for i in range(self.decodes)]
        if self.chunk:
            chunks.append(ScheduledChunk("p", (0,) * self.chunk, self.prefix, (), self.sample, sp))
        return StepPlan(0, tuple(chunks), BatchComposition.of(chunks))


def _linear(tokens: int, ms: float) -> RefPoint:
    return RefPoint(f"linear {tokens} tok", "linear", "llama-3-8b", "a100-80g", 1, ms, 32, MLP_CSV,
                    chunk=tokens, sample=False)


def _decode(batch: int, context: int, ms: float) -> RefPoint:
    return RefPoint(f"decode attn {batch} x {context}", "attention", "llama-3-70b", "a100-80g", 2, ms, 80, ATTN_CSV,
                    decodes=batch, context=context, sample=False)


def _prefill(chunk: int, prefix: int, ms: float) -> RefPoint:
    return RefPoint(f"prefill attn {chunk} after {prefix}", "attention", "llama-3-70b", "a100-80g", 2, ms, 80,
                    ATTN_CSV, chunk=chunk, prefix=prefix, sample=False)


def _cpu(batch: int, ms: float) -> RefPoint:
    return RefPoint(f"cpu overhead {batch} seqs", "overhead", "llama-2-7b", "a100-80g", 1, ms, 1, CPU_CSV,
                    decodes=batch, context=512)


# per-layer medians in ms, as the CSVs give them
A100_POINTS: tuple[RefPoint, ...] = (
    _linear(1, 0.303), _linear(16, 0.3165), _linear(64, 0.351), _linear(128, 0.412), _linear(256, 0.609),
    _linear(512, 1.0825), _linear(1024, 2.348), _linear(2048, 4.431), _linear(4096, 8.529),
    _decode(1, 1024, 0.018), _decode(8, 1024, 0.038), _decode(32, 512, 0.039), _decode(32, 2048, 0.110),
    _decode(64, 1024, 0.124), _decode(128, 128, 0.052), _decode(128, 2048, 0.353),
    _prefill(128, 0, 0.019), _prefill(512, 0, 0.077), _prefill(512, 2048, 0.229), _prefill(1024, 1024, 0.329),
    _prefill(2048, 0, 0.701), _prefill(4096, 0, 2.358),
    _cpu(8, 1.173), _cpu(32, 2.096), _cpu(64, 3.512), _cpu(128, 6.222),
    RefPoint("dynaserve fig6 29 x 1024 + 512", "total", "llama-3-8b", "a100-80g", 1, 50.0, 1, DYNASERVE,
             decodes=29, context=1024, chunk=512, held_out=True),
)


def predict(point: RefPoint, cost_model) -> float:
    """The cost model's seconds for the part of the step ``point`` measured."""
    return float(cost_model.breakdown(point.plan())[point.part])


__all__ = ["A100_POINTS", "RefPoint", "predict"]
