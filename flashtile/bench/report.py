"""``python -m flashtile.bench report FILES... [--out DIR]``: the tables and plots of saved
records (speed, memory and variants records, told apart by their fields)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from . import variants as bench_variants
from .common import MAX_SEQLEN_MODE, MEMORY_MODE, load_records, log, merge_records
from .memory import plot_memory, render_memory_table
from .render import plot, render_table

# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench report",
        description="Print the tables and draw the plots of saved results (JSON lists of records).")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None, help="write plots here (default: no plots)")
    p.add_argument("--device", default=None,
                   help="keep only records whose device name contains this text")
    return p


def run_report(argv: Sequence[str], stdout=None) -> int:
    stdout = stdout or sys.stdout
    a = report_parser().parse_args(argv)
    records: list[dict] = []
    variants: list[dict] = []
    for path in a.files:
        loaded = load_records(path)
        foreign = [r for r in loaded if "impl" not in r or "mode" not in r]
        if foreign:
            log(f"{path}: skipped {len(foreign)} records without impl/mode (another format)")
            loaded = [r for r in loaded if "impl" in r and "mode" in r]
        records = merge_records(records, [r for r in loaded if "variant" not in r])
        variants = merge_records(variants, [r for r in loaded if "variant" in r],
                                 bench_variants.variant_key)
    if a.device:
        def keep(r):
            return a.device.lower() in str(r.get("device", "")).lower()
        records, variants = [r for r in records if keep(r)], [r for r in variants if keep(r)]
    speed = [r for r in records if r.get("mode") not in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    memory = [r for r in records if r.get("mode") in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if speed or not (memory or variants):
        print(render_table(speed), file=stdout)
    if memory:
        print(render_memory_table(memory), file=stdout)
    if variants:
        print(bench_variants.render_table(variants), file=stdout)
    if a.out is not None:
        paths = plot(speed, a.out) + plot_memory(memory, a.out)
        paths += bench_variants.plot(variants, a.out) if variants else []
        log("wrote " + (", ".join(map(str, paths)) or "no plots"))
    return 0



def main(argv: Sequence[str] | None = None) -> int:
    return run_report(list(sys.argv[1:] if argv is None else argv))
