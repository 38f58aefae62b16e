"""Argument checks run before any kernel launches.

Every error names the argument, says what was expected and what was received, and where there
is an obvious fix, says it.  Shape/dtype/device problems raise ``ValueError`` / ``TypeError``.
"""
from __future__ import annotations

import math
import numbers

import torch

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
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions {layout}, "
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
            raise ValueError(f"{name} is on {x.device} but {first_name} is on {first.device}; "
                             "move them to one device")


def last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{tuple(x.stride())}; call {name}.contiguous() first")


def head_dim(d: int, name: str = "q") -> None:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"headdim of {name} must be between 1 and {MAX_HEAD_DIM}, got {d}")


def heads(nheads: int, nheads_k: int) -> None:
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k/v "
                         f"({nheads_k}) (grouped-query attention)")


def softmax_scale(scale, head_dim_: int, name: str = "softmax_scale") -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim_)
    if not _real(scale):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def dropout(p) -> float:
    if not _real(p):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return float(p)


def window(window_size) -> tuple[int, int]:
    if window_size == (-1, -1):
        return -1, -1
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                       for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size}")
    return left, right


def softcap(c) -> float:
    if not _real(c):
        raise TypeError(f"softcap must be a float, got {type(c).__name__}")
    if not (c >= 0.0 and math.isfinite(c)):
        raise ValueError(f"softcap must be >= 0 and finite (0 disables it), got {c}")
    return float(c)


def alibi(slopes, batch: int, nheads: int, device: torch.device):
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {_dt(slopes.dtype)}")
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or "
                         f"(batch, nheads) = ({batch}, {nheads}), got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on {slopes.device} but q is on {device}")
    return slopes if slopes.stride(-1) == 1 else slopes.contiguous()


def cu_seqlens(name: str, cu: torch.Tensor, total: int | None, max_seqlen, max_name: str,
               device: torch.device) -> list[int]:
    """Checks a cumulative-length vector; returns the sequence lengths (``batch`` of them).

    ``total`` is the number of packed rows ``cu[-1]`` must equal; None skips that check
    (paged keys: the pool's size is unrelated to the number of keys)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape (batch + 1,), "
                        f"got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_dt(cu.dtype)}; use {name}.int()")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be a non-negative int, got {max_seqlen!r}")
    # One host read of a (batch + 1)-vector: cheap, and it turns out-of-bounds kernel reads
    # into a clear error.
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} must equal the number of packed tokens "
                         f"({total})")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence in "
                         f"{name} ({max(lengths)})")
    return lengths


def block_table(table, lengths_k: list[int], k: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``block_table`` of a varlen call with paged ``k``/``v`` ``(num_blocks, page_size, Hk, D)``:
    int32 ``(batch, max_num_blocks)`` on q's device whose first ``ceil(len_k / page_size)``
    entries of row ``b`` are pages of the pool (the entries past them are never read)."""
    from .paged_kv import check_page_size

    batch = len(lengths_k)
    layout = "(batch, max_num_blocks)"
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 torch.Tensor of shape {layout}, got "
                        f"{type(table).__name__}")
    if table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {_dt(table.dtype)}; use "
                        "block_table.int()")
    if table.dim() != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table must have shape {layout} with batch = {batch} (from "
                         f"cu_seqlens_k), got {tuple(table.shape)}")
    if table.device != device:
        raise ValueError(f"block_table is on {table.device} but q is on {device}")
    page_size, num_blocks = int(k.shape[1]), int(k.shape[0])
    check_page_size(page_size, "paged k/v (with block_table)")
    capacity = int(table.shape[1]) * page_size
    for b, n in enumerate(lengths_k):
        if n > capacity:
            raise ValueError(f"sequence {b} has {n} keys (cu_seqlens_k) but block_table rows "
                             f"address at most {table.shape[1]} pages x page_size {page_size} "
                             f"= {capacity} keys; it needs ceil({n} / {page_size}) = "
                             f"{-(-n // page_size)} pages")
    # One host read of the (small) table, as for cu_seqlens: a bad page index would otherwise
    # be an out-of-bounds read inside the kernel.
    t = table.to("cpu", torch.int64)
    need = torch.tensor([-(-n // page_size) for n in lengths_k], dtype=torch.int64)
    used = torch.arange(t.shape[1])[None, :] < need[:, None]  # pages the call reads
    bad = used & ((t < 0) | (t >= num_blocks))
    if bad.any():
        r, c = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"block_table[{r}, {c}] = {int(t[r, c])} is not a page of k/v "
                         f"(num_blocks = {num_blocks}); sequence {r} reads its first "
                         f"{int(need[r])} entries")
    return table


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
        raise ValueError(f"attn_mask is on {mask.device} but query is on {query.device}")
    ok = mask.dim() <= len(target)
    if ok:
        for n, t in zip(reversed(mask.shape), reversed(target)):
            if n != 1 and n != t:
                ok = False
    if not ok:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} is not broadcastable to "
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
        raise ValueError(f"block_size entries must be positive multiples of 16 (the smallest "
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
        raise ValueError(f"block_mask must have shape {want}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"block_mask is on {mask.device} but q is on {device}")
    return mask
