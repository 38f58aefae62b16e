"""``python -m flashtile`` (or ``flashtile``): check correctness on this machine, then compare
speed and memory with PyTorch's attention.

On a GPU the Triton kernels run (bf16, N up to 8K); on a CPU the tiled torch backend runs (fp32,
N up to 4K) and the whole job takes well under a minute.  Subcommands run the other tools.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import subprocess
import sys
import time

import torch

from .backends import select

# name -> (module with main(argv), what it does); imported only when the subcommand runs
SUBCOMMANDS = {
    "check": ("flashtile.check", "full correctness suite (python -m flashtile.check)"),
    "bench": ("flashtile.bench.__main__",
              "benchmarks: speed, memory, report, decode, variants, ... "
              "(python -m flashtile.bench)"),
    "tune": ("flashtile.backends.triton.tune", "block-shape search for the Triton kernels (CUDA)"),
    "explain": ("flashtile.explain", "the interactive explainer of the algorithm"),
}


def _time_ms(fn, device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _naive(q, k, v, causal):
    """Standard attention: materialises the (B, H, N, N) score matrix."""
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _impls():
    """The three implementations compared, as ``label -> fn(q, k, v)`` (causal)."""
    from . import scaled_dot_product_attention
    return {"flashtile": lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True),
            "torch SDPA": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True),
            "standard": lambda q, k, v: _naive(q, k, v, True)}


def _proc_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise OSError(key)


def cpu_peak_mib(fn) -> float | None:
    """Peak resident memory that ``fn()`` adds, in MiB: Linux lets a process reset its
    high-water mark (``/proc/self/clear_refs``), so the peak is read around the call alone.
    None where /proc is not available.  Reliable only in a fresh process: memory freed by
    earlier work is reused without raising the resident size (see :func:`cpu_peak_in_child`)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_kib("VmRSS")
        fn()
        return (_proc_kib("VmHWM") - before) / 1024
    except OSError:
        return None


def _child_peak(label: str, n: int, d: int, heads: int) -> None:
    """In a fresh process: peak extra memory of one causal fp32 fwd+bwd of ``label``, printed
    as JSON. A small call first loads what every implementation needs once."""
    fn = _impls()[label]

    def step(n):
        q, k, v, do = (torch.randn(1, heads, n, d, requires_grad=(i < 3)) for i in range(4))
        return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)

    step(64)()
    run = step(n)
    print(json.dumps({"mib": cpu_peak_mib(run)}))


def cpu_peak_in_child(label: str, n: int, d: int, heads: int) -> float | None:
    """:func:`cpu_peak_mib` of one implementation's fwd+bwd, measured in a child process."""
    code = f"from flashtile.__main__ import _child_peak; _child_peak({label!r}, {n}, {d}, {heads})"
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=600, check=True)
        return json.loads(res.stdout.strip().splitlines()[-1])["mib"]
    except (subprocess.SubprocessError, OSError, ValueError, IndexError, KeyError):
        return None


def main(argv=None) -> int:
    """The default job: three correctness checks, a speed table and a memory table."""
    parser().parse_args(argv if argv is not None else [])  # -h, or an error for any argument
    from .check import Case, run_case

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    print(f"flashtile on {name}: backend '{select(device)}', torch {torch.__version__}")

    dtype = torch.bfloat16 if gpu else torch.float32
    checks = [Case("causal-gqa", 2, 200, 200, 8, 2, 64, dtype, causal=True),
              Case("sq<sk-odd-d", 1, 77, 301, 4, 4, 40, dtype),
              Case("window-softcap", 1, 256, 256, 4, 2, 64, dtype, window=(64, 0), softcap=20.0)]
    ok = True
    for c in checks:
        r = run_case(c, device)
        ok &= r["ok"]
        print(f"  check {c.name:<16} out err {r['out']:.1e} (bound {r['out_bound']:.1e}), "
              f"dq {r['dq']:.1e}, dk {r['dk']:.1e}, dv {r['dv']:.1e}: {'ok' if r['ok'] else 'FAILED'}")

    impls = _impls()
    sizes = [1024, 4096, 8192] if gpu else [512, 1024, 2048]
    d, heads = (128, 16) if gpu else (64, 8)
    print(f"\n  causal fwd+bwd, d={d}, {heads} heads, {str(dtype)[6:]}; time in ms "
          "(lower is better)")
    print(f"  {'N':>6} {'flashtile':>10} {'torch SDPA':>11} {'standard':>9}")
    for n in sizes:
        batch = max(1, 8192 // n) if gpu else 1
        q, k, v, do = (torch.randn(batch, heads, n, d, device=device, dtype=dtype,
                                   requires_grad=(i < 3)) for i in range(4))
        row = []
        for fn in impls.values():
            def step(fn=fn):
                torch.autograd.grad(fn(q, k, v), (q, k, v), do)
            try:
                row.append(f"{_time_ms(step, device):.2f}")
            except torch.OutOfMemoryError:
                row.append("OOM")
            if gpu:
                torch.cuda.empty_cache()
        print(f"  {n:>6} {row[0]:>10} {row[1]:>11} {row[2]:>9}")

    n = 8192 if gpu else 4096
    how = ("CUDA allocator peak" if gpu else
           "resident-memory high-water mark, each in its own process")
    print(f"\n  peak extra memory of one causal fwd+bwd at N={n}, d={d}, {heads} heads, in MiB "
          f"({how}):")
    if gpu:
        q, k, v, do = (torch.randn(1, heads, n, d, device=device, dtype=dtype,
                                   requires_grad=(i < 3)) for i in range(4))
    for label, fn in impls.items():
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.autograd.grad(fn(q, k, v), (q, k, v), do)
            torch.cuda.synchronize()
            mib = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            torch.cuda.empty_cache()
        else:
            mib = cpu_peak_in_child(label, n, d, heads)
        print(f"  {label:>11}: " + ("n/a" if mib is None else f"{mib:9.1f} MiB"))
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    width = max(map(len, SUBCOMMANDS))
    subs = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items())
    return argparse.ArgumentParser(
        prog="flashtile", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="flashtile [-h] | flashtile SUBCOMMAND [ARGS ...]",
        description="Without a subcommand: check correctness on this machine, then compare the\n"
                    "speed and memory of one causal forward+backward with PyTorch's SDPA and\n"
                    "standard attention (GPU: the Triton kernels, bf16, N up to 8K; CPU: the\n"
                    "torch backend, fp32, N up to 4K, well under a minute).",
        epilog=f"subcommands ('flashtile SUBCOMMAND -h' for each):\n{subs}")


def run_entry(target: str, argv: list, prog: str) -> int:
    """Run ``target`` (``module`` for its ``main``, or ``module:function``) with ``argv``,
    importing the module only now; exit status 2 with a one-line message when the module is not
    part of this installation (a missing dependency inside it still raises)."""
    module_name, _, entry = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"{prog}: {module_name} is not part of this installation", file=sys.stderr)
        return 2
    return getattr(module, entry or "main")(argv)


def cli(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return run_entry(SUBCOMMANDS[argv[0]][0], argv[1:], f"flashtile {argv[0]}")
    return main(argv)


if __name__ == "__main__":
    sys.exit(cli())
