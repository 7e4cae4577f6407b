"""Writing results: JSON (NaN-safe, atomic) with PNG plots beside it, and the command line that
made them."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

Plotter = Callable[[dict[str, Any], str], list[str]]
T = TypeVar("T")


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats as strings (JSON has no NaN or Infinity)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_json(data: Any, path: str) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(jsonable(data), f, indent=1, default=str)  # an odd object is its text, not a crash
        f.write("\n")
    os.replace(tmp, path)


def write_result(result: dict[str, Any], path: str, plots: bool, plotter: Plotter | None = None,
                 prog: str = "tidal") -> list[str]:
    """Write ``result`` as JSON at ``path`` and, with ``plots``, its PNGs beside it (``plotter``,
    default the load test's plots); returns the PNG paths. A failing plot never loses the data."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    written: list[str] = []
    if plots:
        if plotter is None:
            from tidal.common.plots import write_plots as plotter
        try:
            written = plotter(result, path)
        except Exception as e:  # noqa: BLE001 - a plot must never lose the measurements
            print(f"{prog}: warning: plots failed: {e}", file=sys.stderr)
    result["plots"] = written
    write_json(result, path)
    return written


def run_command(prog: str, work: Callable[[], T], done: Callable[[T], int],
                errors: tuple[type[Exception], ...] = ()) -> int:
    """A command's exit code: ``done(work())``; a bad-input error (one of ``errors``) or an I/O
    error is one line naming it on stderr and exit code 2, an interrupt is 130."""
    try:
        result = work()
    except errors as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{prog}: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return done(result)


def command_line(prog: str, argv: list[str] | None = None) -> str:
    """``prog`` plus the arguments after its last word in ``argv`` (default ``sys.argv``), quoted:
    ``command_line("tidal bench serve")`` is the command a reader can paste to rerun."""
    argv = sys.argv[1:] if argv is None else argv
    last = prog.split()[-1]
    tail = argv[argv.index(last) + 1:] if last in argv else argv
    return shlex.join([*prog.split(), *tail])


def run_stamp() -> dict[str, Any]:
    """When a result was measured and by which tidal: ``{"date": ISO UTC, "tidal": {"version", "commit",
    "dirty"}}`` (commit and dirty only in a git checkout), stamped on the results the performance page
    reads (``tidal bench report``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        info: dict[str, Any] = {"version": version("tidal")}
    except PackageNotFoundError:  # run from a source tree that was never installed
        info = {"version": None}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tidal package
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
        info.update(commit=commit, dirty=bool(status.strip()))
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout (an installed wheel), or no git
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "tidal": info}


def write_figures(path: str, benchmark: str, title: str, prog: str, figures: list[list[Any]], notes: str,
                  raw: Any) -> dict[str, Any]:
    """A benchmark's record of named figures (``[name, value]`` rows; ``tidal bench report`` renders it):
    the command that ran it (``prog`` plus its arguments), this machine, the date and commit; written
    to ``path`` and printed."""
    from tidal.common.machine import describe, machine_info

    record = {"benchmark": benchmark, "title": title, "command": command_line(prog), "machine": machine_info(),
              "figures": figures, **run_stamp(), "notes": notes, "raw": raw}
    write_json(record, path)
    print(f"\nmachine: {describe(record['machine'])}")
    for name, value in figures:
        print(f"  {name}: {value}")
    print(f"wrote {path}")
    return record


def load_eq1(path: str) -> tuple[float, float, float]:
    """(alpha, beta, gamma) of the profile at ``path`` (written by ``tidal profile``); ValueError
    (one line) when the file is not one or has no Eq. 1 fit."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the profile {path}: {e}") from None
    eq1 = data.get("eq1") if isinstance(data, dict) else None
    if not isinstance(eq1, dict) or not all(isinstance(eq1.get(k), (int, float)) for k in ("alpha", "beta", "gamma")):
        raise ValueError(f"{path} has no Eq. 1 coefficients (written by an older `tidal profile`?)")
    return float(eq1["alpha"]), float(eq1["beta"]), float(eq1["gamma"])


__all__ = ["Plotter", "command_line", "jsonable", "load_eq1", "run_stamp", "write_json", "write_result", "write_figures"]
