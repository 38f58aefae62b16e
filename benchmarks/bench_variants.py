"""Variants on the GPU: ``python benchmarks/bench_variants.py OUT.json``.

- block-sparse density sweep: `block_sparse_attn_func` with a random block mask of density
  1, 1/2, 1/4, 1/8, 1/16 (diagonal blocks always on), fwd and fwd+bwd time against the dense call;
  the time should fall in proportion to the density (zero blocks are never loaded);
- sliding window sweep: `flash_attn_func(window_size=(w, 0))` for w = 256..N, against causal;
- varlen: 16K tokens in sequences of random length (mean 1K) packed with `flash_attn_varlen_func`,
  against the same data padded to the longest sequence through `flash_attn_func`;
- unmasked reference: the plain causal/non-causal forward at N=8K (to compare with h100.json's
  rows measured before the variants were added).
bf16, d=128, 16 heads, B=2, N=8K unless stated; medians of triton.testing.do_bench.
"""
import datetime
import json
import math
import sys

import torch
import triton
from triton.testing import do_bench

import flashtile
from flashtile.block_sparse import block_sparse_attn_func


def t(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def fwd_bwd(fn, leaves, do):
    def step():
        out = fn()
        torch.autograd.grad(out, leaves, do)
    return step


def main(path):
    dev, dt = "cuda", torch.bfloat16
    b, n, h, d = 2, 8192, 16, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(b, n, h, d, device=dev, dtype=dt, generator=g) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    rows = []
    full = 4 * b * h * n * n * d

    for causal in (False, True):
        f = lambda c=causal: flashtile.flash_attn_func(q, k, v, causal=c)  # noqa: E731
        ms = t(f)
        rows.append(dict(kind="unmasked", causal=causal, n=n, ms=ms,
                         tflops=full * (0.5 if causal else 1) / ms / 1e9))

    nb = n // 128
    for density in (1.0, 0.5, 0.25, 0.125, 0.0625):
        mask = torch.rand(1, 1, nb, nb, device=dev, generator=g) < density
        mask |= torch.eye(nb, dtype=torch.bool, device=dev)
        real = mask.float().mean().item()
        f = lambda m=mask: block_sparse_attn_func(q, k, v, m, block_size=(128, 128))  # noqa: E731
        rows.append(dict(kind="block_sparse", density=real, fwd_ms=t(f),
                         fwd_bwd_ms=t(fwd_bwd(f, leaves, do))))

    for w in (256, 1024, 4096, n):
        f = lambda w=w: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(w, 0))  # noqa
        rows.append(dict(kind="window", window=w, fwd_ms=t(f), fwd_bwd_ms=t(fwd_bwd(f, leaves, do))))

    lens = torch.randint(256, 1792, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    while sum(lens) > 16384:
        lens.pop()
    total, longest = sum(lens), max(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    qp, kp, vp = (torch.randn(total, h, d, device=dev, dtype=dt, generator=g) for _ in range(3))
    padded = [torch.randn(len(lens), longest, h, d, device=dev, dtype=dt, generator=g) for _ in range(3)]
    for causal in (False, True):
        fv = lambda c=causal: flashtile.flash_attn_varlen_func(qp, kp, vp, cu, cu, longest, longest,  # noqa
                                                               causal=c)
        fp = lambda c=causal: flashtile.flash_attn_func(*padded, causal=c)  # noqa: E731
        useful = sum(4 * h * s * s * d for s in lens) * (0.5 if causal else 1)
        ms_v, ms_p = t(fv), t(fp)
        rows.append(dict(kind="varlen", causal=causal, sequences=len(lens), tokens=total,
                         longest=longest, varlen_ms=ms_v, padded_ms=ms_p,
                         varlen_tflops=useful / ms_v / 1e9))
    for r in rows:
        r.update(meta)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
               if k not in meta})
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "variants.json")
