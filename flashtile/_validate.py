"""Argument checks run before any kernel launches.

Every error names the argument, says what was expected and what was received, and where there
is an obvious fix, says it.  A wrong type or dtype raises ``TypeError``; every bad value (shape,
device, range, index) raises :class:`FlashtileInputError`, which is both a ``ValueError`` and a
``RuntimeError`` so that code written for flash-attn (which raises ``RuntimeError``) or for
flashtile catches it.

Checks that need the values of index tensors (``cu_seqlens``, ``block_table``,
``cache_seqlens`` ...) run inside the backends' op (see :func:`varlen_values`), so they hold in
eager mode and under ``torch.compile`` alike.
"""
from __future__ import annotations

import math
import numbers

import torch

from ._tensor_cache import TensorCache
from .backends.spec import AttnSpec, KVCacheSpec, spec_of
from .paged_kv import check_page_size, row_capacity



class FlashtileInputError(ValueError, RuntimeError):
    """A bad argument value: wrong shape, device, range or index.  Subclasses both
    ``ValueError`` (flashtile's convention) and ``RuntimeError`` (flash-attn's)."""


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_bf16_ok: dict[int, bool] = {}


def _real(x) -> bool:
    # type() first: the numbers.Real ABC check costs microseconds on every call.
    return type(x) in (float, int) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor(name: str, x, ndim: int | tuple[int, ...], layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in dims:
        raise FlashtileInputError(f"{name} must have {' or '.join(map(str, dims))} dimensions {layout}, "
                         f"got shape {tuple(x.shape)}")
    return x


def float_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {_dt(x.dtype)}")
    if x.dtype == torch.bfloat16 and x.device.type == "cuda":
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if index not in _bf16_ok:
            _bf16_ok[index] = torch.cuda.get_device_capability(index) >= (8, 0)
        if not _bf16_ok[index]:
            raise TypeError(f"{name} is bfloat16, which {torch.cuda.get_device_name(x.device)} "
                            "does not support; use float16")


def same_dtype_device(named: dict[str, torch.Tensor]) -> None:
    (first_name, first), *rest = named.items()
    for name, x in rest:
        if x.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {_dt(x.dtype)} but {first_name} has "
                            f"{_dt(first.dtype)}; all of them must share one dtype")
        if x.device != first.device:
            raise FlashtileInputError(f"{name} is on {x.device} but {first_name} is on {first.device}; "
                             "move them to one device")


def last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise FlashtileInputError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(x.stride())}; call {name}.contiguous() first")


def head_dim(d: int, name: str = "q") -> None:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise FlashtileInputError(f"headdim of {name} must be between 1 and {MAX_HEAD_DIM}, got {d}")


def heads(nheads: int, nheads_k: int, kv_name: str = "k/v") -> None:
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise FlashtileInputError(f"nheads of q ({nheads}) must be a multiple of nheads_k of "
                                  f"{kv_name} ({nheads_k}) (grouped-query attention)")


def _finite(x) -> bool:
    # comparisons rather than math.isfinite: they also hold for the symbolic floats
    # torch.compile passes with dynamic=True (math.isfinite breaks the graph there)
    return -math.inf < x < math.inf


def softmax_scale(scale, head_dim_: int, name: str = "softmax_scale"):
    if scale is None:
        return 1.0 / math.sqrt(head_dim_)
    if not _real(scale):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not _finite(scale):
        raise FlashtileInputError(f"{name} must be finite, got {scale}")
    return scale if isinstance(scale, torch.SymFloat) else float(scale)


def dropout(p):
    if not _real(p):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise FlashtileInputError(f"dropout_p must be in [0, 1), got {p}")
    return p if isinstance(p, torch.SymFloat) else float(p)


def _int(x) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def window(window_size) -> tuple[int, int]:
    """``(left, right)`` from a pair of ints: a tuple, a list or a 2-element integer tensor
    (flash-attn's tests draw it with ``torch.randint``); -1 means unbounded."""
    if type(window_size) is tuple and window_size == (-1, -1):
        return -1, -1
    if isinstance(window_size, torch.Tensor):
        if window_size.dtype.is_floating_point or window_size.dtype.is_complex \
                or window_size.dtype == torch.bool:
            raise TypeError(f"window_size must be a pair of ints (left, right), got a "
                            f"{_dt(window_size.dtype)} tensor")
        if window_size.numel() != 2:
            raise FlashtileInputError(f"window_size must be a pair of ints (left, right), got a "
                                      f"tensor of shape {tuple(window_size.shape)}")
        window_size = tuple(int(w) for w in window_size.reshape(2).tolist())
    if not isinstance(window_size, (tuple, list)) or not all(_int(w) for w in window_size):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if len(window_size) != 2:
        raise FlashtileInputError(f"window_size must be a pair of ints (left, right), got "
                                  f"{len(window_size)} entries: {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise FlashtileInputError(f"window_size entries must be >= -1 (-1 = unbounded), got "
                                  f"{tuple(window_size)}")
    return left, right


def softcap(c):
    if not _real(c):
        raise TypeError(f"softcap must be a float, got {type(c).__name__}")
    if not (c >= 0.0 and _finite(c)):
        raise FlashtileInputError(f"softcap must be >= 0 and finite (0 disables it), got {c}")
    return c if isinstance(c, torch.SymFloat) else float(c)


def check_qkv(q, k, v, layout_q: str, layout_kv: str, ndim: int, names=("q", "k", "v"),
              ndim_kv: int | None = None, heads_dim: int = -2) -> None:
    """q, k, v: tensors of the given ranks, one supported float dtype, one device, contiguous
    last dimension, k and v of one shape, one head dim, query heads (dimension ``heads_dim``)
    a multiple of k/v heads."""
    nq, nk, nv = names
    ndim_kv = ndim if ndim_kv is None else ndim_kv
    tensor(nq, q, ndim, layout_q)
    tensor(nk, k, ndim_kv, layout_kv)
    tensor(nv, v, ndim_kv, layout_kv)
    dt, dev = q.dtype, q.device
    if k.dtype is dt and v.dtype is dt and k.device == dev and v.device == dev:
        float_dtype(nq, q)  # (one dtype, one device: the checks of the three are q's)
    else:  # the per-tensor checks, for the error that names the argument
        named = dict(zip(names, (q, k, v)))
        for name, x in named.items():
            float_dtype(name, x)
        same_dtype_device(named)
    for name, x in ((nq, q), (nk, k), (nv, v)):
        last_dim_contiguous(name, x)
    if k.shape != v.shape:
        raise FlashtileInputError(f"{nk} and {nv} must have the same shape {layout_kv}, got "
                                  f"{nk} {tuple(k.shape)} and {nv} {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise FlashtileInputError(f"headdim of {nq} ({q.shape[-1]}) and {nk}/{nv} "
                                  f"({k.shape[-1]}) must match")
    head_dim(q.shape[-1], nq)
    heads(q.shape[heads_dim], k.shape[heads_dim])


def spec(q, softmax_scale_, causal, window_size, softcap_, dropout_p, bottom_right=True,
         scale_name="softmax_scale", deterministic=False):
    """The validated :class:`~flashtile.backends.spec.AttnSpec` of a dense or varlen call.
    ``q``: the query tensor, or its head dim as an int; ``scale_name`` names the scale argument
    in errors (``scale`` in the SDPA drop-in)."""
    head_dim_ = q if isinstance(q, int) else q.shape[-1]

    def make():
        left, right = window(window_size)
        if causal:
            right = 0
        return AttnSpec(softmax_scale(softmax_scale_, head_dim_, scale_name), left, right,
                        bottom_right, softcap(softcap_), dropout(dropout_p),
                        deterministic=bool(deterministic))

    # (a window that is not a tuple of two is keyed by itself: a list or a tensor, which
    # spec_of does not cache)
    pair = type(window_size) is tuple and len(window_size) == 2
    wl, wr = window_size if pair else (window_size, window_size)
    return spec_of((head_dim_, softmax_scale_, causal, wl, wr, softcap_, dropout_p,
                    bottom_right, scale_name, deterministic), make)


def alibi(slopes, batch: int, nheads: int, device: torch.device):
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {_dt(slopes.dtype)}")
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise FlashtileInputError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or "
                         f"(batch, nheads) = ({batch}, {nheads}), got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise FlashtileInputError(f"alibi_slopes is on {slopes.device} but q is on {device}")
    return slopes if slopes.stride(-1) == 1 else slopes.contiguous()


def cu_seqlens(name: str, cu, max_seqlen, max_name: str, device: torch.device) -> int:
    """Static checks of a cumulative-length vector (type, dtype, shape, device) and of its
    ``max_seqlen``; returns ``batch``.  The values are checked by :func:`varlen_values`."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape (batch + 1,), "
                        f"got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_dt(cu.dtype)}; use {name}.int()")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise FlashtileInputError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    if cu.device != device:
        raise FlashtileInputError(f"{name} is on {cu.device} but q is on {device}")
    if not _int(max_seqlen) and not isinstance(max_seqlen, torch.SymInt):
        raise TypeError(f"{max_name} must be a non-negative int, got {max_seqlen!r}")
    if max_seqlen < 0:
        raise FlashtileInputError(f"{max_name} must be a non-negative int, got {max_seqlen!r}")
    return cu.shape[0] - 1


def block_table(table, batch: int, k: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Static checks of the ``block_table`` of a varlen call with paged ``k``/``v``
    ``(num_blocks, page_size, Hk, D)``: int32 ``(batch, max_num_blocks)`` on q's device.  Its
    entries are checked by :func:`varlen_values`."""
    layout = "(batch, max_num_blocks)"
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 torch.Tensor of shape {layout}, got "
                        f"{type(table).__name__}")
    if table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {_dt(table.dtype)}; use "
                        "block_table.int()")
    if table.dim() != 2 or table.shape[0] != batch:
        raise FlashtileInputError(f"block_table must have shape {layout} with batch = {batch} "
                                  f"(from cu_seqlens_k), got {tuple(table.shape)}")
    if table.device != device:
        raise FlashtileInputError(f"block_table is on {table.device} but q is on {device}")
    check_page_size(int(k.shape[1]), "paged k/v (with block_table)")
    return table


def value_checks_enabled(device: torch.device) -> bool:
    """Whether the values of index tensors can be read back on the host: always for CPU
    tensors (free); on a GPU except while a CUDA graph is being captured (a host read is
    impossible there).  In a captured graph the decode kernels' guards keep every access in
    bounds; the varlen kernels trust ``cu_seqlens`` / ``block_table`` (check them before
    capturing)."""
    if device.type != "cuda":
        return True
    return not torch.cuda.is_current_stream_capturing()


def _safe_cu(cu: torch.Tensor, max_len: int, total) -> torch.Tensor:
    """``cu`` made non-decreasing from 0 with lengths <= ``max_len`` and end <= ``total``."""
    c = torch.cummax(cu.clamp(min=0), 0).values
    lens = (c[1:] - c[:-1]).clamp(max=max_len)
    c = torch.cat([c.new_zeros(1), lens.cumsum(0).to(c.dtype)])
    return c if total is None else c.clamp(max=total)


def varlen_guard(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int,
                 k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                 block_table_: torch.Tensor | None):
    """Index tensors no kernel can read or write out of bounds with, computed on the device
    (for CUDA-graph capture, where :func:`varlen_values` cannot read them): ``cu_seqlens_*``
    non-decreasing from 0, within the packed totals and ``max_seqlen_*`` (and, paged, what the
    block table addresses), ``block_table`` entries clamped to the pool.  Equal to the inputs
    when those are valid; a call with invalid ones computes garbage, in bounds (and
    :func:`zero_uncovered` defines the rows of tokens the clamped sequences leave out)."""
    cu_q = _safe_cu(cu_seqlens_q, max_seqlen_q, total_q)
    if block_table_ is None:
        return cu_q, _safe_cu(cu_seqlens_k, max_seqlen_k, k.shape[0]), None
    capacity = block_table_.shape[1] * k.shape[1]
    cu_k = _safe_cu(cu_seqlens_k, min(max_seqlen_k, capacity), None)
    return cu_q, cu_k, block_table_.clamp(0, max(k.shape[0] - 1, 0))


def zero_uncovered(x: torch.Tensor, cu: torch.Tensor, dim: int = 0,
                   fill: float = 0.0) -> torch.Tensor:
    """``x`` with the entries along ``dim`` of the packed tokens that no sequence of ``cu``
    covers (index ``>= cu[-1]``) set to ``fill``, in place and on the device (no host read).
    With the indices :func:`varlen_guard` clamped, the kernels write no row for those tokens:
    without this, their rows would keep whatever the fresh buffer held."""
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    tokens = torch.arange(x.shape[dim], device=x.device).view(shape)
    return x.masked_fill_(tokens >= cu[-1], fill)


def _cu_values(name: str, values: list[int], total, max_seqlen, max_name: str) -> list[int]:
    if values[0] != 0:
        raise FlashtileInputError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise FlashtileInputError(f"{name} must be non-decreasing, got {values}")
    if total is not None and values[-1] != total:
        raise FlashtileInputError(f"{name}[-1] = {values[-1]} must equal the number of packed "
                                  f"tokens ({total})")
    if lengths and max(lengths) > max_seqlen:
        raise FlashtileInputError(f"{max_name} = {max_seqlen} is smaller than the longest "
                                  f"sequence in {name} ({max(lengths)})")
    return lengths


_varlen_checked = TensorCache()


def _varlen_lengths(cu_seqlens_q, cu_seqlens_k, total_q: int, k, max_seqlen_q: int,
                    max_seqlen_k: int, paged: bool) -> list[int]:
    """The key lengths, after checking both cumulative-length tensors (one host read)."""
    lens_q = _cu_values("cu_seqlens_q", cu_seqlens_q.tolist(), total_q, max_seqlen_q,
                        "max_seqlen_q")
    # paged k/v: the pool's size says nothing about the number of keys
    lens_k = _cu_values("cu_seqlens_k", cu_seqlens_k.tolist(), None if paged else k.shape[0],
                        max_seqlen_k, "max_seqlen_k")
    if len(lens_q) != len(lens_k):
        raise FlashtileInputError(f"cu_seqlens_q describes {len(lens_q)} sequences but "
                                  f"cu_seqlens_k describes {len(lens_k)}")
    return lens_k


def varlen_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int,
                  k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  block_table_: torch.Tensor | None) -> None:
    """Value checks of a varlen call, run where the backend op runs (eager and compiled):
    ``cu_seqlens_*`` start at 0, never decrease, end at the packed totals (keys: unless
    paged), ``max_seqlen_*`` cover the longest sequence, and with paged ``k``/``v`` every
    ``block_table`` entry a sequence reads is a page of the pool.  One host read of the small
    index tensors (see :func:`value_checks_enabled`; where it is impossible, use
    :func:`varlen_guard`)."""
    paged = block_table_ is not None
    if not paged:
        # a model's layers pass the same lengths: one host read a step (_tensor_cache)
        _varlen_checked.get((int(total_q), int(k.shape[0]), int(max_seqlen_q),
                             int(max_seqlen_k)), (cu_seqlens_q, cu_seqlens_k),
                            lambda: _varlen_lengths(cu_seqlens_q, cu_seqlens_k, total_q, k,
                                                    max_seqlen_q, max_seqlen_k, False))
        return
    lens_k = _varlen_lengths(cu_seqlens_q, cu_seqlens_k, total_q, k, max_seqlen_q,
                             max_seqlen_k, True)
    if block_table_.shape[0] != len(lens_k):
        raise FlashtileInputError(f"block_table must have shape (batch, max_num_blocks) with "
                                  f"batch = {len(lens_k)} (from cu_seqlens_k), got "
                                  f"{tuple(block_table_.shape)}")
    page_size, num_blocks = int(k.shape[1]), int(k.shape[0])
    capacity = int(block_table_.shape[1]) * page_size
    for b, n in enumerate(lens_k):
        if n > capacity:
            raise FlashtileInputError(
                f"sequence {b} has {n} keys (cu_seqlens_k) but block_table rows address at "
                f"most {block_table_.shape[1]} pages x page_size {page_size} = {capacity} keys; "
                f"it needs ceil({n} / {page_size}) = {-(-n // page_size)} pages")
    t = block_table_.to("cpu", torch.int64)
    need = torch.tensor([-(-n // page_size) for n in lens_k], dtype=torch.int64)
    used = torch.arange(t.shape[1])[None, :] < need[:, None]  # pages the call reads
    bad = used & ((t < 0) | (t >= num_blocks))
    if bad.any():
        r, c = (int(i) for i in torch.nonzero(bad)[0])
        raise FlashtileInputError(f"block_table[{r}, {c}] = {int(t[r, c])} is not a page of "
                                  f"k/v (num_blocks = {num_blocks}); sequence {r} reads its "
                                  f"first {int(need[r])} entries")


def attn_mask(mask, query: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor:
    """SDPA's ``attn_mask``: bool (True = attend) or float (query's dtype or float32),
    broadcastable to ``target = (..., H, L, S)``, on query's device."""
    shape = "(..., heads, L, S) (broadcastable)"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor of shape {shape} or None, got "
                        f"{type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in (query.dtype, torch.float32):
        raise TypeError(f"attn_mask must be bool (True = attend) or a float additive mask of "
                        f"the query's dtype ({_dt(query.dtype)}) or float32, got "
                        f"{_dt(mask.dtype)}")
    if mask.device != query.device:
        raise FlashtileInputError(f"attn_mask is on {mask.device} but query is on {query.device}")
    ok = mask.dim() <= len(target)
    if ok:
        for n, t in zip(reversed(mask.shape), reversed(target)):
            if n != 1 and n != t:
                ok = False
    if not ok:
        raise FlashtileInputError(f"attn_mask of shape {tuple(mask.shape)} is not broadcastable to "
                         f"(..., heads, L, S) = {tuple(target)}")
    return mask


def block_size(bs) -> tuple[int, int]:
    """``(block_m, block_n)`` of a block-sparse mask: positive multiples of 16."""
    if isinstance(bs, numbers.Integral) and not isinstance(bs, bool):
        bs = (bs, bs)
    if (not isinstance(bs, (tuple, list)) or len(bs) != 2
            or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in bs)):
        raise TypeError(f"block_size must be an int or a pair of ints (block_m, block_n), "
                        f"got {bs!r}")
    if not all(b > 0 and b % 16 == 0 for b in bs):
        raise FlashtileInputError(f"block_size entries must be positive multiples of 16 (the smallest "
                         f"kernel tile), got {tuple(bs)}")
    return int(bs[0]), int(bs[1])


def block_mask(mask, batch: int, nheads: int, nblocks_q: int, nblocks_k: int,
               device: torch.device) -> torch.Tensor:
    """Bool ``(batch|1, nheads|1, nblocks_q, nblocks_k)`` block mask."""
    want = f"(batch|1, nheads|1, ceil(seqlen_q/block_m), ceil(seqlen_k/block_n)) = " \
           f"({batch}|1, {nheads}|1, {nblocks_q}, {nblocks_k})"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"block_mask must be a bool torch.Tensor of shape {want}, got "
                        f"{type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be bool (True = compute the block), got "
                        f"{_dt(mask.dtype)}")
    if (mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, nheads)
            or tuple(mask.shape[2:]) != (nblocks_q, nblocks_k)):
        raise FlashtileInputError(f"block_mask must have shape {want}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise FlashtileInputError(f"block_mask is on {mask.device} but q is on {device}")
    return mask


# ------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ------------------------------------------------------------------------------------------
MAX_SPLITS = 128


def _int32(name: str, x, shape: tuple, device: torch.device, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor {layout}, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype int32, got {_dt(x.dtype)}; use "
                        f"{name}.to(torch.int32)")
    if tuple(x.shape) != shape:
        raise FlashtileInputError(f"{name} must have shape {layout} = {shape}, got "
                                  f"{tuple(x.shape)}")
    if x.device != device:
        raise FlashtileInputError(f"{name} is on {x.device} but q is on {device}; move it to "
                                  "q's device")
    return x


def _tree_mask(tree_mask, b: int, sq: int, device: torch.device):
    """bool ``(B|1, Sq, Sq)`` from a bool mask or a packed int64 ``(B|1, Sq)`` bitmask."""
    from .masks import MAX_PACKED_TREE, unpack_tree_mask  # masks imports this module

    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
    if tree_mask.device != device:
        raise FlashtileInputError(f"tree_mask is on {tree_mask.device} but q is on {device}")
    if tree_mask.dtype == torch.bool:
        tm = tree_mask.unsqueeze(0) if tree_mask.dim() == 2 else tree_mask
        if tm.dim() != 3 or tm.shape[0] not in (1, b) or tuple(tm.shape[1:]) != (sq, sq):
            raise FlashtileInputError(f"bool tree_mask must have shape (batch|1, seqlen_q, "
                                      f"seqlen_q) = ({b}|1, {sq}, {sq}), got "
                                      f"{tuple(tree_mask.shape)}")
        return tm
    if tree_mask.dtype == torch.int64:
        tm = tree_mask.unsqueeze(0) if tree_mask.dim() == 1 else tree_mask
        if tm.dim() != 2 or tm.shape[0] not in (1, b) or tm.shape[1] != sq:
            raise FlashtileInputError(f"packed int64 tree_mask must have shape (batch|1, "
                                      f"seqlen_q) = ({b}|1, {sq}), got "
                                      f"{tuple(tree_mask.shape)}")
        if sq > MAX_PACKED_TREE:
            raise FlashtileInputError(f"packed int64 tree_mask holds at most {MAX_PACKED_TREE} "
                                      f"tokens, seqlen_q={sq}; pass a bool (batch|1, seqlen_q, "
                                      "seqlen_q) mask")
        return unpack_tree_mask(tm, sq)
    raise TypeError(f"tree_mask must be bool (batch|1, seqlen_q, seqlen_q) or a packed int64 "
                    f"(batch|1, seqlen_q) bitmask, got {_dt(tree_mask.dtype)}")


def kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table_, softmax_scale_, causal, window_size, softcap_,
            rotary_interleaved, alibi_slopes, num_splits, tree_mask):
    """Every check of ``flash_attn_with_kvcache`` that needs no tensor values (types, dtypes,
    shapes, devices, scalars; an int ``cache_seqlens`` against the capacity), with the dense
    path's rules; returns the normalised call.  The values of index tensors are checked by
    :func:`kvcache_values` (host) or by the Triton decode path on the device.  Returns
    ``(KVCacheSpec, alibi_slopes)``."""
    tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    float_dtype("q", q)
    device = q.device
    b, sq, h, d = q.shape
    head_dim(d)
    paged = block_table_ is not None
    cache_layout = ("(num_blocks, page_size, nheads_k, headdim)" if paged
                    else "(batch_cache, seqlen_cache, nheads_k, headdim)")
    tensor("k_cache", k_cache, 4, cache_layout)
    tensor("v_cache", v_cache, 4, cache_layout)
    same_dtype_device({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    last_dim_contiguous("k_cache", k_cache)
    last_dim_contiguous("v_cache", v_cache)
    if v_cache.shape != k_cache.shape:
        raise FlashtileInputError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                                  f"{tuple(k_cache.shape)}")
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise FlashtileInputError(f"headdim of k_cache ({k_cache.shape[3]}) and q ({d}) "
                                  "must match")
    heads(h, hk, "k_cache")

    if paged:
        tensor("block_table", block_table_, 2, "(batch, max_blocks_per_seq)")
        if block_table_.dtype != torch.int32:
            raise TypeError(f"block_table must have dtype int32, got {_dt(block_table_.dtype)}")
        if block_table_.shape[0] != b:
            raise FlashtileInputError(f"block_table must have shape (batch={b}, max_blocks), "
                                      f"got {tuple(block_table_.shape)}")
        if block_table_.device != device:
            raise FlashtileInputError(f"block_table is on {block_table_.device} but q is on "
                                      f"{device}")
        check_page_size(int(k_cache.shape[1]))
        if cache_batch_idx is not None:
            raise FlashtileInputError("cache_batch_idx cannot be combined with block_table: "
                                      "map rows to pages in block_table instead")
        if k_cache.shape[0] == 0:
            raise FlashtileInputError("paged k_cache has no blocks (num_blocks = 0)")
    capacity = row_capacity(k_cache, block_table_)

    if cache_batch_idx is not None:
        _int32("cache_batch_idx", cache_batch_idx, (b,), device, "(batch,)")
    elif not paged and k_cache.shape[0] != b:
        raise FlashtileInputError(f"k_cache has {k_cache.shape[0]} rows but q has batch {b}; "
                                  "pass cache_batch_idx to map batch rows to cache rows")

    if (k is None) != (v is None):
        raise FlashtileInputError("k and v must be given together (new keys and values to "
                                  "append) or both be None")
    seqlen_new = 0
    if k is not None:
        tensor("k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        tensor("v", v, 4, "(batch, seqlen_new, nheads_k, headdim)")
        same_dtype_device({"q": q, "k": k, "v": v})
        if k.shape[0] != b or k.shape[2] != hk or k.shape[3] != d:
            raise FlashtileInputError(f"k must have shape (batch={b}, seqlen_new, "
                                      f"nheads_k={hk}, headdim={d}), got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise FlashtileInputError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
        seqlen_new = int(k.shape[1])
        if k.shape[-1] > 1 and k.stride(-1) != 1:
            k = k.contiguous()
        if v.shape[-1] > 1 and v.stride(-1) != 1:
            v = v.contiguous()

    static_len = None
    seqlens_t = None
    if cache_seqlens is None:
        static_len = capacity
    elif isinstance(cache_seqlens, torch.Tensor):
        seqlens_t = _int32("cache_seqlens", cache_seqlens, (b,), device, "(batch,)")
    elif _int(cache_seqlens):
        static_len = int(cache_seqlens)
        if static_len < 0:
            raise FlashtileInputError(f"cache_seqlens must be >= 0, got {static_len}")
    else:
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor (batch,), got "
                        f"{type(cache_seqlens).__name__}")
    if static_len is not None and static_len + seqlen_new > capacity:
        what = ("the full cache (cache_seqlens=None)" if cache_seqlens is None
                else f"cache_seqlens={static_len}")
        where = " addressable by block_table" if paged else ""
        raise FlashtileInputError(f"{what} + {seqlen_new} new tokens exceeds the cache "
                                  f"capacity {capacity}{where}")

    if cache_leftpad is not None:
        _int32("cache_leftpad", cache_leftpad, (b,), device, "(batch,)")

    if (rotary_cos is None) != (rotary_sin is None):
        raise FlashtileInputError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise FlashtileInputError("rotary_cos/rotary_sin need new keys k and v to rotate "
                                      "(flash-attn semantics); rotate q yourself when not "
                                      "appending")
        tensor("rotary_cos", rotary_cos, 2, "(seqlen_ro, rotary_dim / 2)")
        tensor("rotary_sin", rotary_sin, 2, "(seqlen_ro, rotary_dim / 2)")
        float_dtype("rotary_cos", rotary_cos)
        same_dtype_device({"rotary_cos": rotary_cos, "rotary_sin": rotary_sin})
        if rotary_cos.device != device:
            raise FlashtileInputError(f"rotary_cos is on {rotary_cos.device} but q is on {device}")
        last_dim_contiguous("rotary_cos", rotary_cos)
        last_dim_contiguous("rotary_sin", rotary_sin)
        if rotary_sin.shape != rotary_cos.shape:
            raise FlashtileInputError(f"rotary_sin shape {tuple(rotary_sin.shape)} != "
                                      f"rotary_cos shape {tuple(rotary_cos.shape)}")
        rd = 2 * rotary_cos.shape[1]
        if rd == 0 or rd > d:
            raise FlashtileInputError(f"rotary_dim = 2 * rotary_cos.shape[1] = {rd} must be in "
                                      f"[2, headdim={d}]")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got "
                        f"{type(rotary_interleaved).__name__}")

    alibi_slopes = alibi(alibi_slopes, b, h, device)
    tree = _tree_mask(tree_mask, b, sq, device) if tree_mask is not None else None
    wl, wr = window(window_size)
    if causal:
        wr = 0
    scale = softmax_scale(softmax_scale_, d)
    cap = softcap(softcap_)
    if not _int(num_splits) or not 0 <= num_splits <= MAX_SPLITS:
        raise FlashtileInputError(f"num_splits must be an int in [0, {MAX_SPLITS}] "
                                  f"(0 = heuristic), got {num_splits!r}")
    q_per_token = bool(causal) or wl >= 0 or wr >= 0 or tree is not None
    if rotary_cos is not None and static_len is not None:
        need = static_len + max(seqlen_new, sq if q_per_token else 1)
        if need > rotary_cos.shape[0]:
            raise FlashtileInputError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} "
                                      f"positions but positions up to {need - 1} are rotated "
                                      "(cache_seqlens + new tokens)")

    if seqlens_t is None:
        seqlens_t = torch.full((b,), static_len, dtype=torch.int32, device=device)
    if q.shape[-1] > 1 and q.stride(-1) != 1:
        q = q.contiguous()
    # the kernels index these tensors with unit stride
    return KVCacheSpec(q, k, v, seqlens_t.contiguous(),
                       cache_batch_idx.contiguous() if cache_batch_idx is not None else None,
                       cache_leftpad.contiguous() if cache_leftpad is not None else None,
                       block_table_.contiguous() if block_table_ is not None else None,
                       tree, scale, wl, wr, cap, q_per_token, int(num_splits), seqlen_new,
                       capacity), alibi_slopes


def kvcache_values(a: KVCacheSpec, k_cache: torch.Tensor, rotary_cos) -> None:
    """Host check of the index tensors' values of a validated ``flash_attn_with_kvcache`` call
    (one read of the small index tensors): ``0 <= cache_seqlens`` and ``cache_seqlens +
    seqlen_new <= capacity``, ``0 <= cache_leftpad <= cache_seqlens``, ``cache_batch_idx``
    rows of the cache, ``block_table`` entries the call reads or writes pages of the pool, and
    the rotary tables long enough.  The Triton path checks the same on the device
    (``backends/triton/kernels/decode.py:_index_error``) without a host read."""
    b, sq = a.q.shape[0], a.q.shape[1]
    new, capacity = a.seqlen_new, a.capacity
    paged = a.block_table is not None
    lens = a.cache_seqlens.to("cpu", torch.int64)
    pads = (a.cache_leftpad.to("cpu", torch.int64) if a.cache_leftpad is not None
            else torch.zeros(b, dtype=torch.int64))
    if (lens < 0).any():
        r = int(torch.nonzero(lens < 0)[0])
        raise FlashtileInputError(f"cache_seqlens[{r}]={int(lens[r])} must be >= 0")
    over = lens + new > capacity
    if over.any():
        r = int(torch.nonzero(over)[0])
        where = (f" addressable by block_table ({a.block_table.shape[1]} pages x page_size "
                 f"{k_cache.shape[1]})" if paged else "")
        raise FlashtileInputError(f"cache_seqlens[{r}]={int(lens[r])} + {new} new tokens exceeds "
                                  f"the cache capacity {capacity}{where}")
    badpad = (pads < 0) | (pads > lens)
    if a.cache_leftpad is not None and badpad.any():
        r = int(torch.nonzero(badpad)[0])
        raise FlashtileInputError(f"cache_leftpad[{r}]={int(pads[r])} must be in "
                                  f"[0, cache_seqlens[{r}]={int(lens[r])}]")
    if a.cache_batch_idx is not None:
        idx = a.cache_batch_idx.to("cpu", torch.int64)
        bad = (idx < 0) | (idx >= k_cache.shape[0])
        if bad.any():
            r = int(torch.nonzero(bad)[0])
            raise FlashtileInputError(f"cache_batch_idx[{r}]={int(idx[r])}: cache_batch_idx "
                                      f"values must be in [0, {k_cache.shape[0]})")
    if paged:
        page = int(k_cache.shape[1])
        bt = a.block_table.to("cpu", torch.int64)
        j = torch.arange(bt.shape[1])
        used = ((j[None, :] >= (pads // page)[:, None])
                & (j[None, :] < ((lens + new + page - 1) // page)[:, None]))
        bad = used & ((bt < 0) | (bt >= k_cache.shape[0]))
        if bad.any():
            r, c = (int(t) for t in torch.nonzero(bad)[0])
            raise FlashtileInputError(f"block_table[{r}, {c}]={int(bt[r, c])} is not a page of "
                                      f"k_cache (num_blocks={k_cache.shape[0]})")
    if rotary_cos is not None and b > 0:
        need = int(lens.max()) + max(new, sq if a.rotary_q_per_token else 1)
        if need > rotary_cos.shape[0]:
            raise FlashtileInputError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} "
                                      f"positions but positions up to {need - 1} are rotated "
                                      "(cache_seqlens + new tokens)")


def kvcache_error_message(code: int, index: int, value: int, paged: bool, seqlen_new: int,
                          capacity: int, n_cols: int, page_size: int, cache_rows: int,
                          seqlen_ro: int, span: int) -> str:
    """The message of the device-side check's error record ``(code, index, value)`` (see
    ``backends/triton/kernels/decode.py:_index_error``); the same words as
    :func:`kvcache_values`."""
    if code == 1:
        return f"cache_seqlens[{index}]={value} must be >= 0"
    if code == 2:
        where = (f" addressable by block_table ({n_cols} pages x page_size {page_size})"
                 if paged else "")
        return (f"cache_seqlens[{index}]={value} + {seqlen_new} new tokens exceeds the cache "
                f"capacity {capacity}{where}")
    if code == 3:
        return f"cache_leftpad[{index}]={value} must be in [0, cache_seqlens[{index}]]"
    if code == 4:
        return (f"cache_batch_idx[{index}]={value}: cache_batch_idx values must be in "
                f"[0, {cache_rows})")
    if code == 5:
        r, c = divmod(index, max(n_cols, 1))
        return f"block_table[{r}, {c}]={value} is not a page of k_cache (num_blocks={cache_rows})"
    if code == 6:
        return (f"rotary_cos/rotary_sin have {seqlen_ro} positions but positions up to "
                f"{value + span - 1} are rotated (cache_seqlens[{index}]={value} + new tokens)")
    return f"flash_attn_with_kvcache: invalid index tensor (error code {code})"
