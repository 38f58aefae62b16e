"""Host-side cost of one eager ``flash_attn_with_kvcache`` call, measured on the CPU.

The Triton kernel launches are stubbed to no-ops that return None (a stand-in for an
asynchronous GPU launch), so what is timed is the Python work of the eager path: validation,
backend selection, the split heuristic, workspace allocation, argument preparation and (with
the default ``--stub run``) the ``triton.heuristics`` dispatch in front of each jitted kernel.
Triton's own launcher (argument binding and specialisation in ``JITFunction.run``, the driver
call) is *not* included; on the H100 host a launch was measured at about 60-130 us
(``benchmarks/results/overhead_h100.json``), so count that per launch on top.  ``--stub
getitem`` replaces the kernel objects themselves (``kernel[grid]`` returns a no-op), which
leaves out every line of Triton.

Tensors are CPU tensors of the decode benchmark's shapes (default: batch 1, cache 16K, 32 query
heads over 8 KV heads, head dim 128, bf16).  With ``--as-cuda`` (the default) the parts of the
path that differ between CPU and CUDA tensors follow the CUDA branch: index values are not
checked on the host (``FLASHTILE_CHECK_INDICES`` unset), the SM count is ``--sms`` and the GPU
block shapes are used, so the split count and hence the combine launch match the H100 run.
``--as-cpu`` keeps the CPU rules (index values checked on the host, one split).

    python benchmarks/decode_host_profile.py
    python benchmarks/decode_host_profile.py --step          # append 1 token with rotary, causal
    python benchmarks/decode_host_profile.py --paged 256     # paged cache, 256-slot pages
    python benchmarks/decode_host_profile.py --as-cpu --calls 5000
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

# the triton backend serves CPU tensors only under the interpreter; it must be set before triton
# decorates the kernels.  No kernel runs: every launch below is stubbed.
os.environ["TRITON_INTERPRET"] = "1"
os.environ.pop("FLASHTILE_BACKEND", None)
os.environ.pop("FLASHTILE_CHECK_INDICES", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import flashtile  # noqa: E402
from flashtile import decode  # noqa: E402
from flashtile.backends.triton import launch_decode  # noqa: E402
from flashtile.backends.triton.kernels import decode as kernel_module  # noqa: E402

_KERNELS = ("_split_kv_kernel", "_combine_kernel", "_rotary_append_kernel")


class _StubLaunch:
    """Stand-in for a kernel launch: counts the call and returns None."""

    def __init__(self, name: str, counts: dict):
        self.name = name
        self.counts = counts

    def __call__(self, *args, **kwargs):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1


class _StubKernel:
    """Replaces a whole kernel object: ``kernel[grid](*args, **meta)`` returns None."""

    def __init__(self, launch: _StubLaunch):
        self._launch = launch

    def __getitem__(self, grid):
        return self._launch


def stub_kernels(counts: dict, level: str) -> None:
    """Make every decode kernel launch a no-op.

    ``level="run"``: only the innermost jitted function's ``run`` (what ``kernel[grid](...)``
    ends in) is replaced, so wrappers such as ``triton.heuristics`` still do their host work
    and are timed.  ``level="getitem"``: the kernel objects themselves are replaced, so
    ``kernel[grid]`` returns a no-op and nothing of Triton is timed.
    """
    for name in _KERNELS:
        kernel = getattr(kernel_module, name)
        launch = _StubLaunch(name, counts)
        if level == "getitem":
            setattr(launch_decode, name, _StubKernel(launch))
            continue
        inner = kernel
        while hasattr(inner, "fn") and hasattr(inner.fn, "run"):  # heuristics / autotuner wrappers
            inner = inner.fn
        inner.run = launch


def emulate_cuda(sms: int) -> None:
    """Follow the CUDA-tensor branches of the eager path while running on CPU tensors."""
    decode._check_indices_enabled = lambda device: False
    launch_decode._on_gpu = lambda x: True
    launch_decode.num_sms = lambda device: sms


def build_call(args):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, n, h, hk, d = args.batch, args.cache, args.nheads, args.nheads_k, args.headdim
    torch.manual_seed(0)
    q = torch.randn(b, 1, h, d, dtype=dtype)
    if args.paged:
        page = args.paged
        per = n // page
        kc = torch.zeros(b * per, page, hk, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        table = torch.randperm(b * per).reshape(b, per).to(torch.int32)
    else:
        kc = torch.zeros(b, n, hk, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        table = None
    if args.step:
        lens = torch.full((b,), n - 1, dtype=torch.int32)
        k_new = torch.randn(b, 1, hk, d, dtype=dtype)
        v_new = torch.randn(b, 1, hk, d, dtype=dtype)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos(), ang.sin()

        def call():
            return flashtile.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos,
                                                     rotary_sin=sin, cache_seqlens=lens,
                                                     block_table=table, causal=True)
    else:
        lens = torch.full((b,), n, dtype=torch.int32)

        def call():
            return flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)
    return call


def time_calls(call, calls: int, repeats: int) -> tuple[list[float], list[float]]:
    """Microseconds per call, one value per repeat of ``calls`` back-to-back calls: wall clock,
    and CPU time of this thread (less sensitive to other processes on a busy machine)."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            call()
        c1, t1 = time.thread_time(), time.perf_counter()
        wall.append((t1 - t0) / calls * 1e6)
        cpu.append((c1 - c0) / calls * 1e6)
    return wall, cpu


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache", type=int, default=16384)
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--nheads-k", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--paged", type=int, default=0, metavar="PAGE_SIZE", help="paged cache with this page size")
    p.add_argument("--step", action="store_true", help="append one new k/v token with rotary (causal)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--as-cuda", dest="as_cuda", action="store_true", default=True,
                      help="follow the CUDA-tensor branches (default)")
    mode.add_argument("--as-cpu", dest="as_cuda", action="store_false", help="follow the CPU-tensor branches")
    p.add_argument("--stub", choices=("run", "getitem"), default="run",
                   help="run: stub the jitted function's run (triton.heuristics dispatch is timed); "
                        "getitem: replace the kernel objects (no Triton code is timed)")
    p.add_argument("--sms", type=int, default=132, help="SM count with --as-cuda (H100 SXM: 132)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--top", type=int, default=20, help="rows of the cProfile table")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative, ...)")
    args = p.parse_args(argv)

    counts: dict = {}
    stub_kernels(counts, args.stub)
    if args.as_cuda:
        emulate_cuda(args.sms)
    torch.set_num_threads(1)
    call = build_call(args)

    for _ in range(50):  # warm-up
        call()
    counts.clear()
    call()
    launches = dict(counts)
    # the split count this call resolves to (num_splits=0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    q_like = torch.empty(args.batch, 1, args.nheads, args.headdim, dtype=dtype)
    splits = launch_decode.default_num_splits(q_like, args.nheads_k, args.cache)

    wall, cpu = time_calls(call, args.calls, args.repeats)
    print(f"torch {torch.__version__}  python {sys.version.split()[0]}  threads {torch.get_num_threads()}")
    layout = f", paged {args.paged}" if args.paged else ""
    step = ", step (append+rotary)" if args.step else ""
    branches = f"cuda (sms={args.sms})" if args.as_cuda else "cpu"
    print(f"shape: batch {args.batch}, cache {args.cache}, heads {args.nheads}/{args.nheads_k}, d {args.headdim}, "
          f"{args.dtype}{layout}{step}; branches: {branches}; stub level: {args.stub}")
    print(f"num_splits {splits}; stubbed launches per call: "
          + ", ".join(f"{k} x{v}" for k, v in sorted(launches.items())))
    print(f"host time per call ({args.repeats} x {args.calls} calls): "
          f"wall min {min(wall):.1f} us, median {statistics.median(wall):.1f} us; "
          f"thread CPU min {min(cpu):.1f} us, median {statistics.median(cpu):.1f} us")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats(args.sort).print_stats(args.top)
    print(f"\ncProfile over {args.calls} calls (profiler overhead inflates the absolute times), "
          f"top {args.top} by {args.sort}:")
    print(buf.getvalue())


if __name__ == "__main__":
    main()
