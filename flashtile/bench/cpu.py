"""CPU benchmark: flashtile's torch backend against torch SDPA and naive attention.

One causal forward+backward at B=1, H=8, N=4096, d=64, float32 (by default), first on the
machine as it is ("quiet": run it when nothing else is busy) and then with one busy foreign
process that this script starts (a spinning Python loop, stopped at the end).
Implementations:

* ``flashtile``        ``flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)``
* ``flashtile_tiled``  the same call with the torch backend's tiled engine forced (what runs
                       for windows, softcap, ALiBi, dropout, biases, varlen, ...)
* ``flashtile_window`` ``flashtile.flash_attn_func(..., causal=True, window_size=(W, 0))``
                       (always the tiled engine; not comparable in FLOPs, shown for scale)
* ``sdpa``             ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)``
* ``naive``            ``softmax(mask(q k^T * scale)) v``, materialising ``N x N``

Method.  Every implementation runs in a worker process of its own (its own allocator and
thread pool), started once per condition; each worker first takes one step whose peak
resident-memory growth is read (VmHWM after resetting it; this also warms it up).  The timed
steps are then interleaved: in each of ``--reps`` rounds every worker takes one step of
``torch.autograd.grad(fn(), (q, k, v), dO)``, one worker at a time, the order rotated by one
every round, so that slow phases of a shared machine fall on every implementation alike.
Reported per implementation: the median, the minimum and the interquartile range (q1, q3) of
its steps; the ratio of its median to SDPA's; and the paired ratio (median and IQR over
rounds of its time divided by SDPA's time in the same round), the statistic least moved by
drifts in the machine's load.  The parent also counts the ATen ops of one step of each
implementation with a ``TorchDispatchMode`` (views included) at N and at 1024.  It writes a
JSON (device, versions, date, conditions, op counts, per-round times, statistics) and a PNG
of the medians with their IQR.

usage:
    python -m flashtile.bench cpu [--out FILE] [--png OUT.png] [--threads 2] [--reps 15]
        [--n 4096] [--conditions quiet,busy] [--impls flashtile,flashtile_tiled,sdpa,naive]

The result goes to entry ``cpu_b1h8n<N>`` of ``benchmarks/results/cpu.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import select
import statistics
import subprocess
import sys
import time

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flashtile
from flashtile.backends.torch import attention as torch_attention

from .common import results_path, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMPLS = ("flashtile", "flashtile_tiled", "flashtile_window", "sdpa", "naive")
WINDOW = 256


def make_fn(impl, q, k, v):
    """A zero-argument callable running implementation ``impl`` on SDPA-layout q, k, v."""
    N, D = q.shape[2], q.shape[3]
    if impl == "flashtile":
        return lambda: flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
    if impl == "flashtile_tiled":  # run inside engine(impl), which turns the routing off
        def tiled():
            with flashtile.use_backend("torch"):
                return flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
        return tiled
    if impl == "flashtile_window":
        def window():
            with flashtile.use_backend("torch"):
                out = flashtile.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2),
                                                v.transpose(1, 2), causal=True,
                                                window_size=(WINDOW, 0))
            return out.transpose(1, 2)
        return window
    if impl == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if impl == "naive":
        hidden = torch.ones(N, N, dtype=torch.bool).triu_(1)

        def naive():
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            return torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v
        return naive
    raise ValueError(f"unknown implementation {impl!r}; expected one of {', '.join(IMPLS)}")


@contextlib.contextmanager
def engine(impl):
    """Around whole steps (forward and backward): ``flashtile_tiled`` turns off the torch
    backend's routing to PyTorch's fused kernel."""
    old = torch_attention.USE_ATEN
    torch_attention.USE_ATEN = impl != "flashtile_tiled"
    try:
        yield
    finally:
        torch_attention.USE_ATEN = old


def inputs(N, H=8, D=64, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(impl, N):
    """ATen ops (every op the dispatcher sees from Python, views included) of one fwd+bwd."""
    q, k, v, do = inputs(N)
    fn = make_fn(impl, q, k, v)
    with engine(impl), _OpCounter() as counter:
        torch.autograd.grad(fn(), (q, k, v), do)
    return counter.count


def _kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def worker(impl, N, threads):
    """Runs in its own process: one measured step for memory, reported as a JSON line, then
    one timed step for each ``step`` line read from stdin (its time in seconds printed back),
    until ``quit`` or the end of stdin."""
    torch.set_num_threads(threads)
    q, k, v, do = inputs(N)
    fn = make_fn(impl, q, k, v)

    def step():
        with engine(impl):
            torch.autograd.grad(fn(), (q, k, v), do)

    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current VmRSS
        f.write("5")
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    extra = (_kib("VmHWM") - base) / 1024
    print(json.dumps(dict(first_s=first, extra_peak_mib=extra)), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        step()
        print(repr(time.perf_counter() - t0), flush=True)


@contextlib.contextmanager
def busy_process(active):
    """One foreign process spinning on a core while the block runs (when ``active``)."""
    if not active:
        yield None
        return
    # spins until stopped, or until this process is gone (it checks its parent every ~0.1 s)
    loop = ("import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n"
            "    for _ in range(10 ** 6):\n        pass\n")
    spin = subprocess.Popen([sys.executable, "-c", loop, str(os.getpid())])
    time.sleep(1.0)
    try:
        yield spin.pid
    finally:
        spin.kill()
        spin.wait()


class _Worker:
    """A worker process for one implementation, driven one step at a time."""

    def __init__(self, impl, N, threads):
        self.impl = impl
        cmd = [sys.executable, "-m", "flashtile.bench.cpu", "--worker", impl, "--n", str(N),
               "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT)

    def _line(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.impl}: no answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read().strip().splitlines()
            raise RuntimeError(f"{self.impl}: " + (err[-1] if err else
                                                   f"exit {self.proc.wait()}"))
        return line

    def start(self, timeout):
        """The first step's ``{"first_s", "extra_peak_mib"}``."""
        return json.loads(self._line(timeout))

    def step(self, timeout):
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self._line(timeout))

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _quartiles(xs):
    """``(q1, median, q3)`` (``statistics.quantiles``' exclusive method; one value: itself)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return q1, statistics.median(xs), q3


def _summary(times):
    q1, med, q3 = _quartiles(times)
    return dict(median_s=med, min_s=min(times), q1_s=q1, q3_s=q3, iqr_s=q3 - q1)


def run_condition(impls, N, threads, reps, timeout, settle=0.1):
    """Starts one worker per implementation, then ``reps`` interleaved rounds (rotated order).

    Returns ``{impl: result}``; a worker that fails keeps its error and drops out."""
    results, live = {}, {}
    try:
        for m in impls:
            w = _Worker(m, N, threads)
            try:
                results[m] = dict(w.start(timeout), times_s=[], round_of_time=[])
                live[m] = w
            except (TimeoutError, RuntimeError, ValueError) as e:
                results[m] = dict(error=str(e))
                w.proc.kill()
                w.proc.wait()
        order = [m for m in impls if m in live]
        for r in range(reps):
            for i in range(len(order)):
                m = order[(r + i) % len(order)]
                if m not in live:
                    continue
                time.sleep(settle)  # the previous worker's threads go idle
                try:
                    t = live[m].step(timeout)
                except (TimeoutError, RuntimeError, ValueError) as e:
                    results[m]["error"] = str(e)
                    live.pop(m).close()
                    continue
                results[m]["times_s"].append(t)
                results[m]["round_of_time"].append(r)
            print(f"  round {r + 1}/{reps}: " + ", ".join(
                f"{m} {results[m]['times_s'][-1] * 1e3:.0f} ms" for m in order
                if results[m].get("times_s") and results[m]["round_of_time"][-1] == r),
                flush=True)
    finally:
        for w in live.values():
            w.close()
    for m, res in results.items():
        if res.get("times_s"):
            res.update(_summary(res["times_s"]))
    base = results.get("sdpa", {})
    if base.get("times_s"):
        sdpa_round = dict(zip(base["round_of_time"], base["times_s"]))
        for m, res in results.items():
            if not res.get("times_s"):
                continue
            res["ratio_to_sdpa"] = res["median_s"] / base["median_s"]
            paired = [t / sdpa_round[r] for r, t in zip(res["round_of_time"], res["times_s"])
                      if r in sdpa_round]
            if paired:
                q1, med, q3 = _quartiles(paired)
                res["paired_ratio_to_sdpa"] = dict(median=med, q1=q1, q3=q3)
    return results


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _loadavg():
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return None


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = list(result["conditions"])
    impls = result["impls"]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(impls) * len(conds) / 2, 4.2))
    width = 0.8 / len(conds)
    for c_i, cond in enumerate(conds):
        rows = result["conditions"][cond]["results"]
        xs, ys, err = [], [], [[], []]
        for i_i, impl in enumerate(impls):
            row = rows.get(impl, {})
            med = row.get("median_s")
            if med is not None:
                xs.append(i_i + (c_i - (len(conds) - 1) / 2) * width)
                ys.append(med * 1e3)
                err[0].append((med - row["q1_s"]) * 1e3)
                err[1].append((row["q3_s"] - med) * 1e3)
        load = result["conditions"][cond].get("loadavg_before")
        label = cond if not load else f"{cond} (1-min load {load[0]:.1f} before)"
        bars = ax.bar(xs, ys, width, label=label, yerr=err, capsize=3)
        for bar, impl in zip(bars, [m for m in impls if rows.get(m, {}).get("median_s")]):
            ratio = rows[impl].get("ratio_to_sdpa")
            if ratio is not None:
                top = max(bar.get_height(), rows[impl]["q3_s"] * 1e3)  # above the IQR bar
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, top),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(impls)), impls, rotation=15)
    ax.set_ylabel("time of one fwd+bwd (ms): median, IQR")
    ax.set_yscale("log")
    s = result["shape"]
    ax.set_title(f"CPU, B{s['B']} H{s['H']} N{s['N']} d{s['D']} fp32 causal fwd+bwd, "
                 f"{result['threads']} threads, {result['reps']} interleaved rounds\n"
                 "(labels: ratio of medians to torch SDPA in the same condition)", fontsize=9)
    ax.legend(title="machine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashtile.bench cpu",
                                description=__doc__.split("\n\n")[0],
                                epilog="Writes entry cpu_b1h8n<N> of the results file.")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="results JSON (default benchmarks/results/cpu.json)")
    p.add_argument("--png", help="plot of the medians (default bench_out/cpu_b1h8n<N>.png)")
    p.add_argument("--n", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--reps", type=int, default=15,
                   help="interleaved rounds: timed steps per implementation (default 15)")
    p.add_argument("--conditions", default="quiet,busy",
                   help="comma list of quiet (as is) and busy (one spinning process)")
    p.add_argument("--impls", default="flashtile,flashtile_tiled,sdpa,naive",
                   help=f"comma list among {','.join(IMPLS)}")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds a worker may take to start or for one step")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.n, a.threads)
        return 0
    if a.reps < 1:
        p.error("--reps must be at least 1")
    impls = [m for m in a.impls.split(",") if m]
    for m in impls:
        if m not in IMPLS:
            p.error(f"--impls: unknown {m!r}; expected among {', '.join(IMPLS)}")
    conds = [c for c in a.conditions.split(",") if c]
    for c in conds:
        if c not in ("quiet", "busy"):
            p.error(f"--conditions: unknown {c!r}; expected quiet and/or busy")

    ops = {}
    for n in sorted({1024, a.n}):
        ops[str(n)] = {m: count_ops(m, n) for m in impls if not (m == "naive" and n > 4096)}
        print(f"ATen ops per fwd+bwd at N={n}: {ops[str(n)]}", flush=True)

    result = dict(
        benchmark="cpu causal fwd+bwd",
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=dict(cpu=_cpu_name(), logical_cpus=os.cpu_count(), machine=platform.machine()),
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      flashtile_commit=_git_commit()),
        shape=dict(B=1, H=8, N=a.n, D=64, dtype="float32", causal=True), threads=a.threads,
        reps=a.reps, impls=impls, window_for_flashtile_window=WINDOW,
        method="one worker process per implementation; rounds of one step each, interleaved, "
               "order rotated every round",
        aten_ops_fwd_bwd=ops, conditions={})
    for cond in conds:
        print(f"[{cond}]", flush=True)
        with busy_process(cond == "busy") as pid:
            entry = dict(busy_process_pid=pid, loadavg_before=_loadavg())
            entry["results"] = run_condition(impls, a.n, a.threads, a.reps, a.timeout)
            entry["loadavg_after"] = _loadavg()
        for m, r in entry["results"].items():
            if "median_s" not in r:
                print(f"[{cond}] {m}: {r.get('error')}", flush=True)
                continue
            line = (f"[{cond}] {m}: median {r['median_s'] * 1e3:.0f} ms (min "
                    f"{r['min_s'] * 1e3:.0f}, IQR {r['q1_s'] * 1e3:.0f}-{r['q3_s'] * 1e3:.0f}), "
                    f"extra peak {r['extra_peak_mib']:.0f} MiB")
            if "paired_ratio_to_sdpa" in r:
                pr = r["paired_ratio_to_sdpa"]
                line += (f"; {r['ratio_to_sdpa']:.2f}x SDPA's median, paired ratio "
                         f"{pr['median']:.2f} (IQR {pr['q1']:.2f}-{pr['q3']:.2f})")
            if "error" in r:
                line += f"; stopped: {r['error']}"
            print(line, flush=True)
        result["conditions"][cond] = entry
    out, key = results_path("cpu", a.out), f"cpu_b1h8n{a.n}"
    write_result(out, key, result)
    png = a.png or os.path.join("bench_out", f"{key}.png")
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    plot(result, png)
    print(f"wrote {out} [{key}] and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
