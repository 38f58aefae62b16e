"""Backward block shapes, old against new, timed as the sweep times them (GPU):
``python benchmarks/probe_bwd_configs.py OUT.json``.

d=128 bf16, 16K tokens x 16 heads, causal and not, N=512 and 8K.  For each case the dK/dV and
dQ configs are pinned (``configs.override``) to the candidates below and ``bwd`` (autograd.grad
on a kept graph) and ``fwd_bwd`` are timed with ``triton.testing.do_bench`` (median), in three
interleaved rounds so that drift shows as spread rather than as a difference.
"""
import json
import sys
import time

import torch
import triton
from triton.testing import do_bench

import flashtile
from flashtile.backends.triton.configs import KernelConfig as C, override

CANDIDATES = {
    # causal -> name -> (dkdv, dq)
    True: {"old": (C(64, 64, 4, 1), C(128, 64, 8, 3)), "new": (C(64, 64, 4, 1), C(64, 64, 4, 4)),
           "dq_128_64_8_4": (C(64, 64, 4, 1), C(128, 64, 8, 4)), "dq_64_64_4_2": (C(64, 64, 4, 1), C(64, 64, 4, 2)),
           "dkdv_2": (C(64, 64, 4, 2), C(128, 64, 8, 3))},
    False: {"old": (C(64, 64, 4, 1), C(128, 64, 8, 5)), "new": (C(64, 64, 4, 2), C(128, 64, 8, 4)),
            "new_short": (C(64, 64, 4, 2), C(128, 32, 4, 3))},
}


def main(path):
    d, h, dt = 128, 16, torch.bfloat16
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command="python benchmarks/probe_bwd_configs.py OUT.json")
    for n in (8192, 512):
        b = 16384 // n
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=dt) for _ in range(4))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        for causal in (False, True):
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            for rnd in range(3):
                for name, (dkdv, dq) in CANDIDATES[causal].items():
                    with override(dkdv=dkdv, dq=dq):
                        out = flashtile.flash_attn_func(*leaves, causal=causal)
                        ms_b = do_bench(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True),
                                        warmup=25, rep=100, return_mode="median")
                        ms_fb = do_bench(lambda: torch.autograd.grad(
                            flashtile.flash_attn_func(*leaves, causal=causal), leaves, do),
                            warmup=25, rep=100, return_mode="median")
                    rows.append(dict(n=n, causal=causal, round=rnd, name=name, dkdv=list(dkdv.__dict__.values()),
                                     dq=list(dq.__dict__.values()), bwd_ms=ms_b, bwd_tflops=2.5 * flops / ms_b / 1e9,
                                     fwd_bwd_ms=ms_fb, fwd_bwd_tflops=3.5 * flops / ms_fb / 1e9))
                    print(json.dumps(rows[-1]), flush=True)
        del q, k, v, do, leaves
    with open(path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_bwd_configs.json")
