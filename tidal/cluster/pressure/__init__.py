"""Handling KV memory pressure across instances (pure): throttle detection, KunServe's drop plan,
lookahead microbatches, restore and autoscale, the Llumnix-like migration baseline, and
``--kv-pressure auto``: the response each throttle onset calls for, predicted and chosen.

The paper is ``../shared/papers/kunserve.md``; each module cites the section it follows.
"""

from tidal.cluster.pressure.auto import AutoPressure
from tidal.cluster.pressure.choose import AutoChoice, AutoChooser, AutoParams
from tidal.cluster.pressure.controller import KunServeController, Plan
from tidal.cluster.pressure.drop_plan import (
    DropPlan,
    DropPlanner,
    KVMove,
    Layers,
    Merge,
    ModelMemory,
    kv_moves,
    merge_layout,
    stage_layers,
)
from tidal.cluster.pressure.events import (
    KINDS,
    PRESSURE_MODES,
    PressureDecision,
    Recorder,
    check_pressure_mode,
)
from tidal.cluster.pressure.lookahead import (
    ChunkCost,
    Microbatch,
    Span,
    bubble_ratio,
    eq1_features,
    eq4_cost,
    fit_chunk_cost,
    lookahead_microbatches,
    pipeline_makespan,
    pipeline_period,
    token_microbatches,
)
from tidal.cluster.pressure.migrate import Migration, MigrationController, plan_migrations
from tidal.cluster.pressure.predict import TECHNIQUES, DropOption, Episode, Prediction, Prices, Victim
from tidal.cluster.pressure.record import ControllerDecision, DecisionRecorder, PressureView
from tidal.cluster.pressure.restore import (
    RESTORE_THRESHOLD,
    AutoscaleSignal,
    RestorePlan,
    RestorePolicy,
    assign_homes,
    restore_plan,
)
from tidal.cluster.pressure.throttle import ADMISSION_WATERMARK, Throttle, ThrottleDetector, demand_bytes

__all__ = [
    "ADMISSION_WATERMARK", "AutoChoice", "AutoChooser", "AutoParams", "AutoPressure", "DropOption", "Episode",
    "Prediction", "Prices", "TECHNIQUES", "Victim", "AutoscaleSignal", "ChunkCost", "ControllerDecision", "DecisionRecorder", "DropPlan",
    "DropPlanner", "KINDS", "KVMove", "KunServeController", "Layers", "Merge", "Microbatch", "Migration",
    "MigrationController", "ModelMemory", "PRESSURE_MODES", "Plan", "PressureDecision", "PressureView",
    "RESTORE_THRESHOLD", "Recorder", "RestorePlan", "RestorePolicy", "Span", "Throttle", "ThrottleDetector",
    "assign_homes", "bubble_ratio", "check_pressure_mode", "demand_bytes", "eq1_features", "eq4_cost",
    "fit_chunk_cost", "kv_moves", "lookahead_microbatches", "merge_layout", "pipeline_makespan", "pipeline_period",
    "plan_migrations", "restore_plan", "stage_layers", "token_microbatches",
]
