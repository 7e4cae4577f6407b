"""Pure decision core: requests, sampling parameters, KV block bookkeeping, plans, scheduler.

Imports nothing else of tidal but ``tidal.config``, and never torch: the simulator runs this
code unchanged.
"""

from tidal.core.kv_manager import BlockPool, KVAllocation, KVCacheManager
from tidal.core.plan import (
    BatchComposition,
    RequestUpdate,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from tidal.core.policy import SchedulerView, SchedulingPolicy
from tidal.core.request import FinishReason, Request, RequestClass, RequestStatus
from tidal.core.sampling import SamplingParams, SamplingParamsError
from tidal.core.scheduler import RequestRejected, Scheduler

__all__ = [
    "BatchComposition", "BlockPool", "FinishReason", "KVAllocation", "KVCacheManager", "Request",
    "RequestClass", "RequestRejected", "RequestStatus", "RequestUpdate", "SamplingParams",
    "SamplingParamsError", "ScheduledChunk", "Scheduler", "SchedulerView", "SchedulingPolicy",
    "StepPlan", "StepResult", "TokenLogprobs",
]
