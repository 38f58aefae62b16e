"""Attention against a KV cache: ``flash_attn_with_kvcache`` (flash-attn 2.x semantics).

Decode steps, chunked prefill against a cache and speculative-decoding verification all call
:func:`flash_attn_with_kvcache`; it optionally appends new keys/values to the cache in place
(with rotary embeddings), then attends.  Two backends compute it:

* ``"triton"``: FlashDecoding.  The keys of each row are cut into ``num_splits`` slices; one
  program per (row, KV head, slice) streams its slice once for all query heads of the KV group
  and all query tokens, writing a partial output and its log-sum-exp; a combine kernel merges
  the slices (:func:`merge_attention_states` is the two-way form of that merge).  No host
  synchronisation on this path, so a decode step can be captured in a CUDA graph.
* ``"torch"``: the same split-and-merge computed with PyTorch ops, row by row (CPU default).

The backend is ``FLASHTILE_BACKEND`` when set, else triton for CUDA tensors (and for CPU tensors
under ``TRITON_INTERPRET=1``), else torch.

Layouts (flash-attn's)::

    q            (B, Sq, H, D)
    k_cache      (B_cache, S_cache, Hk, D)        contiguous cache, or
                 (num_blocks, page_size, Hk, D)   paged cache, with block_table (B, max_blocks)
    k, v (new)   (B, S_new, Hk, D)
    out          (B, Sq, H, D)   in q's dtype
    lse          (B, H, Sq)      float32, natural log

Keys of batch row ``b``: cache positions ``[leftpad[b], cache_seqlens[b] + S_new)``, i.e.
``n_b = cache_seqlens[b] + S_new - leftpad[b]`` keys; key ``j`` of the row is at position
``leftpad[b] + j``.  Query ``t`` sees key ``j`` when (``shift = n_b - Sq``, bottom-right
alignment, as :mod:`flashtile.backends.spec`)::

    j >= t + shift - window_left      (window_left >= 0)
    j <= t + shift + window_right     (window_right >= 0; causal means window_right = 0)
    j <  n_b - Sq  or  tree_mask[b, t, j - (n_b - Sq)]        (with a tree mask)

Tree masks (speculative decoding): the ``Sq`` query tokens are the last ``Sq`` keys; each sees
every older cache key and, among the new tokens, what the mask allows.  For the tree with
parents ``[-1, 0, 0, 1]`` (A is the root, B and C its children, D a child of B)::

                       older cache keys      new tokens
                       0  1  ...  n-Sq-1     A  B  C  D
        query A        1  1  ...    1        1  0  0  0
        query B        1  1  ...    1        1  1  0  0
        query C        1  1  ...    1        1  0  1  0
        query D        1  1  ...    1        1  1  0  1

Autograd is not supported (as in flash-attn): nothing is recorded for autograd (the torch
backend runs under ``torch.no_grad()``; the triton path only launches kernels into fresh
outputs) and the outputs never require grad.

Eager host cost: on a GPU the triton path performs no host/device synchronisation and reads no
tensor values, so an eager call costs the Python work of validation and launch preparation plus
one Triton launch per kernel (split-KV, and the combine only when ``num_splits > 1``; the
append/rotary kernels only when ``k``/``v``/rotary tables are given).
``benchmarks/decode_host_profile.py`` measures that Python work on the CPU.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple, Sequence

import torch

from . import backends, paged_kv

__all__ = [
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "build_tree_mask",
    "apply_rotary",
    "select_decode_backend",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_SPLITS = 128
_MAX_PACKED_TREE = 64


# --------------------------------------------------------------------------------------------
# backend selection
# --------------------------------------------------------------------------------------------
def select_decode_backend(device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device``: the package-wide rule of
    ``flashtile.backends.select`` (``use_backend``, then ``FLASHTILE_BACKEND``, then device)."""
    return backends.select(device)


_LAUNCH_DECODE = None


def _triton_launcher():
    """:mod:`flashtile.backends.triton.launch_decode`, imported on first use (it imports triton)."""
    global _LAUNCH_DECODE
    if _LAUNCH_DECODE is None:
        from .backends.triton import launch_decode

        _LAUNCH_DECODE = launch_decode
    return _LAUNCH_DECODE


# Launch plans of eager triton calls (see launch_decode.Plan): after a call has been validated
# and run, a later call whose every tensor has the same shape, strides, dtype, device and 16-byte
# alignment, with the same other arguments, replays its launches without validating again (the
# checks depend on nothing else on a GPU) or rebuilding kernel arguments.  Only on CUDA, with
# direct launches on, outside poison_outputs, with a cache_seqlens tensor and no tree mask, and
# without FLASHTILE_CHECK_INDICES (whose checks read values).
# FLASHTILE_DECODE_PLANS=0 (or EAGER_PLANS = False, for code that patches launch internals)
# turns them off.
EAGER_PLANS = os.environ.get("FLASHTILE_DECODE_PLANS", "1") != "0"
_PLANS: dict = {}
_MAX_PLANS = 256


def _eager_plan_key(tensors: tuple, scalars: tuple):
    q, seqlens = tensors[0], tensors[7]
    if not (EAGER_PLANS and isinstance(q, torch.Tensor) and q.is_cuda and isinstance(seqlens, torch.Tensor)):
        return None
    fl = _triton_launcher().fastlaunch
    if (not fl.direct_enabled() or fl.poisoning() or select_decode_backend(q.device) != "triton"
            or os.environ.get("FLASHTILE_CHECK_INDICES", "0") not in ("", "0")):
        return None
    parts = []
    for x in tensors:
        if x is None:
            parts.append(None)
        elif isinstance(x, torch.Tensor):
            parts.append((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15))
        else:
            return None
    try:
        window = scalars[2]
        if isinstance(window, (tuple, list)):
            window = tuple((type(w), w) for w in window)
        key = (tuple(parts), tuple((type(v), v) for v in scalars[:2] + (window,) + scalars[3:]),
               torch.cuda.current_device())
        hash(key)
    except TypeError:
        return None
    return key


def _check_indices_enabled(device: torch.device) -> bool:
    """Value checks of index tensors need their values on the host: always on CPU, on a GPU only
    with ``FLASHTILE_CHECK_INDICES=1`` (it synchronises and breaks CUDA-graph capture)."""
    return device.type == "cpu" or os.environ.get("FLASHTILE_CHECK_INDICES", "0") not in ("", "0")


# --------------------------------------------------------------------------------------------
# tree masks
# --------------------------------------------------------------------------------------------
def build_tree_mask(parents, *, packed: bool = False, device=None) -> torch.Tensor:
    """Attention mask of a draft-token tree: each node sees itself and its ancestors.

    ``parents``: sequence or integer tensor ``(n,)`` or ``(B, n)``; ``parents[i]`` is the index of
    node ``i``'s parent among the new tokens, ``-1`` for a root, and must be ``< i`` (nodes in
    topological order, as drafts are laid out).  Returns bool ``(n, n)`` / ``(B, n, n)`` with
    ``mask[i, j]`` True when node ``i`` may attend to node ``j``; with ``packed=True`` an int64
    ``(n,)`` / ``(B, n)`` bitmask instead (bit ``j`` of entry ``i``), which needs ``n <= 64``.

    Example (seed tree, parents ``[-1, 0, 1, 1, 2, 2, 3, 3, 4]``): row 3 (``D``) is
    ``[1, 1, 0, 1, 0, 0, 0, 0, 0]``: D sees A, B and itself, not its sibling C.
    """
    p = torch.as_tensor(parents, device="cpu")
    if p.dtype.is_floating_point or p.dtype == torch.bool or p.dtype.is_complex:
        raise TypeError(f"build_tree_mask: parents must be integers, got {p.dtype}")
    if p.dim() not in (1, 2):
        raise ValueError(f"build_tree_mask: parents must have shape (n,) or (B, n), got {tuple(p.shape)}")
    batched = p.dim() == 2
    p = p.reshape(-1, p.shape[-1]).to(torch.int64)
    n = p.shape[1]
    idx = torch.arange(n)
    if ((p >= idx) | (p < -1)).any():
        raise ValueError("build_tree_mask: every parents[i] must be -1 (root) or an earlier node index < i")
    if packed and n > _MAX_PACKED_TREE:
        raise ValueError(f"build_tree_mask: a packed mask holds at most {_MAX_PACKED_TREE} nodes, got {n}")
    mask = torch.zeros(p.shape[0], n, n, dtype=torch.bool)
    for i in range(n):
        mask[:, i, i] = True
        par = p[:, i]
        has = par >= 0
        if has.any():
            rows = torch.nonzero(has).flatten()
            mask[rows, i] |= mask[rows, par[rows]]
    if packed:
        weights = torch.ones(n, dtype=torch.int64) << idx  # bit j; 1 << 63 wraps to the sign bit
        out = (mask.to(torch.int64) * weights).sum(-1)
    else:
        out = mask
    if not batched:
        out = out[0]
    return out.to(device) if device is not None else out


def _unpack_tree_mask(packed: torch.Tensor, seqlen_q: int) -> torch.Tensor:
    """int64 ``(B|1, Sq)`` bitmask -> bool ``(B|1, Sq, Sq)`` (device ops only, capturable)."""
    bits = torch.arange(seqlen_q, device=packed.device, dtype=torch.int64)
    return ((packed.unsqueeze(-1) >> bits) & 1).bool()


# --------------------------------------------------------------------------------------------
# rotary embeddings
# --------------------------------------------------------------------------------------------
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool = True) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` channels of ``x`` (RoPE).

    ``x``: ``(B, T, H, D)``; ``cos``/``sin``: ``(seqlen_ro, rotary_dim / 2)``; ``positions``:
    integer ``(B, T)``, the absolute position of each token.  With ``c = cos[pos, i]``,
    ``s = sin[pos, i]``, interleaved rotates pairs ``(x[2i], x[2i+1])``, GPT-NeoX style pairs
    ``(x[i], x[i + rotary_dim/2])``: ``(a, b) -> (a c - b s, b c + a s)``.  Computed in float32,
    returned in ``x``'s dtype; channels past ``rotary_dim`` are unchanged.
    """
    rd = 2 * int(cos.shape[1])
    positions = positions.to(device=cos.device, dtype=torch.int64)
    c = cos[positions].float().unsqueeze(2)  # (B, T, 1, rd/2)
    s = sin[positions].float().unsqueeze(2)
    xf = x.float()
    xr = xf[..., :rd]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([rot, xf[..., rd:]], dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------------
# merging partial attention results
# --------------------------------------------------------------------------------------------
def _merge_torch(out_a, lse_a, out_b, lse_b):
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    wa = torch.exp(lse_a - m)  # 0 for an empty side
    wb = torch.exp(lse_b - m)
    total = wa + wb
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(safe), torch.full_like(m, float("-inf")))
    wa = (wa / safe).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    wb = (wb / safe).transpose(1, 2).unsqueeze(-1)
    zero = torch.zeros((), dtype=torch.float32, device=out_a.device)
    # an empty side adds nothing, even if its output holds garbage
    out = torch.where(wa > 0, out_a.float() * wa, zero) + torch.where(wb > 0, out_b.float() * wb, zero)
    return out, lse


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor):
    """Merge two attention results over disjoint key sets into the result over their union.

    ``out_*``: ``(B, S, H, D)`` (flash layout), each normalised over its own keys; ``lse_*``:
    ``(B, H, S)`` natural-log log-sum-exp of those keys' scores (``-inf`` for a row that saw
    none).  Returns ``(out, lse)`` with ``lse = log(exp(lse_a) + exp(lse_b))`` (float32) and
    ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b`` in ``out_a``'s dtype.  An empty
    side (``lse = -inf``) contributes nothing; when both are empty ``out = 0``, ``lse = -inf``.
    Merging is associative, so splits may be folded in any grouping.
    """
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"merge_attention_states: {name} must be a torch.Tensor, got {type(x).__name__}")
    if out_a.dim() != 4:
        raise ValueError(f"merge_attention_states: out_a must be (B, S, H, D), got {tuple(out_a.shape)}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"merge_attention_states: out_b shape {tuple(out_b.shape)} != out_a shape "
                         f"{tuple(out_a.shape)}")
    b, s, h, _ = out_a.shape
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(x.shape) != (b, h, s):
            raise ValueError(f"merge_attention_states: {name} must have shape (B, H, S) = {(b, h, s)}, "
                             f"got {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"merge_attention_states: {name} must be a float tensor, got {x.dtype}")
    for name, x in (("out_a", out_a), ("out_b", out_b)):
        if not x.dtype.is_floating_point:
            raise TypeError(f"merge_attention_states: {name} must be a float tensor, got {x.dtype}")
    if out_b.dtype != out_a.dtype:
        raise TypeError(f"merge_attention_states: out_b dtype {out_b.dtype} != out_a dtype {out_a.dtype}")
    for name, x in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if x.device != out_a.device:
            raise ValueError(f"merge_attention_states: {name} is on {x.device}, out_a on {out_a.device}")
    with torch.no_grad():
        if select_decode_backend(out_a.device) == "triton" and out_a.dtype in _FLOAT_DTYPES:
            launch_decode = _triton_launcher()
            o_part = torch.stack([out_a, out_b]).contiguous()
            l_part = torch.stack([lse_a.float(), lse_b.float()]).contiguous()
            out = torch.empty((b, s, h, out_a.shape[3]), dtype=out_a.dtype, device=out_a.device)
            lse = torch.empty((b, h, s), dtype=torch.float32, device=out_a.device)
            launch_decode.merge_states(o_part, l_part, out, lse)
            return out, lse
        out, lse = _merge_torch(out_a, lse_a, out_b, lse_b)
        return out.to(out_a.dtype), lse


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------
class _Args(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    cache_seqlens: torch.Tensor  # int32 (B,)
    cache_batch_idx: torch.Tensor | None
    cache_leftpad: torch.Tensor | None
    block_table: torch.Tensor | None
    tree_mask: torch.Tensor | None  # bool (B|1, Sq, Sq)
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    rotary_q_per_token: bool
    num_splits: int
    seqlen_new: int
    capacity: int


def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _need_tensor(name: str, x, ndim: int, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}")
    return x


def _need_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; move it to q's device")


def _need_int32(name: str, x, shape: tuple, device: torch.device, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor {layout}, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype int32, got {_dt(x.dtype)}; use {name}.to(torch.int32)")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {tuple(x.shape)}")
    _need_device(name, x, device)
    return x


def _is_int(x) -> bool:
    """An integer that is not a bool (``numbers.Integral``); exact ``int`` is tested first
    because the abstract-class check costs several times more."""
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x) -> bool:
    """A real number that is not a bool (``numbers.Real``); exact ``float``/``int`` first."""
    return type(x) is float or type(x) is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(x.stride())}")


def _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
              cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
              rotary_interleaved, alibi_slopes, num_splits, tree_mask) -> _Args:
    _need_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {_dt(q.dtype)}")
    device = q.device
    b, sq, h, d = q.shape
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"headdim of q must be between 1 and {_MAX_HEAD_DIM}, got {d}")
    paged = block_table is not None
    cache_layout = "(num_blocks, page_size, nheads_k, headdim)" if paged else "(batch_cache, seqlen_cache, nheads_k, headdim)"
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _need_tensor(name, x, 4, cache_layout)
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {_dt(x.dtype)} but q has {_dt(q.dtype)}; they must match")
        _need_device(name, x, device)
        _last_dim_contiguous(name, x)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache headdim {k_cache.shape[3]} != q headdim {d}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"nheads of q ({h}) must be a multiple of nheads_k of k_cache ({hk})")

    if paged:
        _need_tensor("block_table", block_table, 2, "(batch, max_blocks_per_seq)")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must have dtype int32, got {_dt(block_table.dtype)}")
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must have shape (batch={b}, max_blocks), got {tuple(block_table.shape)}")
        _need_device("block_table", block_table, device)
        paged_kv.check_page_size(int(k_cache.shape[1]))
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table: map rows to pages in "
                             "block_table instead")
        if k_cache.shape[0] == 0:
            raise ValueError("paged k_cache has no blocks (num_blocks = 0)")
    capacity = paged_kv.row_capacity(k_cache, block_table)

    if cache_batch_idx is not None:
        _need_int32("cache_batch_idx", cache_batch_idx, (b,), device, "(batch,)")
    elif not paged and k_cache.shape[0] != b:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows but q has batch {b}; pass cache_batch_idx "
                         "to map batch rows to cache rows")

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    seqlen_new = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            _need_tensor(name, x, 4, "(batch, seqlen_new, nheads_k, headdim)")
            if x.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {_dt(x.dtype)} but q has {_dt(q.dtype)}; they must match")
            _need_device(name, x, device)
        if k.shape[0] != b or k.shape[2] != hk or k.shape[3] != d:
            raise ValueError(f"k must have shape (batch={b}, seqlen_new, nheads_k={hk}, headdim={d}), "
                             f"got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
        seqlen_new = int(k.shape[1])
        if k.shape[-1] > 1 and k.stride(-1) != 1:
            k = k.contiguous()
        if v.shape[-1] > 1 and v.stride(-1) != 1:
            v = v.contiguous()

    static_len = None
    if cache_seqlens is None:
        static_len = capacity
        seqlens_t = None
    elif isinstance(cache_seqlens, torch.Tensor):
        seqlens_t = _need_int32("cache_seqlens", cache_seqlens, (b,), device, "(batch,)")
    elif _is_int(cache_seqlens):
        static_len = int(cache_seqlens)
        seqlens_t = None
        if static_len < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {static_len}")
    else:
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor (batch,), got {type(cache_seqlens).__name__}")
    if static_len is not None and static_len + seqlen_new > capacity:
        what = "the full cache (cache_seqlens=None)" if cache_seqlens is None else f"cache_seqlens={static_len}"
        raise ValueError(f"{what} + {seqlen_new} new tokens exceeds the cache capacity {capacity}")

    if cache_leftpad is not None:
        _need_int32("cache_leftpad", cache_leftpad, (b,), device, "(batch,)")

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin need new keys k and v to rotate (flash-attn semantics); "
                             "rotate q yourself when not appending")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _need_tensor(name, x, 2, "(seqlen_ro, rotary_dim / 2)")
            if x.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"{name} must be float16, bfloat16 or float32, got {_dt(x.dtype)}")
            _need_device(name, x, device)
            _last_dim_contiguous(name, x)
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin shape {tuple(rotary_sin.shape)} != rotary_cos shape {tuple(rotary_cos.shape)}")
        if rotary_sin.dtype != rotary_cos.dtype:
            raise TypeError(f"rotary_sin dtype {_dt(rotary_sin.dtype)} != rotary_cos dtype {_dt(rotary_cos.dtype)}")
        rd = 2 * rotary_cos.shape[1]
        if rd == 0 or rd > d:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {rd} must be in [2, headdim={d}]")

    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a float32 tensor (nheads,) or (batch, nheads), got "
                            f"{type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must have dtype float32, got {_dt(alibi_slopes.dtype)}")
        if tuple(alibi_slopes.shape) not in ((h,), (b, h)):
            raise ValueError(f"alibi_slopes must have shape (nheads,) = {(h,)} or (batch, nheads) = {(b, h)}, "
                             f"got {tuple(alibi_slopes.shape)}")
        _need_device("alibi_slopes", alibi_slopes, device)
        _last_dim_contiguous("alibi_slopes", alibi_slopes)

    tree = None
    if tree_mask is not None:
        if not isinstance(tree_mask, torch.Tensor):
            raise TypeError(f"tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
        _need_device("tree_mask", tree_mask, device)
        if tree_mask.dtype == torch.bool:
            tm = tree_mask.unsqueeze(0) if tree_mask.dim() == 2 else tree_mask
            if tm.dim() != 3 or tm.shape[0] not in (1, b) or tuple(tm.shape[1:]) != (sq, sq):
                raise ValueError(f"bool tree_mask must have shape (batch|1, seqlen_q, seqlen_q) = "
                                 f"({b}|1, {sq}, {sq}), got {tuple(tree_mask.shape)}")
            tree = tm
        elif tree_mask.dtype == torch.int64:
            tm = tree_mask.unsqueeze(0) if tree_mask.dim() == 1 else tree_mask
            if tm.dim() != 2 or tm.shape[0] not in (1, b) or tm.shape[1] != sq:
                raise ValueError(f"packed int64 tree_mask must have shape (batch|1, seqlen_q) = ({b}|1, {sq}), "
                                 f"got {tuple(tree_mask.shape)}")
            if sq > _MAX_PACKED_TREE:
                raise ValueError(f"packed int64 tree_mask holds at most {_MAX_PACKED_TREE} tokens, seqlen_q={sq}; "
                                 "pass a bool (batch|1, seqlen_q, seqlen_q) mask")
            tree = _unpack_tree_mask(tm, sq)
        else:
            raise TypeError(f"tree_mask must be bool (batch|1, seqlen_q, seqlen_q) or a packed int64 "
                            f"(batch|1, seqlen_q) bitmask, got {_dt(tree_mask.dtype)}")

    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and _is_int(window_size[0]) and _is_int(window_size[1])):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    wl, wr = int(window_size[0]), int(window_size[1])
    wl = -1 if wl < 0 else wl
    wr = -1 if wr < 0 else wr
    if causal:
        wr = 0
    if not _is_real(softcap) or not softcap >= 0 or math.isinf(softcap):
        raise ValueError(f"softcap must be a finite float >= 0, got {softcap!r}")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    elif not _is_real(softmax_scale) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    if not _is_int(num_splits) or not 0 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {_MAX_SPLITS}] (0 = heuristic), got {num_splits!r}")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    q_per_token = bool(causal) or wl >= 0 or wr >= 0 or tree is not None

    # values of index tensors (host round trip: CPU always, GPU only when asked)
    if _check_indices_enabled(device):
        lens_host = (seqlens_t.to("cpu", torch.int64) if seqlens_t is not None
                     else torch.full((b,), static_len, dtype=torch.int64))
        pad_host = (cache_leftpad.to("cpu", torch.int64) if cache_leftpad is not None
                    else torch.zeros(b, dtype=torch.int64))
        if (lens_host < 0).any():
            raise ValueError(f"cache_seqlens must be >= 0, got {lens_host.tolist()}")
        if (lens_host + seqlen_new > capacity).any():
            bad = int(torch.nonzero(lens_host + seqlen_new > capacity)[0])
            raise ValueError(f"cache_seqlens[{bad}]={int(lens_host[bad])} + {seqlen_new} new tokens exceeds "
                             f"the cache capacity {capacity}")
        if cache_leftpad is not None and ((pad_host < 0) | (pad_host > lens_host)).any():
            bad = int(torch.nonzero((pad_host < 0) | (pad_host > lens_host))[0])
            raise ValueError(f"cache_leftpad[{bad}]={int(pad_host[bad])} must be in [0, cache_seqlens[{bad}]="
                             f"{int(lens_host[bad])}]")
        if cache_batch_idx is not None:
            idx = cache_batch_idx.to("cpu", torch.int64)
            if ((idx < 0) | (idx >= k_cache.shape[0])).any():
                raise ValueError(f"cache_batch_idx values must be in [0, {k_cache.shape[0]}), got {idx.tolist()}")
        if paged:
            page = int(k_cache.shape[1])
            bt = block_table.to("cpu", torch.int64)
            j = torch.arange(bt.shape[1])
            first = (pad_host // page)[:, None]
            last = ((lens_host + seqlen_new + page - 1) // page)[:, None]
            used = (j[None, :] >= first) & (j[None, :] < last)  # pages the call reads or writes
            bad = used & ((bt < 0) | (bt >= k_cache.shape[0]))
            if bad.any():
                r, c = (int(t) for t in torch.nonzero(bad)[0])
                raise ValueError(f"block_table[{r}, {c}]={int(bt[r, c])} is not a page of k_cache "
                                 f"(num_blocks={k_cache.shape[0]})")
        if rotary_cos is not None:
            span = max(seqlen_new, sq if q_per_token else 1)
            need = int(lens_host.max()) + span if b > 0 else 0
            if need > rotary_cos.shape[0]:
                raise ValueError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions but positions up "
                                 f"to {need - 1} are rotated (cache_seqlens + new tokens)")
    elif rotary_cos is not None and static_len is not None:
        need = static_len + max(seqlen_new, sq if q_per_token else 1)
        if need > rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions but positions up to "
                             f"{need - 1} are rotated (cache_seqlens + new tokens)")

    if seqlens_t is None:
        seqlens_t = torch.full((b,), static_len, dtype=torch.int32, device=device)
    seqlens_t = seqlens_t.contiguous()  # the kernels index these tensors with unit stride
    if q.shape[-1] > 1 and q.stride(-1) != 1:
        q = q.contiguous()
    return _Args(q, k, v, seqlens_t,
                 cache_batch_idx.contiguous() if cache_batch_idx is not None else None,
                 cache_leftpad.contiguous() if cache_leftpad is not None else None,
                 block_table.contiguous() if block_table is not None else None,
                 tree, float(softmax_scale), wl, wr, float(softcap), q_per_token,
                 int(num_splits), seqlen_new, capacity)


# --------------------------------------------------------------------------------------------
# torch backend
# --------------------------------------------------------------------------------------------
def _attend_slice(qb, kb, vb, j0, n_keys, *, scale, wl, wr, softcap, slopes, tree_b):
    """Attention of one row's queries to keys ``j0 .. j0 + m - 1`` (of ``n_keys``).

    ``qb (Sq, H, D)``, ``kb/vb (m, Hk, D)``; returns ``out (Sq, H, D)`` float32 normalised over
    these keys and ``lse (H, Sq)`` float32.
    """
    sq, h, d = qb.shape
    m, hk, _ = kb.shape
    g = h // hk
    qf = qb.float().reshape(sq, hk, g, d).permute(1, 2, 0, 3)  # (Hk, G, Sq, D)
    kf = kb.float().permute(1, 0, 2).unsqueeze(1)  # (Hk, 1, m, D)
    vf = vb.float().permute(1, 0, 2).unsqueeze(1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (Hk, G, Sq, m)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    t = torch.arange(sq, device=qb.device)[:, None]
    j = torch.arange(j0, j0 + m, device=qb.device)[None, :]
    shift = n_keys - sq
    if slopes is not None:
        s = s - slopes.float().reshape(hk, g, 1, 1) * (t + shift - j).abs().float()
    vis = torch.ones(sq, m, dtype=torch.bool, device=qb.device)
    if wl >= 0:
        vis &= j >= t + shift - wl
    if wr >= 0:
        vis &= j <= t + shift + wr
    if tree_b is not None:
        c = (j - (n_keys - sq)).expand(sq, m)
        allowed = torch.gather(tree_b, 1, c.clamp(min=0))
        vis &= (c < 0) | allowed
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (Hk, G, Sq), -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.matmul(p, vf)  # (Hk, G, Sq, D)
    return out.permute(2, 0, 1, 3).reshape(sq, h, d), lse.reshape(h, sq)


def _torch_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                   cache_leftpad, block_table, a: _Args, rotary_interleaved, alibi_slopes):
    b, sq, h, d = q.shape
    s_new = a.seqlen_new
    lens = cache_seqlens.tolist()
    pads = cache_leftpad.tolist() if cache_leftpad is not None else [0] * b
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(b))
    if block_table is not None:
        rows = list(range(b))  # a paged cache is addressed through block_table[b]
    dev = q.device

    if k is not None and s_new > 0:
        if rotary_cos is not None:
            pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(s_new, device=dev)
            k = apply_rotary(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
        for i in range(b):
            paged_kv.scatter_kv(k_cache, k[i], lens[i], row=rows[i], block_table=block_table)
            paged_kv.scatter_kv(v_cache, v[i], lens[i], row=rows[i], block_table=block_table)
    if rotary_cos is not None:
        offs = torch.arange(sq, device=dev) if a.rotary_q_per_token else torch.zeros(sq, dtype=torch.int64, device=dev)
        q = apply_rotary(q, rotary_cos, rotary_sin, cache_seqlens.to(torch.int64)[:, None] + offs, rotary_interleaved)

    out = torch.empty((b, sq, h, d), dtype=q.dtype, device=dev)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=dev)
    n_splits = max(1, a.num_splits)
    for i in range(b):
        start, end = pads[i], min(lens[i] + s_new, a.capacity)
        n = max(end - start, 0)
        kb = paged_kv.gather_kv(k_cache, start, start + n, row=rows[i], block_table=block_table)
        vb = paged_kv.gather_kv(v_cache, start, start + n, row=rows[i], block_table=block_table)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
        tree_b = None
        if a.tree_mask is not None:
            tree_b = a.tree_mask[i if a.tree_mask.shape[0] > 1 else 0]
        chunk = -(-n // n_splits) if n > 0 else 0
        o_acc = l_acc = None
        for s in range(n_splits):
            j0 = min(s * chunk, n)
            j1 = min(j0 + chunk, n)
            o_s, l_s = _attend_slice(q[i], kb[j0:j1], vb[j0:j1], j0, n, scale=a.softmax_scale,
                                     wl=a.window_left, wr=a.window_right, softcap=a.softcap,
                                     slopes=slopes, tree_b=tree_b)
            o_s, l_s = o_s.unsqueeze(0), l_s.unsqueeze(0)
            if o_acc is None:
                o_acc, l_acc = o_s, l_s
            else:
                o_acc, l_acc = _merge_torch(o_acc, l_acc, o_s, l_s)
        out[i] = o_acc[0].to(q.dtype)
        lse[i] = l_acc[0]
    return out, lse


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    tree_mask: torch.Tensor | None = None,
):
    """Attend ``q`` to a KV cache, optionally appending new keys/values to it first (in place).

    Arguments
      q: ``(batch, seqlen_q, nheads, headdim)``, float16 / bfloat16 / float32.
      k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_k, headdim)``, or with
        ``block_table`` a paged cache ``(num_blocks, page_size, nheads_k, headdim)`` with
        ``page_size`` a multiple of 16.  Same dtype as q; last dimension contiguous.
        ``nheads % nheads_k == 0`` (MQA / GQA: head ``h`` reads KV head ``h // (nheads // nheads_k)``).
      k, v: ``(batch, seqlen_new, nheads_k, headdim)`` or None.  Written into the cache at
        positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` of cache row
        ``cache_batch_idx[b]`` (or ``b``; through ``block_table[b]`` when paged) and attended to.
        Duplicate cache rows in ``cache_batch_idx`` make the written values unspecified.
      rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)`` or None (needs k/v).  The new keys
        are rotated at positions ``cache_seqlens[b] + i``; q at ``cache_seqlens[b] + i`` when
        causal, windowed or with a tree mask, else every q token at ``cache_seqlens[b]``
        (flash-attn's convention).  ``rotary_interleaved``: pairs ``(2i, 2i+1)``; False: GPT-NeoX
        halves ``(i, i + rotary_dim/2)``.
      cache_seqlens: int or int32 ``(batch,)``: keys already in the cache (before appending);
        None means the whole ``seqlen_cache`` (``max_blocks * page_size`` when paged).
      cache_batch_idx: int32 ``(batch,)``: cache row of each batch row (contiguous cache only).
      cache_leftpad: int32 ``(batch,)``: row ``b``'s keys start at cache position
        ``cache_leftpad[b]`` (earlier slots are ignored); positions stay absolute for rotary.
      block_table: int32 ``(batch, max_blocks_per_seq)``: physical page of each logical page.
      softmax_scale: default ``headdim ** -0.5``.
      causal, window_size: ``(left, right)``, -1 = unbounded; causal sets ``right = 0``; both
        bottom-right aligned to each row's key count ``cache_seqlens - leftpad + seqlen_new``.
      softcap: ``> 0`` caps scores as ``softcap * tanh(score / softcap)``.
      alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``; subtracts
        ``slope * |i + n_keys - seqlen_q - j|`` after the softcap.
      num_splits: slices of each row's keys computed in parallel and merged (FlashDecoding);
        0 chooses from the SM count (1 on CPU); at most 128.  Results do not depend on it
        beyond rounding.
      return_softmax_lse: also return ``lse``.
      tree_mask: bool ``(batch|1, seqlen_q, seqlen_q)`` (True = may attend) or a packed int64
        ``(batch|1, seqlen_q)`` bitmask (bit ``j`` of entry ``i``: token ``i`` sees new token
        ``j``; ``seqlen_q <= 64``).  The ``seqlen_q`` query tokens are the last ``seqlen_q`` keys
        of the row (appended now or earlier); they see every older key, and among themselves
        what the mask allows.  Combines with causal/window by intersection.  See
        :func:`build_tree_mask`.

    Returns ``out (batch, seqlen_q, nheads, headdim)`` in q's dtype, and with
    ``return_softmax_lse`` also ``lse`` float32 ``(batch, nheads, seqlen_q)`` (natural log;
    ``-inf`` for a query that sees no key, whose output is 0).

    Shapes, dtypes and devices are always checked before anything runs or is written.  Values
    of index tensors (lengths vs capacity, leftpad, ``cache_batch_idx``, ``block_table`` pages,
    rotary table length) are checked on CPU, and on GPU only with ``FLASHTILE_CHECK_INDICES=1``
    because that needs a device sync (which would also break CUDA-graph capture).  Forward
    only: no autograd.
    """
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
               cache_leftpad, block_table, alibi_slopes)
    key = None
    if tree_mask is None:
        key = _eager_plan_key(tensors, (softmax_scale, causal, window_size, softcap, rotary_interleaved,
                                        num_splits))
        plan = _PLANS.get(key) if key is not None else None
        if plan is not None:
            res = plan.run(tensors)
            if res is not None:
                return res if return_softmax_lse else res[0]
    a = _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                  cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                  rotary_interleaved, alibi_slopes, num_splits, tree_mask)
    if key is not None or select_decode_backend(q.device) == "triton":
        # only fresh torch.empty outputs written by the kernels: nothing to record for autograd,
        # so no grad-mode switch on this path
        launcher = _triton_launcher()

        def call():
            return launcher.decode_forward(
                a.q, k_cache, v_cache, a.k, a.v, rotary_cos, rotary_sin, a.cache_seqlens,
                a.cache_batch_idx, a.cache_leftpad, a.block_table,
                softmax_scale=a.softmax_scale, window_left=a.window_left, window_right=a.window_right,
                softcap=a.softcap, rotary_interleaved=rotary_interleaved,
                rotary_q_per_token=a.rotary_q_per_token, alibi_slopes=alibi_slopes,
                num_splits=a.num_splits, tree_mask=a.tree_mask)

        if key is None:
            out, lse = call()
        else:
            (out, lse), plan = launcher.record_plan(tensors, call)
            if plan is not None:
                if len(_PLANS) >= _MAX_PLANS:
                    _PLANS.clear()
                _PLANS[key] = plan
    else:
        with torch.no_grad():
            out, lse = _torch_forward(a.q, k_cache, v_cache, a.k, a.v, rotary_cos, rotary_sin,
                                      a.cache_seqlens, a.cache_batch_idx, a.cache_leftpad, a.block_table, a,
                                      rotary_interleaved, alibi_slopes)
    return (out, lse) if return_softmax_lse else out
