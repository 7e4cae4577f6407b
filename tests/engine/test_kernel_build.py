"""A start never hangs on tidal's kernel build (engine/native.py): one process builds under a flock
that dies with it; another start waits, says for whom, and gives up after TIDAL_START_WAIT_S; what a
stopped build leaves (torch's baton, half-built objects) is removed by the next one.

The first tests need no build. The others are one story with real builds in an extensions folder of
their own (one build and a half, a minute or two of CPU each): a start killed (its whole process
group, SIGKILL) during its build, a second start beside it that waited, then served; and a stale baton."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.processes import die_with_parent
from tidal.common import locks
from tidal.common.locks import exclusive
from tidal.engine import native

ROOT = Path(__file__).resolve().parents[2]


def _build_dir(ext: Path) -> Path:
    return ext / native.build_name()  # torch's folder when TORCH_EXTENSIONS_DIR names one


def test_a_build_elsewhere_that_outlasts_the_wait_leaves_torchs_kernels(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TIDAL_START_WAIT_S", "0.5")
    monkeypatch.delenv("TIDAL_NO_NATIVE", raising=False)
    monkeypatch.setattr(locks, "QUIET_S", 0.0)
    monkeypatch.setattr(native, "_state", {})  # this process has not loaded them yet
    lock = f"{_build_dir(tmp_path)}.tidal.lock"
    with exclusive(lock, "building tidal's kernels"):  # "another process" building (this one's pid)
        why = native.load()
    pid = os.getpid()
    assert why == (f"tidal's kernels were still being built elsewhere (pid {pid} has been building tidal's "
                   f"kernels for more than 0.5 s (lock {lock}))")
    assert not native.available(torch.device("cpu"), torch.float32)  # the engine runs torch's kernels
    err = capsys.readouterr().err.splitlines()
    assert err == [f"engine: waiting for pid {pid}, which is building tidal's kernels (lock {lock}; at most 0.5 s) ...",
                   f"engine: warning: pid {pid} has been building tidal's kernels for more than 0.5 s (lock {lock}); "
                   "this start runs torch's kernels (TIDAL_START_WAIT_S sets the wait)"]
    assert not any(_build_dir(tmp_path).iterdir())  # nothing was built


def test_what_a_stopped_build_left_is_removed(tmp_path, capsys):
    name = "tidal_kernels_x"
    d = tmp_path / name
    d.mkdir()
    for f in ("lock", "build.ninja", "qmatmul.o", f"{name}.so"):  # a partial library: its link was cut
        (d / f).write_bytes(b"")
    (d / ".ninja_log").write_text("# ninja log v7\n0\t10\t1\tqmatmul.o\tabc\n")
    native._clear_interrupted(d, name)
    assert d.is_dir() and not any(d.iterdir())
    assert capsys.readouterr().err.splitlines() == [
        f"engine: removed the build lock {d / 'lock'}, left by a kernel build that was stopped",
        f"engine: removed the half-built kernels in {d}"]
    # a finished build (ninja logged its link) keeps all but the baton
    (d / f"{name}.so").write_bytes(b"\x7fELF")
    (d / ".ninja_log").write_text(f"# ninja log v7\n0\t10\t1\tqmatmul.o\tabc\n10\t12\t2\t{name}.so\tdef\n")
    (d / "lock").write_bytes(b"")
    native._clear_interrupted(d, name)
    assert sorted(p.name for p in d.iterdir()) == [".ninja_log", f"{name}.so"]
    assert capsys.readouterr().err.splitlines() == [
        f"engine: removed the build lock {d / 'lock'}, left by a kernel build that was stopped"]


# ------------------------------------------------------------------------------ real builds
def _can_build() -> str | None:
    if os.environ.get("TIDAL_NO_NATIVE"):
        return "TIDAL_NO_NATIVE is set"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler"
    return None


PROMPT = "The capital of France is"
READY = re.compile(r"serving \S+ on (http://[\d.]+:\d+)")
LIMIT_S = 900  # bounds on waits for a line, never timings: a build here takes 1-4 minutes


class Start:
    """``python -m tidal.cli ARGS`` in its own process group (as a terminal runs it), stdout and stderr
    into one log file, with its own empty kernel folder; killed with its group on the way out."""

    def __init__(self, tmp: Path, name: str, env: dict[str, str], *args: str):
        self.log = tmp / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", *args], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline:
            m = re.search(pattern, self.output())
            if m:
                return m
            if self.proc.poll() is not None:
                pytest.fail(f"exited with {self.proc.returncode} before {pattern!r}:\n{self.output()[-3000:]}")
            time.sleep(0.2)
        pytest.fail(f"no {pattern!r} within {LIMIT_S} s:\n{self.output()[-3000:]}")

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the start, ninja and the compilers under it
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """Start A (``tidal generate``) in a fresh extensions folder; once it is building, start B (``tidal
    serve``) beside it and wait until B says it waits for A; then SIGKILL A's process group (Ctrl-C
    or a closed terminal would stop it alike) and let B build and serve. Yields B (ready, serving)
    and the folder; B is stopped by its pid at the end."""
    why = _can_build()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("kernel-build")
    ext = tmp / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TIDAL_WEIGHT_CACHE_MB", None)
    env.pop("TIDAL_START_WAIT_S", None)
    # A builds one object at a time (MAX_JOBS, torch's ninja -j): still building when B gets to its build
    a = Start(tmp, "a", {**env, "MAX_JOBS": "1"}, "generate", PROMPT, "--max-tokens", "8", "--dtype", "float32")
    b = None
    try:
        a.wait_for(r"engine: building tidal's CPU kernels \(")
        b = Start(tmp, "b", env, "serve", "--port", "0", "--dtype", "float32")
        b.wait_for(r"engine: waiting for pid \d+, which is building tidal's kernels")
        a_alive = a.proc.poll() is None
        a.kill_group()
        url = b.wait_for(READY.pattern).group(1)
        yield {"a": a, "a_alive": a_alive, "b": b, "url": url, "ext": ext, "env": env}
    finally:
        a.kill_group()
        if b is not None and b.proc.poll() is None:
            b.proc.send_signal(signal.SIGTERM)
            try:
                b.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                b.kill_group()


@pytest.mark.slow
@pytest.mark.timeout(2 * LIMIT_S)
def test_a_start_beside_a_live_build_waits_and_says_for_whom(story):
    a, b = story["a"], story["b"]
    assert story["a_alive"]  # A was still building when B said it waited
    assert f"engine: waiting for pid {a.proc.pid}, which is building tidal's kernels" in b.output()


@pytest.mark.slow
@pytest.mark.timeout(2 * LIMIT_S)
def test_a_build_killed_halfway_does_not_block_the_next_start(story, make_engine):
    """B, started beside A and left alone once A's process group is killed mid-build, clears what A
    left (torch's baton, half-built objects), builds, and serves the same completion as the engine
    in this process."""
    from tidal import LLM, SamplingParams

    a, b, ext = story["a"], story["b"], story["ext"]
    assert a.proc.returncode == -signal.SIGKILL and "kernels built" not in a.output()
    out = b.output()
    build = _build_dir(ext)
    lines = [ln for ln in out.splitlines() if ln.startswith("engine: ")]
    steps = [next(i for i, ln in enumerate(lines) if ln.startswith(p)) for p in (
        "engine: waiting for pid", "engine: done waiting", f"engine: removed the build lock {build / 'lock'}",
        f"engine: removed the half-built kernels in {build}", "engine: building tidal's CPU kernels",
        "engine: kernels built in ", "engine: float32, weights: ")]
    assert steps == sorted(steps), lines
    assert not (build / "lock").exists() and native._complete(build, build.name)
    r = httpx.post(f"{story['url']}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                   timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    ref = LLM.from_engine(make_engine()).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    assert r.json()["choices"][0]["text"] == ref[0].outputs[0].text


@pytest.mark.slow
@pytest.mark.timeout(2 * LIMIT_S)
def test_a_stale_baton_is_cleared(story):
    """torch's baton with no build behind it (an empty ``lock`` in the finished build folder: what a
    build killed between its link and its clean-up leaves) no longer stops a start: it is removed,
    and the library loads without a build."""
    build = _build_dir(story["ext"])
    (build / "lock").write_bytes(b"")
    code = "from tidal.engine import native; print(native.load())"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=story["env"], capture_output=True, text=True,
                       timeout=LIMIT_S, preexec_fn=die_with_parent)
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
    assert r.stderr.splitlines() == [
        f"engine: removed the build lock {build / 'lock'}, left by a kernel build that was stopped"], r.stderr
    assert not (build / "lock").exists()
