"""The command line: one clear line for bad input, real text for good input."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import warnings

import pytest

from tests.processes import POPEN_KW


class Tidal:
    """``python -m tidal.cli ARGS`` in a real interpreter, started now; ``result()`` waits for it."""

    def __init__(self, *args: str):
        self.out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in result()
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", *args], stdout=self.out, stderr=self.err,
                                     text=True, **POPEN_KW)

    def result(self, timeout: int = 300) -> subprocess.CompletedProcess:
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.proc.kill()  # (a no-op once it exited)
            self.proc.wait()
        streams = []
        for f in (self.out, self.err):
            f.seek(0)
            streams.append(f.read())
            f.close()
        return subprocess.CompletedProcess(self.proc.args, rc, *streams)


def _print_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def tidal_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``tidal.cli.main(args)`` in this process (no interpreter start-up), with what a fresh one shows:
    the CLI's own logging setup and every warning printed to stderr (pytest would capture both)."""
    from tidal.cli import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []  # so that main()'s logging.basicConfig installs its stderr handler
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()  # a fresh interpreter's filters, printing to stderr
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = _print_warning
            rc = main(list(args))
    finally:
        root.handlers, root.level = handlers, level
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["generate", "hi", "--kv-cache-memory", "lots"], "kv_cache_memory"),
    (["generate", "hi", "--max-num-seqs", "0"], "max_num_seqs"),
    (["generate", "hi", "--batching", "nope"], "unknown policy 'nope'"),
    (["serve", "--batching", "nope"], "unknown policy 'nope'"),
    (["serve", "--batching", "sla", "--tbt-slo-ms", "50", "--policy-arg", "sla.alpah=8"],
     "policy argument sla.alpah: unknown parameter of 'sla'"),
    (["serve", "--policy-arg", "sla.alpah=8"], "policy 'sla' is not in batching 'continuous'"),
    (["serve", "--batching", "memory", "--policy-arg", "memory.eps_m=2"], "memory.eps_m=2: input should be less"),
    (["serve", "--instances", "2", "--mode", "disaggregate", "--prefill-instances", "2"], "--prefill-instances"),
    (["serve", "--prefill-instances", "1"], "needs --mode disaggregate"),
    (["serve", "--instances", "2", "--prefill-batching", "bucket"], "--prefill-batching needs --mode disaggregate"),
    (["serve", "--instances", "2", "--mode", "disaggregate", "--prefill-instances", "1", "--prefill-batching", "nope"],
     "nope"),
    (["bench", "policies", "--policies", "continuous,bucket", "--policy-arg", "sla.alpha=4"],
     "no policy of --policies"),
    (["sim", "--batching", "sla"], "needs a decode-latency SLO"),
])
def test_bad_arguments_give_one_line(args, needle, tmp_path, capsys, reuse_smol_tokenizer):
    r = tidal_in_process(capsys, *args)  # the real process's exit code: test_garbage_model_file
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


GENERATE = ("generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
BAD_SHARED_FLAGS = [
    (["bench", "policies", "--max-num-seqs", "0"], "max_num_seqs"),
    (["bench", "policies", "--kv-cache-memory", "lots"], "kv_cache_memory"),
    (["sim", "--block-size", "12", "--workload", "fixed:8:8", "--num-requests", "2"], "block_size"),
    (["sim", "--max-num-seqs", "0", "--workload", "fixed:8:8", "--num-requests", "2"], "max_num_seqs"),
    (["profile", "--repeats", "0"], "--repeats"),
]


@pytest.fixture(scope="module", autouse=True)
def real_processes(request, tmp_path_factory):
    """The commands this module runs in a real interpreter (its start-up, exit code and stderr as a
    user sees them), all started together when the module begins: each is an independent
    interpreter start-up, mostly on one core, so they overlap each other and the in-process tests.
    Only those of the selected tests are started; each test waits for its own."""
    selected = [item for item in request.session.items if item.module is request.module]
    d = tmp_path_factory.mktemp("cli")
    runs: dict = {}  # key: (a path the test checks, the command)
    for item in selected:
        if item.originalname == "test_garbage_model_file":
            bad = d / "bad.gguf"
            bad.write_text("this is not a gguf file")
            runs["garbage"] = (bad, Tidal("generate", "hi", "--model", str(bad)))
        elif item.originalname == "test_generate_prints_greedy_completion":
            runs["generate"] = (None, Tidal(*GENERATE))
        elif item.originalname == "test_bad_shared_flags_give_one_line":
            args = item.callspec.params["args"]
            out = d / item.callspec.id / "x.json"
            out.parent.mkdir()
            runs[tuple(args)] = (out, Tidal(*args, "--output", str(out)))
    yield runs
    for _, run in runs.values():
        if run.proc.poll() is None:  # its test did not run to the end
            run.proc.kill()
            run.proc.wait()


def test_garbage_model_file(real_processes):
    bad, run = real_processes["garbage"]
    r = run.result()
    assert r.returncode == 2 and str(bad) in r.stderr and "Traceback" not in r.stderr


def test_generate_prints_greedy_completion(make_engine, real_processes):
    from tidal import LLM, SamplingParams

    r = real_processes["generate"][1].result()
    assert r.returncode == 0, r.stderr
    ref = LLM.from_engine(make_engine()).generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert r.stdout.rstrip("\n") == ref[0].outputs[0].text.rstrip("\n")


# ============================================================================ shared flags
def parse(*argv: str):
    from tidal.cli import build_parser

    return build_parser().parse_args(list(argv))


SCHED_ARGV = ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--long-prefill-token-threshold", "64",
              "--preemption-mode", "swap", "--batching", "bucket+memory+sla", "--tbt-slo-ms", "40",
              "--policy-arg", "bucket.theta=0.3", "--policy-arg", "sla.alpha=4"]
ENGINE_ARGV = ["--model", "m.gguf", "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
               "--kv-cache-memory", "64MiB", "--gpu-memory-utilization", "0.5", "--block-size", "32",
               "--swap-space", "2GiB", "--num-threads", "1", "--seed", "7", "--quantization", "none"]


def test_scheduler_flags_parse_to_the_same_config_in_every_command():
    from tidal.common import flags as F
    from tidal.config import SchedulerConfig
    from tidal.sim.run import cluster_spec

    want = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, long_prefill_token_threshold=64,
                           preemption_mode="swap", batching="bucket+memory+sla", tbt_slo_ms=40.0,
                           policy_args={"bucket.theta": "0.3", "sla.alpha": "4"})
    got = {
        "serve": F.engine_config(parse("serve", *SCHED_ARGV)).scheduler,
        "generate": F.engine_config(parse("generate", "hi", *SCHED_ARGV)).scheduler,
        "sim": cluster_spec(parse("sim", *SCHED_ARGV)).scheduler,
        "sim-accuracy": F.engine_config(parse("bench", "sim-accuracy", *SCHED_ARGV)).scheduler,
    }
    # bench policies runs every policy of --policies: the rest of the scheduler flags are the shared ones
    no_policy = SCHED_ARGV[:SCHED_ARGV.index("--batching")] + SCHED_ARGV[SCHED_ARGV.index("--policy-arg"):]
    got["bench policies"] = F.engine_config(parse("bench", "policies", *no_policy), batching="bucket+memory+sla",
                                            tbt_slo_ms=40.0).scheduler
    assert got == dict.fromkeys(got, want)
    # unset flags leave the config's own defaults, in the engine and in the simulator alike
    assert F.engine_config(parse("serve")).scheduler == cluster_spec(parse("sim")).scheduler == SchedulerConfig()
    assert F.engine_config(parse("serve", "--max-queued-requests", "3")).scheduler.max_queued_requests == 3


def test_engine_flags_parse_the_same_in_generate_serve_and_profile():
    from tidal.common import flags as F
    from tidal.config import EngineConfig

    gen, srv, prof = (F.engine_kwargs(parse(*cmd, *ENGINE_ARGV)) for cmd in (["generate", "hi"], ["serve"],
                                                                           ["profile"]))
    assert gen == srv == prof
    cfg = EngineConfig.from_kwargs(**gen)
    assert (cfg.model.model, cfg.model.dtype, cfg.model.device, cfg.model.max_model_len, cfg.model.seed,
            cfg.model.num_threads, cfg.model.quantization) == ("m.gguf", "float32", "cpu", 256, 7, 1, "none")
    assert (cfg.cache.kv_cache_memory, cfg.cache.gpu_memory_utilization, cfg.cache.block_size,
            cfg.cache.swap_space) == (64 * 2**20, 0.5, 32, 2 * 2**30)
    # --threads stays an alias of --num-threads in tidal profile; profile's own KV default
    assert parse("profile", "--threads", "3").num_threads == 3
    assert F.engine_kwargs(parse("profile"))["kv_cache_memory"] == "2GiB"
    # unset engine flags are left out, so EngineConfig's defaults apply
    assert F.engine_kwargs(parse("serve")) == {"model": None, "dtype": "auto", "device": "auto"}


def test_engine_seed_is_not_the_workload_seed():
    """bench policies takes the workload's --seed; it must not become the engine's seed."""
    from tidal.common import flags as F

    args = parse("bench", "policies", "--seed", "5")
    assert args.seed == 5 and "seed" not in F.engine_kwargs(args)
    assert F.engine_kwargs(parse("serve", "--seed", "5"))["seed"] == 5


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["serve"], ["profile"], ["sim"], ["bench", "offline"],
                                 ["bench", "policies"], ["bench", "sim-accuracy"]])
def test_dtype_defaults_to_auto_everywhere(cmd):
    assert parse(*cmd).dtype == "auto"


@pytest.mark.parametrize("args, needle", BAD_SHARED_FLAGS)
def test_bad_shared_flags_give_one_line(args, needle, real_processes):
    out, run = real_processes[tuple(args)]  # tidal ARGS --output OUT
    r = run.result()
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
