"""Host-side cost per call and short-sequence configs (GPU): ``python benchmarks/overhead.py``.

1. Wall-clock microseconds per call on a tiny input (the GPU work is negligible, so this is the
   Python + launch cost): flashtile's public call, its Triton launcher alone, and SDPA flash.
2. Forward TFLOP/s at N=512 and 1K (16K tokens, hidden 2048, d=128, bf16) for several tilings,
   to see whether short sequences want other tiles than the N=8K winners.
"""
import json
import math
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import forward
from flashtile.backends.triton.configs import KernelConfig, override


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main(out_path):
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    spec = AttnSpec(0.125, -1, 0)
    qt = q.transpose(1, 2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rec["sdpa_flash_us"] = per_call_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True))
    rec["flashtile_us"] = per_call_us(lambda: flashtile.flash_attn_func(q, q, q, causal=True))
    rec["launcher_us"] = per_call_us(lambda: forward(q, q, q, spec))
    print({k: round(v, 1) if isinstance(v, float) else v for k, v in rec.items()})
    rows = []
    for n in (512, 1024):
        b, h, d = 16384 // n, 16, 128
        qq, kk, vv = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            sp = AttnSpec(1 / math.sqrt(d), -1, 0 if causal else -1)
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1)
            for cfg in [(128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                        (64, 128, 4, 3), (128, 32, 8, 3), (64, 32, 4, 2)]:
                with override(fwd=KernelConfig(*cfg)):
                    ms = do_bench(lambda: forward(qq, kk, vv, sp), warmup=25, rep=100,
                                  return_mode="median")
                rows.append(dict(n=n, causal=causal, cfg=cfg, tflops=flops / ms / 1e9))
                print(rows[-1])
    rec["short_n"] = rows
    with open(out_path, "w") as f:
        json.dump(rec, f, indent=1)




def profile_launch(n=2000, top=25):
    """cProfile of the Triton launcher on a tiny input: where the host time goes."""
    import cProfile
    import io
    import pstats
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    spec = AttnSpec(0.125, -1, 0)
    for _ in range(50):
        forward(q, q, q, spec)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        forward(q, q, q, spec)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


if __name__ == "__main__":
    if "--profile" in sys.argv:
        print(profile_launch())
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "overhead.json")
