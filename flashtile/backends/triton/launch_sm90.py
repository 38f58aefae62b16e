"""Launcher of the Hopper forward kernel (``kernels/attn_fwd_sm90.py``, Gluon).

``FLASHTILE_SM90=1`` routes the calls that kernel covers to it on an sm_90 GPU.  It is off by
default: on the H100 it is not yet faster than the portable Triton kernel everywhere
(docs/dev/tuning-log.md, "Hopper forward in Gluon").  A call it does not cover always takes
the Triton kernel, never a wrong result: ``eligible`` lists the scope.
"""
from __future__ import annotations

import functools

import torch

from ..spec import AttnSpec
from .. import env_reader, interpreting
from .args import LOG2E
from .fastlaunch import empty

BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 4  # the first consumer; the kernel adds 4 + 1 worker warps
STAGES = 2


_sm90_env = env_reader("FLASHTILE_SM90")


def enabled() -> bool:
    return _sm90_env() not in (None, "", "0")


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:  # a Triton without Gluon
        return False
    return torch.cuda.get_device_capability(index) == (9, 0)


def eligible(q, k, v, spec: AttnSpec) -> bool:
    """Dense contiguous fp16/bf16 ``(B, S, H, D)``, ``D`` in {64, 128}, sequence lengths that are
    multiples of the tiles, no softcap / window / dropout, causal only with ``sk >= sq``.  The
    caller has already ruled out every optional tensor (ALiBi, bias, varlen, paging, sparsity)."""
    if not (enabled() and q.is_cuda and not interpreting() and _hopper(q.device.index or 0)):
        return False
    if q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return False
    batch, sq, nheads, head_dim = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    if head_dim not in (64, 128) or v.shape[-1] != head_dim or nheads % nheads_k:
        return False
    if sq == 0 or sk == 0 or batch == 0 or sq % BLOCK_M or sk % BLOCK_N:
        return False
    if spec.softcap or spec.dropout_p or not spec.bottom_right:
        return False
    if spec.is_partial or spec.head_offset or spec.nheads_total:
        return False
    if spec.window_left >= 0 or spec.window_right > 0:
        return False
    return not spec.causal or sk >= sq


def forward(q, k, v, spec: AttnSpec):
    """``(out, lse)`` with the Triton forward's layouts: out like q, lse float32 ``(B, H, Sq)``."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .kernels.attn_fwd_sm90 import attn_fwd_sm90_kernel

    block_mq = BLOCK_M // 2  # rows of one consumer warpgroup

    batch, sq, nheads, head_dim = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    g_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([block_mq, head_dim], g_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], g_dtype)
    # 2-D (B * S, H * D) views: a tile never crosses a batch because S is a tile multiple
    desc_q = TensorDescriptor(q.view(batch * sq, nheads * head_dim), [batch * sq, nheads * head_dim],
                              [nheads * head_dim, 1], [block_mq, head_dim], q_layout)
    desc_k = TensorDescriptor(k.view(batch * sk, nheads_k * head_dim),
                              [batch * sk, nheads_k * head_dim], [nheads_k * head_dim, 1],
                              [BLOCK_N, head_dim], kv_layout)
    desc_v = TensorDescriptor(v.view(batch * sk, nheads_k * head_dim),
                              [batch * sk, nheads_k * head_dim], [nheads_k * head_dim, 1],
                              [BLOCK_N, head_dim], kv_layout)
    out = empty(q.shape, q.dtype, q.device)
    lse = empty((batch, nheads, sq), torch.float32, q.device)
    grid = (sq // BLOCK_M, batch * nheads)
    args = dict(desc_q=desc_q, desc_k=desc_k, desc_v=desc_v, Out=out, Lse=lse,
                stride_ob=out.stride(0), stride_om=out.stride(1), stride_oh=out.stride(2),
                stride_lb=lse.stride(0), stride_lh=lse.stride(1),
                sq=sq, sk=sk, nheads=nheads, group=nheads // nheads_k,
                qk_scale=spec.softmax_scale * LOG2E, CAUSAL=spec.causal)
    attn_fwd_sm90_kernel[grid](**args, STAGES=STAGES, num_warps=NUM_WARPS)
    return out, lse
