"""Shared launch helpers: output allocation, strides of the two layouts, scalar arguments, and
the arguments of the optional features (bias / mask, dropout, block sparsity)."""
from __future__ import annotations

import contextlib
import functools
import operator
import os
import weakref

import torch
from triton import knobs as _knobs
from triton.runtime.autotuner import Heuristics
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

from ..spec import AttnSpec
from .configs import interpreting, pinned_configs

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


# Launch plans of plain calls (launch_fwd, launch_bwd): per call signature, the grids, compiled
# kernels and arguments of a first call, which later calls of that signature replay with their
# own tensors instead of rebuilding ~60 kernel arguments per launch.
class PlanCache:
    """Plans by signature; emptied when it reaches ``limit`` entries."""

    def __init__(self, limit: int = 1024):
        self._plans: dict = {}
        self._limit = limit

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan) -> None:
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[key] = plan


def plans_enabled() -> bool:
    """Plans replay direct launches, and are not used while outputs are poisoned (every buffer
    must come from :func:`empty`) or configs are pinned (``configs.override``)."""
    return _DIRECT and not _poison and not pinned_configs()


def signature(*tensors: torch.Tensor) -> tuple:
    """Shape, strides and 16-byte alignment of each tensor: with the dtype, device and spec,
    everything a plan's launches depend on."""
    return tuple([(t.shape, t.stride(), t.data_ptr() & 15) for t in tensors])


def seq_strides(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, position, head) strides; a packed varlen tensor has no batch stride."""
    st = x.stride()
    return (0, st[0], st[1]) if varlen else (st[0], st[1], st[2])


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of lse: ``(B, H, Sq)`` dense, ``(H, total_q)`` varlen."""
    if varlen:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def scalar_args(spec: AttnSpec, seqlen_q: int = 0, seqlen_k: int = 0, nheads: int = 0) -> dict:
    """Scores in base 2: ``log2(e)`` is folded into the scale (or into the softcap).  The
    partial-call frame (``spec.py``) goes in as runtime scalars: global offsets and the global
    lengths (``seqlen_*``, the call's own or ``max_seqlen_*``, by default), so every offset
    runs the same compiled kernel."""
    total_q, total_k = spec.totals(int(seqlen_q), int(seqlen_k))
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
        q_offset=spec.q_offset, k_offset=spec.k_offset, seqlen_q_total=total_q,
        seqlen_k_total=total_k, batch_offset=spec.batch_offset, head_offset=spec.head_offset,
        nheads_total=spec.nheads_total or nheads,
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



def launch(kernel, grid, args: tuple, meta: dict) -> tuple | None:
    """``kernel[grid](*args, **meta)``, through a cheaper host path once a variant is compiled.

    For a ``triton.heuristics`` kernel the derived constexprs are computed here, from one
    name -> value mapping, and the wrapped jitted function is launched with them: the wrapper
    rebuilds that mapping of every argument once per heuristic, which on an H100 host costs
    ~18 us a launch (benchmarks/overhead.py --profile).  Same rules, same order, same values.

    After the first launch of a variant its compiled kernel is called directly (see
    :func:`_direct_key`); ``FLASHTILE_DIRECT_LAUNCH=0`` turns that off.  Returns
    ``(compiled kernel, every argument in signature order)`` when launches are direct (for
    :func:`run_direct`), else None.
    """
    if isinstance(kernel, Heuristics):
        named = dict(zip(kernel.arg_names, args))
        named.update(meta)
        for name, rule in kernel.values.items():
            named[name] = meta[name] = rule(named)
        kernel = kernel.fn
    else:
        named = None
    direct = _DIRECT and grid[0] and kernel.__class__ is JITFunction
    if direct:
        if named is None:
            named = dict(zip(kernel.arg_names, args))
            named.update(meta)
        key = _direct_key(kernel, named, meta)
        try:
            compiled = _compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable scalar argument
            compiled = key = None
        if compiled is not None:
            values = named_values(kernel, named)
            if run_direct(compiled, grid, values, key[1]):
                return compiled, values
    fit_key = (kernel, tuple(sorted((k, v) for k, v in meta.items() if k != "num_stages"
                                    and isinstance(v, (int, float, str, bool, type(None))))))
    stages = _fitted_stages.get(fit_key)
    if stages is not None:
        meta["num_stages"] = stages
    while True:
        try:
            compiled = kernel[grid](*args, **meta)
            break
        except OutOfResources:
            # Optional features (bias tiles, dropout state) add shared memory to a config tuned
            # without them: fewer pipeline stages always fit in less.  Remembered per variant.
            if meta.get("num_stages", 1) <= 1:
                raise
            meta["num_stages"] = _fitted_stages[fit_key] = meta["num_stages"] - 1
    if direct and key is not None and compiled is not None:
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        # under the key of the requested options: a retry that lowered num_stages is remembered
        # by the next lookup too
        _compiled[key] = compiled
        return compiled, named_values(kernel, named)
    return None


# Direct launches.  ``JITFunction.run`` binds every argument, derives its specialisation
# (dtype, 16-byte alignment, ints equal to 1 or divisible by 16), hashes that into a cache key
# and builds launch metadata on every call, although a training step repeats the same few
# variants.  Here the compiled kernel of a variant is remembered under a key that determines
# that specialisation: the exact value and type of every non-tensor argument (ints, floats,
# bools, None, constexprs) and the launch options, and each tensor's dtype and 16-byte
# alignment.  Equal keys imply equal Triton cache keys, so the kernel called is the one
# ``kernel[grid]`` would call (``tests/gpu/test_direct_launch.py`` compares the two
# bitwise on the GPU).
_DIRECT = os.environ.get("FLASHTILE_DIRECT_LAUNCH", "1") != "0" and not interpreting()
_MAX_COMPILED = 4096
_compiled: dict = {}
_layouts: dict = {}  # kernel -> getters of its tensor / scalar / all arguments, parameter names


def _no_launch_hooks() -> bool:
    hook = _knobs.runtime.launch_enter_hook  # a HookChain; profilers add calls to it
    return hook is None or not getattr(hook, "calls", True)


def no_launch_hooks() -> bool:
    """True unless a profiler hooks Triton's launches (then recorded launches must not be
    replayed directly: the hook would miss them)."""
    return _no_launch_hooks()


def _direct_key(kernel, named: dict, meta: dict):
    """``(kernel, device, scalars, their types, tensors, options)``, or None when the plain path
    must run (a parameter left at its default, or a tensor where the first call had a scalar)."""
    lay = _layouts.get(kernel)
    if lay is None:
        names = tuple(kernel.arg_names)
        if any(n not in named for n in names):
            return None
        ptr = tuple(n for n in names if named[n] is None or isinstance(named[n], torch.Tensor))
        scalar = tuple(n for n in names if n not in ptr)
        lay = _layouts[kernel] = (_tuple_getter(ptr), _tuple_getter(scalar), _tuple_getter(names),
                                  frozenset(names))
    get_ptr, get_scalar, _, params = lay
    try:
        scalars = get_scalar(named)
        tensors = tuple([None if a is None else (a.dtype, a.data_ptr() & 15 == 0) for a in get_ptr(named)])
    except (KeyError, AttributeError):
        return None
    options = tuple([(k, v) for k, v in meta.items() if k not in params])
    return kernel, torch.cuda.current_device(), scalars, tuple(map(type, scalars)), tensors, options


def _tuple_getter(names: tuple):
    """``d -> tuple(d[n] for n in names)`` at C speed (``itemgetter`` of one name is not a tuple)."""
    if len(names) >= 2:
        return operator.itemgetter(*names)
    return (lambda d: (d[names[0]],)) if names else (lambda d: ())


def named_values(kernel, named: dict) -> list:
    """Every argument of ``kernel`` in signature order (after :func:`_direct_key` saw it)."""
    return list(_layouts[kernel][2](named))


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def run_direct(compiled, grid: tuple, values: list, device: int) -> bool:
    """Launch ``compiled`` with ``values`` (every argument, signature order) on the current
    stream; False (nothing launched) when a profiler hook asks for the full path."""
    if not _no_launch_hooks():
        return False
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 _raw_stream(device), compiled.function, compiled.packed_metadata, None, None,
                 None, *values)
    return True


_fitted_stages: dict = {}


def broadcast_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of ``x`` with 0 on every size-1 dim, so it indexes like its broadcast."""
    return tuple(0 if n == 1 else st for n, st in zip(x.shape, x.stride()))


def bias_args(attn_bias):
    """(tensor the kernel reads, its 4 broadcast strides) for a ``(B|1, H|1, Sq|1, Sk|1)`` bias
    or bool mask.  A bool mask is read through a uint8 view (same storage, same strides)."""
    if attn_bias is None:
        return None, (0, 0, 0, 0)
    t = attn_bias.view(torch.uint8) if attn_bias.dtype == torch.bool else attn_bias
    return t, broadcast_strides(t)


def dropout_args(spec: AttnSpec, rng_seed):
    """(seed tensor or None, dropout_p, 1 / (1 - p)) for the kernels."""
    if spec.dropout_p <= 0:
        return None, 0.0, 1.0
    if rng_seed is None:
        raise ValueError("dropout_p > 0 needs rng_seed (an int64 tensor of shape (1,))")
    return rng_seed, float(spec.dropout_p), 1.0 / (1.0 - spec.dropout_p)


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
# (same object, same version counter).
_lists_cache: dict = {}
_LISTS_CACHE_SIZE = 64


def _mask_lists(block_mask: torch.Tensor, key: tuple, build):
    entry = _lists_cache.get((id(block_mask), key))
    if entry is not None:
        ref, version, idx = entry
        if ref() is block_mask and block_mask._version == version:
            return idx
    idx = build()
    if len(_lists_cache) >= _LISTS_CACHE_SIZE:
        _lists_cache.clear()
    _lists_cache[(id(block_mask), key)] = (weakref.ref(block_mask), block_mask._version, idx)
    return idx


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
    idx = _mask_lists(block_mask, (bs_m, bs_n, bounds, transpose), build)
    st = broadcast_strides(idx)
    return idx, st[:3], bs_m, bs_n


def fit_block(block: int, size: int) -> int:
    """The largest ``block / 2^k`` that divides ``size`` (tiles must not straddle mask blocks)."""
    while block > 16 and size % block:
        block //= 2
    return block
