"""Block-sparse FlashAttention (paper section 3.3, Algorithm 5) and block-mask builders.

A block mask ``M`` of shape ``(batch|1, nheads|1, ceil(Sq / bm), ceil(Sk / bn))`` lets query
``i`` see key ``j`` only when ``M[b, h, i // bm, j // bn]`` is True (and, with ``causal``, when
the causal rule also allows it)::

    block_size=(2, 2), Sq = Sk = 6        element mask
    M = 1 0 1                             1 1 0 0 1 1
        0 1 0                             1 1 0 0 1 1
        1 1 1                             0 0 1 1 0 0
                                          0 0 1 1 0 0
                                          1 1 1 1 1 1
                                          1 1 1 1 1 1

The Triton kernels walk, for every query block, only the list of its nonzero key blocks (and
the transposed lists in the dK/dV pass), so zero blocks are never loaded: the IO and the work
scale with the fraction of nonzero blocks.  Rows whose blocks are all zero output 0.

Builders return bool ``(1, 1, R, C)`` masks (combine them with ``|`` / ``&``, expand over
batch/heads as needed): :func:`local_block_mask`, :func:`strided_block_mask`,
:func:`global_block_mask`, :func:`butterfly_block_mask`, :func:`block_mask_from_dense`;
:func:`expand_block_mask` turns a block mask back into the dense element mask.
"""
from __future__ import annotations

import math

import torch

from . import _validate as V
from .autograd import attention, dropout_seed

__all__ = [
    "block_sparse_attn_func",
    "local_block_mask",
    "strided_block_mask",
    "global_block_mask",
    "butterfly_block_mask",
    "block_mask_from_dense",
    "expand_block_mask",
]


def block_sparse_attn_func(q, k, v, block_mask, block_size=(128, 128), dropout_p=0.0,
                           softmax_scale=None, causal=False):
    """Attention restricted to the nonzero blocks of ``block_mask``.

    Arguments:
        q: ``(batch, seqlen_q, nheads, headdim)``; k, v: ``(batch, seqlen_k, nheads_k,
            headdim)`` (``nheads % nheads_k == 0``), float16 / bfloat16 / float32.
        block_mask: bool ``(batch|1, nheads|1, ceil(seqlen_q / block_m),
            ceil(seqlen_k / block_n))``; True = compute the block.  Broadcast over batch or
            heads with a size-1 dimension.  The last block row/column may be partial.
        block_size: ``(block_m, block_n)`` (or one int), positive multiples of 16.  The
            kernels' tiles divide the blocks (several tiles per block).
        dropout_p, softmax_scale: as in ``flash_attn_func``.
        causal: additionally apply the (bottom-right) causal mask inside the nonzero blocks.

    Returns ``out (batch, seqlen_q, nheads, headdim)``, differentiable w.r.t. q, k, v.
    """
    V.check_qkv(q, k, v, "(batch, seqlen, nheads, headdim)",
               "(batch, seqlen_k, nheads_k, headdim)", 4)
    if k.shape[0] != q.shape[0]:
        raise V.FlashtileInputError(f"batch of q ({q.shape[0]}) and k/v ({k.shape[0]}) must match")
    bm, bn = V.block_size(block_size)
    batch, sq, nheads, _ = q.shape
    sk = k.shape[1]
    V.block_mask(block_mask, batch, nheads, math.ceil(sq / bm), math.ceil(sk / bn), q.device)
    spec = V.spec(q, softmax_scale, causal, (-1, -1), 0.0, dropout_p)
    out, _ = attention(q, k, v, spec, block_mask=block_mask, block_size=(bm, bn),
                       rng_seed=dropout_seed(spec, q.device))
    return out


def _blocks(seqlen_q, seqlen_k, block_size):
    bm, bn = V.block_size(block_size)
    return math.ceil(seqlen_q / bm), math.ceil(seqlen_k / bn)


def _grid(seqlen_q, seqlen_k, block_size, device):
    nr, nc = _blocks(seqlen_q, seqlen_k, block_size)
    r = torch.arange(nr, device=device).view(-1, 1)
    c = torch.arange(nc, device=device).view(1, -1)
    return r, c


def local_block_mask(seqlen_q, seqlen_k, block_size=(128, 128), window_blocks=1, causal=False,
                     device=None) -> torch.Tensor:
    """Sliding window of blocks: block row ``r`` sees block columns ``c`` with
    ``|r - c| <= window_blocks`` (``r - window_blocks <= c <= r`` when ``causal``)::

        window_blocks=1               window_blocks=1, causal
            1 1 0 0                       1 0 0 0
            1 1 1 0                       1 1 0 0
            0 1 1 1                       0 1 1 0
            0 0 1 1                       0 0 1 1
    """
    r, c = _grid(seqlen_q, seqlen_k, block_size, device)
    m = (c - r).abs() <= window_blocks
    if causal:
        m &= c <= r
    return m[None, None]


def strided_block_mask(seqlen_q, seqlen_k, block_size=(128, 128), stride=2, causal=False,
                       device=None) -> torch.Tensor:
    """Sparse Transformer's strided pattern on blocks: row ``r`` sees columns ``c`` with
    ``(r - c) % stride == 0`` (and ``c <= r`` when ``causal``)::

        stride=2
            1 0 1 0
            0 1 0 1
            1 0 1 0
            0 1 0 1
    """
    if stride < 1:
        raise V.FlashtileInputError(f"stride must be >= 1, got {stride}")
    r, c = _grid(seqlen_q, seqlen_k, block_size, device)
    m = (r - c).remainder(stride) == 0
    if causal:
        m &= c <= r
    return m[None, None]


def global_block_mask(seqlen_q, seqlen_k, block_size=(128, 128), num_global_blocks=1,
                      device=None) -> torch.Tensor:
    """Global tokens: the first ``num_global_blocks`` block rows see everything and every row
    sees the first ``num_global_blocks`` block columns::

        num_global_blocks=1
            1 1 1 1
            1 0 0 0
            1 0 0 0
    """
    r, c = _grid(seqlen_q, seqlen_k, block_size, device)
    return ((r < num_global_blocks) | (c < num_global_blocks))[None, None]


def butterfly_block_mask(seqlen_q, seqlen_k, block_size=(128, 128), device=None) -> torch.Tensor:
    """The fixed (flat) butterfly pattern used by the paper's block-sparse experiments: the
    union of the supports of all butterfly factors, i.e. block ``(r, c)`` is nonzero iff
    ``r XOR c`` is 0 or a power of two (row ``r`` sees ``c = r``, ``r ^ 1``, ``r ^ 2``,
    ``r ^ 4``, ...): ``O(log n)`` blocks per row::

        8 x 8 blocks
            1 1 1 0 1 0 0 0
            1 1 0 1 0 1 0 0
            1 0 1 1 0 0 1 0
            0 1 1 1 0 0 0 1
            1 0 0 0 1 1 1 0
            0 1 0 0 1 1 0 1
            0 0 1 0 1 0 1 1
            0 0 0 1 0 1 1 1
    """
    r, c = _grid(seqlen_q, seqlen_k, block_size, device)
    x = r ^ c
    return ((x & (x - 1)) == 0)[None, None]


def block_mask_from_dense(mask: torch.Tensor, block_size=(128, 128)) -> torch.Tensor:
    """Bool ``(..., Sq, Sk)`` element mask -> bool block mask ``(B|1, H|1, R, C)``: a block is
    nonzero iff any of its elements is True.  The result attends to *whole* blocks, so it is a
    superset of ``mask`` (combine with an exact mask where that matters)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or not 2 <= mask.dim() <= 4:
        raise TypeError("mask must be a bool tensor of shape (Sq, Sk), (H, Sq, Sk) or "
                        f"(B, H, Sq, Sk), got {getattr(mask, 'dtype', type(mask).__name__)} "
                        f"{tuple(getattr(mask, 'shape', ()))}")
    bm, bn = V.block_size(block_size)
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    b, h, sq, sk = m4.shape
    nr, nc = math.ceil(sq / bm), math.ceil(sk / bn)
    padded = torch.zeros(b, h, nr * bm, nc * bn, dtype=torch.bool, device=mask.device)
    padded[:, :, :sq, :sk] = m4
    return padded.view(b, h, nr, bm, nc, bn).any(dim=5).any(dim=3)


def expand_block_mask(block_mask: torch.Tensor, block_size, seqlen_q: int,
                      seqlen_k: int) -> torch.Tensor:
    """Dense bool element mask ``(..., seqlen_q, seqlen_k)`` of a block mask."""
    bm, bn = V.block_size(block_size)
    dense = block_mask.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
    return dense[..., :seqlen_q, :seqlen_k]

