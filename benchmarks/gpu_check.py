"""The GPU check a developer runs when a device is lent (issue 41): one script, one log, one JSON.

    python benchmarks/gpu_check.py --out DIR [--tokenizer DIR] [--stages models,parity,steps,offline,serve]
                                   [--baseline TREE]

Stages, each in its own process under a time limit (a hang or a crash costs that stage only):
- ``models``: random-weight Llama checkpoints of the Llama-3.2-1B and Llama-3-8B shapes (vocabulary 49,152,
  bf16, the default model's tokenizer beside them), built on the GPU (nothing can be downloaded there);
- ``parity``: float32 greedy tokens of tidal (CUDA graphs + Triton attention, and ``--enforce-eager``)
  against a plain transformers greedy loop, 8 prompts x 32 tokens, 1B shape;
- ``steps``: 8B bf16 decode step times at batch 1 and 32, CUDA graphs against eager, beside
  ``AnalyticCostModel``'s prediction for this GPU (the ratio the issue asks for);
- ``offline``: ``tidal bench offline --device cuda`` (tidal, transformers generate, generate_batch), 8B;
- ``serve``: ``tidal serve`` on CUDA (one instance, ``--instances 2``, 1P1D, split) answering the same
  greedy requests as one instance, 1B shape;
- ``kernels``: the fused elementwise kernels (engine/triton_fused.py) against the torch ops they replace on
  the 8B shape (bfloat16: bit for bit, or how many elements differ), their times, the decoder's matrix
  products (cuBLAS) at 1, 32 and 64 rows against the bytes they read, and the device-to-device copy
  bandwidth.

``--baseline TREE`` (a directory holding an earlier commit's ``tidal/``) runs the stages of ``--ab-stages``
(default steps and offline) once on that tree ("before") and once on this one ("after"), one after the other
in the same run: a change measured against the previous commit on the same GPU. ``steps`` also records the
GPU kernels of a few decode steps (torch.profiler, the largest first) at batch 1 and 32.

``--offline-async`` runs the offline stage once more on this tree with ``--async-scheduling`` (tree
"after-async"); ``--step-modes async`` and ``--serve-modes async`` time its decode steps and check its answers.

``--device cpu --tiny`` runs every stage on a 2-layer model on the CPU: how the script is tested before a
GPU is lent. Every figure goes to ``DIR/gpu_check.json`` (one object per stage) and the log to stdout;
``--record PATH`` also writes the performance page's record of the check (``tidal bench report`` reads it
from ``benchmarks/results/``), and ``--summarize REPORT --record PATH`` writes it from a saved report.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

from gpu_record import write_record  # (beside this script)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHAPES = {  # name -> (hidden, layers, heads, kv heads, intermediate, tied head)
    "1b": (2048, 16, 32, 8, 8192, True),
    "8b": (4096, 32, 32, 8, 14336, False),
    "tiny": (256, 2, 4, 2, 512, True),
}
VOCAB = 49152


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ============================================================================ stages
def stage_models(args) -> dict:
    import torch
    import transformers

    out = {}
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    for name in args.shapes:
        path = os.path.join(args.models, name)
        if os.path.exists(os.path.join(path, "config.json")):
            out[name] = "exists"
            continue
        h, layers, heads, kvh, inter, tied = SHAPES[name]
        cfg = transformers.LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kvh, intermediate_size=inter, vocab_size=VOCAB,
                                       tie_word_embeddings=tied, max_position_embeddings=4096,
                                       rope_theta=500000.0, torch_dtype="bfloat16")
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
        del model
        _save_tokenizer(args, path)
        out[name] = {"params": None, "seconds": round(time.perf_counter() - t0, 1)}
        log(f"models: {name} built in {out[name]['seconds']} s")
    return out


def _save_tokenizer(args, path: str) -> None:
    import shutil

    if args.tokenizer:
        for f in os.listdir(args.tokenizer):
            shutil.copy(os.path.join(args.tokenizer, f), path)
        return
    from tidal.engine.loader import load_checkpoint
    from tidal.engine.tokenizer import Tokenizer

    Tokenizer.from_checkpoint(load_checkpoint(None)).hf.save_pretrained(path)


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def stage_parity(args) -> dict:
    import torch
    import transformers

    from tidal import LLM, SamplingParams

    name = args.parity_shape
    path = os.path.join(args.models, name)
    prompts = _prompts(8, 8, 300, seed=1)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(args.device).eval()
    ref = []
    with torch.inference_mode():
        for p in prompts:  # one prompt at a time: no padding in the reference
            ids = torch.tensor([p], device=args.device)
            o = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=args.parity_tokens, min_new_tokens=args.parity_tokens)
            ref.append(o[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out = {}
    for label, kw in (("graphs", {}), ("eager", {"enforce_eager": True})):
        llm = LLM(model=path, dtype="float32", device=args.device, kv_cache_memory="2GiB", max_num_seqs=8,
                  max_num_batched_tokens=256, **kw)
        backend = llm.engine.model.attention_backend
        got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=args.parity_tokens, ignore_eos=True),
                           use_tqdm=False)
        toks = [list(g.outputs[0].token_ids) for g in got]
        same = sum(a == b for a, b in zip(toks, ref, strict=True))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                      for a, b in zip(toks, ref, strict=True)]
        graphs = llm.engine.runner.graphs
        out[label] = {"equal": same, "of": len(prompts), "first_divergence": first_diff, "attention": backend,
                      "graph_replays": graphs.replays if graphs else 0}
        log(f"parity {label}: {same}/{len(prompts)} equal to transformers ({backend}, "
            f"{out[label]['graph_replays']} graph replays)")
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def stage_steps(args) -> dict:
    import torch

    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.hardware import get_hardware

    path = os.path.join(args.models, args.step_shape)
    hw_name = _hardware_name(args)
    out: dict = {"hardware_model": hw_name, "shape": args.step_shape}
    from tidal.engine import attention

    # "sampled": the graphs' steps with every request sampling (temperature 0.8, top-p 0.9) instead of greedy
    modes = {"eager": {"enforce_eager": True}, "graphs": {}, "async": {"async_scheduling": True}, "sampled": {}}
    default_span = attention.PARTITION
    for label in args.step_modes.split(","):
        # "graphs@128": a fresh engine whose FlashDecoding programs each cover 128 tokens of context (default
        # 512): more programs at short contexts, more (empty) ones at long table widths
        mode, _, span = label.partition("@")
        if mode not in modes or (span and not span.isdigit()):
            raise SystemExit(f"--step-modes: {label!r} is not eager, graphs, async, sampled or graphs@TOKENS")
        _set_span(int(span) if span else default_span)
        e = LLMEngine(EngineConfig.from_kwargs(model=path, dtype="bfloat16", device=args.device,
                                               kv_cache_memory="8GiB", max_num_seqs=64,
                                               max_num_batched_tokens=4096, **modes[mode]))
        model = AnalyticCostModel(e.arch, get_hardware(hw_name), dtype_bytes=2) if hw_name else None
        weight_bytes = sum(p.numel() * p.element_size() for p in e.model.parameters())
        res = {"attention": e.model.attention_backend, "weight_gb": round(weight_bytes / 1e9, 3)}
        for batch in (1, 32):
            res[f"batch{batch}"] = _time_decodes(e, f"{label}-{batch}", batch, model, weight_bytes,
                                                 profile=mode == "graphs" and args.profile_steps,
                                                 sampled=mode == "sampled")
            log(f"steps {label} batch {batch}: {_brief(res[f'batch{batch}'])}")
        if e.runner.graphs is not None:
            res["graph_pool_mib"] = round(e.runner.graphs.pool_bytes / 2**20, 1)
        out[label] = res
        del e
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def _set_span(tokens: int) -> None:
    """The FlashDecoding span (tokens of context a decode program covers) for engines built after this."""
    from tidal.engine import attention

    attention.PARTITION = tokens  # (the split count and the Triton kernel both read it there)


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "kernels"}


def _time_decodes(e, tag: str, batch: int, model, weight_bytes: int, profile: bool = False,
                  sampled: bool = False) -> dict:
    """Decode steps of ``batch`` 128-token prompts (80 tokens each): the median step of the whole batch, the
    engine's step around it, the analytic model's ratio and the weights' read rate; with ``profile``, the
    GPU kernels of five of those steps by total time."""
    import torch

    from tidal import SamplingParams

    for i, p in enumerate(_prompts(batch, 128, 128, seed=batch)):
        how = {"temperature": 0.8, "top_p": 0.9, "seed": i} if sampled else {"temperature": 0}
        e.add_request(f"{tag}-{i}", None, SamplingParams(max_tokens=80, ignore_eos=True, **how), prompt_token_ids=p)
    times, walls, ratios = [], [], []
    steps, prof = 0, None
    while e.has_unfinished_requests():
        if profile and steps == 20:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        e.step()
        wall = time.perf_counter() - t0
        steps += 1
        if prof is not None and steps == 25:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
        comp = e.last_result.composition
        if comp.num_prefill_tokens or comp.num_decode_seqs != batch or steps < 8:
            continue  # decodes of the whole batch only, after a few warm steps
        times.append(e.last_result.step_time_s)
        walls.append(wall)
        if model is not None:
            ratios.append(e.last_result.step_time_s / model.decode_step_time_at(list(comp.context_lens), 0))
    step = statistics.median(times)
    out = {"step_ms_median": round(1e3 * step, 3), "engine_step_ms_median": round(1e3 * statistics.median(walls), 3),
           "steps": len(times), "vs_analytic": round(statistics.median(ratios), 3) if ratios else None,
           "weights_tb_s": round(weight_bytes / step / 1e12, 3),
           "hbm_fraction": round(weight_bytes / step / HBM_BYTES_S, 3)}
    if prof is not None:
        out["kernels"] = _kernel_table(prof, steps=5)
    return out


HBM_BYTES_S = 4.8e12  # the H200's datasheet bandwidth: the issue's "fraction of HBM" is against it


def _kernel_table(prof, steps: int, top: int = 40) -> dict:
    """The profiled GPU kernels by total time: per step, microseconds and calls, the largest first."""
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0)
        if t and ev.device_type.name == "CUDA":
            rows.append((ev.key[:120], round(t / steps, 1), round(ev.count / steps, 2)))
    rows.sort(key=lambda r: -r[1])
    return {"per_step_us_total": round(sum(r[1] for r in rows), 1), "kernels_per_step": round(sum(r[2] for r in rows), 1),
            "top": rows[:top]}


def _hardware_name(args) -> str | None:
    import torch

    if not args.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return "h200" if "H200" in name else "h100-80g" if "H100" in name else None


def stage_offline(args) -> dict:
    path = os.path.join(args.models, args.offline_shape)
    dst = os.path.join(args.out, f"offline-{args.tree}.json")
    cmd = [sys.executable, "-m", "tidal.cli", "bench", "offline", "--model", path, "--device", args.device,
           "--dtype", "bfloat16" if args.device.startswith("cuda") else "float32",
           "--systems", args.offline_systems, "--workloads", args.offline_workloads, "--repeats",
           str(args.offline_repeats),
           "--no-peak", "--no-prefill-runs", "--no-plots", "--no-progress", "--output", dst,
           *(["--async-scheduling"] if args.tree == "after-async" else [])]
    log("offline:", " ".join(cmd))
    # run from the tree's root: ``-m`` puts the working directory first on sys.path, ahead of PYTHONPATH
    cwd = args.baseline if args.tree == "before" else ROOT
    subprocess.run(cmd, check=True, timeout=args.stage_timeout - 10, cwd=cwd)
    with open(dst) as f:
        data = json.load(f)
    imported = subprocess.run([sys.executable, "-c", "import tidal; print(tidal.__file__)"], cwd=cwd,
                              capture_output=True, text=True, check=True).stdout.strip()  # the CLI's tidal
    return {"command": " ".join(cmd), "summary": _offline_summary(data), "cli_tidal": imported}


def _offline_summary(data: dict) -> dict:
    out = {}
    for w, rep in (data.get("workloads") or {}).items():
        out[w] = {"output_tok_s": {s: r.get("output_tok_s") for s, r in rep.get("results", {}).items()},
                  "status": {s: r.get("status") for s, r in rep.get("results", {}).items()},
                  "ratios": rep.get("ratios", {}).get("output_tok_s")}
    return out


def stage_serve(args) -> dict:
    import httpx

    path = os.path.join(args.models, args.serve_shape)
    prompts = _prompts(6, 8, 120, seed=3)
    modes = {"one": [], "split": ["--instances", "2", "--mode", "split"],
             "disaggregate": ["--instances", "2", "--mode", "disaggregate", "--prefill-instances", "1"],
             "instances2": ["--instances", "2"], "async": ["--async-scheduling"]}
    modes = {m: modes[m] for m in ["one", *(m for m in args.serve_modes.split(",") if m != "one")]}
    out, ref = {}, None
    for i, (mode, extra) in enumerate(modes.items()):
        port = 18500 + i
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--model", path, "--device", args.device,
               "--port", str(port), "--kv-cache-memory", "2GiB", *extra]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            t0 = time.perf_counter()
            url = f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve {mode} exited: {proc.stderr.read().decode()[-800:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > 240:
                    raise RuntimeError(f"serve {mode} did not answer /health in 240 s")
                time.sleep(1)
            started = time.perf_counter() - t0
            got = []
            with httpx.Client(timeout=120) as c:
                model = c.get(url + "/v1/models").json()["data"][0]["id"]
                # greedy, then seeded sampling (drawn on the GPU: the same draws with --async-scheduling; a
                # request whose decode moves to another instance starts its generator again there)
                for j, p in enumerate(prompts + prompts[:3]):
                    sampling = {"temperature": 0} if j < len(prompts) else {"temperature": 0.8, "top_p": 0.9,
                                                                            "seed": 7 + j}
                    r = c.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": 16,
                                                              **sampling})
                    r.raise_for_status()
                    got.append(r.json()["choices"][0]["text"])
            ref = got if ref is None else ref
            same = [a == b for a, b in zip(got, ref, strict=True)]
            out[mode] = {"start_s": round(started, 1), "equal_to_one_instance": sum(same[:len(prompts)]),
                         "of": len(prompts), "seeded_equal_to_one_instance": sum(same[len(prompts):]),
                         "seeded_of": 3}
            log(f"serve {mode}: {out[mode]}")
            _save_stage(args, "serve", out)  # kept if the stage is stopped at its limit
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out


def stage_profile(args) -> dict:
    """``tidal profile`` on the GPU (``--profile-grid``: the quick grid, or the full one that drives the
    simulator): the fit's R^2 of its step times."""
    path = os.path.join(args.models, args.step_shape)
    dst = os.path.join(args.out, "profile.json")
    quick = ["--quick", "--no-live"] if args.profile_grid == "quick" else []
    cmd = [sys.executable, "-m", "tidal.cli", "profile", "--model", path, "--device", args.device, *quick,
           "--repeats", "5", "--kv-cache-memory", "8GiB", "--no-progress", "--output", dst,
           "--dtype", "bfloat16" if args.device.startswith("cuda") else "float32"]
    log("profile:", " ".join(cmd))
    run = subprocess.run(cmd, check=True, timeout=args.stage_timeout - 10, capture_output=True, text=True)
    lines = [ln for ln in run.stdout.splitlines() if "R2" in ln or "fit" in ln]
    log("profile:", *lines)
    return {"command": " ".join(cmd), "fit_lines": lines}


def stage_kernels(args) -> dict:
    """The fused kernels against torch's ops (bit for bit in bfloat16 on the GPU), the time of each against
    the ops it replaces, the decoder's matrix products against their bytes, and the copy bandwidth."""
    import torch
    from triton.testing import do_bench

    dev, dt = args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict = {"dtype": str(dt)}
    if dev.startswith("cuda"):
        n = 1 << 30
        a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
        a.random_(generator=g)
        out["copy_tb_s"] = round(2 * n / do_bench(lambda: b.copy_(a), return_mode="median") / 1e9, 3)
        del a, b

    def bench(fn) -> float:
        return round(1e3 * do_bench(fn, warmup=5, rep=20, return_mode="median"), 2) if dev.startswith("cuda") else 0.0

    for t in (1, 32, 64):
        out[f"tokens{t}"] = _kernel_checks(t, SHAPES[args.step_shape], dev, dt, g, bench)
        log(f"kernels {t} tokens: " + json.dumps(out[f"tokens{t}"]))
    return out


def _diff(x, y) -> dict:
    return {"differ": int((x != y).sum()), "of": x.numel(), "max_abs": float((x.float() - y.float()).abs().max())}


def _kernel_checks(t: int, shape: tuple, dev: str, dt, g, bench) -> dict:
    """One row count of :func:`stage_kernels`."""
    import torch
    import torch.nn.functional as F

    from tidal.engine import triton_fused as tf
    from tidal.engine.model import Rotary

    h, _, heads, kvh, inter, _ = shape
    d = h // heads
    r: dict = {}
    x, res = (torch.randn(t, h, generator=g, device=dev).to(dt) for _ in range(2))
    w = torch.randn(h, generator=g, device=dev).to(dt)
    o, s2 = tf.rms_norm(x, w, 1e-5, residual=res)
    r["add_rms_norm"] = {**_diff(o, w * F.rms_norm(x + res, (h,), eps=1e-5)), "residual": _diff(s2, x + res),
                         "fused_us": bench(lambda: tf.rms_norm(x, w, 1e-5, residual=res)),
                         "torch_us": bench(lambda: w * F.rms_norm(x + res, (h,), eps=1e-5))}
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g, device=dev).to(dt)
    pos = torch.randint(0, 4000, (t,), generator=g, device=dev)
    cos = torch.randn(4096, d // 2, generator=g, device=dev)[pos].unsqueeze(1).to(dt)
    sin = torch.randn(4096, d // 2, generator=g, device=dev)[pos].unsqueeze(1).to(dt)
    kc, vc = (torch.zeros(1024, 16, kvh, d, dtype=dt, device=dev) for _ in range(2))
    slots = torch.randperm(1024 * 16, generator=g, device=dev)[:t]
    q = tf.rope_write_kv(qkv, cos, sin, kc, vc, slots, heads, kvh, d)

    def torch_rope():
        qk = Rotary.apply(qkv[:, :(heads + kvh) * d].view(t, -1, d), cos, sin)
        kc.view(-1, kvh, d).index_copy_(0, slots, qk[:, heads:])
        vc.view(-1, kvh, d).index_copy_(0, slots, qkv[:, (heads + kvh) * d:].view(t, kvh, d))
        return qk

    kf, vf = kc.clone(), vc.clone()
    qk = torch_rope()
    r["rope_write_kv"] = {"q": _diff(q, qk[:, :heads]), "k": _diff(kf, kc), "v": _diff(vf, vc),
                          "fused_us": bench(lambda: tf.rope_write_kv(qkv, cos, sin, kc, vc, slots, heads, kvh, d)),
                          "torch_us": bench(torch_rope)}
    gu = torch.randn(t, 2 * inter, generator=g, device=dev).to(dt)
    gate, up = gu.chunk(2, dim=-1)
    r["silu_mul"] = {**_diff(tf.silu_mul(gu), F.silu(gate) * up), "fused_us": bench(lambda: tf.silu_mul(gu)),
                     "torch_us": bench(lambda: F.silu(gate) * up)}
    r["matmul"] = {name: _matmul_rate(t, n, k, dev, dt, g, bench) for name, (n, k) in {
        "qkv": ((heads + 2 * kvh) * d, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}.items()}
    return r


def _matmul_rate(t: int, n: int, k: int, dev: str, dt, g, bench) -> dict:
    """``F.linear`` of ``t`` rows through an [n, k] weight (cuBLAS): microseconds and the weight's read rate."""
    import torch
    import torch.nn.functional as F

    wt = torch.randn(n, k, generator=g, device=dev).to(dt)
    xx = torch.randn(t, k, generator=g, device=dev).to(dt)
    us = bench(lambda: F.linear(xx, wt))
    return {"us": us, "tb_s": round(wt.numel() * wt.element_size() / us / 1e6, 3) if us else None}


STAGES = {"models": stage_models, "parity": stage_parity, "steps": stage_steps, "offline": stage_offline,
          "serve": stage_serve, "profile": stage_profile, "kernels": stage_kernels}


# ============================================================================ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=None, help="where the checkpoints are built (default OUT/../models)")
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer directory to copy beside each model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="every stage on a 2-layer model (a CPU dry run)")
    ap.add_argument("--stages", default="models,parity,steps,offline,serve")
    ap.add_argument("--stage-timeout", type=int, default=240)
    ap.add_argument("--stage-timeouts", default="", help="per stage, e.g. models=150,offline=200")
    ap.add_argument("--deadline", type=int, default=0,
                    help="seconds for the whole check: no stage starts past it, each gets what is left")
    ap.add_argument("--offline-systems", default="tidal,hf,hf-cb")
    ap.add_argument("--offline-workloads", default="c,b,a")
    ap.add_argument("--offline-repeats", type=int, default=1)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--baseline", default=None, help="a tree holding an earlier commit's tidal/ (see above)")
    ap.add_argument("--ab-stages", default="steps,offline", help="the stages run on both trees")
    ap.add_argument("--offline-async", action="store_true",
                    help="run the offline stage once more on this tree with --async-scheduling (tree after-async)")
    ap.add_argument("--step-modes", default="eager,graphs",
                    help="the steps stage's engines: eager, graphs, graphs@TOKENS (another FlashDecoding span)")
    ap.add_argument("--profile-steps", action="store_true", help="the GPU kernels of the graphs' decode steps")
    ap.add_argument("--profile-grid", default="quick", choices=["quick", "full"],
                    help="the profile stage's grid: tidal profile --quick --no-live, or its full grid and live steps")
    ap.add_argument("--serve-modes", default="one,split,disaggregate,instances2")
    ap.add_argument("--record", default=None, help="also write the performance page's record of the check here")
    ap.add_argument("--summarize", default=None, metavar="REPORT",
                    help="write --record from a saved gpu_check.json and run nothing")
    ap.add_argument("--machine-from", default=None, help="the record's machine: that of this offline JSON")
    ap.add_argument("--notes", default=None, help="the record's notes")
    ap.add_argument("--title", default=None, help="the record's title")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # run one stage in this process
    ap.add_argument("--tree", default="after", help=argparse.SUPPRESS)  # which tree the stage runs on
    args = ap.parse_args()
    if args.summarize:
        if not args.record:
            ap.error("--summarize needs --record")
        with open(args.summarize) as f:
            n = write_record(json.load(f), args.record, args.machine_from, args.notes, args.title)
        log(f"wrote {args.record} ({n} rows)")
        return 0
    args.out = os.path.abspath(args.out)
    args.models = os.path.abspath(args.models or os.path.join(os.path.dirname(args.out), "models"))
    big = "tiny" if args.tiny else "8b"
    small = "tiny" if args.tiny else "1b"
    args.shapes = sorted({big, small})
    args.parity_shape, args.step_shape, args.offline_shape, args.serve_shape = small, big, big, small
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.models, exist_ok=True)
    if args.baseline:
        args.baseline = os.path.abspath(args.baseline)
    tree = args.baseline if args.tree == "before" else ROOT
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    if args.stage:
        result = STAGES[args.stage](args)
        result["tree"] = _tree_identity(tree)
        _save_stage(args, args.stage, result)
        return 0
    report = {"argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch

        report["torch"] = torch.__version__
        report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception as e:  # noqa: BLE001
        report["torch"] = f"unavailable ({e})"
    start = time.perf_counter()
    ab = set(args.ab_stages.split(",")) if args.baseline else set()
    for stage in args.stages.split(","):
        trees = ("before", "after") if stage in ab else ("after",)
        if stage == "offline" and args.offline_async:
            trees = (*trees, "after-async")
        for tree in trees:
            entry = _run_stage(args, stage, tree, start)
            if len(trees) > 1:
                report.setdefault(stage, {})[tree] = entry
            else:
                report[stage] = entry
            with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
                json.dump(report, f, indent=1)
    if args.record:
        after = os.path.join(args.out, "offline-after.json")
        n = write_record(report, args.record, args.machine_from or (after if os.path.exists(after) else None),
                         args.notes, args.title)
        log(f"wrote {args.record} ({n} rows)")
    return 0


def _save_stage(args, stage: str, result: dict) -> None:
    with open(os.path.join(args.models, f"stage-{stage}-{args.tree}.json"), "w") as f:
        json.dump(result, f, indent=1)


def _tree_identity(root: str) -> dict:
    """Where the stage's ``tidal`` was imported from, and the commit a ``COMMIT`` file in that tree names."""
    import tidal

    commit = os.path.join(root, "COMMIT")
    return {"tidal": os.path.dirname(os.path.abspath(tidal.__file__)),
            "commit": open(commit).read().strip() if os.path.exists(commit) else None}


def _run_stage(args, stage: str, tree: str, start: float) -> dict:
    """One stage in its own process (and process group) under its time limit, on one tree."""
    t0, started = time.perf_counter(), time.time()
    limit = dict((k, int(v)) for k, v in (x.split("=") for x in args.stage_timeouts.split(",") if x)).get(
        stage, args.stage_timeout)
    if args.deadline:
        limit = min(limit, int(args.deadline - (t0 - start)))
        if limit < 20:
            log(f"== stage {stage} ({tree}): skipped (deadline)")
            return {"rc": "skipped (deadline)"}
    cmd = [sys.executable, os.path.abspath(__file__), "--stage", stage, *sys.argv[1:], "--stage-timeout", str(limit),
           "--tree", tree]
    log(f"== stage {stage} ({tree})")
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    took = round(time.perf_counter() - t0, 1)
    entry: dict = {"rc": rc, "seconds": took}
    path = os.path.join(args.models, f"stage-{stage}-{tree}.json")
    if os.path.exists(path) and os.path.getmtime(path) >= started - 1:  # (a stopped stage's partial result too)
        with open(path) as f:
            entry["result"] = json.load(f)
    log(f"== stage {stage} ({tree}): rc {rc} in {took} s")
    return entry


if __name__ == "__main__":
    # a stage on the "before" tree imports that tree's tidal (the argument is read before anything imports it)
    before = "--tree" in sys.argv and sys.argv[sys.argv.index("--tree") + 1] == "before"
    base = sys.argv[sys.argv.index("--baseline") + 1] if "--baseline" in sys.argv else None
    sys.path.insert(0, os.path.abspath(base) if before and base else ROOT)
    sys.exit(main())
