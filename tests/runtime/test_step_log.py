"""``tidal serve --step-log FILE``: the flag reaches the cluster's config, and each worker step
report becomes one JSON line with the step's time and shape (where a layout's time goes)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tidal.cluster.monitor import InstanceStatus


def test_the_flag_reaches_the_cluster_config():
    from tidal.cli import build_parser
    from tidal.common import flags as F

    args = build_parser().parse_args(["serve", "--instances", "2", "--step-log", "/tmp/x.jsonl"])
    assert F.serving_config(args).cluster.step_log == "/tmp/x.jsonl"
    args = build_parser().parse_args(["serve", "--instances", "2"])
    assert F.serving_config(args).cluster.step_log is None


def test_a_step_report_is_one_json_line(tmp_path):
    from tidal.runtime.step_log import StepLog

    rec = SimpleNamespace(handoffs_in=3, reserved={"a": 2})
    st = InstanceStatus(1, 364, 300, 16, num_running=4, num_waiting=1, step_time_s=0.125, step_prefill_tokens=20,
                        step_decode_count=3, step_decode_context=210.0, step_prefill_prefix=35.0, token_budget=64)
    log = StepLog(str(tmp_path / "steps.jsonl"))
    log.write(1, st, rec, 12.5)
    log.write(1, st, rec, 12.75)
    log.close()
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert len(lines) == 2
    row = json.loads(lines[0])
    assert row == {"t": 12.5, "instance": 1, "step_s": 0.125, "prefill_tokens": 20, "prefill_prefix": 35.0,
                   "decodes": 3, "decode_context": 210.0, "running": 4, "waiting": 1, "free_blocks": 300,
                   "blocks": 364, "token_budget": 64, "handoffs_in": 3, "reserved": 1, "import_s": 0.0,
                   "export_s": 0.0, "chunks_in": 0, "chunks_out": 0}


def test_a_step_report_carries_the_kv_moved_since_the_last_and_resets_it():
    from tests.runtime.test_split_front_records import _engine, _plan
    from tidal.runtime.worker import Worker

    w = SimpleNamespace(engine=_engine(_plan([], [300])), cfg=SimpleNamespace(index=0), _io=[0.25, 0.5, 40, 12])
    idle = Worker.status(w)  # type: ignore[arg-type]  (not a step report: the counters wait)
    assert idle.chunks_in == 0 and w._io == [0.25, 0.5, 40, 12]
    st = Worker.status(w, 0.05)  # type: ignore[arg-type]
    assert (st.import_s, st.export_s, st.chunks_in, st.chunks_out) == (0.25, 0.5, 40, 12)
    assert w._io == [0.0, 0.0, 0, 0]
    again = Worker.status(w, 0.05)  # type: ignore[arg-type]
    assert (again.import_s, again.chunks_in) == (0.0, 0)
