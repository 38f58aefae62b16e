"""CPU benchmark: flashtile's torch backend against torch SDPA and naive attention.

One causal forward+backward at B=1, H=8, N=4096, d=64, float32 (by default), each
implementation in a fresh process, first on the machine as it is ("quiet": run it when nothing
else is busy) and then with one busy foreign process that this script starts (a spinning
Python loop, stopped at the end).  Implementations:

* ``flashtile``        ``flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)``
* ``flashtile_tiled``  the same call with the torch backend's tiled engine forced (what runs
                       for windows, softcap, ALiBi, dropout, biases, varlen, ...)
* ``flashtile_window`` ``flashtile.flash_attn_func(..., causal=True, window_size=(W, 0))``
                       (always the tiled engine; not comparable in FLOPs, shown for scale)
* ``sdpa``             ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)``
* ``naive``            ``softmax(mask(q k^T * scale)) v``, materialising ``N x N``

Each child process times ``torch.autograd.grad(fn(), (q, k, v), dO)``: one step whose peak
resident-memory growth is read (VmHWM after resetting it), then ``--reps`` timed steps.  The
parent also counts the ATen ops of one step of each implementation with a
``TorchDispatchMode`` (views included) at N and at 1024.  It writes a JSON (device, versions,
date, conditions, op counts, per-rep times, medians, ratios to SDPA) and a PNG of the medians.

usage (from the repository root):
    python benchmarks/bench_cpu.py OUT.json [--png OUT.png] [--threads 2] [--reps 5]
        [--n 4096] [--conditions quiet,busy] [--impls flashtile,flashtile_tiled,sdpa,naive]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import flashtile  # noqa: E402
from flashtile.backends.torch import attention as torch_attention  # noqa: E402

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


def child(impl, N, threads, reps):
    """Runs in its own process: one measured step for memory, then ``reps`` timed steps."""
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
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(first_s=first, times_s=times, median_s=statistics.median(times),
                extra_peak_mib=extra)


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


def _run_child(impl, N, threads, reps, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--n", str(N),
           "--threads", str(threads), "--reps", str(reps)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout} s")
    if res.returncode != 0:
        return dict(error=res.stderr.strip().splitlines()[-1] if res.stderr.strip()
                    else f"exit {res.returncode}")
    return json.loads(res.stdout.strip().splitlines()[-1])


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
        xs, ys = [], []
        for i_i, impl in enumerate(impls):
            med = rows.get(impl, {}).get("median_s")
            if med is not None:
                xs.append(i_i + (c_i - (len(conds) - 1) / 2) * width)
                ys.append(med * 1e3)
        load = result["conditions"][cond].get("loadavg_before")
        label = cond if not load else f"{cond} (1-min load {load[0]:.1f} before)"
        bars = ax.bar(xs, ys, width, label=label)
        for bar, impl in zip(bars, [m for m in impls if rows.get(m, {}).get("median_s")]):
            ratio = rows[impl].get("ratio_to_sdpa")
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                              bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(impls)), impls, rotation=15)
    ax.set_ylabel("median time of one fwd+bwd (ms)")
    ax.set_yscale("log")
    s = result["shape"]
    ax.set_title(f"CPU, B{s['B']} H{s['H']} N{s['N']} d{s['D']} fp32 causal fwd+bwd, "
                 f"{result['threads']} threads\n(labels: ratio to torch SDPA in the same "
                 "condition)", fontsize=9)
    ax.legend(title="machine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="JSON file to write")
    p.add_argument("--png", help="plot of the medians (default: OUT with .png)")
    p.add_argument("--n", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--reps", type=int, default=5, help="timed steps per process")
    p.add_argument("--conditions", default="quiet,busy",
                   help="comma list of quiet (as is) and busy (one spinning process)")
    p.add_argument("--impls", default="flashtile,flashtile_tiled,sdpa,naive",
                   help=f"comma list among {','.join(IMPLS)}")
    p.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.n, a.threads, a.reps)))
        return 0
    if not a.out:
        p.error("give the JSON file to write")
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
        aten_ops_fwd_bwd=ops, conditions={})
    for cond in conds:
        with busy_process(cond == "busy") as pid:
            entry = dict(busy_process_pid=pid, loadavg_before=_loadavg(), results={})
            for m in impls:
                entry["results"][m] = r = _run_child(m, a.n, a.threads, a.reps, a.timeout)
                print(f"[{cond}] {m}: " + (f"median {r['median_s'] * 1e3:.0f} ms, extra peak "
                                           f"{r['extra_peak_mib']:.0f} MiB" if "error" not in r
                                           else r["error"]), flush=True)
            entry["loadavg_after"] = _loadavg()
        base = entry["results"].get("sdpa", {}).get("median_s")
        for m, r in entry["results"].items():
            if base and "median_s" in r:
                r["ratio_to_sdpa"] = r["median_s"] / base
        result["conditions"][cond] = entry
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    plot(result, png)
    print(f"wrote {a.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
