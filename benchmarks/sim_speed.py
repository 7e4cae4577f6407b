"""How much faster than real time the simulator runs: one hour of the Azure conversation trace
on 8 simulated A100-80G instances of Llama-3-8B (the ratio is printed as ``...x faster``).
Extra arguments go to ``tidal sim`` (e.g. ``--batching sla --tbt-slo-ms 50``)."""

import sys

from tidal.cli import main

ARGS = ["sim", "--model", "llama-3-8b", "--hardware", "a100-80g", "--instances", "8",
        "--trace", "../shared/traces/azure2023_conv.csv", "--duration", "3600", "--slo", "ttft=2000,tpot=100",
        "--output", "results/sim_azure_8xa100.json"]

if __name__ == "__main__":
    sys.exit(main([*ARGS, *sys.argv[1:]]))
