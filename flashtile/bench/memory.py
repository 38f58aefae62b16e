"""Memory benchmark (``python -m flashtile.bench memory ...``): peak extra CUDA memory of one
forward+backward against sequence length, and the longest N each implementation runs.

It reads the CUDA caching allocator's own counters (``torch.cuda.max_memory_allocated``), so it
needs a CUDA device; ``python -m flashtile`` measures CPU memory (one child process per
implementation).  The records go to the device's results file
(``benchmarks/results/<device>.json``, entry ``memory``), the plot to ``--plots``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path
from typing import Sequence

import torch

from . import common
from .common import (IMPLS, MAX_SEQLEN_MODE, MEMORY_MODE, MODES, Inputs, classify_error,
                     common_arguments, default_device, first_line, is_fatal, log, make_progress,
                     make_record, merge_result, parse_dtype, parse_names, parse_seqlen,
                     positive_int, results_path, runtime_env)
from .report import (STATUS_CELL, by_device, figure, format_n, have_matplotlib, log2_axis,
                     markdown, ordered, sections, slug)

KEY = "memory"  # the entry of the results file that holds the memory records

# --------------------------------------------------------------------------------------------
# Memory run
# --------------------------------------------------------------------------------------------

class CudaMemory:
    """The allocator statistics the memory benchmark reads (replaceable in tests)."""

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def measure_peak(impl_name: str, inputs: Inputs, causal: bool, mem) -> int:
    """Peak bytes allocated by one forward+backward beyond what was allocated before it (the
    inputs). A first, unmeasured step absorbs compilation and autotuning."""
    impl = IMPLS[impl_name]
    with impl.context(inputs.device):
        prep = impl.prepare(inputs, causal, inputs.d ** -0.5)
        step = MODES["fwd_bwd"].build(prep)
        step()
        mem.synchronize()
        mem.reset_peak()
        base = mem.allocated()
        step()
        mem.synchronize()
        return mem.peak() - base


@dataclasses.dataclass(frozen=True)
class MemoryConfig(common.RunOptions):
    device: str
    impls: tuple[str, ...] = ("flashtile", "sdpa_flash", "sdpa_math")
    n_min: int = 1024
    n_max: int = 256 * 1024
    batch: int = 1
    heads: int = 16
    d: int = 128
    dtype: str = "bf16"
    causal: bool = False

    def seqlens(self) -> list[int]:
        ns, n = [], self.n_min
        while n <= self.n_max:
            ns.append(n)
            n *= 2
        return ns


def run_memory(cfg: MemoryConfig, mem=None, stdout=None) -> list[dict]:
    """Peak extra memory of fwd+bwd for N = n_min, 2 n_min, ... up to n_max. An impl stops at
    its first failure; a ``max_seqlen`` record per impl gives the longest N that ran (its
    ``error`` says what stopped the probe, None when it reached n_max). Records are merged into
    entry ``memory`` of the results file, the plot goes to ``PLOTS/memory.png``."""
    stdout = stdout or sys.stdout
    device = torch.device(cfg.device)
    mem = mem or CudaMemory()
    env = runtime_env(device)
    results = results_path(device, cfg.out)
    ns = cfg.seqlens()
    progress = make_progress(len(ns) * len(cfg.impls), cfg.progress)
    records: list[dict] = []
    longest: dict[str, dict] = {}
    stopped: dict[str, str] = {}
    base = dict(mode=MEMORY_MODE, causal=cfg.causal, dtype=cfg.dtype, d=cfg.d,
                batch=cfg.batch, heads=cfg.heads)
    try:
        for n in ns:
            active = [i for i in cfg.impls if i not in stopped]
            if not active:
                break
            try:
                inputs = common.make_inputs(cfg.batch, n, cfg.heads, cfg.d, cfg.dtype, device,
                                            cfg.seed)
                input_failure = None
            except Exception as exc:  # noqa: BLE001 - recorded for every impl
                if cfg.raise_errors:
                    raise
                inputs = None
                input_failure = (classify_error(exc, True),
                                 f"making the inputs: {first_line(exc)}")
            for impl in active:
                progress.set_description(f"memory {impl} n={n}")
                status, error, peak = "ok", None, None
                if input_failure is not None:
                    status, error = input_failure
                else:
                    try:
                        peak = measure_peak(impl, inputs, cfg.causal, mem)
                    except Exception as exc:  # noqa: BLE001
                        if cfg.raise_errors:
                            raise
                        status, error = classify_error(exc, IMPLS[impl].peer), first_line(exc)
                gc.collect()
                mem.empty_cache()
                rec = make_record(env, impl=impl, n=n, status=status, error=error,
                                  peak_bytes=peak, **base)
                records.append(rec)
                if status == "ok":
                    longest[impl] = rec
                else:
                    stopped[impl] = f"{status} at n={n}: {error}"
                progress.update(1)
                if is_fatal(error):
                    log(f"unrecoverable CUDA error ({impl}, n={n}): stopping the sweep")
                    stopped.update({i: f"not run after the CUDA error at n={n}"
                                    for i in cfg.impls if i not in stopped})
                    break
            del inputs
            gc.collect()
            mem.empty_cache()
            merge_result(results, KEY, records)
    finally:
        progress.close()
    for impl in cfg.impls:
        best = longest.get(impl)
        records.append(make_record(
            env, impl=impl, n=best["n"] if best else None,
            status="ok" if best else records_status(records, impl),
            error=stopped.get(impl), peak_bytes=best["peak_bytes"] if best else None,
            **{**base, "mode": MAX_SEQLEN_MODE}))
    merge_result(results, KEY, records)
    print(render_memory_table(records), file=stdout)
    written = [f"{results} [{KEY}]"]
    if cfg.plot:
        written += plot_memory(records, cfg.plots)
    log("wrote " + ", ".join(str(p) for p in written))
    return records


def records_status(records: list[dict], impl: str) -> str:
    """Status of ``impl``'s last memory record ("error" when it never ran)."""
    statuses = [r["status"] for r in records if r["impl"] == impl and r["mode"] == MEMORY_MODE]
    return statuses[-1] if statuses else "error"


def memory_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench memory",
        description="Peak extra CUDA memory of forward+backward against sequence length "
                    "(doubling from --n-min to --n-max), and the longest N each impl runs.")
    p.add_argument("--impl", nargs="+", default=None, metavar="NAME",
                   help=f"default flashtile sdpa_flash sdpa_math; any of {', '.join(IMPLS)}")
    p.add_argument("--n-min", type=parse_seqlen, default=1024, help="first N (default 1K)")
    p.add_argument("--n-max", type=parse_seqlen, default=256 * 1024,
                   help="last N of the doubling sweep (default 256K)")
    p.add_argument("--batch", type=positive_int, default=1, help="default 1")
    p.add_argument("--heads", type=positive_int, default=16, help="default 16")
    p.add_argument("--d", type=positive_int, default=128, help="head dim (default 128)")
    p.add_argument("--dtype", type=parse_dtype, default="bf16", help="default bf16")
    p.add_argument("--causal", choices=("0", "1"), default="0", help="default 0")
    common_arguments(p, KEY, "memory.png")
    return p


def parse_memory_args(argv: Sequence[str] | None = None) -> MemoryConfig:
    p = memory_parser()
    a = p.parse_args(argv)
    try:
        impls = parse_names(a.impl, list(IMPLS), "implementation")
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if a.n_min > a.n_max:
        p.error("--n-min is larger than --n-max")
    return MemoryConfig(
        device=a.device or default_device(), impls=impls or MemoryConfig.impls,
        n_min=a.n_min, n_max=a.n_max, batch=a.batch, heads=a.heads, d=a.d, dtype=a.dtype,
        causal=a.causal == "1", out=a.out, plots=a.plots, seed=a.seed, plot=a.plot,
        progress=a.progress, raise_errors=a.raise_errors)

def render_memory_table(records: list[dict]) -> str:
    """Peak extra memory (GiB) per sequence length and impl, and each impl's longest N."""
    mem = [r for r in records if r.get("mode") in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not mem:
        return "(no memory records)"
    parts = []
    for dev, recs in by_device(mem):
        impls = ordered((r["impl"] for r in recs), list(IMPLS))
        cells = {(r["n"], r["impl"]): r for r in recs if r["mode"] == MEMORY_MODE}
        longest = {r["impl"]: r for r in recs if r["mode"] == MAX_SEQLEN_MODE}
        rows = []
        for n in sorted({n for n, _ in cells}):
            row = [format_n(n)]
            for impl in impls:
                r = cells.get((n, impl))
                if r is None:
                    row.append("-")
                elif r.get("status") == "ok" and r.get("peak_bytes") is not None:
                    row.append(f"{r['peak_bytes'] / 2**30:.3f}")
                else:
                    row.append(STATUS_CELL.get(r.get("status"), str(r.get("status"))))
            rows.append(row)
        if longest:
            rows.append(["longest"] + [format_n(longest[i]["n"]) if i in longest else "-"
                                       for i in impls])
        parts.append((dev, markdown(["n"] + [f"{i} GiB" for i in impls], rows)))
    return sections(parts)



def plot_memory(records: list[dict], out_dir: Path | str) -> list[Path]:
    """Peak extra memory of fwd+bwd against N, one line per impl, longest N in the legend."""
    mem = [r for r in records if r.get("mode") in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not mem or not have_matplotlib():
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = by_device(mem)
    paths = []
    for dev, recs in groups:
        fig, ax = figure()
        longest = {r["impl"]: r["n"] for r in recs if r["mode"] == MAX_SEQLEN_MODE}
        sweep = [r for r in recs if r["mode"] == MEMORY_MODE]
        for impl in ordered((r["impl"] for r in sweep), list(IMPLS)):
            pts = {r["n"]: r["peak_bytes"] / 2**30 for r in sweep
                   if r["impl"] == impl and r.get("status") == "ok" and r.get("peak_bytes")}
            if pts:
                ns = sorted(pts)
                label = f"{impl} (longest {format_n(longest[impl])})" if impl in longest else impl
                ax.plot(ns, [pts[n] for n in ns], marker="o", label=label)
        if sweep:
            log2_axis(ax, sorted({r["n"] for r in sweep}))
        if ax.lines:
            ax.set_yscale("log")
            ax.legend(fontsize="small")
        first = sweep[0] if sweep else recs[0]
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("peak extra memory, fwd+bwd (GiB)")
        ax.grid(alpha=0.3, which="both")
        ax.set_title(f"memory: B={first['batch']}, H={first['heads']}, d={first['d']}, "
                     f"{first['dtype']}\n{dev}", fontsize="medium")
        fig.tight_layout()
        path = out_dir / (f"{slug(dev)}_memory.png" if len(groups) > 1 else "memory.png")
        fig.savefig(path, dpi=120)
        paths.append(path)
    return paths



def main(argv: Sequence[str] | None = None) -> int:
    """Run the memory benchmark (CUDA only: one clear line and exit status 2 elsewhere)."""
    mcfg = parse_memory_args(argv)
    if torch.device(mcfg.device).type != "cuda" or not torch.cuda.is_available():
        log("bench memory reads the CUDA allocator's peak counters and needs a CUDA device; "
            "on a CPU, `python -m flashtile` reports peak memory (one child process per "
            "implementation)")
        return 2
    records = run_memory(mcfg)
    return 1 if any(r["status"] == "error" for r in records) else 0
