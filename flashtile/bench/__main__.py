"""``python -m flashtile.bench [SUBCOMMAND] [FLAGS]``: dispatch to one benchmark module.

``SUBCOMMANDS`` maps each name to what implements it: a module exposing ``main(argv) -> int``,
or ``module:function`` for another entry point of that signature. A module is imported only when
its subcommand runs, so adding one is a function or module plus one entry here. Without a
subcommand, ``speed`` runs.  Every benchmark writes its records into the device's results file,
``benchmarks/results/<device>.json``, under its own entry.
"""
from __future__ import annotations

import sys
from typing import Sequence

from flashtile.__main__ import run_entry

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "speed": ("flashtile.bench.speed", "TFLOP/s of dense attention against SDPA and Flex"),
    "overhead": ("flashtile.bench.speed:overhead_main",
                 "host cost per call, direct launches and launch plans off and on (CUDA)"),
    "memory": ("flashtile.bench.memory", "peak CUDA memory of fwd+bwd against N"),
    "report": ("flashtile.bench.report", "tables and plots of saved results"),
    "decode": ("flashtile.bench.decode", "KV-cache decode step against SDPA and Flex (CUDA)"),
    "variants": ("flashtile.bench.variants", "block-sparse density, sliding window, varlen"),
    "train": ("flashtile.bench.train", "GPT-2 training end to end (tokens/s, memory, loss curves)"),
    "io": ("flashtile.bench.io", "measured DRAM traffic against the IO model (ncu)"),
    "cp": ("flashtile.bench.cp", "context-parallel attention: one-GPU check, multi-GPU scaling"),
    "cpu": ("flashtile.bench.cpu:main",
            "the CPU engine against PyTorch's CPU SDPA (one process per implementation)"),
}
DEFAULT = "speed"


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return ("usage: python -m flashtile.bench [SUBCOMMAND] [FLAGS]   "
            f"('{DEFAULT}' when no subcommand is given)\n\nsubcommands "
            "('python -m flashtile.bench SUBCOMMAND -h' for each):\n" + "\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("help", "--list"):
        print(usage())
        return 0
    sub = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else DEFAULT
    return run_entry(SUBCOMMANDS[sub][0], argv, f"python -m flashtile.bench {sub}")


if __name__ == "__main__":
    sys.exit(main())
