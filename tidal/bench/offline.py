"""``tidal bench offline``: offline throughput of tidal against its peers (placeholder being written)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="offline throughput: tidal vs transformers and llama.cpp")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("tidal bench offline: not written yet")
