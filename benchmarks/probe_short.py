"""Causal forward at N=512 (d=128, bf16, 16K tokens): the launcher with several tilings against
the public call, with and without autograd, to locate where short causal calls lose time."""
import math

import torch
from triton.testing import do_bench

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import forward
from flashtile.backends.triton.configs import KernelConfig, get_config, override

n, b, h, d = 512, 32, 16, 128
q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flops = 4 * b * h * n * n * d * 0.5
spec = AttnSpec(1 / math.sqrt(d), -1, 0)
print("default config", get_config("fwd", d, True, q.dtype, q.device, n))
for cfg in [None, (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 3), (128, 32, 8, 3)]:
    if cfg is None:
        ms = do_bench(lambda: forward(q, k, v, spec), warmup=25, rep=100, return_mode="median")
    else:
        with override(fwd=KernelConfig(*cfg)):
            ms = do_bench(lambda: forward(q, k, v, spec), warmup=25, rep=100, return_mode="median")
    print("launcher", cfg, f"{ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
for grad in (False, True):
    qq, kk, vv = (x.detach().requires_grad_(grad) for x in (q, k, v))
    ms = do_bench(lambda: flashtile.flash_attn_func(qq, kk, vv, causal=True), warmup=25, rep=100,
                  return_mode="median")
    print("flash_attn_func requires_grad", grad, f"{ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
