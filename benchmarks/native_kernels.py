"""tidal's float32 CPU kernels (``tidal/engine/native.py``) against what the engine runs without them:
the Q4_1 and Q8_0 matmuls against ``F.linear`` on the dequantized float32 weights (each timed cycling
through 64 MB of copies, as a model step streams its weights from memory), and the paged decode
attention against the gather + masked SDPA path, and that kernel over a KV cache on 4 KiB pages against
one on transparent huge pages (``tidal/engine/hugepages.py``), and the prefill chunk's causal attention
against torch's SDPA with the causal mask. Shapes default to SmolLM2-135M's.

    .venv/bin/python benchmarks/native_kernels.py [--tokens 1,2,4,8,16,32] [--output PATH]
"""

from __future__ import annotations

import argparse
import functools
import sys

PROG = "benchmarks/native_kernels.py"
SHAPES = {"qkv_proj": (960, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536), "lm_head": (49152, 576)}


def _matmuls(tokens: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from tidal.engine import native
    from tidal.engine.quant import GROUP, _copies, _median_time

    def cycle(fn, mats, x):
        for m in mats:
            fn(x, m)

    rows = []
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        q8 = name == "lm_head"
        ws, packed = [], []
        for _ in range(_copies(n, k, torch.float32)):
            d = (torch.rand(n, k // GROUP, generator=g) * 0.01).half().float()
            if q8:
                q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
                ws.append((q.float().view(n, -1, GROUP) * d.unsqueeze(-1)).view(n, k))
                packed.append(native.Q8_0Weight.pack(q, d))
            else:
                q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
                ws.append((q.float().view(n, -1, GROUP) * d.unsqueeze(-1) - 8 * d.unsqueeze(-1)).view(n, k))
                packed.append(native.Q4_1Weight.pack(q, d, -8 * d))
        with torch.inference_mode():
            for m in tokens:
                x = torch.randn(m, k, generator=g)
                tf = _median_time(functools.partial(cycle, F.linear, ws, x), repeats) / len(ws)
                tq = _median_time(functools.partial(cycle, lambda x, p: p.matmul(x), packed, x), repeats) / len(ws)
                rows.append({"matrix": name, "shape": [n, k], "kernel": "q8_0" if q8 else "q4_1", "tokens": m,
                             "float_ms": tf * 1e3, "kernel_ms": tq * 1e3, "speedup": tf / tq})
                print(f"{name:>13} {n}x{k} {rows[-1]['kernel']} tokens {m:>3}: float32 {tf * 1e3:7.3f} ms  "
                      f"kernel {tq * 1e3:7.3f} ms  {tf / tq:5.2f}x", flush=True)
    return rows


def _attention(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    import torch

    from tidal.engine.attention import AttentionBatch, DecodeGroup, KVLayer, _decode_attention
    from tidal.engine.quant import _median_time

    rows, bs, heads, kv_heads, d = [], 16, 9, 3, 64
    g = torch.Generator().manual_seed(1)
    for n, ctx in cases:
        width = ctx // bs + 1
        blocks = torch.randperm(n * width, generator=g)
        kv = KVLayer(torch.randn(n * width, bs, kv_heads, d, generator=g),
                     torch.randn(n * width, bs, kv_heads, d, generator=g))
        tables = blocks.view(n, width)
        pos = torch.full((n,), ctx)
        mask = (torch.arange(width * bs).unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, width * bs)
        group = DecodeGroup(0, n, tables, mask)
        batch = AttentionBatch(positions=pos, slot_mapping=pos, num_decodes=n, decode_groups=[group], prefills=[],
                               block_size=bs)
        q = torch.randn(n, heads, d, generator=g)
        with torch.inference_mode():
            t_sdpa = _median_time(functools.partial(_decode_attention, q, kv, batch, group, d ** -0.5), repeats)
            batch.native_attention = True
            t_nat = _median_time(functools.partial(_decode_attention, q, kv, batch, group, d ** -0.5), repeats)
        rows.append({"decodes": n, "context": ctx, "gather_sdpa_us": t_sdpa * 1e6, "kernel_us": t_nat * 1e6,
                     "speedup": t_sdpa / t_nat})
        print(f"attention {n:>3} decodes at context {ctx:>5}: gather+SDPA {t_sdpa * 1e6:8.0f} us  "
              f"kernel {t_nat * 1e6:8.0f} us  {t_sdpa / t_nat:5.2f}x", flush=True)
    return rows


def _prefill_attention(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    """``prefill_attention`` against masked SDPA (grouped-query) for chunks of n tokens after a cached prefix
    of ``offset``; GFLOP/s of useful work (the causal half of QK^T and PV)."""
    import torch
    import torch.nn.functional as F

    from tidal.engine.quant import _median_time

    rows, heads, kv_heads, d = [], 9, 3, 64
    g = torch.Generator().manual_seed(3)
    for n, offset in cases:
        m = offset + n
        q, k, v = (torch.randn(n, heads, d, generator=g), torch.randn(m, kv_heads, d, generator=g),
                   torch.randn(m, kv_heads, d, generator=g))
        mask = torch.arange(m)[None] <= (offset + torch.arange(n))[:, None]
        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]

        def sdpa(qt=qt, kt=kt, vt=vt, mask=mask):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)

        with torch.inference_mode():
            t_sdpa = _median_time(sdpa, repeats)
            t_nat = _median_time(functools.partial(torch.ops.tidal.prefill_attention, q, k, v, offset, d ** -0.5),
                                 repeats)
        gflop = 4 * d * heads * (n * offset + n * (n + 1) / 2) / 1e9
        rows.append({"tokens": n, "offset": offset, "sdpa_us": t_sdpa * 1e6, "kernel_us": t_nat * 1e6,
                     "sdpa_gflops": gflop / t_sdpa, "kernel_gflops": gflop / t_nat, "speedup": t_sdpa / t_nat})
        print(f"prefill attention {n:>4} tokens after {offset:>4}: SDPA {t_sdpa * 1e6:8.0f} us "
              f"({gflop / t_sdpa:5.1f} GFLOP/s)  kernel {t_nat * 1e6:8.0f} us ({gflop / t_nat:5.1f} GFLOP/s)  "
              f"{t_sdpa / t_nat:5.2f}x", flush=True)
    return rows


def _attention_pages(n: int, ctx: int, layers: int, repeats: int) -> dict:
    """The decode attention kernel over ``layers`` layers' KV (64 decodes at context 400 read ~200 MB: far
    more than the caches), allocated as the engine's on 4 KiB pages and on huge pages, timed alternately."""
    import time

    import torch

    from tidal.engine import hugepages

    bs, heads, kv_heads, d, blocks = 16, 9, 3, 64, n * (ctx // 16 + 1)
    g = torch.Generator().manual_seed(2)

    def cache(huge: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(layers):
            k, v = (hugepages.zeros((blocks, bs, kv_heads, d), torch.float32, torch.device("cpu")) if huge
                    else torch.zeros(blocks, bs, kv_heads, d) for _ in range(2))
            out.append((k.normal_(generator=g), v.normal_(generator=g)))
        return out

    caches = {"4k": cache(False), "huge": cache(True)}
    tables = torch.randperm(blocks, generator=g).view(n, -1).contiguous()
    pos = torch.full((n,), ctx - 1)
    q = torch.randn(n, heads, d, generator=g)
    op = torch.ops.tidal.paged_decode_attention
    times: dict[str, list[float]] = {"4k": [], "huge": []}
    for _ in range(max(repeats, 3) * 3):
        for name, kv in caches.items():
            t0 = time.perf_counter()
            for k, v in kv:
                op(q, k, v, tables, pos, d ** -0.5)
            times[name].append(time.perf_counter() - t0)
    t4, th = (sorted(times[x])[len(times[x]) // 2] for x in ("4k", "huge"))
    gb = layers * 2 * n * ctx * kv_heads * d * 4 / 1e9
    print(f"attention over {layers} layers' KV ({n} decodes at context {ctx}, {gb * 1e3:.0f} MB read): "
          f"4 KiB pages {t4 * 1e3:.2f} ms ({gb / t4:.1f} GB/s)  huge pages {th * 1e3:.2f} ms ({gb / th:.1f} GB/s)  "
          f"{t4 / th:5.2f}x", flush=True)
    return {"decodes": n, "context": ctx, "layers": layers, "pages_4k_ms": t4 * 1e3, "huge_pages_ms": th * 1e3,
            "speedup": t4 / th}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", default="results/native_kernels.json")
    args = p.parse_args(argv)

    import torch

    from tidal.common.machine import machine_info
    from tidal.common.results import command_line, write_result
    from tidal.engine import native

    why = native.load()
    if why is not None:
        print(f"{PROG}: error: {why}", file=sys.stderr)
        return 2
    machine = machine_info(dtype="float32", num_threads=torch.get_num_threads())
    command = command_line(PROG, argv if argv is not None else sys.argv[1:])
    print(f"command: {command}")
    print(f"machine: {machine.get('cpu_model')} ({machine.get('cores')} cores), torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, median of {args.repeats}")
    report = {"command": command, "machine": machine, "matmuls": _matmuls(args.tokens, args.repeats),
              "attention": _attention([(1, 192), (1, 1024), (4, 192), (32, 192), (32, 1024)], args.repeats),
              "attention_pages": _attention_pages(64, 400, 4, args.repeats),
              "prefill_attention": _prefill_attention([(128, 0), (256, 0), (512, 0), (256, 256), (37, 100)],
                                                      args.repeats)}
    write_result(report, args.output, False, prog=PROG)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
