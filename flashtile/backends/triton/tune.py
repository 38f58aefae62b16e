"""Search block shapes for the Triton kernels on a CUDA GPU: ``flashtile tune`` (or
``python -m flashtile.backends.triton.tune``).

For each (pass, head dim, causal) it times every config of a pruned space on the benchmark
shape (16K tokens, hidden 2048, bf16) and reports the fastest; the winners are pasted into
``flashtile/backends/triton/configs.py:TUNED`` so a first call never tunes.  Kernels are compiled
in parallel worker processes first (Triton caches them on disk), so the timing loop only
measures.  The backward is tuned in two steps: dK/dV with the default dQ config, then dQ with
the best dK/dV config.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from ..spec import AttnSpec
from . import backward, forward
from .configs import KernelConfig, get_config, override


def space(pass_: str, d: int) -> list[KernelConfig]:
    if pass_ == "fwd":
        bms, bns = (64, 128), ((32, 64) if d > 128 else (32, 64, 128))
    elif pass_ == "dkdv":
        bms, bns = ((16, 32, 64) if d > 128 else (32, 64)), ((32, 64) if d > 128 else (64, 128))
    else:  # dq
        bms, bns = ((32, 64) if d > 128 else (64, 128)), ((16, 32) if d > 128 else (32, 64))
    out = []
    for bm, bn, w, s in itertools.product(bms, bns, (4, 8), (2, 3, 4) if pass_ == "fwd" else (1, 2, 3, 4, 5)):
        if bm * bn >= 128 * 128 and w == 4 and d > 64:
            continue  # accumulators would spill at 4 warps
        if bm * bn <= 64 * 32 and w == 8:
            continue  # too little work per warp
        out.append(KernelConfig(bm, bn, w, s))
    return out


def shape(d: int, n: int, tokens: int = 16384, hidden: int = 2048):
    return max(1, tokens // n), n, hidden // d, d


def make(batch, n, heads, d, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(batch, n, heads, d, device=device, dtype=dtype, generator=g)
                   for _ in range(4))
    return q, k, v, do


def run_pass(pass_, q, k, v, do, spec, out=None, lse=None):
    if pass_ == "fwd":
        return forward(q, k, v, spec)
    return backward(do, q, k, v, out, lse, spec)


def _pins(pass_, cfg, best):
    pins = {pass_: cfg}
    if pass_ == "dq" and best.get("dkdv"):
        pins["dkdv"] = best["dkdv"]
    return pins


def _compile_one(job):
    pass_, d, causal, dtype_name, cfg, best = job
    dtype = getattr(torch, dtype_name)
    batch, _, heads, _ = shape(d, 8192)
    q, k, v, do = make(1, 256, heads, d, dtype, "cuda")
    spec = AttnSpec(1 / math.sqrt(d), -1, 0 if causal else -1)
    try:
        out, lse = forward(q, k, v, spec)
        with override(**_pins(pass_, cfg, best)):
            run_pass(pass_, q, k, v, do, spec, out, lse)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # a config that does not compile is reported, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def flops(pass_, batch, n, heads, d, causal):
    f = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
    return f if pass_ == "fwd" else 2.5 * f


def tune(pass_, d, causal, dtype, n, jobs, best, log):
    from triton.testing import do_bench
    cfgs = space(pass_, d)
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        errors = list(ex.map(_compile_one, [(pass_, d, causal, str(dtype)[6:], c, best)
                                            for c in cfgs]))
    batch, n, heads, d = shape(d, n)
    q, k, v, do = make(batch, n, heads, d, dtype, "cuda")
    spec = AttnSpec(1 / math.sqrt(d), -1, 0 if causal else -1)
    out, lse = forward(q, k, v, spec)
    rows = []
    for cfg, err in zip(cfgs, errors):
        row = dict(pass_=pass_, d=d, causal=causal, n=n, batch=batch, heads=heads,
                   dtype=str(dtype)[6:], cfg=list(cfg.__dict__.values()))
        if err:
            row.update(status="error", error=err)
        else:
            try:
                with override(**_pins(pass_, cfg, best)):
                    ms = do_bench(lambda: run_pass(pass_, q, k, v, do, spec, out, lse),
                                  warmup=25, rep=100, return_mode="median")
                row.update(status="ok", ms=ms, tflops=flops(pass_, batch, n, heads, d, causal) / ms / 1e9)
            except Exception as e:
                row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rows.append(row)
        log(row)
    ok = [r for r in rows if r["status"] == "ok"]
    default = get_config(pass_, d, causal, dtype, q.device)
    win = min(ok, key=lambda r: r["ms"]) if ok else None
    return rows, (KernelConfig(*win["cfg"]) if win else default)


def peers(d, causal, dtype, n, log):
    """SDPA flash and cuDNN on the same shape, for the ratio in the log."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    batch, n, heads, d = shape(d, n)
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in make(batch, n, heads, d, dtype, "cuda"))
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        try:
            with sdpa_kernel(be):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)  # noqa
                ms_f = do_bench(fn, warmup=25, rep=100, return_mode="median")
                o = fn()
                ms_b = do_bench(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True),
                                warmup=25, rep=100, return_mode="median")
        except Exception as e:
            print(name, "unsupported:", str(e).splitlines()[0][:120])
            continue
        for pass_, ms in (("fwd", ms_f), ("bwd", ms_b)):
            log(dict(pass_=name + ":" + pass_, d=d, causal=causal, n=n, batch=batch, heads=heads,
                     dtype=str(dtype)[6:], cfg=[], status="ok", ms=ms,
                     tflops=flops(pass_, batch, n, heads, d, causal) / ms / 1e9))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="flashtile tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, nargs="+", default=[128])
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--passes", default="fwd,dkdv,dq")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    p.add_argument("--out", default="tune.json")
    p.add_argument("--peers", action="store_true", help="also time SDPA flash and cuDNN")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashtile tune times the Triton kernels on a CUDA GPU; no CUDA device is "
              "available here", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    records, table = [], {}
    arch = "sm%d%d" % torch.cuda.get_device_capability()
    t0 = time.time()

    def log(row):
        records.append(row)
        desc = f"{row['pass_']:14s} d={row['d']} causal={int(row['causal'])} cfg={row['cfg']}"
        print(desc, f"{row['tflops']:7.1f} TFLOP/s" if row["status"] == "ok" else row["error"],
              flush=True)

    for d, causal in itertools.product(args.d, causals):
        if args.peers:
            peers(d, causal, dtype, args.n, log)
        best = {}
        for pass_ in args.passes.split(","):
            _, win = tune(pass_, d, causal, dtype, args.n, args.jobs, best, log)
            best[pass_] = win
            table[(arch, pass_, d, causal, args.dtype)] = tuple(win.__dict__.values())
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "records": records,
                   "winners": [list(k) + list(v) for k, v in table.items()]}, f, indent=1)
    print("TUNED entries:")
    for key, val in table.items():
        print(f"    {key!r}: {val!r},")
    print(f"tuned in {time.time() - t0:.0f}s; median of winners:",
          statistics.median([r["tflops"] for r in records if r["status"] == "ok"] or [0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
