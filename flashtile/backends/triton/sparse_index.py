"""Block-sparse index lists: which mask blocks a query (or key) block visits, the visible-throughout
ones first, built once per mask tensor and cached; and the tile sizes that fit the blocks."""
from __future__ import annotations

import functools

import torch

from ..._tensor_cache import TensorCache
from ..spec import AttnSpec
from .args import broadcast_strides


def full_blocks(n_rows: int, n_cols: int, bs_m: int, bs_n: int, sq: int, sk: int,
                spec: AttnSpec, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full, empty)``, bool ``(n_rows, n_cols)`` over the blocks of ``bs_m x bs_n``.

    ``full``: every (query, key) pair of the block exists and is visible under the causal /
    window bounds, so its tiles need no predicate.  ``empty``: no pair is visible, so the
    block is dropped from the lists even where the mask holds it.
    """
    r = torch.arange(n_rows, device=device)[:, None]
    c = torch.arange(n_cols, device=device)[None, :]
    q_lo, q_hi = r * bs_m, torch.clamp((r + 1) * bs_m, max=sq) - 1
    k_lo, k_hi = c * bs_n, torch.clamp((c + 1) * bs_n, max=sk) - 1
    shift = sk - sq if spec.bottom_right else 0
    full = ((r + 1) * bs_m <= sq) & ((c + 1) * bs_n <= sk)
    empty = (q_lo >= sq) | (k_lo >= sk)
    if spec.window_right >= 0:
        full = full & (k_hi <= q_lo + shift + spec.window_right)
        empty = empty | (k_lo > q_hi + shift + spec.window_right)
    if spec.window_left >= 0:
        full = full & (k_lo >= q_hi + shift - spec.window_left)
        empty = empty | (k_hi < q_lo + shift - spec.window_left)
    return full, empty


def block_lists(block_mask: torch.Tensor, full: torch.Tensor | None = None,
                transpose: bool = False) -> torch.Tensor:
    """Per row of a ``(B|1, H|1, R, C)`` bool block mask, int32 ``(B|1, H|1, R, C + 2)``:
    ``[n_full, n_part, full column indices..., partial column indices...]``, each group in
    increasing order, where ``full`` (``(R, C)`` bool, default all False) marks the blocks that
    need no predicate.  ``transpose`` lists the nonzero rows of every column instead."""
    m = block_mask
    f = torch.zeros(m.shape[-2:], dtype=torch.bool, device=m.device) if full is None else full
    if transpose:
        m, f = m.transpose(-1, -2), f.transpose(-1, -2)
    ncol = m.shape[-1]
    cols = torch.arange(ncol, device=m.device, dtype=torch.int32)
    is_full = m & f
    is_part = m & ~f
    # full blocks first, then partial ones, each in increasing order; the padding after them
    # (absent blocks) is never read
    rank = torch.where(is_full, cols, torch.where(is_part, cols + ncol, cols + 2 * ncol))
    order = rank.sort(dim=-1).values % max(ncol, 1)
    n_full = is_full.sum(dim=-1, keepdim=True, dtype=torch.int32)
    n_part = is_part.sum(dim=-1, keepdim=True, dtype=torch.int32)
    return torch.cat([n_full, n_part, order.to(torch.int32)], dim=-1).contiguous()


@functools.lru_cache(maxsize=256)
def _full_blocks(n_rows, n_cols, bs_m, bs_n, sq, sk, window_left, window_right, bottom_right,
                 device):
    return full_blocks(n_rows, n_cols, bs_m, bs_n, sq, sk,
                       AttnSpec(1.0, window_left, window_right, bottom_right), device)


# Block lists of recent masks.  A training loop passes the same mask every step, and the
# forward and the dQ kernel use the same lists: built once, they cost no launches afterwards
# (building them takes ~10 small kernels, which at low density is more host time than the
# attention itself).  An entry is used only while it refers to the very tensor, unmodified
# (``TensorCache``: same object, same version counter).
_lists_cache = TensorCache()


def sparse_args(block_mask, block_size, sq: int = 0, sk: int = 0, spec: AttnSpec | None = None,
                transpose: bool = False):
    """(index lists or None, (stride_b, stride_h, stride_row), bs_m, bs_n) for sequences of
    ``sq`` queries and ``sk`` keys under ``spec``'s causal / window bounds."""
    if block_mask is None:
        return None, (0, 0, 0), 1, 1
    bs_m, bs_n = int(block_size[0]), int(block_size[1])

    def build():
        mask, full = block_mask, None
        if spec is not None:
            full, empty = _full_blocks(mask.shape[-2], mask.shape[-1], bs_m, bs_n, int(sq), int(sk),
                                       spec.window_left, spec.window_right, spec.bottom_right,
                                       mask.device)
            mask = mask & ~empty
        return block_lists(mask, full, transpose)

    bounds = None if spec is None else (int(sq), int(sk), spec.window_left, spec.window_right,
                                        spec.bottom_right)
    idx = _lists_cache.get((bs_m, bs_n, bounds, transpose), (block_mask,), build)
    st = broadcast_strides(idx)
    return idx, st[:3], bs_m, bs_n


def fit_block(block: int, size: int) -> int:
    """The largest ``block / 2^k`` that divides ``size`` (tiles must not straddle mask blocks)."""
    while block > 16 and size % block:
        block //= 2
    return block
