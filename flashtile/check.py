"""Correctness suite for whatever device is present: ``python -m flashtile.check``.

Each case draws fresh random inputs, runs flashtile forward and backward with NaN-poisoned
gradient buffers, and compares against a float64 reference using flash-attn's rule:

    |flashtile - ref64|_max  <=  2 * |torch_same_dtype - ref64|_max + eps      (output)
    |flashtile - ref64|_max  <=  3 * |torch_same_dtype - ref64|_max + eps      (dq, dk, dv)

where ``torch_same_dtype`` is plain attention computed by PyTorch in the input dtype (softmax
in float32).  On a GPU it runs the Triton kernels; on a CPU the torch backend (small shapes).
Exit status 1 if any case fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import sys
import time

import torch

from .backends import select
from .backends.spec import AttnSpec
from .interface import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from .masks import visible_mask


def reference(q, k, v, spec: AttnSpec, alibi_slopes=None, dtype=torch.float64):
    """Plain attention in ``dtype`` (softmax in at least float32); dense flash layout."""
    batch, sq, nheads, d = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(nheads // nheads_k, dim=1)
    vd = vd.repeat_interleave(nheads // nheads_k, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2))
    soft_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s = s.to(soft_dtype) * spec.softmax_scale
    if spec.softcap > 0:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if alibi_slopes is not None:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s - alibi_slopes.to(soft_dtype).reshape(-1, nheads, 1, 1) * (i + sk - sq - j).abs()
    vis = visible_mask(sq, sk, spec.window_left, spec.window_right, spec.bottom_right, q.device)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.matmul(p.to(dtype), vd)
    return out.transpose(1, 2)


@dataclasses.dataclass
class Case:
    name: str
    batch: int
    sq: int
    sk: int
    nheads: int
    nheads_k: int
    d: int
    dtype: torch.dtype
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    varlen: bool = False
    sdpa: bool = False


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_case(c: Case, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(hash(c.name) % (2 ** 31))
    mk = lambda *s: torch.randn(*s, device=device, dtype=c.dtype, generator=gen)  # noqa: E731
    q = mk(c.batch, c.sq, c.nheads, c.d)
    k = mk(c.batch, c.sk, c.nheads_k, c.d)
    v = mk(c.batch, c.sk, c.nheads_k, c.d)
    do = mk(c.batch, c.sq, c.nheads, c.d)
    slopes = (torch.rand(c.batch, c.nheads, device=device, generator=gen) * 0.3) if c.alibi else None
    right = 0 if c.causal else c.window[1]
    spec = AttnSpec(1.0 / math.sqrt(c.d), c.window[0], right, not c.sdpa, c.softcap)

    def ours(q_, k_, v_):
        if c.sdpa:
            return scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2),
                                                v_.transpose(1, 2), is_causal=c.causal,
                                                enable_gqa=True).transpose(1, 2)
        if c.varlen:
            lens_q = [c.sq] * c.batch
            cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32,
                                device=device)
            cu_k = torch.tensor([0] + list(itertools.accumulate([c.sk] * c.batch)),
                                dtype=torch.int32, device=device)
            o = flash_attn_varlen_func(q_.reshape(-1, c.nheads, c.d), k_.reshape(-1, c.nheads_k, c.d),
                                       v_.reshape(-1, c.nheads_k, c.d), cu_q, cu_k, c.sq, c.sk,
                                       causal=c.causal, window_size=c.window, softcap=c.softcap,
                                       alibi_slopes=slopes)
            return o.reshape(c.batch, c.sq, c.nheads, c.d)
        return flash_attn_func(q_, k_, v_, causal=c.causal, window_size=c.window,
                               softcap=c.softcap, alibi_slopes=slopes)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = ours(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_leaves, spec, slopes)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())
    low_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    low = reference(*low_leaves, spec, slopes, dtype=c.dtype)
    low_grads = torch.autograd.grad(low, low_leaves, do)

    eps = 1e-5 if c.dtype == torch.float32 else 1e-4
    result = {"case": c.name, "dtype": str(c.dtype).replace("torch.", ""), "ok": True}
    for name, got, want, base, factor in [("out", out, ref, low, 2)] + [
            (n, g, r, b, 3) for n, g, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads)]:
        err = _max_err(got, want)
        bound = factor * _max_err(base, want) + eps
        finite = bool(torch.isfinite(got).all())
        result[name] = err
        result[name + "_bound"] = bound
        if not (finite and err <= bound):
            result["ok"] = False
    return result


def cases(device: torch.device, quick: bool) -> list[Case]:
    gpu = device.type == "cuda"
    dtypes = [torch.float16, torch.bfloat16] if gpu else [torch.float32, torch.bfloat16]
    dims = [64, 128, 256] if gpu else [32, 64]
    n = 1024 if gpu else 128
    out = []
    for dtype, d, causal in itertools.product(dtypes, dims, (False, True)):
        tag = f"{str(dtype)[6:]}-d{d}-{'causal' if causal else 'full'}"
        out.append(Case(f"{tag}-square", 2, n, n, 4, 4, d, dtype, causal))
        out.append(Case(f"{tag}-gqa-sq<sk-odd", 2, n // 4 + 3, n + 17, 8, 2, d, dtype, causal))
        if not quick:
            out.append(Case(f"{tag}-sq>sk-odd", 1, n + 33, n // 2 - 5, 4, 1, d, dtype, causal))
    for dtype in dtypes:
        t = str(dtype)[6:]
        out += [
            Case(f"{t}-d40-odd-lengths", 2, 177, 301, 6, 3, 40, dtype),
            Case(f"{t}-d96-len1", 3, 1, 1000 if gpu else 100, 4, 2, 96, dtype, True),
            Case(f"{t}-d128-window", 1, n, n, 4, 2, 128 if gpu else 64, dtype, window=(100, 20)),
            Case(f"{t}-d64-softcap-alibi", 2, 300, 300, 4, 4, 64, dtype, True, softcap=30.0,
                 alibi=True),
            Case(f"{t}-d64-varlen", 3, 200, 257, 4, 2, 64, dtype, True, varlen=True),
            Case(f"{t}-d64-sdpa-topleft", 2, 150, 300, 4, 2, 64, dtype, True, sdpa=True),
            Case(f"{t}-d256-odd", 1, 129, 129, 2, 1, 256 if gpu else 80, dtype, True),
        ]
    if gpu:
        out.append(Case("float32-d64", 1, 512, 512, 4, 4, 64, torch.float32, True))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--only", default="", help="run only cases whose name matches this "
                        "regular expression (e.g. ^bfloat16); several processes with disjoint "
                        "filters compile in parallel")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    t0 = time.time()
    results = [run_case(c, device) for c in cases(device, args.quick) if re.search(args.only, c.name)]
    if not results:
        print(f"no case matches --only {args.only!r}")
        return 1
    width = max(len(r["case"]) for r in results)
    print(f"flashtile.check on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f" (backend {select(device)}, torch {torch.__version__})")
    print(f"{'case':<{width}}  {'out err/bound':>19}  {'dq err/bound':>19}  {'dk err/bound':>19}"
          f"  {'dv err/bound':>19}  ok")
    for r in results:
        cols = "  ".join(f"{r[n]:9.2e}/{r[n + '_bound']:9.2e}" for n in ("out", "dq", "dk", "dv"))
        print(f"{r['case']:<{width}}  {cols}  {'yes' if r['ok'] else 'NO'}")
    failed = [r["case"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed in {time.time() - t0:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "results": results}, f,
                      indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
