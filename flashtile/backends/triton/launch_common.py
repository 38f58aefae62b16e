"""Shared launch helpers: output allocation, strides of the two layouts, scalar arguments."""
from __future__ import annotations

import contextlib

import torch
from triton.runtime.autotuner import Heuristics

from ..spec import AttnSpec

LOG2E = 1.4426950408889634
_poison = False


@contextlib.contextmanager
def poison_outputs():
    """Fill every buffer the kernels write with NaN first, so a test can prove that each
    element was written."""
    global _poison
    old, _poison = _poison, True
    try:
        yield
    finally:
        _poison = old


def empty(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if _poison else out


def seq_strides(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, position, head) strides; a packed varlen tensor has no batch stride."""
    st = x.stride()
    return (0, st[0], st[1]) if varlen else (st[0], st[1], st[2])


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of lse: ``(B, H, Sq)`` dense, ``(H, total_q)`` varlen."""
    if varlen:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def scalar_args(spec: AttnSpec) -> dict:
    """Scores in base 2: ``log2(e)`` is folded into the scale (or into the softcap)."""
    if spec.softcap > 0:
        qk_scale = spec.softcap * LOG2E
        softcap_scale = spec.softmax_scale / spec.softcap
    else:
        qk_scale = spec.softmax_scale * LOG2E
        softcap_scale = 1.0
    return dict(
        qk_scale=qk_scale, softcap_scale=softcap_scale,
        window_left=max(spec.window_left, 0), window_right=max(spec.window_right, 0),
        BOTTOM_RIGHT=spec.bottom_right, HAS_LEFT=spec.window_left >= 0,
        HAS_RIGHT=spec.window_right >= 0, HAS_SOFTCAP=spec.softcap > 0,
    )


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products: users who pay for fp32 expect fp32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def alibi_args(alibi_slopes, batch: int):
    if alibi_slopes is None:
        return None, 0
    return alibi_slopes, (alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layout(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    """(varlen, batch, seqlen_q, seqlen_k, H, Hk, D) of a call."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        return True, batch, int(max_seqlen_q), int(max_seqlen_k), q.shape[1], k.shape[1], q.shape[2]
    return False, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]



def launch(kernel, grid, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``.

    For a ``triton.heuristics`` kernel the derived constexprs are computed here, from one
    name -> value mapping, and the wrapped jitted function is launched with them: the wrapper
    rebuilds that mapping of every argument once per heuristic, which on an H100 host costs
    ~18 us a launch (benchmarks/overhead.py --profile).  Same rules, same order, same values.
    """
    if isinstance(kernel, Heuristics):
        named = dict(zip(kernel.arg_names, args))
        named.update(meta)
        for name, rule in kernel.values.items():
            named[name] = meta[name] = rule(named)
        kernel = kernel.fn
    kernel[grid](*args, **meta)
