"""``tidal bench offline``: offline throughput of tidal against its peers, in one run.

Every system serves the same random-token prompts (fixed seed) on the same model file, machine,
thread count and dtype, with greedy decoding and a forced output length (EOS ignored):

* ``tidal``    -- :class:`tidal.LLM`'s engine, stepped by hand so each step's time and batch
  composition are recorded;
* ``hf``       -- transformers' plain batched ``model.generate`` (left padding, pad = EOS, all
  requests of a workload in one padded batch);
* ``hf-cb``    -- transformers' own continuous batching, ``model.generate_batch`` with a persistent
  manager; defaults tuned on this CPU: page_size 64, max_batch_tokens 512, max_requests_per_batch 16
  (its CPU/sdpa path attends each query over the whole batch's KV under a mask, so large batches
  cost quadratically), num_blocks sized for the largest workload, no block sharing (the repeats
  send identical prompts, a prefix cache would skip their prefill);
* ``llamacpp`` -- llama-cpp-python, when importable: one request after another (it has no batch
  API), on the GGUF's own (possibly quantized) weights.

Workloads: ``a`` 64 requests with prompts uniform in [32, 512] tokens; ``b`` a batch of 32 prompts
of 128 tokens; ``c`` one 128-token prompt (decode latency). 128 output tokens each.

Each timed run comes after a short warm-up and excludes model loading; runs of the systems are
interleaved repeat by repeat (so drift of a shared machine hits all of them alike) and the median
is reported. Output tok/s = generated tokens / wall time. Decode tok/s: for tidal, the tokens of
its decode-only steps over their summed step time; for every system (tidal included, as a
like-for-like column) also an estimate ``(output - one token per request) / (wall - prefill wall)``
where the prefill wall is a separate run with one output token.

The report also measures the machine's matmul peak (a large square matmul and a decode-shaped
"skinny" one) and the fraction of it that tidal's batch-``b`` decode steps reach.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import logging
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

ALL_SYSTEMS = ("tidal", "hf", "hf-cb", "llamacpp")
PEERS = ("hf", "hf-cb", "llamacpp")
ALL_WORKLOADS = ("a", "b", "c")
DEFAULT_WORKLOADS = ("a", "b", "c")
DEFAULT_OUTPUT = os.path.join("results", "offline.json")

_DESCRIPTION = ("Offline throughput of tidal vs transformers (generate, generate_batch) and llama.cpp on the same "
                "model, machine, threads and dtype; greedy, forced output length, median of --repeats runs.")

SYSTEM_LABELS = {
    "tidal": "tidal (LLM engine)",
    "hf": "transformers generate (padded batch)",
    "hf-cb": "transformers generate_batch (continuous batching)",
    "llamacpp": "llama.cpp (llama-cpp-python, sequential)",
}


class SystemUnavailable(Exception):
    """A system cannot run here (not installed, wrong model format...); the message says why."""


# ============================================================================ workloads
@dataclass
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    output_len: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def expected_output_tokens(self) -> int:
        return self.num_requests * self.output_len

    def summary(self) -> dict[str, Any]:
        lens = self.prompt_lens
        return {
            "description": self.description,
            "num_requests": self.num_requests,
            "output_len": self.output_len,
            "prompt_tokens": sum(lens),
            "prompt_len_min": min(lens),
            "prompt_len_max": max(lens),
            "prompt_len_mean": sum(lens) / len(lens),
            "expected_output_tokens": self.expected_output_tokens,
        }


def _random_prompt(rng: random.Random, length: int, vocab_size: int, avoid: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        t = rng.randrange(vocab_size)
        if t not in avoid:
            out.append(t)
    return out


def make_workloads(names: Sequence[str], vocab_size: int, avoid_ids: Sequence[int] = (), seed: int = 0,
                   num_requests: int | None = None, output_len: int | None = None) -> list[Workload]:
    """The named workloads with deterministic random prompts (the same for every system).

    ``num_requests`` overrides the request count of ``a`` and ``b`` (``c`` is always one request);
    ``output_len`` overrides the 128 output tokens of all of them.
    """
    avoid = set(avoid_ids)
    out_len = 128 if output_len is None else output_len
    workloads = []
    for name in names:
        rng = random.Random(seed * 7919 + ord(name))
        if name == "a":
            n = 64 if num_requests is None else num_requests
            lens = [rng.randint(32, 512) for _ in range(n)]
            desc = f"{n} requests, prompts uniform in [32, 512] tokens, {out_len} output tokens each"
        elif name == "b":
            n = 32 if num_requests is None else num_requests
            lens = [128] * n
            desc = f"batch of {n}, prompts of 128 tokens, {out_len} output tokens each"
        elif name == "c":
            lens = [128]
            desc = f"batch of 1, a 128-token prompt, {out_len} output tokens (decode latency)"
        else:
            raise ValueError(f"unknown workload {name!r} (known: {', '.join(ALL_WORKLOADS)})")
        prompts = [_random_prompt(rng, n_tok, vocab_size, avoid) for n_tok in lens]
        workloads.append(Workload(name, desc, prompts, out_len))
    return workloads


# ============================================================================ system runners
@dataclass
class StepRecord:
    time_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    sum_context: int  # summed context length of the scheduled requests (after the step)


@dataclass
class RunOutput:
    wall_s: float
    token_ids: list[list[int]]
    steps: list[StepRecord] | None = None  # tidal only

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass
class BenchContext:
    """What every runner needs to know: the model, the dtype, threads and the workloads' extent."""

    model_path: str  # a .gguf file or an HF directory
    dtype: str  # "bfloat16" | "float32"
    num_threads: int
    arch: Any  # tidal.config.ModelArch
    eos_token_id: int
    max_requests: int  # largest batch over the selected workloads
    max_seq_len: int  # longest prompt + output over the selected workloads
    workloads: list[Workload]
    max_num_batched_tokens: int | None = None  # tidal's step token budget (None: tidal's default)
    hf_cb_max_batch_tokens: int = 512
    hf_cb_page_size: int = 64
    hf_cb_max_requests: int | None = 16  # None: every request of the largest workload at once

    @property
    def torch_dtype(self):
        import torch

        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.dtype]


class CpuMeter:
    """CPU time used by *other* processes while a run lasts, in cores (from /proc/stat and our rusage).

    The machine may be shared: a second busy process on a 2-core box can slow a 2-thread run many
    times over (threads wait at every barrier), so each timed run records how busy the rest was.
    """

    def __init__(self) -> None:
        self.t0 = self.busy0 = self.own0 = None

    @staticmethod
    def _busy_s() -> float | None:
        try:
            with open("/proc/stat") as f:
                parts = f.readline().split()
        except OSError:
            return None
        vals = [int(x) for x in parts[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        steal = vals[7] if len(vals) > 7 else 0
        guest = sum(vals[8:10]) if len(vals) > 9 else 0  # already counted in user/nice
        hz = os.sysconf("SC_CLK_TCK")
        return (sum(vals) - idle - steal - guest) / hz

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy_s(), self._own_s()

    def other_cores(self) -> float | None:
        """Mean number of cores the other processes kept busy since ``start``."""
        busy = self._busy_s()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.t0
        if wall <= 0:
            return None
        other = (busy - self.busy0) - (self._own_s() - self.own0)
        return max(0.0, other / wall)


class SystemRunner:
    name = ""
    notes = ""

    def __init__(self, ctx: BenchContext):
        self.ctx = ctx
        self.load_s: float | None = None

    def load(self) -> None:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        return {}

    def generate(self, prompts: list[list[int]], output_len: int) -> RunOutput:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TidalRunner(SystemRunner):
    name = "tidal"
    notes = "continuous batching, paged KV"

    def __init__(self, ctx: BenchContext):
        super().__init__(ctx)
        self.llm = None
        self._counter = 0

    def _kv_bytes(self) -> int:
        """Enough KV for the largest workload (whole blocks, +25%), at least 1 GiB."""
        import torch

        block = 16
        nbytes = torch.empty((), dtype=self.ctx.torch_dtype).element_size()
        per_token = self.ctx.arch.kv_bytes_per_token(nbytes)
        need = 0
        for w in self.ctx.workloads:
            tokens = sum(-(-(p + w.output_len) // block) * block for p in w.prompt_lens)
            need = max(need, tokens * per_token)
        return max(1024**3, int(need * 1.25))

    def load(self) -> None:
        from tidal import LLM

        self.kwargs = dict(
            dtype=self.ctx.dtype, device="cpu", max_num_seqs=max(64, self.ctx.max_requests),
            max_num_batched_tokens=self.ctx.max_num_batched_tokens, kv_cache_memory=self._kv_bytes(),
            num_threads=self.ctx.num_threads)
        self.llm = LLM(model=self.ctx.model_path, **self.kwargs)

    def settings(self) -> dict[str, Any]:
        sc = self.llm.engine.config.scheduler
        cc = self.llm.engine.config.cache
        return {"dtype": self.ctx.dtype, "max_num_seqs": sc.max_num_seqs,
                "max_num_batched_tokens": sc.max_num_batched_tokens, "kv_cache_memory": cc.kv_cache_memory,
                "num_kv_blocks": self.llm.engine.kv_manager.num_blocks, "block_size": cc.block_size,
                "batching": sc.batching, "num_threads": self.ctx.num_threads}

    def generate(self, prompts: list[list[int]], output_len: int) -> RunOutput:
        from tidal import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        steps: list[StepRecord] = []
        done: dict[str, list[int]] = {}
        rids = []
        t0 = time.perf_counter()
        try:
            for p in prompts:
                self._counter += 1
                rid = f"bench-{self._counter}"
                engine.add_request(rid, None, params, prompt_token_ids=p)
                rids.append(rid)
            while engine.has_unfinished_requests():
                outs = engine.step()
                res = engine.last_result
                comp = res.composition
                steps.append(StepRecord(res.step_time_s, comp.num_prefill_tokens, comp.num_decode_seqs,
                                        sum(comp.context_lens)))
                for o in outs:
                    if o.finished:
                        done[o.request_id] = list(o.outputs[0].token_ids)
        except BaseException:
            engine.abort_request(rids)
            raise
        wall = time.perf_counter() - t0
        return RunOutput(wall, [done[r] for r in rids], steps)

    def close(self) -> None:
        self.llm = None


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' info/warning logs and progress bars (loading, CB manager)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    cb_level = cb_log.level
    cb_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
        cb_log.setLevel(cb_level)


def load_hf_model(model_path: str, torch_dtype):
    """``AutoModelForCausalLM`` from a GGUF file (dequantized by transformers) or an HF directory."""
    from transformers import AutoModelForCausalLM

    # (the GGUF dequantization progress bar is a bare tqdm on stderr: keep it out of the report)
    with _quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
        if os.path.isfile(model_path):
            d, name = os.path.split(model_path)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    model.eval()
    # EOS must neither stop nor be masked (tidal's ignore_eos): no EOS in the model's defaults either,
    # else generate() fills it back in. The forced length comes from min/max_new_tokens.
    model.generation_config.eos_token_id = None
    return model


class HFRunner(SystemRunner):
    name = "hf"
    notes = "one left-padded static batch"

    def load(self) -> None:
        self.model = load_hf_model(self.ctx.model_path, self.ctx.torch_dtype)

    def settings(self) -> dict[str, Any]:
        return {"dtype": self.ctx.dtype, "attn_implementation": self.model.config._attn_implementation,
                "padding": "left", "pad_token_id": self.ctx.eos_token_id, "do_sample": False,
                "min_new_tokens": "= max_new_tokens", "eos": "disabled (never stops, never masked)"}

    def generate(self, prompts: list[list[int]], output_len: int) -> RunOutput:
        import torch
        from transformers import GenerationConfig

        pad = self.ctx.eos_token_id
        gen_cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                   pad_token_id=pad, eos_token_id=None)
        t0 = time.perf_counter()
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        with torch.inference_mode(), _quiet_transformers():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
        tokens = out[:, width:].tolist()
        wall = time.perf_counter() - t0
        return RunOutput(wall, tokens)

    def close(self) -> None:
        self.model = None


class HFCBRunner(SystemRunner):
    name = "hf-cb"
    notes = "transformers continuous batching (paged, sdpa on CPU)"

    def load(self) -> None:
        from transformers.generation import ContinuousBatchingConfig

        self.model = load_hf_model(self.ctx.model_path, self.ctx.torch_dtype)
        page = self.ctx.hf_cb_page_size
        # room for the largest workload at once (whole pages per request), plus a margin
        need = max(sum(-(-(p + w.output_len) // page) for p in w.prompt_lens) for w in self.ctx.workloads)
        self.cb_kwargs = dict(
            page_size=page,
            num_blocks=int(need * 1.25) + 4,
            max_batch_tokens=self.ctx.hf_cb_max_batch_tokens,
            max_requests_per_batch=self.ctx.hf_cb_max_requests or max(64, self.ctx.max_requests),
            allow_block_sharing=False,  # no prefix cache: repeats send identical prompts
            use_async_batching=False,
            use_cuda_graph=False,
            scheduler_type="fifo",
        )
        self.cb_config = ContinuousBatchingConfig(**self.cb_kwargs)

    def settings(self) -> dict[str, Any]:
        return {"dtype": self.ctx.dtype, **self.cb_kwargs, "persistent_manager": True,
                "attn_implementation": self.model.config._attn_implementation, "do_sample": False,
                "eos": "disabled (eos_token_id=-1)"}

    def generate(self, prompts: list[list[int]], output_len: int) -> RunOutput:
        from transformers import GenerationConfig

        gen_cfg = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                                   pad_token_id=self.ctx.eos_token_id)
        t0 = time.perf_counter()
        # (no inference_mode here: the manager's thread updates its tensors in place outside of it)
        with _quiet_transformers():
            res = self.model.generate_batch(inputs=[list(p) for p in prompts], generation_config=gen_cfg,
                                            continuous_batching_config=self.cb_config,
                                            persistent_manager=True, progress_bar=False)
        wall = time.perf_counter() - t0
        outs = list(res.values())
        errors = [o.error for o in outs if getattr(o, "error", None)]
        if len(outs) != len(prompts) or errors:
            # generate_batch logs its exceptions and returns what finished: make that a failure
            why = errors[0] if errors else f"{len(outs)} of {len(prompts)} requests came back"
            raise RuntimeError(f"generate_batch failed: {why}")
        return RunOutput(wall, [list(o.generated_tokens) for o in outs])

    def close(self) -> None:
        if getattr(self, "model", None) is not None:
            with contextlib.suppress(Exception), _quiet_transformers():
                self.model.destroy_cached_continuous_batching_manager()
        self.model = None


class LlamaCppRunner(SystemRunner):
    name = "llamacpp"
    notes = "requests run one after another (no batch API); GGUF's own weights"

    def load(self) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise SystemUnavailable("llama_cpp (llama-cpp-python) is not installed")
        if not (os.path.isfile(self.ctx.model_path) and self.ctx.model_path.lower().endswith(".gguf")):
            raise SystemUnavailable("llama.cpp needs a .gguf model file")
        import llama_cpp

        self.n_ctx = max(512, 64 * -(-(self.ctx.max_seq_len + 8) // 64))
        self.n_batch = min(512, self.n_ctx)
        self.version = getattr(llama_cpp, "__version__", "?")
        self.llm = llama_cpp.Llama(model_path=self.ctx.model_path, n_ctx=self.n_ctx, n_batch=self.n_batch,
                                   n_ubatch=self.n_batch, n_threads=self.ctx.num_threads,
                                   n_threads_batch=self.ctx.num_threads, logits_all=False, verbose=False)

    def settings(self) -> dict[str, Any]:
        return {"llama_cpp_version": self.version, "n_ctx": self.n_ctx, "n_batch": self.n_batch,
                "n_ubatch": self.n_batch, "n_threads": self.ctx.num_threads, "temp": 0.0,
                "weights": "as stored in the GGUF (not --dtype)", "batching": "none: one request at a time",
                "eos": "ignored (Llama.generate never stops by itself; cut at the output length)"}

    def _one(self, prompt: list[int], output_len: int) -> list[int]:
        llm = self.llm
        llm.reset()  # no prefix reuse from the previous request
        toks: list[int] = []
        # Llama.generate yields sampled tokens forever (EOS included); we stop at the output length, so
        # EOS is ignored exactly as tidal's ignore_eos does. temp=0 is greedy.
        for tok in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(tok))
            if len(toks) >= output_len:
                break
        return toks

    def generate(self, prompts: list[list[int]], output_len: int) -> RunOutput:
        t0 = time.perf_counter()
        tokens = [self._one(list(p), output_len) for p in prompts]
        return RunOutput(time.perf_counter() - t0, tokens)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None and hasattr(llm, "close"):
            with contextlib.suppress(Exception):
                llm.close()
        self.llm = None


RUNNERS: dict[str, type[SystemRunner]] = {
    "tidal": TidalRunner, "hf": HFRunner, "hf-cb": HFCBRunner, "llamacpp": LlamaCppRunner,
}


def installed_systems() -> list[str]:
    """The systems whose packages are importable here (tidal always)."""
    out = ["tidal"]
    if importlib.util.find_spec("transformers") is not None:
        out += ["hf", "hf-cb"]
    if importlib.util.find_spec("llama_cpp") is not None:
        out.append("llamacpp")
    return out


# ============================================================================ machine and peak
def machine_info(num_threads: int, dtype: str) -> dict[str, Any]:
    import torch

    cpu = ""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    cpu = cpu or platform.processor() or "unknown"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    info: dict[str, Any] = {
        "cores": cores,
        "cpu_model": cpu,
        "isa": [f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2"))],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "num_threads": num_threads,
        "dtype": dtype,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    for mod in ("transformers", "llama_cpp"):
        if importlib.util.find_spec(mod) is not None:
            try:
                info[mod] = getattr(__import__(mod), "__version__", "?")
            except Exception as e:  # noqa: BLE001 - a broken optional package must not stop the bench
                info[mod] = f"import failed: {e}"
    return info


def _time_op(fn: Callable[[], Any], min_time_s: float) -> float:
    """Seconds per call of ``fn``: enough calls to last ``min_time_s``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    iters = max(1, int(min_time_s / once))
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure_matmul_peak(hidden: int, dtype: str, square_n: int = 2048, skinny_m: int = 32,
                        samples: int = 5, min_time_s: float = 0.25) -> dict[str, Any]:
    """GFLOP/s of a square ``n x n @ n x n`` matmul and of a decode-shaped ``m x h @ h x 4h`` one."""
    import torch

    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"dtype": dtype, "samples": samples}
    with torch.inference_mode():
        a = torch.randn(square_n, square_n, generator=g).to(dt)
        b = torch.randn(square_n, square_n, generator=g).to(dt)
        flops = 2.0 * square_n ** 3
        ts = [_time_op(lambda: torch.mm(a, b), min_time_s) for _ in range(samples)]
        out["square"] = {"shape": [square_n, square_n, square_n], "gflops": flops / statistics.median(ts) / 1e9,
                         "gflops_samples": [flops / t / 1e9 for t in ts]}
        x = torch.randn(skinny_m, hidden, generator=g).to(dt)
        w = torch.randn(4 * hidden, hidden, generator=g).to(dt)  # an nn.Linear weight [out, in]
        flops = 2.0 * skinny_m * hidden * 4 * hidden
        ts = [_time_op(lambda: torch.nn.functional.linear(x, w), min_time_s) for _ in range(samples)]
        out["skinny"] = {"shape": [skinny_m, hidden, 4 * hidden], "gflops": flops / statistics.median(ts) / 1e9,
                         "gflops_samples": [flops / t / 1e9 for t in ts]}
    return out


def combine_peaks(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The peak of several measurements (before and after the runs): per shape, the best median.

    A neighbour that is busy during one measurement only lowers that one; a peak is what the
    machine can do, so the better of the two is kept (both are in ``runs``).
    """
    out: dict[str, Any] = {"dtype": runs[0]["dtype"], "samples": runs[0]["samples"], "runs": runs}
    for shape in ("square", "skinny"):
        best = max(runs, key=lambda r: r[shape]["gflops"])
        out[shape] = {**best[shape], "when": best["when"]}
    return out


def linear_params(arch) -> int:
    """Weights of every matmul of a forward pass: q/k/v/o, gate/up/down per layer, plus lm_head
    (computed even when tied to the embedding)."""
    h = arch.hidden_size
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch.intermediate_size
    return arch.num_layers * per_layer + arch.vocab_size * h


def decode_step_flops(arch, batch: int, sum_context: float) -> float:
    """2 * linear params * batch + attention (QK^T and PV: 4 * ctx * heads * head_dim per layer)."""
    attn = 4.0 * sum_context * arch.num_heads * arch.head_dim * arch.num_layers
    return 2.0 * linear_params(arch) * batch + attn


# ============================================================================ the benchmark
@dataclass
class BenchOptions:
    workloads: Sequence[str] = DEFAULT_WORKLOADS
    systems: Sequence[str] | None = None  # None: every installed one
    repeats: int = 3
    dtype: str = "bfloat16"
    model: str | None = None
    output: str | None = DEFAULT_OUTPUT
    plot: str | None = None  # None: next to the JSON; "" : no plot
    num_requests: int | None = None
    output_len: int | None = None
    num_threads: int | None = None
    seed: int = 0
    max_num_batched_tokens: int | None = None
    hf_cb_max_batch_tokens: int = 512
    hf_cb_page_size: int = 64
    hf_cb_max_requests: int | None = 16
    measure_peak: bool = True
    peak_square_n: int = 2048
    peak_samples: int = 5
    prefill_runs: bool = True
    command: str | None = None
    quiet: bool = False  # no progress lines


@dataclass
class BenchResult:
    report: dict[str, Any]
    generated: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)  # workload -> system -> ids
    text: str = ""


def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _tidal_decode(steps: list[StepRecord]) -> tuple[int, float]:
    """Tokens and seconds of the decode-only steps (no prefill token in the step)."""
    toks, secs = 0, 0.0
    for s in steps:
        if s.num_prefill_tokens == 0 and s.num_decode_seqs > 0:
            toks += s.num_decode_seqs
            secs += s.time_s
    return toks, secs


class _Progress:
    def __init__(self, total: int, quiet: bool):
        self.total, self.done, self.quiet = total, 0, quiet
        self.t0 = time.perf_counter()

    def line(self, msg: str, count: bool = True) -> None:
        if count:
            self.done += 1
        if not self.quiet:
            el = time.perf_counter() - self.t0
            head = f"[{self.done:3d}/{self.total}]" if count else "[   ...]"
            print(f"{head} {el:7.1f}s  {msg}", file=sys.stderr, flush=True)


def resolve_systems(requested: Sequence[str] | None) -> list[str]:
    if requested is None:
        return installed_systems()
    out = []
    for s in requested:
        s = s.strip()
        if not s:
            continue
        if s not in ALL_SYSTEMS:
            raise ValueError(f"unknown system {s!r} (known: {', '.join(ALL_SYSTEMS)})")
        if s not in out:
            out.append(s)
    if not out:
        raise ValueError("no system selected")
    return out


def run_benchmark(opts: BenchOptions) -> BenchResult:
    """Run every selected system on every selected workload; return the report (and write it)."""
    import torch

    from tidal.config import default_cpu_threads
    from tidal.engine.loader import load_checkpoint

    if opts.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32 on CPU, got {opts.dtype!r}")
    if opts.repeats < 1:
        raise ValueError("repeats must be >= 1")
    systems = resolve_systems(opts.systems)
    wl_names = []
    for w in opts.workloads:
        w = w.strip()
        if w not in ALL_WORKLOADS:
            raise ValueError(f"unknown workload {w!r} (known: {', '.join(ALL_WORKLOADS)})")
        if w and w not in wl_names:
            wl_names.append(w)
    threads = opts.num_threads or default_cpu_threads()
    torch.set_num_threads(threads)

    ckpt = load_checkpoint(opts.model)  # metadata only
    arch = ckpt.arch
    eos = arch.eos_token_ids[0] if arch.eos_token_ids else 0
    avoid = set(arch.eos_token_ids) | ({arch.bos_token_id} if arch.bos_token_id is not None else set())
    workloads = make_workloads(wl_names, arch.vocab_size, sorted(avoid), opts.seed, opts.num_requests,
                               opts.output_len)
    ctx = BenchContext(
        model_path=ckpt.path, dtype=opts.dtype, num_threads=threads, arch=arch, eos_token_id=eos,
        max_requests=max(w.num_requests for w in workloads),
        max_seq_len=max(max(w.prompt_lens) + w.output_len for w in workloads), workloads=workloads,
        max_num_batched_tokens=opts.max_num_batched_tokens, hf_cb_max_batch_tokens=opts.hf_cb_max_batch_tokens,
        hf_cb_page_size=opts.hf_cb_page_size, hf_cb_max_requests=opts.hf_cb_max_requests)

    command = opts.command or shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:])
    report: dict[str, Any] = {
        "command": command,
        "machine": machine_info(threads, opts.dtype),
        "model": {"path": ckpt.path, "format": ckpt.format, "name": arch.name, "architecture": arch.architecture,
                  "num_params": arch.num_params(), "linear_params": linear_params(arch),
                  "hidden_size": arch.hidden_size, "num_layers": arch.num_layers, "vocab_size": arch.vocab_size},
        "options": {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in asdict(opts).items()
                    if k not in ("command", "quiet")},
        "systems": {},
        "workloads": {},
    }
    result = BenchResult(report)
    b_decode: dict[str, Any] | None = None
    runs_per = opts.repeats * (2 if opts.prefill_runs else 1) + 1
    prog = _Progress(total=len(workloads) * len(systems) * runs_per, quiet=opts.quiet)

    # ---------------------------------------------------------------- machine peak
    peak_runs: list[dict[str, Any]] = []

    def measure_peak(when: str) -> None:
        prog.line(f"measuring matmul peak ({opts.dtype}, {when})", count=False)
        meter = CpuMeter()
        meter.start()
        pk = measure_matmul_peak(arch.hidden_size, opts.dtype, square_n=opts.peak_square_n,
                                 samples=opts.peak_samples)
        pk["when"], pk["other_cores"] = when, meter.other_cores()
        peak_runs.append(pk)

    if opts.measure_peak:
        measure_peak("before the runs")

    # ---------------------------------------------------------------- load
    runners: dict[str, SystemRunner] = {}
    for name in systems:
        runner = RUNNERS[name](ctx)
        prog.line(f"loading {name}", count=False)
        t0 = time.perf_counter()
        try:
            runner.load()
        except SystemUnavailable as e:
            report["systems"][name] = {"status": "skipped", "reason": str(e), "label": SYSTEM_LABELS[name]}
            prog.line(f"{name}: skipped ({e})", count=False)
            continue
        except Exception as e:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
            reason = f"load failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            report["systems"][name] = {"status": "skipped", "reason": reason, "label": SYSTEM_LABELS[name]}
            prog.line(f"{name}: skipped ({reason})", count=False)
            if name == "tidal":
                raise
            continue
        runner.load_s = time.perf_counter() - t0
        runners[name] = runner
        report["systems"][name] = {"status": "ok", "label": SYSTEM_LABELS[name], "notes": runner.notes,
                                   "load_s": runner.load_s, "settings": runner.settings()}
    torch.set_num_threads(threads)  # loaders may have touched it
    prog.total = len(workloads) * len(runners) * runs_per

    # ---------------------------------------------------------------- run
    try:
        for w in workloads:
            rows: dict[str, dict[str, Any]] = {}
            raw: dict[str, dict[str, Any]] = {}
            failed: dict[str, str] = {}
            generated: dict[str, list[list[int]]] = {}
            warm_prompts = w.prompts[: min(2, w.num_requests)]
            for name, runner in runners.items():
                try:
                    runner.generate(warm_prompts, min(4, w.output_len))
                    prog.line(f"workload {w.name}: {name} warm-up")
                except Exception as e:  # noqa: BLE001
                    failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    prog.line(f"workload {w.name}: {name} FAILED in warm-up: {failed[name]}")
                raw[name] = {"wall": [], "prefill": [], "tokens": [], "dec_toks": [], "dec_secs": [], "steps": [],
                             "other_cores": []}
            names = list(runners)
            for rep in range(opts.repeats):
                k = rep % len(names)  # rotate who goes first, so no system always follows the same one
                for name in names[k:] + names[:k]:
                    runner = runners[name]
                    if name in failed:
                        continue
                    r = raw[name]
                    meter = CpuMeter()
                    meter.start()
                    try:
                        out = runner.generate(w.prompts, w.output_len)
                    except Exception as e:  # noqa: BLE001
                        failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                        prog.line(f"workload {w.name} rep {rep + 1}: {name} FAILED: {failed[name]}")
                        continue
                    r["wall"].append(out.wall_s)
                    r["other_cores"].append(meter.other_cores())
                    r["tokens"].append(out.num_output_tokens)
                    generated[name] = out.token_ids
                    if out.steps is not None:
                        dt, ds = _tidal_decode(out.steps)
                        r["dec_toks"].append(dt)
                        r["dec_secs"].append(ds)
                        r["steps"].extend(out.steps)
                    oc = r["other_cores"][-1]
                    prog.line(f"workload {w.name} rep {rep + 1}/{opts.repeats}: {name:8s} "
                              f"{out.wall_s:8.2f} s  {out.num_output_tokens / out.wall_s:9.1f} out tok/s"
                              + (f"  (other processes: {oc:.2f} cores)" if oc is not None else ""))
                    if opts.prefill_runs:
                        try:
                            pre = runner.generate(w.prompts, 1)
                            r["prefill"].append(pre.wall_s)
                            prog.line(f"workload {w.name} rep {rep + 1}/{opts.repeats}: {name:8s} "
                                      f"prefill-only {pre.wall_s:8.2f} s")
                        except Exception as e:  # noqa: BLE001
                            prog.line(f"workload {w.name}: {name} prefill-only run failed: {e}")
            for name in runners:
                rows[name] = _summarize(name, w, raw[name], failed.get(name), generated)
            if w.name == "b" and "tidal" in raw:
                b_decode = _collect_b_decode(raw["tidal"]["steps"], w.num_requests, arch)
            report["workloads"][w.name] = {**w.summary(), "results": rows, "ratios": _ratios(rows)}
            result.generated[w.name] = generated
            if opts.output:  # a partial report after each workload: a long run killed midway keeps its results
                _write_json({**report, "partial": True}, opts.output)
    finally:
        for runner in runners.values():
            runner.close()
        gc.collect()

    if opts.measure_peak:
        measure_peak("after the runs")
        report["peak"] = combine_peaks(peak_runs)
    report["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    report["peak_fraction"] = _peak_fraction(report.get("peak"), b_decode, workloads)
    result.text = format_report(report)
    if opts.output:
        out_dir = os.path.dirname(os.path.abspath(opts.output))
        os.makedirs(out_dir, exist_ok=True)
        plot_path = opts.plot if opts.plot is not None else os.path.splitext(opts.output)[0] + ".png"
        if plot_path:
            _try_plot(report, plot_path)
        report["output"] = opts.output
        _write_json(report, opts.output)
    elif opts.plot:
        _try_plot(report, opts.plot)
    return result


def _write_json(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)


def _try_plot(report: dict[str, Any], path: str) -> None:
    try:
        write_plot(report, path)
        report["plot"] = path
    except Exception as e:  # noqa: BLE001 - a chart must not lose the measurements
        report["plot_error"] = f"{type(e).__name__}: {e}"
        print(f"tidal bench offline: could not write the plot {path}: {e}", file=sys.stderr)


def _summarize(name: str, w: Workload, r: dict[str, Any], failure: str | None,
               generated: dict[str, list[list[int]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"system": name}
    if not r["wall"]:
        row.update(status="failed", reason=failure or "no run completed")
        return row
    wall = _median(r["wall"])
    tokens = r["tokens"][-1]
    row.update(
        status="ok" if all(t == w.expected_output_tokens for t in r["tokens"]) else "wrong_length",
        wall_s=wall, wall_s_all=r["wall"], output_tokens=tokens, output_tokens_all=r["tokens"],
        expected_output_tokens=w.expected_output_tokens, output_tok_s=tokens / wall,
    )
    oc = [x for x in r["other_cores"] if x is not None]
    row["other_cores_all"] = oc
    row["other_cores_median"] = _median(oc)
    if failure:
        row["reason"] = f"failed in a later repeat: {failure}"
    decode_tokens = tokens - w.num_requests  # the first token of each request comes out of its prefill
    pre = _median(r["prefill"])
    if pre is not None:
        row["prefill_s"] = pre
        row["prefill_s_all"] = r["prefill"]
        row["decode_tok_s_est"] = decode_tokens / (wall - pre) if wall > pre and decode_tokens > 0 else None
    if r["dec_secs"]:
        rates = [t / s for t, s in zip(r["dec_toks"], r["dec_secs"], strict=True) if s > 0]
        row["decode_tok_s"] = _median(rates)
        row["decode_tok_s_all"] = rates
        row["decode_method"] = "decode-only engine steps: their tokens / their summed step time"
        steps = r["steps"]
        row["num_steps"] = len(steps) // max(1, len(r["wall"]))
        row["decode_step_s_median"] = _median([s.time_s for s in steps if s.num_prefill_tokens == 0])
    else:
        row["decode_tok_s"] = row.get("decode_tok_s_est")
        row["decode_method"] = "(output - 1 per request) / (wall - prefill-only wall)"
    if name != "tidal" and "tidal" in generated and name in generated:
        ref, mine = generated["tidal"], generated[name]
        same = sum(1 for a, b in zip(ref, mine, strict=False) if a == b)
        prefix = [_common_prefix(a, b) for a, b in zip(ref, mine, strict=False)]
        row["greedy_match_requests"] = same
        row["greedy_match_mean_prefix"] = sum(prefix) / len(prefix) if prefix else 0
    return row


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    t = rows.get("tidal")
    if not t or t.get("status") not in ("ok", "wrong_length"):
        return {}
    out: dict[str, Any] = {"output_tok_s": {}, "decode_tok_s_est": {}}
    best: tuple[str, float] | None = None
    for name, row in rows.items():
        if name == "tidal" or row.get("status") not in ("ok", "wrong_length"):
            continue
        out["output_tok_s"][name] = t["output_tok_s"] / row["output_tok_s"]
        if t.get("decode_tok_s_est") and row.get("decode_tok_s_est"):
            out["decode_tok_s_est"][name] = t["decode_tok_s_est"] / row["decode_tok_s_est"]
        if best is None or row["output_tok_s"] > best[1]:
            best = (name, row["output_tok_s"])
    if best is not None:
        out["best_peer"] = best[0]
        out["tidal_over_best_peer"] = t["output_tok_s"] / best[1]
    return out


def _peak_fraction(peak: dict[str, Any] | None, b_decode: dict[str, Any] | None,
                   workloads: list[Workload]) -> dict[str, Any]:
    """FLOP/s of tidal's decode steps at the batch of workload b, against the measured matmul peaks."""
    if peak is None:
        return {"status": "skipped", "reason": "matmul peak not measured"}
    wb = next((w for w in workloads if w.name == "b"), None)
    if wb is None:
        return {"status": "skipped", "reason": "workload b not run"}
    if b_decode is None:
        return {"status": "skipped", "reason": f"no tidal decode-only step at batch {wb.num_requests}"}
    return {"status": "ok", "batch": wb.num_requests, **b_decode,
            "flops_formula": "2 * linear params (incl. lm_head) * batch + 4 * context * heads * head_dim * layers "
                             "per sequence",
            "fraction_of_square_peak": b_decode["gflops"] / peak["square"]["gflops"],
            "fraction_of_skinny_peak": b_decode["gflops"] / peak["skinny"]["gflops"]}


def _collect_b_decode(steps: list[StepRecord], batch: int, arch) -> dict[str, Any] | None:
    dec = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_seqs == batch]
    if not dec:
        return None
    t = statistics.median(s.time_s for s in dec)
    mean_ctx = sum(s.sum_context for s in dec) / len(dec) / batch
    flops = decode_step_flops(arch, batch, mean_ctx * batch)
    return {"num_steps": len(dec), "median_step_s": t, "mean_context": mean_ctx, "flops_per_step": flops,
            "linear_flops_per_step": 2.0 * linear_params(arch) * batch, "gflops": flops / t / 1e9}


# ============================================================================ output
def _fmt(x: Any, spec: str = ".1f") -> str:
    if x is None:
        return "-"
    return format(x, spec)


def format_report(report: dict[str, Any]) -> str:
    lines = []
    m = report["machine"]
    lines.append(f"command: {report['command']}")
    lines.append(f"machine: {m['cores']} cores ({m['cpu_model']}), torch {m['torch']}, {m['num_threads']} threads, "
                 f"dtype {m['dtype']}" + (f", transformers {m['transformers']}" if "transformers" in m else "")
                 + (f", llama_cpp {m['llama_cpp']}" if "llama_cpp" in m else ""))
    if m.get("isa"):
        lines.append(f"         ISA: {' '.join(m['isa'])}; load average at start {m.get('loadavg_start')}")
    mod = report["model"]
    lines.append(f"model: {mod['path']} ({mod['architecture']}, {mod['num_params'] / 1e6:.1f}M params, "
                 f"{mod['linear_params'] / 1e6:.1f}M in matmuls incl. lm_head)")
    for name, s in report["systems"].items():
        if s["status"] != "ok":
            lines.append(f"  {name:8s} SKIPPED: {s['reason']}")
        else:
            st = ", ".join(f"{k}={v}" for k, v in s["settings"].items())
            lines.append(f"  {name:8s} loaded in {s['load_s']:.1f} s; {st}")
    for wname, w in report["workloads"].items():
        lines.append("")
        lines.append(f"workload {wname}: {w['description']} ({w['prompt_tokens']} prompt tokens, "
                     f"{w['expected_output_tokens']} output tokens)")
        hdr = (f"  {'system':9s}{'wall s':>9s}{'out tok/s':>11s}{'decode tok/s':>14s}{'decode est':>12s}"
               f"{'prefill s':>11s}{'tokens':>9s}{'=tidal':>9s}{'others':>8s}  notes")
        lines.append(hdr)
        for name, row in w["results"].items():
            if row["status"] == "failed":
                lines.append(f"  {name:9s} FAILED: {row['reason']}")
                continue
            match = "-"
            if "greedy_match_requests" in row:
                match = f"{row['greedy_match_requests']}/{w['num_requests']}"
            notes = report["systems"][name].get("notes", "")
            if row["status"] == "wrong_length":
                notes = f"WRONG LENGTH (expected {row['expected_output_tokens']}); " + notes
            if row.get("reason"):
                notes = row["reason"] + "; " + notes
            lines.append(f"  {name:9s}{_fmt(row['wall_s'], '.2f'):>9s}{_fmt(row['output_tok_s']):>11s}"
                         f"{_fmt(row.get('decode_tok_s')):>14s}{_fmt(row.get('decode_tok_s_est')):>12s}"
                         f"{_fmt(row.get('prefill_s'), '.2f'):>11s}{row['output_tokens']:>9d}{match:>9s}"
                         f"{_fmt(row.get('other_cores_median'), '.2f'):>8s}  {notes}")
    lines.append("")
    lines.append("columns: wall s = median wall time of a run; decode tok/s = tidal: its decode-only steps, peers: "
                 "= decode est; decode est = (output - 1/request) / (wall - prefill-only wall); =tidal = requests "
                 "whose greedy tokens equal tidal's; others = cores kept busy by other processes during the runs")
    busy = [row.get("other_cores_median") or 0.0 for w in report["workloads"].values()
            for row in w["results"].values()]
    if busy and max(busy) > 0.25:
        lines.append(f"WARNING: other processes used up to {max(busy):.2f} of {m['cores']} cores during the runs: "
                     "the timings are perturbed (with all cores in use, one busy neighbour can slow a run "
                     "several-fold)")
    lines.append("")
    lines.append("ratios, tidal / peer (output tok/s; decode est in brackets):")
    for wname, w in report["workloads"].items():
        r = w.get("ratios") or {}
        if not r.get("output_tok_s"):
            lines.append(f"  {wname}: - (no tidal row or no peer)")
            continue
        parts = []
        for peer, x in r["output_tok_s"].items():
            d = r["decode_tok_s_est"].get(peer)
            parts.append(f"tidal/{peer} {x:.2f}x" + (f" [{d:.2f}x]" if d else ""))
        parts.append(f"tidal/best peer ({r['best_peer']}) {r['tidal_over_best_peer']:.2f}x")
        lines.append(f"  {wname}: " + ";  ".join(parts))
    lines.append("")
    pk = report.get("peak")
    if pk:
        lines.append(f"matmul peak ({pk['dtype']}, {m['num_threads']} threads; median of {pk['samples']}, the better of "
                     f"{len(pk.get('runs', [])) or 1} measurements): square "
                     f"{'x'.join(map(str, pk['square']['shape']))} {pk['square']['gflops']:.1f} GFLOP/s; skinny "
                     f"{'x'.join(map(str, pk['skinny']['shape']))} (x @ W^T) {pk['skinny']['gflops']:.1f} GFLOP/s")
        for r in pk.get("runs", []):
            oc = r.get("other_cores")
            lines.append(f"  measured {r['when']}: square {r['square']['gflops']:.1f}, skinny "
                         f"{r['skinny']['gflops']:.1f} GFLOP/s"
                         + (f" (other processes: {oc:.2f} cores)" if oc is not None else ""))
    pf = report.get("peak_fraction", {})
    if pf.get("status") == "ok":
        lines.append(f"tidal decode step at batch {pf['batch']} (workload b): median {pf['median_step_s'] * 1e3:.2f} ms "
                     f"over {pf['num_steps']} steps, mean context {pf['mean_context']:.0f}, "
                     f"{pf['flops_per_step'] / 1e9:.2f} GFLOP/step -> {pf['gflops']:.1f} GFLOP/s = "
                     f"{100 * pf['fraction_of_square_peak']:.1f}% of the square-matmul peak, "
                     f"{100 * pf['fraction_of_skinny_peak']:.1f}% of the skinny-matmul peak (a step also runs "
                     f"the wide lm_head matmul, so it can beat the skinny shape)")
    else:
        lines.append(f"peak fraction: {pf.get('status', 'skipped')} ({pf.get('reason', '')})")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wnames = list(report["workloads"])
    systems = [s for s in ALL_SYSTEMS if any(
        report["workloads"][w]["results"].get(s, {}).get("output_tok_s") for w in wnames)]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(wnames) + 2), 4.5))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        vals = [report["workloads"][w]["results"].get(s, {}).get("output_tok_s") or 0.0 for w in wnames]
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(wnames))]
        bars = ax.bar(xs, vals, width, label=s)
        for b, v in zip(bars, vals, strict=True):
            if v:
                ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(wnames)))
    ax.set_xticklabels([f"{w}: {report['workloads'][w]['num_requests']} req" for w in wnames])
    ax.set_ylabel("output tokens / s")
    m = report["machine"]
    ax.set_title(f"offline throughput, {report['model'].get('name') or 'model'}, {m['dtype']}, "
                 f"{m['num_threads']} threads", fontsize=10)
    ax.legend()
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ============================================================================ command line
def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", type=_csv, default=list(DEFAULT_WORKLOADS),
                   help="comma-separated subset of a,b,c (default: a,b,c)")
    p.add_argument("--systems", type=_csv, default=None,
                   help=f"comma-separated subset of {','.join(ALL_SYSTEMS)} (default: every installed one)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system and workload; the median is reported")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights/activations dtype")
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON report path (default: results/offline.json)")
    p.add_argument("--plot", default=None, help="PNG chart path (default: next to the JSON; '' for none)")
    p.add_argument("--num-requests", type=int, default=None, help="override the request count of workloads a and b")
    p.add_argument("--output-len", type=int, default=None, help="override the 128 output tokens per request")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads for every system (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tidal's step token budget (default: tidal's own)")
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=512,
                   help="transformers generate_batch max_batch_tokens (default 512, tidal's step budget)")
    p.add_argument("--hf-cb-page-size", type=int, default=64, help="transformers generate_batch page_size")
    p.add_argument("--hf-cb-max-requests", type=int, default=16,
                   help="transformers generate_batch max_requests_per_batch (default 16: on CPU its sdpa path "
                        "attends every query to the whole batch's KV under a mask, so cost grows with the "
                        "square of the batch; 0 = the largest workload's batch)")
    p.add_argument("--no-peak", action="store_true", help="skip the matmul peak measurement")
    p.add_argument("--no-prefill-runs", action="store_true",
                   help="skip the prefill-only runs (no decode estimate for the peers)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        workloads=args.workloads, systems=args.systems, repeats=args.repeats, dtype=args.dtype, model=args.model,
        output=args.output or None, plot=args.plot, num_requests=args.num_requests, output_len=args.output_len,
        num_threads=args.num_threads, seed=args.seed, max_num_batched_tokens=args.max_num_batched_tokens,
        hf_cb_max_batch_tokens=args.hf_cb_max_batch_tokens, hf_cb_page_size=args.hf_cb_page_size,
        hf_cb_max_requests=args.hf_cb_max_requests,
        measure_peak=not args.no_peak, prefill_runs=not args.no_prefill_runs, quiet=args.quiet)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="offline throughput: tidal vs transformers and llama.cpp",
                       description=_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()  # a crash in a peer's native code (or its thread) leaves a traceback
    try:
        opts = options_from_args(args)
        result = run_benchmark(opts)
    except ValueError as e:
        print(f"tidal bench offline: error: {e}", file=sys.stderr)
        return 2
    print(result.text)
    if opts.output:
        print(f"\nwrote {opts.output}" + (f" and {result.report['plot']}" if result.report.get("plot") else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/offline_throughput.py ...`` == ``tidal bench offline ...``."""
    p = argparse.ArgumentParser(prog="offline_throughput", description=_DESCRIPTION)
    add_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    return run(args)


__all__ = [
    "BenchOptions", "BenchResult", "Workload", "add_arguments", "add_parser", "decode_step_flops",
    "linear_params", "main", "make_workloads", "measure_matmul_peak", "run", "run_benchmark",
]
