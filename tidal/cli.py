"""Command line: ``tidal generate | serve | bench | sim | profile``.

Engine and scheduler flags are the config dataclass fields with dashes (``--max-num-seqs``),
defined once in :mod:`tidal.common.flags` for every command that takes them; errors in
arguments or in loading a model end with one line naming the problem, not a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys

from tidal.common.flags import (
    add_cluster_flags,
    add_engine_flags,
    add_pipeline_flags,
    add_pressure_flags,
    add_scheduler_flags,
    engine_config,
    engine_kwargs,
    serving_config,
)
from tidal.config import ConfigError


def _cmd_generate(args: argparse.Namespace) -> int:
    from tidal import LLM, SamplingParams

    engine_config(args)  # policy names and parameters checked before the weights load
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop or [])
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    print(out.outputs[0].text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    serving = serving_config(args)  # the whole tree, validated once, before anything loads
    cfg, layout = serving.engine, serving.cluster.layout
    if args.backend == "ray":
        from tidal.runtime.backend import check_ray_available, check_reachable

        check_ray_available()
        if args.ray_address:
            check_reachable(args.ray_address)
    from tidal.server.app import build_app

    if layout.instances == 1 and args.backend == "process":
        from tidal.engine.async_engine import AsyncLLM
        from tidal.engine.llm_engine import LLMEngine

        llm = AsyncLLM(LLMEngine(cfg))
        print(f"engine: {llm.engine.describe_weights()}", file=sys.stderr, flush=True)
    else:
        from tidal.runtime.cluster import ClusterLLM

        llm = ClusterLLM(serving)
    app = build_app(llm, args.served_model_name)
    name = app.state.serving.model_name

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                port = args.port
                for srv in self.servers:
                    for sock in srv.sockets:
                        port = sock.getsockname()[1]
                for i, w in enumerate(getattr(llm, "weights", ())):  # each instance's own start-up choice
                    print(f"instance {i} engine: {w}", file=sys.stderr, flush=True)
                print(f"serving {name} on http://{args.host}:{port}", file=sys.stderr, flush=True)

        async def shutdown(self, sockets=None) -> None:
            app.state.begin_shutdown()  # live streams end with an error event and [DONE], not cut
            await super().shutdown(sockets)

    level = str(args.log_level).lower()
    if level not in uvicorn.config.LOG_LEVELS:
        level = "warning"
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=level, access_log=args.access_log,
                            timeout_graceful_shutdown=5)

    def _on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal: make that a clean exit
    signal.signal(signal.SIGTERM, _on_term)
    with contextlib.suppress(KeyboardInterrupt):
        Server(config).run()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="tidal LLM serving engine")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_flags(g)
    add_scheduler_flags(g)
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: the checkpoint's)")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_flags(s)
    add_scheduler_flags(s)
    add_cluster_flags(s)
    add_pipeline_flags(s)
    add_pressure_flags(s)
    s.set_defaults(func=_cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    from tidal.bench import kv_transfer, offline, soak
    from tidal.bench import report as bench_report
    from tidal.bench import serve as bench_serve
    from tidal.experiments import (
        calibration,
        jitter_fit,
        length_error,
        reproduce,
        sim_accuracy,
        sim_auto,
        sim_dynaserve,
        sim_kunserve,
        sim_policies,
        sim_prefix,
    )
    from tidal.experiments import policies as bench_policies

    offline.add_parser(bsub)
    bench_serve.add_parser(bsub)
    bench_policies.add_parser(bsub)
    sim_accuracy.add_parser(bsub)
    sim_policies.add_parser(bsub)
    sim_prefix.add_parser(bsub)
    sim_auto.add_parser(bsub)
    sim_dynaserve.add_parser(bsub)
    sim_kunserve.add_parser(bsub)
    kv_transfer.add_parser(bsub)
    calibration.add_parser(bsub)
    jitter_fit.add_parser(bsub)
    length_error.add_parser(bsub)
    soak.add_parser(bsub)
    bench_report.add_parser(bsub)

    reproduce.add_parser(sub)
    from tidal.sim import run as sim_run

    sim_run.add_parser(sub)
    from tidal.bench import profile

    profile.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tidal.core.sampling import SamplingParamsError
    from tidal.core.scheduler import RequestRejected

    errors: tuple[type[BaseException], ...] = (ConfigError, SamplingParamsError, RequestRejected, FileNotFoundError)
    try:
        from tidal.engine.loader import ModelLoadError
        errors += (ModelLoadError,)
    except ImportError:  # pragma: no cover - torch missing
        pass
    try:
        return int(args.func(args) or 0)
    except errors as e:
        print(f"tidal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
