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

The backend is chosen as for every call (``flashtile.backends.select``: ``use_backend``,
``FLASHTILE_BACKEND``, then the device) and reached through ``flashtile.backends.get(name)``:
``decode`` in ``backends/triton/launch_decode.py`` (kernels in
``backends/triton/kernels/decode.py``) and ``backends/torch/decode.py``.  Every check lives in
``flashtile._validate`` (``kvcache``, ``kvcache_values``).

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

Index values (``cache_seqlens``, ``cache_leftpad``, ``cache_batch_idx``, ``block_table``, the
rotary tables' length) are checked on every call.  The torch backend checks them on the host and
raises in the call.  The Triton path checks them on the device inside kernels the call launches
anyway, and never reads them on the host: a call with a bad index writes nothing into the
caches, its output is NaN where the index was used, and the error (argument, row, value) is
raised, as set by ``FLASHTILE_KVCACHE_CHECK``:

* ``async`` (default): by the next call on the same device that finds the record written
  (before it launches anything), or by :func:`check_kvcache_errors`, which waits;
* ``sync``: by the call itself, which waits for its check (flash-attn's behaviour);
* ``off`` (also ``FLASHTILE_CHECK_INDICES=0``): never; the kernels' guards still keep every
  access inside the cache.

Inside CUDA-graph capture nothing is read back; a replay that finds a bad index keeps its error
for :func:`check_kvcache_errors`.  Under ``torch.compile`` the call is the custom op
``flashtile::kvcache_fwd`` (fake implementation for tracing), so it compiles with
``fullgraph=True``; the checks run inside it.

Eager host cost: on a GPU the triton path reads no tensor values on the host, so an eager call
costs the Python work of validation and launch preparation (with the check: reading one word
of the oldest outstanding error record) plus one Triton launch per kernel (split-KV, and the
combine only when ``num_splits > 1``; the append/rotary kernels only when ``k``/``v``/rotary
tables are given).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _validate as V
from . import backends
from .masks import build_tree_mask
from .rotary import apply_rotary

__all__ = [
    "flash_attn_with_kvcache",
    "check_kvcache_errors",
    "merge_attention_states",
    "build_tree_mask",
    "apply_rotary",
    "select_decode_backend",
]


def select_decode_backend(device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device``: the package-wide rule of
    ``flashtile.backends.select`` (``use_backend``, then ``FLASHTILE_BACKEND``, then device)."""
    return backends.select(device)


# Launch plans of eager triton calls (see launch_decode.Plan): after a call has been validated
# and run, a later call whose every tensor has the same shape, strides, dtype, device and 16-byte
# alignment, with the same other arguments, replays its launches without validating again (the
# host checks depend on nothing else on a GPU; the device-side index check is part of the
# replayed launches, with a new error record per call) or rebuilding kernel arguments.  Only on
# CUDA outside CUDA-graph capture, with launch plans on (fastlaunch.plans_enabled), with a
# cache_seqlens tensor and no tree mask.
# FLASHTILE_DECODE_PLANS=0 (or EAGER_PLANS = False, for code that patches launch internals)
# turns them off.
EAGER_PLANS = os.environ.get("FLASHTILE_DECODE_PLANS", "1") != "0"
_PLANS: dict = {}
_MAX_PLANS = 256
_plans_enabled = _check_mode = None  # fastlaunch.plans_enabled, launch_decode.check_mode


_Tensor = torch.Tensor


def _eager_plan_key(tensors: tuple, scalars: tuple):
    """The plan key of an eager call, or None when it gets no plan.  Runs on every eager call
    (~5-10 us of host time at batch 1 on the H100 machine, where a step's GPU time is ~33 us):
    each tensor's shape, strides, dtype, device and 16-byte alignment, each scalar with its type
    (``1``, ``1.0`` and ``True`` are equal keys otherwise), the current device and the check
    mode."""
    q, seqlens = tensors[0], tensors[7]
    if not (EAGER_PLANS and isinstance(q, _Tensor) and q.is_cuda and isinstance(seqlens, _Tensor)):
        return None
    global _plans_enabled, _check_mode
    if _plans_enabled is None:  # the launch layer, imported once (it imports triton)
        from .backends.triton.fastlaunch import plans_enabled
        from .backends.triton.launch_decode import check_mode
        _plans_enabled, _check_mode = plans_enabled, check_mode
    if (not _plans_enabled() or torch.cuda.is_current_stream_capturing()
            or backends.select(q.device) != "triton"):
        return None
    # get_device(): the device as an int (-1 on the CPU), cheaper than x.device; 0 marks a
    # non-tensor where a tensor or None belongs
    parts = tuple([None if x is None else
                   (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15)
                   if isinstance(x, _Tensor) else 0 for x in tensors])
    if 0 in parts:
        return None
    window, rest = scalars[2], scalars[:2] + scalars[3:]
    if not isinstance(window, (tuple, list)):
        window = (window,)
    # a tensor window_size (or scale) would key by identity: no plan
    if any([isinstance(v, _Tensor) for v in rest + tuple(window)]):
        return None
    key = (parts, rest, tuple(map(type, rest)), tuple(window), tuple(map(type, window)),
           torch.cuda.current_device(), _check_mode())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def check_kvcache_errors(device: torch.device | str | int | None = None) -> None:
    """Wait for the ``flash_attn_with_kvcache`` calls issued so far and raise the first bad index
    value they found.

    On the Triton path (every CUDA call, and CPU calls under ``TRITON_INTERPRET=1``) a call does
    not wait for its own index check (``FLASHTILE_KVCACHE_CHECK=async``, the default): its error
    is raised by a later call on the same device once the check has run, or here.  This
    synchronises ``device`` (every device with calls when None), reads every outstanding error
    record, and raises :class:`flashtile.FlashtileInputError` naming the argument, the batch row
    and the value of the first bad call.  It also reports replays of CUDA graphs: a captured call
    keeps the error of a replay that found a bad index until this reports it.  Returns None when
    every call was valid.  Call it where a decode loop synchronises anyway (e.g. after reading
    the sampled tokens) to learn of a bad index at a known point.
    """
    import sys

    launch = sys.modules.get("flashtile.backends.triton.launch_decode")
    if launch is None:  # no triton call has run in this process
        return
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    launch.check_errors(device)


# --------------------------------------------------------------------------------------------
# merging partial attention results
# --------------------------------------------------------------------------------------------
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
        raise V.FlashtileInputError(f"merge_attention_states: out_a must be (B, S, H, D), got {tuple(out_a.shape)}")
    if out_b.shape != out_a.shape:
        raise V.FlashtileInputError(f"merge_attention_states: out_b shape {tuple(out_b.shape)} != out_a shape "
                         f"{tuple(out_a.shape)}")
    b, s, h, _ = out_a.shape
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(x.shape) != (b, h, s):
            raise V.FlashtileInputError(f"merge_attention_states: {name} must have shape (B, H, S) = {(b, h, s)}, "
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
            raise V.FlashtileInputError(f"merge_attention_states: {name} is on {x.device}, out_a on {out_a.device}")
    name = backends.select(out_a.device)
    if name == "triton" and out_a.dtype not in V.SUPPORTED_DTYPES:
        name = "torch"
    with torch.no_grad():
        return backends.get(name).merge_states(out_a, lse_a, out_b, lse_b)


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
def _run(a, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes, rotary_interleaved):
    name = backends.select(a.q.device)
    if name == "torch":
        # the torch backend reads these values on the host anyway; the triton path checks them
        # on the device (also under the interpreter, so that CPU tests run the same machinery)
        V.kvcache_values(a, k_cache, rotary_cos)
    return backends.get(name).decode(a, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes,
                                     rotary_interleaved)


@torch.library.custom_op("flashtile::kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def kvcache_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                v: Optional[Tensor], rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
                cache_seqlens: Tensor, cache_batch_idx: Optional[Tensor],
                cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                alibi_slopes: Optional[Tensor], tree_mask: Optional[Tensor],
                softmax_scale: float, window_left: int, window_right: int, softcap: float,
                rotary_interleaved: bool, rotary_q_per_token: bool, num_splits: int,
                seqlen_new: int, capacity: int) -> tuple[Tensor, Tensor]:
    """The compiled form of a validated call (``torch.compile`` traces the fake below; the
    value checks and the kernels run here, at run time)."""
    a = V.KVCacheSpec(q, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                      tree_mask, softmax_scale, window_left, window_right, softcap,
                      rotary_q_per_token, num_splits, seqlen_new, capacity)
    return _run(a, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes, rotary_interleaved)


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, tree_mask, softmax_scale, window_left,
      window_right, softcap, rotary_interleaved, rotary_q_per_token, num_splits, seqlen_new,
      capacity):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


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
    rotary table length) are checked on every call: on the host by the torch backend (raised
    in the call); on the device by the Triton path, without a host synchronisation: a bad call
    writes nothing into the caches, its output is NaN where the index was used, and the error
    is raised by the next call on the device or by :func:`check_kvcache_errors`
    (``FLASHTILE_KVCACHE_CHECK=sync``: by the call itself; ``off``: never, the kernels' guards
    still keep every access in bounds).  Bad values raise :class:`flashtile.FlashtileInputError`
    (a ``ValueError`` and a ``RuntimeError``).  Forward only: no autograd.
    """
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
               cache_leftpad, block_table, alibi_slopes)
    compiling = torch.compiler.is_compiling()
    key = None
    if tree_mask is None and not compiling:
        key = _eager_plan_key(tensors, (softmax_scale, causal, window_size, softcap,
                                        rotary_interleaved, num_splits))
        plan = _PLANS.get(key) if key is not None else None
        if plan is not None:
            res = plan.run(tensors)
            if res is not None:
                return res if return_softmax_lse else res[0]
    a, slopes = V.kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                          cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                          window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                          tree_mask)
    if compiling:
        out, lse = kvcache_fwd(a.q, k_cache, v_cache, a.k, a.v, rotary_cos, rotary_sin,
                               a.cache_seqlens, a.cache_batch_idx, a.cache_leftpad,
                               a.block_table, slopes, a.tree_mask, a.softmax_scale,
                               a.window_left, a.window_right, a.softcap, rotary_interleaved,
                               a.rotary_q_per_token, a.num_splits, a.seqlen_new, a.capacity)
    elif key is not None:
        # only fresh outputs written by the kernels: nothing to record for autograd
        (out, lse), plan = backends.get("triton").record_decode(
            tensors, a, k_cache, v_cache, rotary_cos, rotary_sin, slopes, rotary_interleaved)
        if plan is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    else:
        out, lse = _run(a, k_cache, v_cache, rotary_cos, rotary_sin, slopes, rotary_interleaved)
    return (out, lse) if return_softmax_lse else out
