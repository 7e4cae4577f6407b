"""``tidal serve --step-log FILE``: each worker step report as one JSON line (the front end's clock,
the step's time and shape, the pool, the queue, the hand-offs and KV moved), to profile where a
layout's time goes."""

from __future__ import annotations

import json
from typing import Any


class StepLog:
    def __init__(self, path: str):
        self.file = open(path, "w")  # noqa: SIM115 (closed by close(), at the cluster's shutdown)

    def write(self, i: int, st: Any, rec: Any, now: float) -> None:
        """Instance ``i``'s step report ``st`` (an ``InstanceStatus``), its monitor record ``rec``."""
        self.file.write(json.dumps({
            "t": round(now, 6), "instance": i, "step_s": st.step_time_s, "prefill_tokens": st.step_prefill_tokens,
            "prefill_prefix": st.step_prefill_prefix, "decodes": st.step_decode_count,
            "decode_context": st.step_decode_context, "running": st.num_running, "waiting": st.num_waiting,
            "free_blocks": st.num_free_blocks, "blocks": st.num_blocks, "token_budget": st.token_budget,
            "handoffs_in": rec.handoffs_in, "reserved": len(rec.reserved), "import_s": st.import_s,
            "export_s": st.export_s, "chunks_in": st.chunks_in, "chunks_out": st.chunks_out}) + "\n")

    def close(self) -> None:
        self.file.close()
