"""Tables and plots of benchmark records, and ``python -m flashtile.bench report``.

The helpers here (markdown tables that say their unit, matplotlib figures, device grouping) serve
every sweep's own table and plots; :func:`render_table` and :func:`plot` are the speed
benchmark's.  The ``report`` subcommand prints the tables and draws the plots of saved results:

    python -m flashtile.bench report [FILE ...] [--plots DIR] [--device TEXT]
        [--ratio-png FILE [--ratio-to IMPL]]

``FILE`` is a results file (``benchmarks/results/<device>.json``, default: every results file
there; its entries ``speed``, ``memory`` and ``variants``) or a plain JSON list of records;
speed, memory and variants records are told apart by their fields.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

from .common import (IMPLS, MAX_SEQLEN_MODE, MEMORY_MODE, MODES, RESULTS_DIR, load_records, log,
                     merge_records, read_results)

def format_n(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt_tflops(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


SPEED_UNIT = ("TFLOP/s (FlashAttention's FLOP count, higher is better); "
              "ft/X = flashtile's TFLOP/s over X's")
STATUS_CELL = {"oom": "oom", "unsupported": "unsup", "error": "error"}


def _cell(rec: dict | None) -> str:
    if rec is None:
        return "-"
    if rec.get("status") == "ok" and rec.get("tflops") is not None:
        return _fmt_tflops(rec["tflops"])
    return STATUS_CELL.get(rec.get("status"), str(rec.get("status")))


def markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def ordered(values: Iterable, preferred: Sequence) -> list:
    seen = list(dict.fromkeys(values))
    return [v for v in preferred if v in seen] + [v for v in seen if v not in preferred]


def by_device(records: list[dict]) -> list[tuple[str, list[dict]]]:
    devices = list(dict.fromkeys(r.get("device") for r in records))
    return [(dev, [r for r in records if r.get("device") == dev]) for dev in devices]


def sections(parts: list[tuple[str, str]]) -> str:
    if len(parts) == 1:
        return parts[0][1]
    return "\n\n".join(f"device: {dev}\n{text}" for dev, text in parts)


def render_table(records: list[dict], reference: str = "flashtile") -> str:
    """TFLOP/s per (mode, causal, dtype, d, n) row and impl column, under a line that says so,
    plus ``ft/<peer>`` ratio columns (reference TFLOP/s over the peer's; "-" unless both ran).
    A later record for the same cell wins. Failed cells show "oom", "unsup" or "error"."""
    speed = [r for r in records if r.get("mode") not in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not speed:
        return "(no speed records)"
    parts = []
    mode_order = {m: i for i, m in enumerate(MODES)}
    for dev, recs in by_device(speed):
        impls = ordered((r["impl"] for r in recs), list(IMPLS))
        peers = [i for i in impls if i != reference] if reference in impls else []
        cells: dict[tuple, dict] = {}
        for r in recs:
            key = (r["mode"], bool(r["causal"]), r["dtype"], r["d"], r["n"], r["batch"], r["heads"])
            cells[key + (r["impl"],)] = r
        keys = sorted({k[:-1] for k in cells},
                      key=lambda k: (mode_order.get(k[0], len(mode_order)), k[0], k[1], k[2],
                                     k[3], k[4], k[5], k[6]))
        header = ["mode", "causal", "dtype", "d", "n", "B", "H"] + impls
        header += [f"ft/{p}" for p in peers]
        rows = []
        for key in keys:
            mode, causal, dtype, d, n, batch, heads = key
            row = [mode, "1" if causal else "0", dtype, str(d), format_n(n), str(batch), str(heads)]
            row += [_cell(cells.get(key + (i,))) for i in impls]
            ref = cells.get(key + (reference,))
            for p in peers:
                peer = cells.get(key + (p,))
                ok = (ref is not None and peer is not None and ref.get("status") == "ok"
                      and peer.get("status") == "ok" and peer.get("tflops"))
                row.append(f"{ref['tflops'] / peer['tflops']:.2f}" if ok else "-")
            rows.append(row)
        parts.append((dev, SPEED_UNIT + "\n" + markdown(header, rows)))
    return sections(parts)

def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", str(text)).strip("_").lower() or "device"


def figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def log2_axis(ax, ns: list[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([format_n(n) for n in ns])
    ax.xaxis.set_minor_locator(NullLocator())


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("matplotlib is not installed: no plots (pip install matplotlib)")
        return False
    return True


def _shape_note(recs: list[dict]) -> list[str]:
    """"B*N=16384" / "H=16" when constant over ``recs``."""
    tokens = {r["batch"] * r["n"] for r in recs}
    heads = {r["heads"] for r in recs}
    notes = [f"B*N={tokens.pop()}"] if len(tokens) == 1 else []
    return notes + ([f"H={heads.pop()}"] if len(heads) == 1 else [])


def plot(records: list[dict], out_dir: Path | str) -> list[Path]:
    """One PNG per (mode, causal, dtype, d): TFLOP/s against N, one line per impl.

    File names are ``{mode}_{causal|full}_{dtype}_d{d}.png``, prefixed by the device when the
    records come from several devices."""
    speed = [r for r in records if r.get("mode") not in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not speed or not have_matplotlib():
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = by_device(speed)
    paths = []
    for dev, recs in groups:
        keys = sorted({(r["mode"], bool(r["causal"]), r["dtype"], r["d"]) for r in recs},
                      key=lambda k: (list(MODES).index(k[0]) if k[0] in MODES else 99, k))
        for mode, causal, dtype, d in keys:
            sel = [r for r in recs if (r["mode"], bool(r["causal"]), r["dtype"], r["d"])
                   == (mode, causal, dtype, d)]
            fig, ax = figure()
            for impl in ordered((r["impl"] for r in sel), list(IMPLS)):
                pts = {r["n"]: r["tflops"] for r in sel
                       if r["impl"] == impl and r.get("status") == "ok" and r.get("tflops")}
                if pts:
                    ns = sorted(pts)
                    ax.plot(ns, [pts[n] for n in ns], marker="o", label=impl)
            log2_axis(ax, sorted({r["n"] for r in sel}))
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
            shape = ", ".join(_shape_note(sel))
            ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}, {dtype}, d={d}"
                         f"{', ' + shape if shape else ''}\n{dev}", fontsize="medium")
            fig.tight_layout()
            name = f"{mode}_{'causal' if causal else 'full'}_{dtype}_d{d}.png"
            path = out_dir / (f"{slug(dev)}_{name}" if len(groups) > 1 else name)
            fig.savefig(path, dpi=120)
            paths.append(path)
    return paths


def plot_ratio(records: list[dict], peer: str, path: Path | str, impl: str = "flashtile",
               dtype: str = "bf16") -> Path | None:
    """One PNG: ``impl``'s TFLOP/s over ``peer``'s, measured in the same run, for every
    (mode, causal) panel and (d, N) shape, one bar per device; the line at 1.0 is parity.
    None when no shape has both (or matplotlib is missing)."""
    speed = [r for r in records if r.get("mode") in MODES and r.get("dtype") == dtype
             and r.get("status") == "ok" and r.get("tflops")]
    cases = {}
    for r in speed:
        if r["impl"] in (impl, peer):
            key = (r.get("device"), r["mode"], bool(r["causal"]), r["d"], r["n"])
            cases.setdefault(key, {})[r["impl"]] = r["tflops"]
    ratios = {k: v[impl] / v[peer] for k, v in cases.items() if impl in v and peer in v}
    if not ratios or not have_matplotlib():
        return None
    import matplotlib.pyplot as plt

    devices = sorted({k[0] for k in ratios})
    panels = [(mode, causal) for mode in MODES for causal in (False, True)
              if any(k[1:3] == (mode, causal) for k in ratios)]
    shapes_of = {p: sorted({(k[3], k[4]) for k in ratios if k[1:3] == p}) for p in panels}
    # a full-width panel per (mode, causal), a column of bars per shape, the labels upright
    # (many head dims and lengths: side by side panels would print them over each other)
    most = max(len(v) for v in shapes_of.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 0.28 * most + 1.5),
                                                      2.6 * len(panels)),
                             squeeze=False, sharey=True)
    width = 0.8 / len(devices)
    for ax, (mode, causal) in zip(axes[:, 0], panels):
        shapes = shapes_of[(mode, causal)]
        for i, dev in enumerate(devices):
            xs = [j + (i - (len(devices) - 1) / 2) * width for j in range(len(shapes))]
            ys = [ratios.get((dev, mode, causal, d, n), 0.0) for d, n in shapes]
            ax.bar(xs, ys, width, label=dev)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"d{d} {format_n(n)}" for d, n in shapes], fontsize="small",
                           rotation=90)
        ax.set_xlim(-0.6, max(len(shapes), most) - 0.4)
        ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}", fontsize="medium")
        ax.set_ylabel(f"{impl} / {peer}")
        ax.grid(axis="y", alpha=0.3)
    # (above the first panel: inside it would cover bars)
    axes[0][0].legend(fontsize="small", ncol=len(devices), loc="lower right",
                      bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(f"{impl} over {peer}, {dtype}, same run per device (1.0 = parity)",
                 fontsize="medium")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# The report subcommand
# --------------------------------------------------------------------------------------------

def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench report",
        description="Print the tables and draw the plots of saved results: results files "
                    "(one JSON object per device, an entry per benchmark) or JSON lists of "
                    "records.")
    p.add_argument("files", nargs="*", type=Path,
                   help=f"default: every {RESULTS_DIR}/*.json")
    p.add_argument("--plots", type=Path, default=None,
                   help="write plots here (default: no plots)")
    p.add_argument("--device", default=None,
                   help="keep only records whose device name contains this text")
    p.add_argument("--ratio-png", type=Path, default=None, metavar="FILE",
                   help="also draw flashtile's TFLOP/s over --ratio-to's for every shape and "
                        "device in one figure")
    p.add_argument("--ratio-to", default="sdpa_default", metavar="IMPL",
                   help="the peer of --ratio-png (default: sdpa_default, PyTorch's own choice)")
    return p


REPORT_KEYS = ("speed", "memory", "variants")  # the results-file entries report reads


def _records_of(path: Path) -> list[dict]:
    """The speed, memory and variants records of a results file, or the records of a JSON
    list."""
    try:
        data = read_results(path)
    except ValueError:  # not an object: a JSON list of records
        return load_records(path)
    return [r for key in REPORT_KEYS for r in load_records(path, key)] if data else []


def run_report(argv: Sequence[str], stdout=None) -> int:
    from . import variants as bench_variants  # these two draw on the helpers above
    from .memory import plot_memory, render_memory_table

    stdout = stdout or sys.stdout
    a = report_parser().parse_args(argv)
    files = a.files or sorted(RESULTS_DIR.glob("*.json"))
    records: list[dict] = []
    variants: list[dict] = []
    for path in files:
        loaded = _records_of(path)
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
    if a.plots is not None:
        paths = plot(speed, a.plots) + plot_memory(memory, a.plots)
        paths += bench_variants.plot(variants, a.plots) if variants else []
        log("wrote " + (", ".join(map(str, paths)) or "no plots"))
    if a.ratio_png is not None:
        path = plot_ratio(speed, a.ratio_to, a.ratio_png)
        log(f"wrote {path}" if path else f"no shape has both flashtile and {a.ratio_to}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_report(list(sys.argv[1:] if argv is None else argv))
