"""Systems, workloads and machine measurements of ``tidal bench offline``.

One runner per system (tidal, transformers ``generate``, transformers ``generate_batch``,
llama.cpp), the workloads they share, and the matmul peak the report compares against.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ALL_SYSTEMS = ("tidal", "tidal-float", "tidal-compile", "hf", "hf-cb", "llamacpp")
PEERS = ("hf", "hf-cb", "llamacpp")
ALL_WORKLOADS = ("a", "b", "c")
DEFAULT_WORKLOADS = ("a", "b", "c")
DEFAULT_OUTPUT = os.path.join("results", "offline.json")

_DESCRIPTION = ("Offline throughput of tidal vs transformers (generate, generate_batch) and llama.cpp on the same "
                "model, machine, threads and dtype; greedy, forced output length, median of --repeats runs.")

SYSTEM_LABELS = {
    "tidal": "tidal (LLM engine)",
    "tidal-float": "tidal with dequantized float weights (--quantization none)",
    "tidal-compile": "tidal with its decode steps compiled (--compile)",
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
    max_num_batched_tokens: int | None = None  # tidal's step token budget (None: the offline LLM's default)
    hf_cb_max_batch_tokens: int = 512
    hf_cb_page_size: int = 64
    hf_cb_max_requests: int | None = 16  # None: every request of the largest workload at once
    device: str = "cpu"  # tidal's and transformers' device (llama.cpp is a CPU peer)
    async_scheduling: bool = False  # tidal's --async-scheduling

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
    quantization = "auto"
    compile = False

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
            dtype=self.ctx.dtype, device=self.ctx.device, max_num_seqs=max(64, self.ctx.max_requests),
            max_num_batched_tokens=self.ctx.max_num_batched_tokens, kv_cache_memory=self._kv_bytes(),
            num_threads=self.ctx.num_threads, quantization=self.quantization, compile=self.compile,
            async_scheduling=self.ctx.async_scheduling)
        self.llm = LLM(model=self.ctx.model_path, **self.kwargs)

    def settings(self) -> dict[str, Any]:
        from tidal.engine.quant import describe_quantization

        sc = self.llm.engine.config.scheduler
        cc = self.llm.engine.config.cache
        return {"dtype": self.ctx.dtype, "max_num_seqs": sc.max_num_seqs,
                "max_num_batched_tokens": sc.max_num_batched_tokens, "kv_cache_memory": cc.kv_cache_memory,
                "num_kv_blocks": self.llm.engine.kv_manager.num_blocks, "block_size": cc.block_size,
                "batching": sc.batching, "num_threads": self.ctx.num_threads,
                "weights": describe_quantization(self.llm.engine.quantization), "compile": self.compile,
                "async_scheduling": self.ctx.async_scheduling}

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
                engine.add_request(rid, None, params, prompt_token_ids=p, final_only=True)  # as LLM.generate does
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


def load_hf_model(model_path: str, torch_dtype, device: str = "cpu"):
    """``AutoModelForCausalLM`` from a GGUF file (dequantized by transformers) or an HF directory."""
    from transformers import AutoModelForCausalLM

    # (the GGUF dequantization progress bar is a bare tqdm on stderr: keep it out of the report)
    with _quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
        if os.path.isfile(model_path):
            d, name = os.path.split(model_path)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    model.to(device).eval()
    # EOS must neither stop nor be masked (tidal's ignore_eos): no EOS in the model's defaults either,
    # else generate() fills it back in. The forced length comes from min/max_new_tokens.
    model.generation_config.eos_token_id = None
    return model


class TidalFloatRunner(TidalRunner):
    """tidal with the int4 copies off: what --quantization auto gains, side by side in one run."""

    name = "tidal-float"
    notes = "as tidal, dequantized float weights"
    quantization = "none"


class TidalCompileRunner(TidalRunner):
    """tidal with ``--compile``: what compiling the decode steps gains, side by side in one run."""

    name = "tidal-compile"
    notes = "as tidal, decode steps compiled"
    compile = True


class HFRunner(SystemRunner):
    name = "hf"
    notes = "one left-padded static batch"

    def load(self) -> None:
        self.model = load_hf_model(self.ctx.model_path, self.ctx.torch_dtype, self.ctx.device)

    def settings(self) -> dict[str, Any]:
        return {"dtype": self.ctx.dtype, "device": self.ctx.device, "attn_implementation": self.model.config._attn_implementation,
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
            out = self.model.generate(input_ids=ids.to(self.ctx.device), attention_mask=mask.to(self.ctx.device),
                                      generation_config=gen_cfg)
        tokens = out[:, width:].tolist()
        wall = time.perf_counter() - t0
        return RunOutput(wall, tokens)

    def close(self) -> None:
        self.model = None


def _accepted(klass, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``klass`` takes (transformers' continuous-batching config has gained and
    renamed fields between releases: ``page_size`` was ``block_size``); the rest are left out."""
    import inspect

    params = inspect.signature(klass).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    out = {k: v for k, v in kwargs.items() if k in params}
    if "page_size" in kwargs and "page_size" not in params and "block_size" in params:
        out["block_size"] = kwargs["page_size"]
    return out


class HFCBRunner(SystemRunner):
    name = "hf-cb"
    notes = "transformers continuous batching (paged, sdpa on CPU)"

    def load(self) -> None:
        from transformers.generation import ContinuousBatchingConfig

        self.model = load_hf_model(self.ctx.model_path, self.ctx.torch_dtype, self.ctx.device)
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
            use_cuda_graph=self.ctx.device.startswith("cuda"),  # its fastest mode on a GPU; none on CPU
            scheduler_type="fifo",
        )
        self.cb_config = ContinuousBatchingConfig(**_accepted(ContinuousBatchingConfig, self.cb_kwargs))

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
    "tidal": TidalRunner, "tidal-float": TidalFloatRunner, "tidal-compile": TidalCompileRunner, "hf": HFRunner, "hf-cb": HFCBRunner, "llamacpp": LlamaCppRunner,
}


def installed_systems() -> list[str]:
    """The systems whose packages are importable here (tidal always)."""
    out = ["tidal"]
    if importlib.util.find_spec("transformers") is not None:
        out += ["hf", "hf-cb"]
    if importlib.util.find_spec("llama_cpp") is not None:
        out.append("llamacpp")
    return out
