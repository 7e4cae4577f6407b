"""Readers of trace files and length sets (Azure CSV, Mooncake JSONL, length CSVs, Alpaca JSON).

Pure: no torch, threads or clock. Malformed rows raise :class:`WorkloadError` naming the file and
line. The shared traces are described in ``../shared/traces/README.md``.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np


class WorkloadError(ValueError):
    """A workload, trace or length-set argument is wrong; the message names the problem."""


# ============================================================================ trace files
@dataclass
class TraceRow:
    time_s: float  # seconds, as in the file (not yet shifted to 0)
    input_len: int
    output_len: int
    hash_ids: list[int] | None = None
    line: int = 0


def _positive_int(value: Any, path: str, line: int, col: str) -> int:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise WorkloadError(f"{path}:{line}: bad {col} {value!r} (expected a number)") from None
    if not math.isfinite(f) or f < 0 or f != int(f):
        raise WorkloadError(f"{path}:{line}: bad {col} {value!r} (expected a non-negative integer)")
    return int(f)


_AZURE_TS = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?")


def parse_azure_timestamp(text: str) -> float:
    """``2023-11-16 18:15:46.6805900`` -> seconds since the epoch (naive, UTC); any number of decimals."""
    m = _AZURE_TS.fullmatch(text.strip())
    if not m:
        raise ValueError(text)
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    base = datetime(y, mo, d, h, mi, s)
    return (base - datetime(1970, 1, 1)).total_seconds() + frac


def detect_trace_format(path: str) -> str:
    """``mooncake`` (JSON lines) or ``azure`` (CSV with TIMESTAMP,ContextTokens,GeneratedTokens) or
    ``csv`` (a CSV with a time column and input/output length columns), from the content."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise WorkloadError(f"trace file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read trace {path}: {e}") from None
    first = head.lstrip().split("\n", 1)[0].strip()
    if first.startswith("{"):
        return "mooncake"
    cols = [c.strip().lower() for c in first.split(",")]
    if cols[:3] == ["timestamp", "contexttokens", "generatedtokens"]:
        return "azure"
    if _csv_columns(cols) is not None:
        return "csv"
    raise WorkloadError(f"{path}: unknown trace format (expected Mooncake JSONL, or a CSV whose header is "
                        f"TIMESTAMP,ContextTokens,GeneratedTokens or names time, input and output columns)")


_TIME_COLS = ("timestamp", "arrival_s", "arrival_time", "time", "time_s")
_IN_COLS = ("contexttokens", "input_length", "input_len", "prompt_len", "num_prefill_tokens", "input_tokens")
_OUT_COLS = ("generatedtokens", "output_length", "output_len", "num_decode_tokens", "output_tokens")


def _csv_columns(cols: list[str]) -> tuple[int, int, int] | None:
    def find(names: tuple[str, ...]) -> int | None:
        return next((cols.index(c) for c in names if c in cols), None)

    t, i, o = find(_TIME_COLS), find(_IN_COLS), find(_OUT_COLS)
    return None if t is None or i is None or o is None else (t, i, o)


def load_trace(path: str, limit: int | None = None) -> list[TraceRow]:
    """The rows of a timed trace, sorted by time (stable). Malformed rows raise
    :class:`WorkloadError` naming the line. ``limit`` stops after that many rows of the file."""
    fmt = detect_trace_format(path)
    rows: list[TraceRow] = []
    with open(path, encoding="utf-8", newline="") as f:
        if fmt == "mooncake":
            for line_no, line in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{path}:{line_no}: malformed JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise WorkloadError(f"{path}:{line_no}: expected a JSON object")
                for key in ("timestamp", "input_length", "output_length"):
                    if key not in obj:
                        raise WorkloadError(f"{path}:{line_no}: missing field {key!r}")
                try:
                    ts = float(obj["timestamp"]) / 1000.0
                except (TypeError, ValueError):
                    raise WorkloadError(f"{path}:{line_no}: bad timestamp {obj['timestamp']!r}") from None
                hashes = obj.get("hash_ids")
                if hashes is not None and not (isinstance(hashes, list) and all(isinstance(h, int) for h in hashes)):
                    raise WorkloadError(f"{path}:{line_no}: hash_ids must be a list of integers")
                rows.append(TraceRow(ts, _positive_int(obj["input_length"], path, line_no, "input_length"),
                                     _positive_int(obj["output_length"], path, line_no, "output_length"),
                                     hashes, line_no))
        else:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise WorkloadError(f"{path}: empty trace")
            cols = [c.strip().lower() for c in header]
            ti, ii, oi = _csv_columns(cols) or (0, 1, 2)
            for rec in reader:
                line_no = reader.line_num
                if limit is not None and len(rows) >= limit:
                    break
                if not rec or all(not c.strip() for c in rec):
                    continue
                if len(rec) < len(header):
                    raise WorkloadError(f"{path}:{line_no}: expected {len(header)} columns, got {len(rec)}")
                raw_t = rec[ti].strip()
                try:
                    ts = parse_azure_timestamp(raw_t) if fmt == "azure" else float(raw_t)
                except ValueError:
                    raise WorkloadError(f"{path}:{line_no}: bad timestamp {raw_t!r}") from None
                if not math.isfinite(ts):
                    raise WorkloadError(f"{path}:{line_no}: bad timestamp {raw_t!r}")
                rows.append(TraceRow(ts, _positive_int(rec[ii].strip(), path, line_no, header[ii].strip()),
                                     _positive_int(rec[oi].strip(), path, line_no, header[oi].strip()),
                                     None, line_no))
    if not rows:
        raise WorkloadError(f"{path}: the trace has no rows")
    rows.sort(key=lambda r: r.time_s)
    return rows


def load_length_set(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths of a length-set CSV (``num_prefill_tokens,num_decode_tokens,...``)."""
    try:
        f = open(path, encoding="utf-8", newline="")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise WorkloadError(f"length set not found: {path}") from None
    with f:
        reader = csv.reader(f)
        header = [c.strip().lower() for c in (next(reader, None) or [])]
        if "num_prefill_tokens" not in header or "num_decode_tokens" not in header:
            raise WorkloadError(f"{path}: expected columns num_prefill_tokens,num_decode_tokens")
        pi, di = header.index("num_prefill_tokens"), header.index("num_decode_tokens")
        ins, outs = [], []
        for rec in reader:
            if not rec:
                continue
            line = reader.line_num
            if len(rec) <= max(pi, di):
                raise WorkloadError(f"{path}:{line}: expected {len(header)} columns, got {len(rec)}")
            ins.append(_positive_int(rec[pi].strip(), path, line, "num_prefill_tokens"))
            outs.append(_positive_int(rec[di].strip(), path, line, "num_decode_tokens"))
    if not ins:
        raise WorkloadError(f"{path}: no rows")
    return np.asarray(ins, dtype=np.int64), np.asarray(outs, dtype=np.int64)


def load_alpaca(path: str) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of an Alpaca-format JSON file: prompt = instruction [+ blank line + input]."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise WorkloadError(f"dataset not found: {path}") from None
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of instruction records")
    pairs = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("instruction"), str):
            raise WorkloadError(f"{path}: record {i} has no 'instruction' text")
        prompt = item["instruction"].strip()
        extra = str(item.get("input") or "").strip()
        if extra:
            prompt += "\n\n" + extra
        pairs.append((prompt, str(item.get("output") or "")))
    if not pairs:
        raise WorkloadError(f"{path}: no records")
    return pairs
