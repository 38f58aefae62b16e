"""Host cost per call and the short-sequence forward, with and without direct launches (GPU).

    python benchmarks/overhead.py OUT.json [--profile]

1. Wall-clock microseconds per call on a tiny input, where the GPU work is negligible, so this
   is the Python + launch cost: SDPA flash, flashtile's public forward and forward+backward, and
   the Triton forward launcher alone; each with direct launches on and off
   (``fastlaunch.direct_launches``); then
   forward+backward with the backward's launch plans (``launch_bwd.PLANS``) off and on,
   alternating over three rounds.
2. Forward milliseconds at N=512 and 1K (16K tokens, hidden 2048, d=64 and 128, bf16, causal and
   not) through ``flash_attn_func`` against SDPA flash, medians of ``triton.testing.do_bench``.
3. ``--profile``: the cProfile of a forward+backward through the public call, direct launches on.
"""
import cProfile
import io
import json
import math
import pstats
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import forward, launch_bwd
from flashtile.backends.triton.fastlaunch import direct_launches


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def host_costs() -> dict:
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    qg = q.clone().requires_grad_()
    spec = AttnSpec(0.125, -1, 0)
    qt = q.transpose(1, 2)
    rec = {}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rec["sdpa_flash_fwd_us"] = per_call_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True))
        qtg = qg.transpose(1, 2)
        rec["sdpa_flash_fwd_bwd_us"] = per_call_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(qtg, qtg, qtg, is_causal=True)
            .sum().backward(), n=500)
    for direct in (False, True):
        tag = "direct" if direct else "triton_run"
        with direct_launches(direct):
            rec[f"flashtile_fwd_us_{tag}"] = per_call_us(
                lambda: flashtile.flash_attn_func(q, q, q, causal=True))
            rec[f"flashtile_fwd_bwd_us_{tag}"] = per_call_us(
                lambda: flashtile.flash_attn_func(qg, qg, qg, causal=True).sum().backward(), n=500)
            rec[f"launcher_fwd_us_{tag}"] = per_call_us(lambda: forward(q, q, q, spec))
    # backward launch plans off and on, alternating, direct launches on; a contiguous output
    # gradient as in training (the gradient of .sum() is an expanded tensor, which the plans
    # leave to the full path)
    k, v = qg.detach().clone().requires_grad_(), qg.detach().clone().requires_grad_()
    dout = torch.randn_like(q)
    for rnd in range(3):
        for plans in (False, True):
            launch_bwd.PLANS = plans
            tag = f"bwd_plans_{'on' if plans else 'off'}_round{rnd}"
            rec[f"flashtile_fwd_bwd_us_direct_{tag}"] = per_call_us(
                lambda: flashtile.flash_attn_func(qg, k, v, causal=True).backward(dout), n=500)
    launch_bwd.PLANS = True
    return rec


def short_n() -> list:
    rows = []
    for d in (64, 128):
        for n in (512, 1024):
            b, h = 16384 // n, 2048 // d
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1)
                row = dict(d=d, n=n, causal=causal)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    row["sdpa_flash_ms"] = do_bench(
                        lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                        warmup=25, rep=100, return_mode="median")
                for direct in (False, True):
                    with direct_launches(direct):
                        row[f"flashtile_ms_{'direct' if direct else 'triton_run'}"] = do_bench(
                            lambda: flashtile.flash_attn_func(q, k, v, causal=causal), warmup=25,
                            rep=100, return_mode="median")
                row["ratio_vs_fa2_direct"] = row["sdpa_flash_ms"] / row["flashtile_ms_direct"]
                row["tflops_direct"] = flops / row["flashtile_ms_direct"] / 1e9
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def profile_call(n=1000, top=30) -> str:
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        flashtile.flash_attn_func(q, q, q, causal=True).sum().backward()

    with direct_launches(True):
        for _ in range(50):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            step()
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(out_path):
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d")}
    rec.update(host_costs())
    print({k: round(v, 1) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
    rec["short_n"] = short_n()
    if "--profile" in sys.argv:
        rec["profile"] = profile_call()
        print(rec["profile"])
    with open(out_path, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "overhead.json")
