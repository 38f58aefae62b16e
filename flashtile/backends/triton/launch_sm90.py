"""Launchers of the Hopper kernels (Gluon): the forward (``kernels/attn_fwd_sm90.py``) and the
backward (``kernels/attn_bwd_sm90.py``): by default one kernel computing dQ, dK and dV
(:func:`fused_backward`), in the deterministic backward only dK and dV after the Triton dQ
kernel (:func:`dkdv`).

On an sm_90 GPU (H100, H200) the calls they cover go to them; ``FLASHTILE_SM90=0`` sends them
to the portable Triton kernels instead.  They are faster than the Triton kernels on the shapes
measured (docs/dev/tuning-log.md, steps 36-41).  A call they do not cover always takes the
Triton kernels, never a wrong result: ``eligible`` and ``bwd_eligible`` list the scopes.
"""
from __future__ import annotations

import functools
import heapq

import torch

from ..._tensor_cache import TensorCache
from ..spec import AttnSpec
from .. import env_reader, interpreting
from .args import LOG2E
from .fastlaunch import (INTERNALS_OK, BoundLaunch, PlanCache, TmaLaunch, _run, constant,
                         empty, empty_like, launch, launch_hooks_set, plans_enabled, raw_stream,
                         recorder, run_direct, signature, unplannable, zeros)
from .kernels.bwd import attn_bwd_delta_kernel
from .kernels.key_mask import key_mask_ranges_kernel

BLOCK_M = 128
BLOCK_N = 128  # keys per tile at d = 64 and 128
NUM_WARPS = 4  # the first consumer; the kernel adds 4 + 1 worker warps
STAGES = 2
BWD_BLOCK_M = 64   # query rows per step of the backward kernel (d = 64: bwd_rows)
BWD_BLOCK_N = 128  # keys per CTA (64 per consumer warpgroup; at d = 256 64 in all)
DELTA_ROWS = 64    # rows (b, s, h) per program of the fused backward's prologue


def block_n(head_dim: int) -> int:
    """Keys per tile: 64 at d = 256, where Q, two stages of K and V tiles of 128 keys would need
    320 KB of shared memory (64 keys: 192 KB) and the consumers' registers would spill."""
    return 64 if head_dim == 256 else BLOCK_N


def bwd_rows(head_dim: int, packed: bool = False, masked: bool = False) -> int:
    """Query rows per step of the backward kernel of width ``head_dim`` (its Q, dO, lse and
    delta tiles, the dQ accumulator's tiles): 128 at d = 64, where one step's products are
    small enough that the barriers and hand-offs of a step weigh (``sᵀ`` and ``dpᵀ`` of 64
    keys by 128 rows fit the consumers' 240 registers with 20-96 bytes of spills; H200, bf16,
    1K-16K: the backward 1.05-1.11x faster than with 64 rows, docs/dev/tuning-log.md, step
    115; packed sequences without masking 1.07x), but not for ``packed`` sequences with a
    window (``masked``, causal included: on sequences of ~1K that variant ran 1.06x slower,
    and no faster with its masking code and spills dropped, step 116); else ``BWD_BLOCK_M``
    (64: at d = 128 dK and dV take 128 registers a thread)."""
    return 128 if head_dim == 64 and not (packed and masked) else BWD_BLOCK_M


def bwd_keys(head_dim: int) -> int:
    """Keys of a backward work item: 128 (64 per consumer), at d = 256 64 that both consumers
    share (one consumer's dK and dV of 64 keys would take 256 float32 registers a thread)."""
    return 64 if head_dim == 256 else BWD_BLOCK_N


_sm90_env = env_reader("FLASHTILE_SM90")


ONE_CONSUMER_KEYS = 768  # mean keys a row sees up to which masked d = 64 takes one consumer
# queries from which a masked d = 64 call without a lower edge (causal) takes three consumers
THREE_CONSUMER_ROWS = 3072


def consumers(head_dim: int, masked: bool, keys: int = 1 << 30, ragged: bool = False,
              rows: int = 0, lower: bool = True) -> int:
    """Consumer warpgroups of the forward: three (192-row work items, 160 registers a thread)
    at d = 64 without masking, and with a window that has no lower edge (``lower`` false:
    causal) from ``THREE_CONSUMER_ROWS`` queries (``rows``) on; one, in ``ONE_CONSUMER_CTAS``
    CTAs an SM (two or three), at d = 64 with masking where a row sees at most
    ``ONE_CONSUMER_KEYS`` keys on average (``keys``); else two.  Causal, H200, B H32, bf16 /
    fp16, one process: three 1.03x cuDNN at 3K, 1.04x at 4K, 1.05x at 8K, 1.08-1.09x at 16K
    where two ran 0.98-1.00x; at 2K three measured 0.70-0.73x against two's 0.96x, 0.89-0.95x
    longest first, one consumer 0.77-0.93x (docs/dev/tuning-log.md, steps 137-138; before
    step 137 three spilled in their key loops and ran 0.36-0.56x).  H100, bf16, B H32 d64
    non-causal, 3 rounds: 1.07-1.11x cuDNN at N = 2K-16K with three, 0.94-0.97x with two (equal
    at 1K).  Causal at 1K (4.5 key tiles an item), one consumer in two CTAs
    an SM: 0.88-0.93x cuDNN against 0.81-0.86x with two (the other CTA's turns fill the
    tensor cores through this one's first tile and epilogue); from 2K two are faster
    (docs/dev/tuning-log.md, step 51).  Lengths that are not multiples of the tiles
    (``ragged``) take two where they would take three: the three consumers' code for them
    spills 768 bytes (compiled for sm_90a)."""
    if head_dim == 64 and masked and keys <= ONE_CONSUMER_KEYS:
        return 1
    if head_dim == 64 and masked and not ragged and not lower and rows >= THREE_CONSUMER_ROWS:
        return 3
    return 3 if head_dim == 64 and not masked and not ragged else 2


# CTAs an SM of the one-consumer forward (:func:`consumers`) and each one's key tile and register
# cap: two of 128-key tiles at 128 registers a thread (step 51; 82 KB of shared memory each), or
# three of 64-key tiles at 80 (49.5 KB each, the consumer raising itself to 136; ptxas spills
# the same 16 bytes).  H200, causal d = 64 B16 H32: three 327-333 against 316-319 TFLOP/s bf16
# at N = 1K in alternated processes (0.98-1.00x against 0.95x cuDNN), fp16 308-313 against
# 303-306; 350-351 against 344 at 1536 (docs/dev/tuning-log.md, step 120).
ONE_CONSUMER_CTAS = 3
_ONE_CONSUMER = {2: (BLOCK_N, 128), 3: (64, 80)}  # CTAs an SM -> (key tile, maxnreg)


def _mean_keys(sq: int, sk: int, wl: int, wr: int) -> int:
    """About how many keys a query row sees on average (bottom-right, edges as ``_window``
    gives them): the causal triangle's mean, or the window's width."""
    return min(sk, wl + wr + 1, sk - sq + (sq + 1) // 2 + wr)


def enabled() -> bool:
    """On unless ``FLASHTILE_SM90=0`` (read per call)."""
    return _sm90_env() != "0"


def setting() -> tuple:
    """The switches (read per call) that decide which Hopper kernels a call launches: what a
    launch plan's key must hold besides the call's own arguments (with the padded backward's
    module switches: a process that turns them, as a benchmark's A/B does, gets the path it
    asked for)."""
    return _sm90_env(), _dq_env(), PAD_BWD_VIEWS, PAD_NARROW_DKDV


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:  # a Triton without Gluon
        return False
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _plan(x):
    """How the TMA reads a ``(B, S, H, D)`` tensor whose rows are contiguous: ``(shape,
    row_stride, (rb, rh, ch))`` of the 2-D view and of tile coordinates (the rows of head
    ``h``, batch entry ``b`` start at row ``b * rb + h * rh``, column ``h * ch``), or None.
    Two layouts qualify: heads side by side in a row of ``(b, s)`` (contiguous tensors, and
    slices of a fused QKV projection: ``rb = S, rh = 0, ch = D``), and each head's rows
    together (the ``(B, H, S, D)`` SDPA layout transposed: ``rb = H * S, rh = S, ch = 0``)."""
    batch, seq, heads, head_dim = x.shape
    s_b, s_s, s_h, s_d = x.stride()
    if s_d != 1 and head_dim > 1:
        return None
    if ((heads == 1 or s_h == head_dim) and (batch == 1 or s_b == seq * s_s)
            and s_s >= heads * head_dim):
        return [batch * seq, heads * head_dim], s_s, (seq, 0, head_dim)
    if s_h == seq * s_s and (batch == 1 or s_b == heads * s_h) and s_s >= head_dim:
        return [batch * heads * seq, head_dim], s_s, (heads * seq, seq, 0)
    return None


def on_hopper(q) -> bool:
    """The switch is on and ``q`` is on an sm_90 GPU (not the interpreter)."""
    return enabled() and q.is_cuda and not interpreting() and _hopper(q.device.index or 0)


def _dense(q, *tensors) -> bool:
    """The switch is on, ``q`` is a 4-D fp16/bf16 tensor on an sm_90 GPU, and ``q`` and
    ``tensors`` are in a layout the TMA reads (:func:`_plan`) at 16-byte aligned addresses
    and row strides."""
    if not on_hopper(q):
        return False
    if q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    address = 0
    for x in (q, *tensors):
        plan = _plan(x)
        if plan is None:
            return False
        address |= x.data_ptr() | (plan[1] * x.element_size())
    return not address & 15


def eligible(q, k, v, spec: AttnSpec, packed: bool = False, padded: bool = False) -> bool:
    """Dense fp16/bf16 ``(B, S, H, D)`` in a layout the TMA reads (:func:`_plan`; K and V alike),
    ``D`` in {64, 128, 256} (with ``padded``, any :func:`padded_width`), any sequence lengths
    (not multiples of the tiles: 3-D descriptors, :func:`_rows`), a scale > 0, no softcap /
    dropout, causal masking or a window only with ``sk >= sq`` (bottom-right).  The caller has
    already ruled out every optional tensor (ALiBi, bias, varlen, paging, sparsity);
    ``packed``: one batch entry of packed sequences (the windows are each sequence's, any
    totals)."""
    if not _dense(q, k, v):
        return False
    batch, sq, nheads, head_dim = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    if head_dim not in (64, 128, 256) and not (padded and padded_width(head_dim)):
        return False
    if v.shape[-1] != head_dim or nheads % nheads_k:
        return False
    if sq == 0 or sk == 0 or batch == 0:
        return False
    # the kernel's row maxima are of the raw scores q.k (the scale folded into exp2): with a
    # negative scale they bound no exponent, and with 0 the first tile's alpha is
    # exp2(-inf * 0), NaN (the portable kernels' maxima are of the scaled scores)
    if not spec.softmax_scale > 0:
        return False
    # K and V are walked with the same coordinates
    return _plan(k)[2] == _plan(v)[2] and _plain(spec, sq, max(sk, sq) if packed else sk,
                                                 window=True)


def sparse_eligible(q, k, v, spec: AttnSpec, block_size) -> bool:
    """A block-sparse call the Hopper forward takes: :func:`eligible`, lengths that are
    multiples of the tiles (``BLOCK_M`` queries, :func:`block_n` keys), mask blocks of whole
    128-row work items and whole key tiles."""
    if not eligible(q, k, v, spec):
        return False
    sq, sk, head_dim = q.shape[1], k.shape[1], q.shape[3]
    bs_m, bs_n = int(block_size[0]), int(block_size[1])
    tile_n = block_n(head_dim)
    return not (sq % BLOCK_M or sk % tile_n or bs_m % BLOCK_M or bs_n % tile_n)


def _sparse_args(sparse, stand_in, tile_n: int) -> dict:
    """The forward's block-sparse arguments from ``sparse_index.sparse_args``' ``(lists,
    strides, bs_m, bs_n)``, or without a block mask ``stand_in`` (a float32 tensor) for the
    lists, which the kernel tells apart by type."""
    if sparse is None:
        return dict(Lists=stand_in, stride_xb=0, stride_xh=0, stride_xr=0, tpb=1, ipr=1)
    lists, (sb, sh, sr), bs_m, bs_n = sparse
    return dict(Lists=lists, stride_xb=sb, stride_xh=sh, stride_xr=sr, tpb=bs_n // tile_n,
                ipr=bs_m // BLOCK_M)


def sparse_bwd_eligible(q, k, v, do, dk, dv, spec: AttnSpec, block_mask, block_size) -> bool:
    """A block-sparse call the fused Hopper backward takes: :func:`bwd_eligible` at d = 64 or
    128, lengths that are multiples of 128, mask blocks of whole 128-key work items and whole
    128-row blocks (two query tiles), and one mask for the query heads of a key/value head
    (the mask broadcast over heads, or no grouping)."""
    head_dim = q.shape[3]
    if head_dim == 256 or not bwd_eligible(q, k, v, do, dk, dv, spec):
        return False
    sq, sk = q.shape[1], k.shape[1]
    bs_m, bs_n = int(block_size[0]), int(block_size[1])
    keys = bwd_keys(head_dim)
    if sq % BLOCK_M or sk % keys or bs_m % BLOCK_M or bs_n % keys:
        return False
    return block_mask.shape[1] == 1 or q.shape[2] == k.shape[2]


def varlen_bwd_eligible(q, k, v, do, dk, dv, spec: AttnSpec) -> bool:
    """Packed ``(total, H, D)`` sequences the fused Hopper backward takes: :func:`bwd_eligible`
    of the tensors as one batch entry at d = 64 or 128 (the persistent kernel), a window only
    bottom-right (per sequence), any totals (:func:`varlen_eligible`'s rule)."""
    if q.dim() != 3 or q.shape[-1] not in (64, 128) or not varlen_eligible(q, k, v, spec):
        return False
    return bwd_eligible(*(x.unsqueeze(0) for x in (q, k, v, do, dk, dv)), spec, packed=True)


def _bwd_sparse_args(sparse, stand_in, keys: int, rows: int) -> dict:
    """The backward's block-sparse arguments from ``sparse_index.sparse_args(...,
    transpose=True)``' ``(lists, strides, bs_m, bs_n)``, or without a block mask ``stand_in``
    (a float32 tensor) for the lists; ``rows`` the kernel's query tile (:func:`bwd_rows`)."""
    if sparse is None:
        return dict(Lists=stand_in, stride_xb=0, stride_xh=0, stride_xr=0, tpr=1, ipc=1)
    lists, (sb, sh, sr), bs_m, bs_n = sparse
    return dict(Lists=lists, stride_xb=sb, stride_xh=sh, stride_xr=sr, tpr=bs_m // rows,
                ipc=bs_n // keys)


def _plain(spec: AttnSpec, sq: int, sk: int, window: bool = False) -> bool:
    """No optional feature in ``spec`` but causal masking (and with ``window``, any window)
    with ``sk >= sq`` (bottom-right: every row then sees at least its diagonal key).  A
    top-left window (the SDPA drop-in's ``is_causal``) is the bottom-right one when
    ``sq == sk``; without a window the alignment means nothing."""
    if spec.softcap or spec.dropout_p:
        return False
    if not spec.bottom_right and spec.has_window and sq != sk:
        return False
    if spec.is_partial or spec.head_offset or spec.nheads_total:
        return False
    if not window and (spec.window_left >= 0 or spec.window_right > 0):
        return False
    return not spec.has_window or sk >= sq


def key_mask(bias, batch: int, sk: int):
    """The ``(B, Sk)`` uint8 view (contiguous keys) of ``bias`` where it is a key mask: a bool
    attention mask that varies along the batch and the keys only (``(B|1, 1, 1, Sk)``, or
    broadcast over heads and queries with stride 0: a padded batch's mask), else None.  The
    Hopper kernels read such a mask (``kernels/key_mask.py``); any other mask or bias takes
    the Triton kernels."""
    if bias is None or bias.dtype != torch.bool or bias.dim() != 4 or bias.shape[-1] != sk:
        return None
    if bias.shape[0] not in (1, batch) or not all(bias.shape[d] == 1 or bias.stride(d) == 0
                                                  for d in (1, 2)):
        return None
    rows = bias[:, 0, 0, :]
    if rows.stride(-1) != 1 and sk > 1:
        rows = rows.contiguous()
    return rows.expand(batch, sk).view(torch.uint8)


def key_ranges(mask):
    """``(B, 3)`` int32: each batch entry's visible key range and whether the mask is that
    range (``kernels/key_mask.py``), for the key mask ``mask`` (:func:`key_mask`)."""
    batch, sk = mask.shape
    ranges = empty((batch, 3), torch.int32, mask.device)
    launch(key_mask_ranges_kernel, (batch,), MASK=mask, RANGES=ranges, stride_mb=mask.stride(0),
           stride_mn=mask.stride(1), seqlen_k=sk, BLOCK=1024 if sk > 512 else 256, num_warps=4)
    return ranges


# Key masks summarised by earlier calls: a padded batch's one mask serves every layer's forward
# and backward.  Key: the mask's address, shape and strides, for its base tensor unchanged
# (``TensorCache``); value: the uint8 view and the ranges.  The view holds the base alive, so
# no other tensor takes its memory while the entry lives.
_key_masks = TensorCache(size=8)


def key_mask_of(bias, batch: int, sk: int):
    """``(view, ranges)`` of :func:`key_mask` and :func:`key_ranges` for ``bias``, or None
    where it is not a key mask.  Reused while ``bias`` is unchanged (its version counter,
    which every in-place write advances), except while a CUDA graph is captured (the capture
    records the summary's kernel, so that a replay on new mask contents summarises them) and
    for inference tensors (no version counter)."""
    return _key_masks.get_view(batch, bias, lambda: _key_summary(bias, batch, sk))


def _key_summary(bias, batch: int, sk: int):
    mask = key_mask(bias, batch, sk)
    return None if mask is None else (mask, key_ranges(mask))


def _key_mask_args(key_mask, stand_in) -> dict:
    """The kernels' key-mask arguments: the rows and ranges of ``key_mask`` (:func:`key_mask_of`),
    or without one ``stand_in`` (a float32 tensor) in their place, which the kernels tell apart
    by type."""
    if key_mask is None:
        return dict(Ranges=stand_in, KeyMask=stand_in, stride_mb=0)
    mask, ranges = key_mask
    return dict(Ranges=ranges, KeyMask=mask, stride_mb=mask.stride(0))


def bwd_eligible(q, k, v, do, dk, dv, spec: AttnSpec, deterministic: bool = False,
                 packed: bool = False) -> bool:
    """Whether the Hopper backward kernel serves this call: the forward's conditions with
    ``D`` = 64, 128 or 256 (any lengths, as the forward's), ``do`` in a layout the TMA reads,
    ``dk`` and ``dv`` of one layout with contiguous rows.  ``deterministic`` (the kernel computes
    dK and dV only, dQ comes from a dQ kernel: :func:`dq_pass`): ``D`` = 64 only with causal
    masking.  ``packed``: one batch entry of packed sequences (:func:`varlen_bwd_eligible`).
    The caller has ruled out every optional tensor."""
    if not (_dense(q, k, v, do) and _plan(k)[2] == _plan(v)[2]):
        return False
    if dk.stride() != dv.stride() or dk.stride(-1) != 1:  # stored with dK's strides
        return False
    if do.dtype != q.dtype or dk.dtype != q.dtype or dv.dtype != q.dtype:
        return False
    batch, sq, nheads, head_dim = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    if head_dim not in (64, 128, 256) or v.shape[-1] != head_dim or nheads % nheads_k:
        return False
    if deterministic and head_dim == 64 and not spec.causal:
        # dK/dV alone: measured no faster than the Triton kernel (0.96-1.00x the backward, H200)
        return False
    if sq == 0 or sk == 0 or batch == 0:
        return False
    # (packed: one batch entry of packed sequences, windows per sequence: :func:`eligible`)
    return _plain(spec, sq, max(sk, sq) if packed else sk, window=True)


def fused_pays(sq: int, sk: int, causal: bool, head_dim: int) -> bool:
    """Whether the fused backward is the faster Hopper backward for these lengths.  At d = 128
    always: with the consumers at 240 registers (no spill) it is 0.91x the two kernels' time at
    causal 1K, 0.94x at 768, 0.98x at 512 (H200, bf16 and fp16, B * N = 16K; at 232 registers
    it had been 1.05x at causal 1K, step 59).  At d = 64, whose kernel runs persistent
    (:func:`bwd_persistent`), not without masking up to 512 keys (0.92x there), but with causal
    masking at every length (1.11x at 1K, 1.12x at 512; before the persistent kernel 0.93-0.95x
    at causal 1K).  At d = 256 never: the fused kernel (by an estimate from its kernel times
    bound by its dq reductions: with 64-key items twice the dq bytes a product of d = 128's)
    ran at 0.78-0.81x the two kernels without masking, 0.78-1.00x causal (N = 1K-16K); it
    serves calls with a key mask, which the two kernels do not take.  docs/dev/tuning-log.md,
    steps 41, 44, 54, 60 and 65."""
    if head_dim == 256:
        return False
    if head_dim == 64:
        return causal or sk > 512
    return True


@functools.lru_cache(maxsize=None)
def _layout(rows: int, head_dim: int, dtype: torch.dtype, ragged: bool = False,
            heads: bool = False):
    """Shared-memory layout of a ``[rows, head_dim]`` tile (building one costs host time); with
    ``ragged`` and / or ``heads`` of the same tile in a descriptor of one sequence / one head
    (``[1, rows, head_dim]``, ``[rows, 1, head_dim]``, ``[1, rows, 1, head_dim]``:
    :func:`_rows`)."""
    from triton.experimental.gluon import language as gl

    g_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}.get(dtype, gl.float32)
    return gl.NVMMASharedLayout.get_default_for(_block(rows, head_dim, ragged, heads), g_dtype)


def _block(rows: int, cols: int, ragged: bool, heads: bool) -> list:
    """A descriptor's tile (:func:`_layout`)."""
    return [1] * ragged + [rows] + [1] * heads + [cols]


# keys from which a padded head dim's backward runs on the Hopper kernels over copies padded to
# the next width (pad_backward), and through views of that width (PAD_BWD_VIEWS: no copies to
# amortise; H200, bf16, d = 96 / 192: 1.10-1.50x the portable kernels at 1K keys, 1.16-1.79x
# at 512, 1.00-1.74x at 256; tuning log steps 104, 108)
PAD_BWD_KEYS = 4096
PAD_VIEW_KEYS = 256


def pad_backward(q, k, v, spec: AttnSpec) -> int:
    """The width at which the backward of a dense call at a head dim the Hopper forward pads
    (:func:`padded_width`) runs on the Hopper kernels, over copies of q, k, v, out and dO padded
    with zeros (``launch_bwd._padded_backward``), or 0: the Triton kernels at the head's own
    width.  The copies cost a read and a write of each tensor (and of the gradients' crop),
    which pays over ``PAD_BWD_KEYS`` keys or more: d = 96 / 192 at N = 4K, bf16, H100, 0.69 ->
    0.93x and 0.52 -> 0.84x SDPA's default with the forward padded as well, while at 1K a
    causal d = 96 backward lost 17% (docs/dev/tuning-log.md, steps 100 and 103).  With
    ``PAD_BWD_VIEWS`` (no copies: :func:`padded_backward`) from ``PAD_VIEW_KEYS`` keys; the
    caller then takes the copies only from ``PAD_BWD_KEYS`` (``launch_bwd._padded_backward``)."""
    head_dim = q.shape[-1]
    width = padded_width(head_dim)
    keys = min(PAD_VIEW_KEYS, PAD_BWD_KEYS) if PAD_BWD_VIEWS else PAD_BWD_KEYS
    if width in (0, head_dim) or k.dim() != 4 or k.shape[1] < keys:
        return 0
    return width if eligible(q, k, v, spec, padded=True) else 0


# whether a padded head dim's backward reads q, dO, k and v through views of the kernels'
# width (padded_backward: no copies of the inputs) instead of zero-padded copies
# (launch_bwd._padded_backward): H200, bf16, d = 96 / 192, 1.46-1.74x the copies' speed at
# 1K keys, 1.11-1.29x at 4K, 1.04-1.08x at 16K (tuning log step 104)
PAD_BWD_VIEWS = True


# whether a padded backward stores dK and dV into the narrow gradients where its kernels can
# (_narrow_dkdv) instead of buffers of the kernels' width cropped by two copies: H200, bf16,
# packed d = 96 backward 0.76 -> 0.61 ms causal, 1.03 -> 0.91 ms not; dense 1.08-1.22x the
# crops' speed at d = 80 / 96 / 192 and 1K keys, 1.02-1.06x at 4K (tuning log steps 106-107)
PAD_NARROW_DKDV = True


def _views_on(q, out, do) -> bool:
    """:func:`padded_backward`'s conditions on any call: the switch, ``do`` of q's dtype,
    ``out`` contiguous (the prologue's rows)."""
    return PAD_BWD_VIEWS and do.dtype == q.dtype and out.is_contiguous()


def padded_view_width(q, k, v, out, do, dq, spec: AttnSpec, width: int | None = None) -> int:
    """The width at which :func:`padded_backward` serves a dense call (with or without a key
    mask), or 0: :func:`_views_on`, :func:`pad_backward`'s conditions (``width``: its answer,
    where the caller has it), ``do`` and ``dq`` in layouts the TMA reads and writes."""
    if not _views_on(q, out, do):
        return 0
    width = pad_backward(q, k, v, spec) if width is None else width
    return width if width and _dense(q, k, v, do, dq) else 0


def padded_backward(q, k, v, out, do, lse, dq, dk, dv, spec: AttnSpec, width: int,
                    varlen=None, key_mask=None, plan_key=None) -> None:
    """Fill ``dq``, ``dk``, ``dv`` of a call :func:`pad_backward` admits at ``width``, with no
    copy of the inputs: the Hopper kernels of that width read q, dO, k and v through views
    whose tiles reach past each head's last column, where the TMA reads zeros (the forward's,
    :func:`_rows`); zero columns add nothing to the scores and get zero gradients.  Where the
    fused kernel pays at ``width`` (:func:`fused_pays`: 128) it adds dQ into a float32
    accumulator ``width`` wide (zeroed by the prologue, which reads ``D`` columns of ``out``
    and ``do`` for delta), cropped into ``dq`` by its conversion; else (256) the prologue's
    delta, the dQ kernel storing through a view of ``dq`` (nothing past a head's last column),
    and the dK/dV kernel.  dK and dV go straight into ``dk``, ``dv`` (``PAD_NARROW_DKDV``,
    :func:`_narrow_dkdv`; off, or ``dk`` not as the TMA reads it: buffers ``width`` wide,
    cropped).  ``varlen``: packed ``(total, H, D)`` sequences as :func:`fused_backward`'s
    (:func:`varlen_pad_width`: the fused kernel at 128); ``key_mask`` as :func:`forward`'s (the
    fused kernel at either width: the two kernels take no mask).  With ``plan_key``
    (:func:`bwd_plan_key`) the fused kernel's direct launch leaves a plan that
    :func:`planned_backward` repeats, crops included; the crops (and the fused kernel's dQ
    conversion) are no launches, so a launch plan (``fastlaunch.recording``) of such a call is
    refused; the two kernels at 256 storing dK and dV narrow (``PAD_NARROW_DKDV``) are
    launches only, and may be recorded."""
    head_dim = q.shape[-1]
    narrow = _narrow_dkdv(q, k, dk, width, varlen)
    dk_w = dk if narrow else empty((*k.shape[:-1], width), q.dtype, q.device)
    dv_w = dv if narrow else empty((*v.shape[:-1], width), q.dtype, q.device)
    fused = (varlen is not None or key_mask is not None
             or fused_pays(q.shape[1], k.shape[1], spec.causal, width))
    if fused or not narrow:
        unplannable()
    if varlen is not None:  # (the packed prologue lays out its own delta)
        fused_backward(q, k, v, out, do, lse, None, dq, dk_w, dv_w, spec, plan_key,
                       varlen=varlen, width=width)
    else:
        batch, sq, nheads, _ = q.shape
        delta = empty((batch, nheads, sq), torch.float32, q.device)
        if fused:
            fused_backward(q, k, v, out, do, lse, delta, dq, dk_w, dv_w, spec, plan_key,
                           key_mask=key_mask, width=width)
        else:
            _prologue(q, out, do, delta, zero=False, cols=width)
            _dq(q, k, v, do, lse, delta, dq, spec, width)
            _bwd(q, k, v, do, lse, delta, None, dk_w, dv_w, spec, width=width)
    if not narrow:
        dk.copy_(dk_w[..., :head_dim])
        dv.copy_(dv_w[..., :head_dim])


def _narrow_dkdv(q, k, dk, width: int, varlen) -> bool:
    """Whether :func:`padded_backward`'s kernels store dK and dV straight into ``dk``, ``dv``
    (``PAD_NARROW_DKDV``): TMA stores through the 2-D view of each head's rows (the SDPA
    layout), whose edge is the head's last column (the TMA writes nothing past it); else the
    kernels' own stores, the columns from the head's last one masked (``DK_COLS``: packed
    sequences, width 256, lengths that are not multiples of the tiles, heads side by side,
    where a TMA store would need a view with a dimension for the heads, which a slice of the
    shared-memory buffer cannot be stored from). Heads side by side at 128 the own stores
    beat TMA stores into buffers 128 wide and the crops: H200, bf16, d = 80 / 96, 1.08-1.18x
    at 1K, 1.02-1.09x at 2K, 1.02-1.06x at 4K (tuning log step 107)."""
    if not PAD_NARROW_DKDV:
        return False
    if varlen is not None or width == 256 or _bwd_ragged(q.shape[1], k.shape[1], width):
        return True
    return _plan(dk) is not None


def varlen_pad_width(q, k, v, out, do, dq, spec: AttnSpec) -> int:
    """The width at which :func:`padded_backward` takes packed ``(total, H, D)`` sequences, or
    0: the switch, a head dim the forward pads to 128 (packed sequences run the persistent
    kernel of d <= 128), the packed forward's conditions (:func:`varlen_eligible`), ``out``
    contiguous, ``do`` and ``dq`` as the TMA reads them, ``do`` of q's dtype."""
    head_dim = q.shape[-1]
    if q.dim() != 3 or head_dim == 128 or padded_width(head_dim) != 128:
        return 0
    if not _views_on(q, out, do):
        return 0
    if not (varlen_eligible(q, k, v, spec, padded=True)
            and _dense(*(x.unsqueeze(0) for x in (q, k, v, do, dq)))):
        return 0
    return 128


# whether the forward of a head dim that is the sum of two tile widths (80, 96, 144, 160, 192:
# split_width) runs the split kernel (attn_fwd_split_sm90_kernel: no column computed past the
# head) instead of the kernel of the next width (padded_width): 1.04-1.22x the padded kernel on
# the H200 (tuning log, step 109)
FWD_SPLIT = True


def split_width(head_dim: int) -> int:
    """The first tile's width where ``head_dim`` is two tiles' (a power of two of 64 or 128 and
    a smaller one of at least 16: 80 = 64 + 16, 96, 144, 160, 192 = 128 + 64), else 0."""
    for first in (128, 64):
        rest = head_dim - first
        if 16 <= rest < first and rest & (rest - 1) == 0:
            return first
    return 0


def padded_width(head_dim: int) -> int:
    """The Hopper forward's tile width for ``head_dim``: itself at 64, 128 and 256; for another
    multiple of 8 between 64 and 256 (80, 96, 112, 160, 192, ...) the next of those, its
    descriptors' tiles reaching past each head's last column, where the TMA reads zeros (no
    copy) and stores nothing; 0 where the kernels do not run."""
    if head_dim in (64, 128, 256):
        return head_dim
    if head_dim % 8 or not 64 < head_dim < 256:
        return 0
    return 128 if head_dim < 128 else 256


BWD_GROUP_L2 = 24 << 20  # bytes of Q, dO and dQ a group of backward CTAs may share through L2
BWD_CTA_SETUP = 3        # a backward CTA's K/V load and dK/dV store, in steps of one query tile


def bwd_persistent(head_dim: int) -> bool:
    """Whether the backward kernel runs persistent (``PERSISTENT``: one CTA per SM claiming
    work items, a CTA's K/V load, first turns and dK/dV stores overlapping the previous and next
    items') rather than one CTA per item: at d = 64, where its consumers compile without
    spills (H100, bf16, B * N = 16K, 2 x 3 rounds against one CTA per item: causal +1-6%,
    non-causal +2-6% at N = 1K-4K, within +-2% from 8K).  At d = 128 the loop over items
    first left the consumers 280-376 bytes of spills (8-22% slower, docs/dev/tuning-log.md
    step 53): the K/V tiles' matrix descriptors, hoisted over the item loop; recomputed per
    tile (``_consume_item``) no variant spills, and the persistent kernel takes 0.96-0.99x
    the time at N = 1K-2K, 0.98-1.0x from 4K (step 66)."""
    return head_dim in (64, 128)


@functools.lru_cache(maxsize=256)
@functools.lru_cache(maxsize=256)
def bwd_group(n_bh: int, group: int, sq: int, sk: int, head_dim: int, wl: int, wr: int,
              masked: bool, n_sm: int) -> int:
    """``bh_group`` of the backward kernel (``_item_keys``): how many (batch, key/value head)
    pairs issue their CTAs key block by key block together.  With causal masking key block
    ``j``'s CTA walks ``(sq - 128 j) / 64`` query tiles, so in the plain order (1: a pair's
    blocks, then the next pair's) the last pair's heaviest blocks start near the end and run
    alone: the SMs idle for up to one heavy CTA (~6% at 1K-8K keys, B * N = 16K).  Each
    candidate order is counted here as the GPU issues CTAs, to the SM that frees first (a
    CTA's steps: its query tiles times the heads it walks, plus ``BWD_CTA_SETUP``); the
    group's Q, dO and dQ stay within ``BWD_GROUP_L2`` (or within the pairs the plain order has
    in flight).  1 unless a group finishes more than 1% sooner.  H100, bf16, B * N = 16K, H16,
    causal, the backward against the plain order (5 interleaved rounds): d = 128 1.024-1.039x at
    N = 1K-8K; d = 64 0.98-1.02x, so d = 64 keeps the plain order (docs/dev/tuning-log.md,
    step 52).  d = 256 (64-key items, the dK/dV kernel of its default backward): 1.007,
    1.028, 1.009x at N = 1K, 2K, 4K (fastest of 5 rounds; step 61)."""
    if not masked or head_dim == 64:
        return 1
    keys = bwd_keys(head_dim)
    n_kb = -(-sk // keys)
    rows = bwd_rows(head_dim)
    shift, n_q = sk - sq, -(-sq // rows)
    steps = []
    for j in range(n_kb):  # as _query_tiles counts them
        n0 = j * keys
        lo = max(n0 - shift - wr, 0) // rows
        hi = min(n0 + keys - 1 - shift + wl + 1, sq)
        steps.append(group * min(max(-(-hi // rows) - lo, 0), n_q) + BWD_CTA_SETUP)
    per_sm = sum(steps) * n_bh / n_sm
    if max(steps) < 0.03 * per_sm:  # the tail is short whatever the order
        return 1

    def makespan(g: int) -> int:
        free = [0] * n_sm
        for g0 in range(0, n_bh, g):
            size = min(g, n_bh - g0)
            for w in steps:
                for _ in range(size):
                    heapq.heappush(free, heapq.heappop(free) + w)
        return max(free)

    in_flight = -(-n_sm // n_kb) + 1
    head_bytes = group * sq * head_dim * 8  # Q and dO (2 bytes each), dQ (float32)
    best, best_time = 1, makespan(1)
    g = 2
    while g <= n_bh and (g * head_bytes <= BWD_GROUP_L2 or g <= in_flight):
        t = makespan(g)
        if t < best_time * 0.99 and (best == 1 or t < best_time):
            best, best_time = g, t
        g *= 2
    return best


# Compiled variants of the kernels, for launches past ``JITFunction.run``: its argument binding
# and specialisation key cost ~100 us of host time a call with tensor descriptors among the
# arguments (docs/dev/tuning-log.md, step 36).  The key holds everything Triton specialises on
# here: kernel, dtype, head dim, causal, and per integer argument its width, divisibility by 16
# and whether it is 1.
_compiled: dict = {}


def _int_key(args: dict) -> tuple:
    return tuple([(v % 16 == 0, v == 1, v >= 2 ** 31) for v in args.values()
                  if type(v) is int])


def _launch(kernel_name: str, device: int, key: tuple, grid: tuple, args: dict,
            descs: dict):
    """Launch ``kernel_name`` (``fwd``, ``bwd`` or ``dq``) on GPU ``device`` with ``args`` and
    the tensor descriptors ``descs`` (name -> :func:`_descriptor`'s ``(tensor, shape, strides,
    block, layout)``); ``(compiled kernel, arguments in signature order)`` when it launched a
    compiled variant directly, else None.  A call's :func:`fastlaunch.recording` notes the
    launch (a direct one with its descriptors, for a plan to rebuild)."""
    # (and the descriptors' tiles: a variant compiled for one tile shape never serves another,
    # whatever the caller's key names)
    key = (kernel_name, device, *key, _int_key(args), tuple(tuple(d[3]) for d in descs.values()))
    rec = recorder()
    compiled = _compiled.get(key) if INTERNALS_OK else None
    # a profiler's launch hooks want Triton's own launch path (and full descriptors)
    direct = compiled is not None and not launch_hooks_set()
    args.update({name: _descriptor(*d, direct) for name, d in descs.items()})
    kernel = _kernel(kernel_name)
    if direct:
        values = list(map(args.__getitem__, kernel.arg_names))
        if run_direct(compiled, grid, values, device):
            if rec is not None:
                # a launch plan (fastlaunch.record_plan) rebuilds each descriptor of its own
                # call's tensor: {position: (tensor, build)}
                names = kernel.arg_names
                rec.launches.append((kernel, grid, (compiled, values, {
                    names.index(n): (d[0], functools.partial(_plan_descriptor, *d[1:]))
                    for n, d in descs.items()})))
            return compiled, values
    if rec is not None:  # not direct: a call with this launch records no plan
        rec.launches.append((kernel, grid, None))
    compiled = kernel[grid](**args)
    if INTERNALS_OK and compiled is not None:
        _compiled[key] = compiled
    return None


def _plan_descriptor(shape, strides, block, layout, x):
    """A plan's replay of a direct launch's descriptor of ``x`` (:func:`_descriptor`)."""
    return _descriptor(x, shape, strides, block, layout, True)


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    if name == "fwd":
        from .kernels.attn_fwd_sm90 import attn_fwd_sm90_kernel
        return attn_fwd_sm90_kernel
    if name == "fwd_split":
        from .kernels.attn_fwd_sm90 import attn_fwd_split_sm90_kernel
        return attn_fwd_split_sm90_kernel
    if name == "dq":
        from .kernels.attn_bwd_dq_sm90 import attn_bwd_dq_sm90_kernel
        return attn_bwd_dq_sm90_kernel
    if name == "dq_split":
        from .kernels.attn_bwd_dq_sm90 import attn_bwd_dq_split_sm90_kernel
        return attn_bwd_dq_split_sm90_kernel
    if name == "bwd_split":
        from .kernels.attn_bwd_sm90 import attn_bwd_split_sm90_kernel
        return attn_bwd_split_sm90_kernel
    from .kernels.attn_bwd_sm90 import attn_bwd_sm90_kernel
    return attn_bwd_sm90_kernel


@functools.lru_cache(maxsize=256)
def causal_order(n_m: int, n_bh: int, sq: int, sk: int, n_ctas: int,
                 tile_n: int = BLOCK_N, block_m: int = BLOCK_M, pad: int = 0) -> int:
    """1 where the causal work items should be sorted longest first (``_work_item``'s ``lpt``),
    else 0.  The kernel's default order keeps the row blocks of a head together (their K/V
    shared through L2: 1.0-1.33x faster than longest-first at N <= 8K on the H200), but when a
    head has about as many row blocks as there are CTAs every CTA of the snake keeps landing on
    long (or on short) blocks: at B1 H16 N16K one CTA gets 1.5x the mean work.  Both schedules
    are counted here (tiles per CTA, one tile more per item for its Q and first Q·Kᵀ); the
    default stays unless it is more than 8% over the mean and longest-first is better.
    ``pad``: rows the first block starts before row 0 (three consumers lay the blocks from the
    sequence's end, the kernel's ``_block_row``)."""
    n_work = n_m * n_bh
    shift = sk - sq

    def worst(lpt: bool) -> float:
        load = [0] * n_ctas
        for w in range(n_work):
            k, r = divmod(w, n_ctas)
            pid = r if k % 2 == 0 else n_ctas - 1 - r
            i_m = n_m - 1 - (w // n_bh if lpt else w % n_m)
            hi = min(sk, (i_m + 1) * block_m - pad + shift)
            load[pid] += -(-hi // tile_n) + 1
        return max(load) * n_ctas / sum(load)

    default = worst(False)
    return int(default > 1.08 and worst(True) < default)


def _descriptor(x, shape: list, strides: list, block: list, layout, direct: bool):
    """A TMA descriptor of ``x`` seen as a tensor of ``shape`` and ``strides`` (one to three
    dimensions, the last contiguous), read and written in tiles of ``block``.
    For a direct launch of a compiled variant (``direct``) the launcher reads only base, shape,
    strides and padding, and ``eligible`` has already checked what the constructor asserts
    (alignment, strides): the object is filled in directly (the constructor's checks cost
    ~10 us a call)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not direct:
        return TensorDescriptor(x, shape, strides, block, layout)
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = x, shape, strides
    desc.block_shape, desc.layout, desc.padding = block, layout, "zero"
    return desc


def _rows(x, block_rows: int, ragged: bool, prefix: str = "", args: dict | None = None,
          cols: int = 0) -> tuple:
    """``_descriptor`` arguments of a ``(B, S, H, D)`` tensor in tiles of ``block_rows`` rows
    and ``cols`` columns (default ``D``) of one head; with ``args`` the coordinates of a head's
    sequence go into it as ``{prefix}_rb``, ``{prefix}_rh`` (per batch entry, per head) and
    ``{prefix}_ch`` (its first column; a contiguous output's are ``S``, 0 and ``D``, which the
    kernels assume).
    Without ``ragged`` (``S`` a multiple of the tiles) the descriptor is :func:`_plan`'s 2-D
    view and a sequence's coordinate is its first row; with it the view is 3-D
    ``(sequences, S, columns)`` (a sequence per batch entry, or per batch entry and head in the
    SDPA layout) and the coordinate is the sequence's index: the TMA reads zeros past ``S``
    and writes nothing there (``kernels/attn_fwd_sm90._tma_load``).
    ``cols`` wider than ``D`` (:func:`padded_width`): where a row holds the heads side by side
    (one head too: a packed sequence's last tile, stored by the kernel, takes its columns from
    the view's kind), a tile that wide would read the next head's columns, so the view has a
    dimension for the heads (``(B * S, H, D)``, or with ``ragged`` ``(B, S, H, D)``), its tiles
    one head's, and ``{prefix}_ch`` is 1 (the head's index is its coordinate); the TMA reads
    zeros past ``D`` and writes nothing there."""
    shape, row_stride, (rb, rh, ch) = _plan(x)
    seq, cols = x.shape[1], cols or x.shape[-1]
    heads = cols > x.shape[-1] and ch != 0
    if heads:
        # (one head: its index is always 0, and a stride its size keeps the TMA's alignment)
        shape = [shape[0], x.shape[2], x.shape[-1]]
        strides, ch = [row_stride, x.stride(2) if x.shape[2] > 1 else x.shape[-1], 1], 1
    else:
        strides = [row_stride, 1]
    if ragged:
        shape, strides = [shape[0] // seq, seq, *shape[1:]], [seq * row_stride, *strides]
        rb, rh = rb // seq, rh // seq
    if args is not None:
        args.update({f"{prefix}_rb": rb, f"{prefix}_rh": rh, f"{prefix}_ch": ch})
    return (x, shape, strides, _block(block_rows, cols, ragged, heads),
            _layout(block_rows, cols, x.dtype, ragged, heads))


def _second_tiles(rest: int, ragged: bool, **tensors) -> dict:
    """A split head dim's second descriptors (``desc_<name>2``, :func:`_rows`' arguments) of
    each ``name=(tensor, rows)``: tiles of ``rows`` rows and ``rest`` columns of one head, at
    the coordinates of the first descriptors (the kernels add the first tile's width to the
    column)."""
    return {f"desc_{name}2": _rows(x, rows, ragged, cols=rest)
            for name, (x, rows) in tensors.items()}


def _window(spec: AttnSpec, sq: int, sk: int) -> dict:
    """The kernels' window arguments: ``MASKED`` for any window (causal masking is the window
    (-1, 0)) and the edges ``wl``, ``wr``, where -1 (no edge) becomes an edge no key reaches."""
    return dict(MASKED=spec.has_window,
                wl=min(spec.window_left, sq + sk) if spec.window_left >= 0 else sq + sk,
                wr=min(spec.window_right, sk) if spec.window_right >= 0 else sk)


# Plans of forward launches: a call whose q, k, v have the shapes, strides and alignment of an
# earlier direct launch's, with its dtype, device and spec, repeats that launch with its own
# tensors (``eligible`` holds for it as it did for the earlier one), skipping the checks and the
# argument building (docs/dev/tuning-log.md, step 50).
_fwd_plans = PlanCache()
# descriptors of q, k, v, out (and a split head dim's second ones: the same tensors)
_FWD_ROLES = ("desc_q", "desc_k", "desc_v", "desc_o")


class _FwdPlan:
    __slots__ = ("compiled", "grid", "values", "lse_at", "mask_at", "packed_at", "descs",
                 "device", "order", "fast")

    def __init__(self, compiled, grid, values, descs, device, order=None, kernel="fwd"):
        names = _kernel(kernel).arg_names
        self.compiled, self.grid, self.device = compiled, grid, device
        self.values, self.lse_at = list(values), names.index("Lse")
        # KeyMask, Ranges; Lists (lse stands in for those a call does not have)
        self.mask_at = (names.index("KeyMask"), names.index("Ranges"), names.index("Lists"))
        # CuQ, CuK, Items, Out: packed sequences' (lse stands in for the first three and the
        # kernel stores through desc_o, without)
        self.packed_at = tuple(names.index(n) for n in ("CuQ", "CuK", "Items", "Out"))
        # (position, role, shape, strides, block, layout) of each descriptor
        self.descs = tuple((names.index(n), _FWD_ROLES.index(n.rstrip("2")), *d[1:])
                           for n, d in descs.items())
        self.fast = _tma_launch(compiled, grid, self.descs)
        # packed sequences: packed_order's arguments past the lengths, else None
        self.order = order
        # the plan keeps no tensor of the call it was made from alive (every call fills them)
        for at in (self.lse_at, *self.mask_at, *self.packed_at, *(d[0] for d in self.descs)):
            self.values[at] = None


def _fwd_key(q, k, v, spec: AttnSpec, key_mask, varlen, sparse=None) -> tuple:
    """The key of a forward's plan: the tensors' signatures, dtype, device, spec, the key mask's
    view's signature, packed sequences' count and longest lengths, the block mask's lists
    (:func:`_sparse_key`), ``FWD_SPLIT`` and ``ONE_CONSUMER_CTAS``."""
    return (signature(q, k, v), q.dtype, q.device, spec, _mask_key(key_mask),
            None if varlen is None else (varlen[0].shape[0], varlen[2], varlen[3]),
            _sparse_key(sparse), FWD_SPLIT, ONE_CONSUMER_CTAS)


def _mask_key(key_mask):
    """What a plan's launch depends on in a key mask (:func:`key_mask_of`): its view's shape,
    strides and alignment (the ranges are always ``(B, 3)`` int32)."""
    return None if key_mask is None else signature(key_mask[0])


def _sparse_key(sparse):
    """What a plan's launch depends on in a block mask's lists (``sparse_index.sparse_args``'
    ``(lists, strides, bs_m, bs_n)``): the lists' shape, strides and alignment, the strides the
    kernel walks them with (0 where the mask is broadcast) and the block size."""
    return None if sparse is None else (signature(sparse[0]), *sparse[1:])


def _fill_mask(values: list, mask_at: tuple, key_mask, stand_in, sparse=None) -> None:
    """Put ``key_mask``'s view and ranges (or ``stand_in`` in both places) and the block mask's
    lists (or ``stand_in``) into a plan's argument values (``mask_at``: their positions)."""
    values[mask_at[0]], values[mask_at[1]] = key_mask or (stand_in, stand_in)
    values[mask_at[2]] = stand_in if sparse is None else sparse[0]


def _plan_of(plans: PlanCache, key):
    """The plan under ``key``, or None where there is none or a plan may not be used: plans
    off (``fastlaunch.plans_enabled``), the Hopper kernels switched off, the interpreter, a
    launch recorder or a profiler's launch hooks (which want Triton's own launch path)."""
    if not plans_enabled():
        return None
    plan = plans.get(key())
    if (plan is None or not enabled() or interpreting() or recorder() is not None
            or launch_hooks_set()):
        return None
    return plan


def _tma_launch(compiled, grid: tuple, descs: tuple):
    """A plan's :class:`fastlaunch.TmaLaunch` of ``compiled`` (``descs`` as the plan's), or
    None where Triton's launcher is not the known one."""
    return TmaLaunch.of(compiled, grid, tuple(
        (at, role, functools.partial(_plan_descriptor, *geometry))
        for at, role, *geometry in descs))


def _run_plan(plan, values: list, tensors: tuple) -> None:
    """Launch ``plan`` with ``values`` (its argument values, the tensors of this call filled
    in) and the descriptors of ``tensors`` (by role): through its :class:`TmaLaunch`, which
    keeps each descriptor's encoding per address, else rebuilt in place."""
    if plan.fast is not None:
        plan.fast(values, tensors, raw_stream(plan.device))
        return
    for at, role, shape, strides, block, layout in plan.descs:
        values[at] = _descriptor(tensors[role], shape, strides, block, layout, True)
    _run(plan.compiled, plan.grid, values, plan.device)


def planned_forward(q, k, v, spec: AttnSpec, key_mask=None, varlen=None, sparse=None):
    """:func:`forward`'s ``(out, lse)`` through the plan of an earlier call like this one (its
    key mask's view alike; ``varlen`` as :func:`forward`'s, as many sequences of the same
    longest lengths; ``sparse`` as :func:`forward`'s, lists of the same geometry), or None
    where there is none or plans are off (the caller then checks :func:`eligible`,
    :func:`varlen_eligible` or :func:`sparse_eligible`)."""
    plan = _plan_of(_fwd_plans, lambda: _fwd_key(q, k, v, spec, key_mask, varlen, sparse))
    if plan is None:
        return None
    out = empty(q.shape, q.dtype, q.device)
    values = plan.values.copy()
    if varlen is None:
        lse = empty((q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device)
        packed = (lse, lse, lse, out)
        tensors = (q, k, v, out)
    else:
        lse = empty((q.shape[1], q.shape[0]), torch.float32, q.device)
        packed = (*varlen[:2], packed_order(*varlen[:2], *plan.order), out)
        tensors = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0))
    values[plan.lse_at] = lse
    for at, x in zip(plan.packed_at, packed):
        values[at] = x
    _fill_mask(values, plan.mask_at, key_mask, lse, sparse)
    _run_plan(plan, values, tensors)
    return out, lse


# packed_order's and packed_prologue's tables, per pair of cumulative-length tensors (same objects,
# same version counters) and launch geometry: a model's layers share one pair, so a step
# builds each once
_orders = TensorCache()


def packed_order(cu_q, cu_k, n_m: int, block_m: int, tile_n: int, window: dict):
    """The forward's order of the work items of packed sequences (the kernel's ``Items``):
    int32 ``(B * n_m,)``, every (sequence ``b``, row block ``i``) pair as ``b * n_m + i``, sorted
    by the key tiles it walks (``_tile_range``'s count under ``window``, plus one for its Q and
    first tile), most first; the row blocks past a sequence's end last.  Computed on the device
    (no host read of the lengths, so it can be captured in a CUDA graph)."""
    return _orders.get(("order", n_m, block_m, tile_n, window["MASKED"],
                        window["wl"], window["wr"]), (cu_q, cu_k),
                       lambda: _packed_order(cu_q, cu_k, n_m, block_m, tile_n, window))


def _packed_order(cu_q, cu_k, n_m: int, block_m: int, tile_n: int, window: dict):
    lq = (cu_q[1:] - cu_q[:-1])[:, None]                                   # [B, 1]
    lk = (cu_k[1:] - cu_k[:-1])[:, None]                                   # [B, 1]
    rows = torch.arange(n_m, device=cu_q.device, dtype=torch.int32)[None, :] * block_m
    lo = torch.zeros_like(rows)
    hi = lk.expand(-1, n_m)
    if window["MASKED"]:  # each sequence's own bottom-right window
        shift = lk - lq
        lo = (rows + shift - window["wl"]).clamp(min=0) // tile_n
        hi = torch.minimum(hi, rows + block_m + shift + window["wr"]).clamp(min=0)
    tiles = (-(-hi // tile_n) - lo).clamp(min=1) + 1                      # [B, n_m]
    work = torch.where(rows < lq, tiles, 0)
    return torch.argsort(work.flatten(), descending=True, stable=True).to(torch.int32)


def packed_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """The kernels' ``varlen``: the cumulative lengths as int32 (what they read) and the
    longest lengths as ints."""
    return (cu_seqlens_q.to(torch.int32).contiguous(), cu_seqlens_k.to(torch.int32).contiguous(),
            int(max_seqlen_q), int(max_seqlen_k))


def varlen_eligible(q, k, v, spec: AttnSpec, padded: bool = False) -> bool:
    """Packed ``(total, H, D)`` sequences the Hopper forward takes: :func:`eligible` of the
    tensors as one batch entry (``padded`` as its), a window only bottom-right (per sequence),
    no empty tensor."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return False
    if spec.has_window and not spec.bottom_right:
        return False
    # (a row of a sequence with fewer keys than queries that sees no key outputs 0, so the
    # packed totals need not have sk >= sq)
    return eligible(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), spec, packed=True,
                    padded=padded)


def forward(q, k, v, spec: AttnSpec, key_mask=None, sparse=None, varlen=None):
    """``(out, lse)`` with the Triton forward's layouts: out like q, lse float32 ``(B, H, Sq)``;
    ``key_mask``: :func:`key_mask_of`'s ``(view, ranges)`` of a key mask (a row that sees no
    key outputs 0 and lse -inf); ``sparse``: ``sparse_index.sparse_args``' ``(lists, strides,
    bs_m, bs_n)`` of a block mask, where :func:`sparse_eligible` holds (a row with no block
    outputs 0 and lse -inf); ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)`` of packed ``(total, H, D)`` inputs (:func:`varlen_eligible`; lse ``(H,
    total_q)``, a row that sees no key outputs 0 and lse -inf)."""
    out = empty(q.shape, q.dtype, q.device)
    if varlen is not None:
        cu_q, cu_k, sq, sk = varlen
        batch = cu_q.shape[0] - 1
        lse = empty((q.shape[1], q.shape[0]), torch.float32, q.device)
        # one batch entry of all the packed rows (the kernel takes each sequence's first row
        # from the cumulative lengths)
        q, k, v, out4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0)
        nheads, head_dim = q.shape[2], q.shape[3]
        lse_strides = dict(stride_lb=0, stride_lh=lse.stride(0))
    else:
        batch, sq, nheads, head_dim = q.shape
        sk = k.shape[1]
        lse = empty((batch, nheads, sq), torch.float32, q.device)
        out4 = out
        lse_strides = dict(stride_lb=lse.stride(0), stride_lh=lse.stride(1))
    nheads_k = k.shape[2]
    # the tiles' width: a narrower head dim reads as zeros past its last column (padded_width),
    # or with FWD_SPLIT two tiles' widths make it up (split_width: the key tiles and consumers
    # of the next width, which the shared memory of its two tiles allows)
    width = padded_width(head_dim)
    tile_n = block_n(width)
    split = split_width(head_dim) if FWD_SPLIT else 0
    device = q.device.index or 0
    window = _window(spec, sq, sk)
    masked = window["MASKED"]  # causal masking is the window (-1, 0)
    # lengths that are not multiples of the tiles: 3-D descriptors (_rows); packed sequences
    # are one 2-D view, their ends masked in the kernel
    ragged = bool(sq % BLOCK_M or sk % tile_n) and varlen is None
    keymask = key_mask is not None
    # (with a key mask, two consumers where three would run: its code spills with three;
    # packed sequences' lengths are not multiples of three consumers' rows)
    n_c = consumers(width, masked, _mean_keys(sq, sk, window["wl"], window["wr"]),
                    ragged or keymask or varlen is not None, sq, spec.window_left >= 0)
    if sparse is not None:  # work items of BLOCK_M rows, whole parts of the mask's blocks
        n_c = 2
    block_m = n_c * (BLOCK_M // 2)
    n_m = -(-sq // block_m)
    # persistent: one CTA per SM (with one consumer ONE_CONSUMER_CTAS, each at its register cap
    # at launch, which the consumer raises and the producer lowers to 24), at most one per work
    # item (row block, batch entry, head)
    per_sm = 1
    if n_c == 1:
        per_sm = ONE_CONSUMER_CTAS
        tile_n, maxnreg = _ONE_CONSUMER[per_sm]
        ragged = bool(sq % BLOCK_M or sk % tile_n) and varlen is None
    grid = (min(n_m * batch * nheads, per_sm * _sm_count(device)),)
    args = dict(Lse=lse, **lse_strides,
                batch=batch, sq=sq, sk=sk, nheads=nheads, group=nheads // nheads_k,
                qk_scale=spec.softmax_scale * LOG2E, **window,
                STAGES=STAGES, num_warps=NUM_WARPS, CONSUMERS=n_c,
                lpt=causal_order(n_m, batch * nheads, sq, sk, grid[0], tile_n, block_m,
                                 n_m * block_m - sq if n_c == 3 else 0)
                if spec.causal and varlen is None else 0, **_key_mask_args(key_mask, lse),
                **_sparse_args(sparse, lse, tile_n),
                CuQ=lse if varlen is None else varlen[0], CuK=lse if varlen is None else varlen[1],
                Items=lse if varlen is None else packed_order(varlen[0], varlen[1], n_m, block_m,
                                                              tile_n, window),
                Out=out, stride_om=0 if varlen is None else out.stride(0))
    if n_c == 1:
        args["maxnreg"] = maxnreg
    cols = split or width
    descs = dict(desc_q=_rows(q, BLOCK_M // 2, ragged, "q", args, cols),
                 desc_k=_rows(k, tile_n, ragged, "kv", args, cols),
                 desc_v=_rows(v, tile_n, ragged, "kv", args, cols),
                 desc_o=_rows(out4, BLOCK_M // 2, ragged, cols=cols))
    if split:  # the columns from the first tile's width on (the kernel's coordinates + split)
        rest = head_dim - split
        descs.update(_second_tiles(rest, ragged, q=(q, BLOCK_M // 2), k=(k, tile_n),
                                   v=(v, tile_n), o=(out4, BLOCK_M // 2)))
    name = "fwd_split" if split else "fwd"
    # (the compiled variant depends on the descriptors' ranks: a padded head dim's views)
    launched = _launch(name, device, (q.dtype, head_dim, masked, n_c, ragged,
                                      sparse is not None, varlen is not None,
                                      tuple(len(d[3]) for d in descs.values()), keymask),
                       grid, args, descs)
    if launched is not None:
        # (packed: the 3-D tensors' key, as planned_forward sees them)
        key = (_fwd_key(q, k, v, spec, key_mask, None, sparse) if varlen is None else
               _fwd_key(q[0], k[0], v[0], spec, None, varlen))
        _fwd_plans.put(key, _FwdPlan(launched[0], grid, launched[1], descs, device,
                                     None if varlen is None else (n_m, block_m, tile_n, window),
                                     name))
    return out, lse


@functools.lru_cache(maxsize=None)
def _flat_layout():
    """Shared-memory layout of a row of float32 values (lse, delta: a query tile's)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _bwd(q, k, v, do, lse, delta, dq_acc, dk, dv, spec: AttnSpec, key_mask=None, sparse=None,
         varlen=None, counter=None, width: int = 0):
    """Launch the backward kernel: with ``dq_acc`` (float32 like ``q``, zeroed) it also adds
    dQ into it; without, dK and dV only; ``key_mask`` as :func:`forward`'s; ``sparse`` the
    transposed lists of a block mask (:func:`sparse_bwd_eligible`, :func:`_bwd_sparse_args`);
    ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of packed
    ``(1, total, H, D)`` views (:func:`varlen_bwd_eligible`; lse and delta ``(H, sq_pad)``,
    :func:`packed_prologue`).  ``width`` wider than ``D`` (:func:`padded_backward`): the
    kernel of that width reads q, dO, k and v through views whose tiles reach past each head's
    last column (:func:`_rows`: zeros there), ``dq_acc``, ``dk`` and ``dv`` are ``width``
    wide.
    ``(launch, grid, descriptors, persistent, ragged)`` when it launched a compiled variant
    directly (what a plan repeats), else None."""
    batch, sq, nheads, d = q.shape
    head_dim = width or d  # the kernel's width
    sk, nheads_k = k.shape[1], k.shape[2]
    # the dK/dV kernel of a padded head dim of 128 and a smaller tile (BWD_SPLIT): each of q,
    # dO, k and v through two descriptors, the first 128 columns and the rest
    split = (split_width(d) if BWD_SPLIT and head_dim == 256 and split_width(d) == 128
             and dq_acc is None and key_mask is None and sparse is None and varlen is None
             else 0)
    # the fused kernel of a padded head dim of 64 and a smaller tile (80, 96) at 128
    # (BWD128_SPLIT): the same two descriptors a tensor, and the dQ accumulator's second tile
    # through a second descriptor (dense inputs, a key mask or none)
    if (BWD128_SPLIT and head_dim == 128 and split_width(d) == 64 and dq_acc is not None
            and sparse is None and varlen is None):
        split = 64
    if varlen is not None:  # the sequences, the longest lengths (the packed rows: one entry)
        batch, sq, sk = varlen[0].shape[0] - 1, varlen[2], varlen[3]
    device = q.device.index or 0
    fused = dq_acc is not None
    # lengths that are not multiples of the tiles: 3-D descriptors (_rows)
    keys, rows = bwd_keys(head_dim), bwd_rows(head_dim, varlen is not None, spec.has_window)
    ragged = _bwd_ragged(sq, sk, head_dim) and varlen is None
    # a tile is half a head's columns of a query tile's rows, at d = 256 an eighth
    acc_tile = [rows, head_dim // (8 if head_dim == 256 else 2)]
    if fused:
        desc_dq = _rows(dq_acc, rows, ragged, cols=acc_tile[1])
    else:
        desc_dq = _one_tile(acc_tile, torch.float32, q.device)
    n_bh = batch * nheads_k
    n_sm = _sm_count(device)
    n_items = -(-sk // keys) * n_bh
    persistent = bwd_persistent(head_dim)
    # persistent: at most one CTA per SM, claiming work items from a counter zeroed here;
    # else one CTA per item, and the kernel reads no counter (``dk`` stands in)
    grid = (min(n_items, n_sm) if persistent else n_items,)
    if counter is None:  # (packed: packed_prologue's, zeroed)
        counter = zeros(1, torch.int32, q.device) if persistent else dk
    window = _window(spec, sq, sk)
    bh_group = bwd_group(n_bh, nheads // nheads_k, sq, sk, head_dim, window["wl"],
                         window["wr"], window["MASKED"], n_sm)
    if ragged and lse.shape[-1] % rows:
        # the kernel reads whole tiles of lse and delta: padded (_pad_rows; the fused
        # kernel's prologue already pads them)
        lse, delta = _pad_rows(lse, delta, rows)
    args = dict(DK=dk, DV=dv, Counter=counter,
                stride_kb=dk.stride(0), stride_kn=dk.stride(1), stride_kh=dk.stride(2),
                # dK and dV narrower than the kernel (padded_backward): stored by the kernel
                # itself, the columns from DK_COLS on masked
                DK_COLS=dk.shape[-1],
                sq=sq, sk=sk, sq_pad=lse.shape[-1], nheads_k=nheads_k, n_bh=n_bh,
                bh_group=bh_group, group=nheads // nheads_k, scale=spec.softmax_scale,
                qk_scale=spec.softmax_scale * LOG2E, **window,
                # edges other than the causal diagonal (without, the causal-only code)
                WINDOW=window["MASKED"] and (window["wl"] < sq + sk or window["wr"] != 0),
                DQ=fused, PERSISTENT=persistent, RAGGED=ragged, STAGES=STAGES,
                num_warps=NUM_WARPS, **_key_mask_args(key_mask, lse),
                **_bwd_sparse_args(sparse, lse, keys, rows),
                CuQ=lse if varlen is None else varlen[0], CuK=lse if varlen is None else varlen[1])
    flat = _flat_layout()
    # K/V tiles: each consumer's keys, or at d = 256 and with ragged one tile of the item's
    # keys (the kernel's K/V buffer is one allocation: a 3-D TMA cannot write into a slice)
    # (and where a padded head dim's view of K has a dimension for the heads, _rows: a 3-D
    # TMA cannot write into a slice either)
    heads_k = head_dim > d and _plan(k)[2][2] != 0
    kv_rows = keys if ragged or head_dim == 256 or heads_k or split else keys // 2
    # dK and dV stored by TMA from a consumer's rows of the V buffer (2-D: not with ragged
    # lengths; d = 256 consumers share their keys); else by the kernel's own stores, and the
    # descriptors are of one tile, never read
    # (packed: a key block's TMA store would reach into the next sequence's rows)
    # (dK and dV narrower than the kernel, padded_backward: by TMA only through the 2-D view of
    # each head's rows, whose edge is the head's last column; else the kernel's own stores,
    # masked at DK_COLS)
    narrow = dk.shape[-1] < head_dim
    args["DKDV_TMA"] = (not ragged and head_dim != 256 and _dense(q, dk, dv) and not split
                        and varlen is None and (not narrow or _plan(dk)[2][2] == 0))
    if args["DKDV_TMA"]:
        desc_dk = _rows(dk, keys // 2, False, "dk", args, head_dim)
        desc_dv = _rows(dv, keys // 2, False, cols=head_dim)
    else:
        args.update(dk_rb=0, dk_rh=0, dk_ch=0)
        desc_dk = desc_dv = _one_tile([keys // 2, head_dim], q.dtype, q.device)
    cols = split or head_dim
    descs = dict(desc_q=_rows(q, rows, ragged, "q", args, cols),
                 desc_do=_rows(do, rows, ragged, "do", args, cols),
                 desc_k=_rows(k, kv_rows, ragged, "kv", args, cols),
                 desc_v=_rows(v, kv_rows, ragged, "kv", args, cols),
                 desc_lse=(lse, [lse.numel()], [1], [rows], flat),
                 desc_delta=(delta, [delta.numel()], [1], [rows], flat), desc_dq=desc_dq,
                 desc_dk=desc_dk, desc_dv=desc_dv)
    if split:
        rest = d - split
        descs.update(_second_tiles(rest, ragged, q=(q, rows), do=(do, rows),
                                   k=(k, kv_rows), v=(v, kv_rows)),
                     # (the accumulator's columns from 64 on: a split head dim of 64's)
                     desc_dq2=(_rows(dq_acc, rows, ragged, cols=rest) if split == 64
                               else desc_dq))
    # (the compiled variant depends on the descriptors' ranks: a padded head dim's views; a
    # split one's tiles on the head dim)
    launched = _launch("bwd_split" if split else "bwd", device,
                       (q.dtype, head_dim, window["MASKED"], args["WINDOW"], fused, persistent,
                        ragged, args["DKDV_TMA"], args["DK_COLS"], split and d,
                        tuple(len(x[3]) for x in descs.values()), sparse is not None,
                        varlen is not None, key_mask is not None),
                       grid, args, descs)
    return (launched, grid, descs, persistent, ragged) if launched is not None else None


def _bwd_ragged(sq: int, sk: int, head_dim: int) -> bool:
    """Whether a dense backward's lengths are not multiples of its tiles (query rows, the
    kernel's keys at ``head_dim``): its 3-D descriptors and the kernels' own dK/dV stores."""
    return bool(sq % bwd_rows(head_dim) or sk % bwd_keys(head_dim))


def _one_tile(tile: list, dtype: torch.dtype, device) -> tuple:
    """A stand-in descriptor (:func:`_descriptor`'s arguments) of one ``tile`` of a tensor,
    for a kernel parameter the launched variant never reads (one tensor per tile, dtype and
    device: nothing reads or writes it)."""
    return _stand_in(tuple(tile), dtype, device)


@functools.lru_cache(maxsize=64)
def _stand_in(tile: tuple, dtype: torch.dtype, device) -> tuple:
    tile = list(tile)
    # (made once, outside any call's buffers: plans take its descriptor as a stand-in)
    return (constant(torch.empty(tile, dtype=dtype, device=device)), tile, [tile[1], 1], tile,
            _layout(*tile, dtype))


# the prologue's pointer parameters (attn_bwd_delta_kernel), in the order the prologues pass
# their tensors, launched or bound (a plan's fastlaunch.BoundLaunch)
_PROLOGUE_PTRS = ("O", "DO", "DELTA", "DQ_ACC", "LSE", "LSE_P", "SRC", "COUNTER")


def packed_prologue(q, out, do, lse, cu_q, bound=None, cols: int = 0, masked: bool = False):
    """:func:`_prologue` of packed sequences (``q``, ``out``, ``do``: ``(1, total_q, H, D)``
    views; ``lse`` float32 ``(H, total_q)``), in one launch: the zeroed dQ accumulator, lse and
    delta laid out for the backward kernel's TMA loads, ``(H, sq_pad)`` with sequence ``b``'s
    rows from ``((cu_q[b] + b * R) // R) * R`` on (``R`` the kernel's query tile,
    :func:`bwd_rows` of ``cols`` and ``masked``, whether the call has a window: a whole tile,
    so every load starts 16-byte aligned; a misaligned start is an illegal instruction) and the
    gaps +inf and 0 as :func:`_pad_rows`' padding, and a zeroed int32 work counter.  Each
    sequence's offset grows by at least its length plus one over the previous one's, so
    ``sq_pad = total_q + B * R`` (rounded to a tile) holds them all.  ``(dq_acc,
    lse_p, delta_p, counter, launched)``, ``launched`` as :func:`_prologue`'s.  On the device: no
    host read of the lengths.  ``cols``: as :func:`_prologue`'s."""
    nheads, total = lse.shape
    head_dim = q.shape[-1]
    cols = cols or head_dim
    tile = bwd_rows(cols, packed=True, masked=masked)
    width = -(-(total + (cu_q.numel() - 1) * tile) // tile) * tile
    src = _orders.get(("rows", total, tile), (cu_q,),
                      lambda: _packed_rows(cu_q, total, width, tile))
    dq_acc = torch.empty((*q.shape[:-1], cols), dtype=torch.float32, device=q.device)
    lse_p = empty((nheads, width), torch.float32, q.device)
    delta_p = empty((nheads, width), torch.float32, q.device)
    counter = empty((1,), torch.int32, q.device)
    ptrs = (out, do, delta_p, dq_acc, lse, lse_p, src, counter)
    if bound is not None:
        bound(ptrs, q.device.index)
        return dq_acc, lse_p, delta_p, counter, None
    rows = width * nheads
    grid = (-(-rows // DELTA_ROWS),)
    launched = launch(attn_bwd_delta_kernel, grid, **dict(zip(_PROLOGUE_PTRS, ptrs)),
                      stride_db=0, stride_ds=do.stride(1), stride_dh=do.stride(2), n_rows=rows,
                      seqlen_q=width, nheads=nheads, total=total, HEAD_DIM=cols,
                      O_COLS=head_dim, ROWS=DELTA_ROWS, ZERO=True, PACKED=True, COUNT=True,
                      PAD=False, num_warps=4)
    return dq_acc, lse_p, delta_p, counter, launched and (launched, grid)


def _packed_rows(cu_q, total: int, width: int, tile: int):
    """:func:`packed_prologue`'s packed row at each position of the padded layout (int32
    ``(width,)``, -1 in the gaps)."""
    rows = torch.arange(total, device=cu_q.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_q[1:], rows, right=True)          # each row's sequence
    first = cu_q[seq]                                              # its first packed row
    dst = rows - first + (first + seq * tile) // tile * tile
    return torch.full((width,), -1, dtype=torch.int32, device=cu_q.device).index_copy_(
        0, dst, rows)


def _pad_rows(lse, delta, rows: int):
    """``lse`` and ``delta`` (float32 ``(B, H, Sq)``) with each head's rows padded to whole
    tiles of ``rows``: +inf and 0, so that a last tile's rows past ``Sq`` (zeros of q and dO)
    have p = 0 and delta = 0, not the next head's values."""
    pad = -lse.shape[-1] % rows
    return (torch.nn.functional.pad(lse, (0, pad), value=float("inf")),
            torch.nn.functional.pad(delta, (0, pad), value=0.0))


DQ_ROWS = 64     # query rows of a dQ kernel consumer (two a CTA)
# keys a K/V tile of the dQ kernel at d = 256 (Q and dO of 128 rows take 128 KB of shared
# memory, a 2-stage ring of 32-key K and V tiles 64 KB more)
DQ_BLOCK_N = 32
# whether the dQ pass of a head dim that is 128 and a smaller tile's width (144, 160, 192:
# split_width) runs the split dQ kernel (attn_bwd_dq_split_sm90_kernel: no column computed past
# the head) instead of the kernel of width 256, and its K/V tiles' keys (Q, dO and a 2-stage
# ring of 64-key K and V tiles in 192 KB at d = 192; ptxas spills 0-20 bytes at 32 or 64 keys):
# the d = 192 backward 1.10-1.15x faster on the H200 with 64-key tiles, 1.02-1.08x with 32
# (tuning log, step 110)
DQ_SPLIT = True
DQ_SPLIT_BLOCK_N = 64
# whether the fused backward of a head dim of 64 and a smaller tile's width (80 = 64 + 16,
# 96 = 64 + 32) runs split (attn_bwd_split_sm90_kernel with the consumers of d = 128: sᵀ and
# dpᵀ two products each, dK and dV in two accumulators, dq of the first tile's columns from
# consumer 0, of the second's from consumer 1) instead of the kernel of width 128 through
# views: a quarter less work at d = 96, the backward 1.05-1.15x faster on the H200 (tuning
# log, step 112)
BWD128_SPLIT = True
# whether the dK/dV kernel of such a head dim's two-kernel backward runs split
# (attn_bwd_split_sm90_kernel: the 64-key items of d = 256, consumer 0 computing dK and dV of
# the first 128 columns, consumer 1 of the rest) instead of the kernel of width 256: a quarter
# less work at d = 192 (0 bytes of spills, 166 KB shared): the d = 192 backward 1.07-1.13x
# faster on the H200, d = 160 1.14-1.21x (tuning log, step 111)
BWD_SPLIT = True

_dq_env = env_reader("FLASHTILE_SM90_DQ")


def dq_eligible(head_dim: int) -> bool:
    """Whether the Gluon dQ kernel (``kernels/attn_bwd_dq_sm90.py``) is the dQ pass of a
    two-kernel backward that ``bwd_eligible`` admits: at ``D`` = 256, unless
    ``FLASHTILE_SM90_DQ=0`` (the Triton dQ kernel)."""
    return head_dim == 256 and _dq_env() != "0"


def dq_pass(q, k, v, out, do, lse, delta, dq_out, spec: AttnSpec) -> bool:
    """The dQ pass of a two-kernel backward that :func:`bwd_eligible` admits, where the Gluon
    dQ kernel serves it (:func:`dq_eligible`, ``out`` contiguous, ``dq_out`` in a layout the TMA
    writes): ``delta`` computed by the prologue, then ``dq_out`` filled; False (nothing
    launched) elsewhere, where the Triton dQ kernel computes both."""
    if not (dq_eligible(q.shape[-1]) and out.is_contiguous() and _plan(dq_out) is not None):
        return False
    _prologue(q, out, do, delta, zero=False)
    _dq(q, k, v, do, lse, delta, dq_out, spec)
    return True


def _dq(q, k, v, do, lse, delta, dq_out, spec: AttnSpec, width: int = 0) -> None:
    """Fill ``dq_out`` (like ``q``, rows contiguous) with the Gluon dQ kernel from ``lse`` and
    ``delta`` (contiguous float32 ``(B, H, Sq)``, delta computed); ``width`` wider than ``D``
    (:func:`padded_backward`): the kernel of that width, q, dO, k, v and ``dq_out`` through
    views whose tiles reach past each head's last column (:func:`_rows`: zeros read there,
    nothing stored), or with ``DQ_SPLIT`` at 128 and a smaller tile's width (192 = 128 + 64)
    the split kernel, two descriptors a tensor, no column past the head."""
    batch, sq, nheads, d = q.shape
    head_dim = width or d  # the kernel's width
    sk, nheads_k = k.shape[1], k.shape[2]
    device = q.device.index or 0
    # a padded head dim of 128 and a smaller tile (DQ_SPLIT): each tensor through two
    # descriptors, the first 128 columns and the rest (the kernel's coordinates + split)
    split = split_width(d) if DQ_SPLIT and head_dim > d and split_width(d) == 128 else 0
    block_n = DQ_SPLIT_BLOCK_N if split else DQ_BLOCK_N
    # lengths that are not multiples of the tiles (a CTA's 128 rows, a K/V tile): 3-D
    # descriptors, and lse, delta padded to whole 64-row tiles
    ragged = bool(sq % (2 * DQ_ROWS) or sk % block_n)
    if ragged:
        lse, delta = _pad_rows(lse, delta, DQ_ROWS)
    n_m = -(-sq // (2 * DQ_ROWS))
    window = _window(spec, sq, sk)
    args = dict(sq=sq, sk=sk, sq_pad=lse.shape[-1], nheads=nheads, group=nheads // nheads_k,
                n_m=n_m, n_bh=batch * nheads, scale=spec.softmax_scale,
                qk_scale=spec.softmax_scale * LOG2E, **window,
                WINDOW=window["MASKED"] and (window["wl"] < sq + sk or window["wr"] != 0),
                RAGGED=ragged, STAGES=STAGES, num_warps=NUM_WARPS)
    flat = _flat_layout()
    cols = split or head_dim
    descs = dict(desc_q=_rows(q, DQ_ROWS, ragged, "q", args, cols),
                 desc_do=_rows(do, DQ_ROWS, ragged, "do", args, cols),
                 desc_k=_rows(k, block_n, ragged, "kv", args, cols),
                 desc_v=_rows(v, block_n, ragged, "kv", args, cols),
                 desc_lse=(lse, [lse.numel()], [1], [DQ_ROWS], flat),
                 desc_delta=(delta, [delta.numel()], [1], [DQ_ROWS], flat),
                 desc_dq=_rows(dq_out, DQ_ROWS, ragged, "dq", args, cols))
    if split:
        rest = d - split
        descs.update(_second_tiles(rest, ragged, q=(q, DQ_ROWS), do=(do, DQ_ROWS),
                                   k=(k, block_n), v=(v, block_n), dq=(dq_out, DQ_ROWS)))
    # (a split variant's tiles depend on the head dim, which the kernel's width does not tell)
    _launch("dq_split" if split else "dq", device,
            (q.dtype, head_dim, window["MASKED"], args["WINDOW"], ragged,
             tuple(len(x[3]) for x in descs.values()), split and d),
            (n_m * batch * nheads,), args, descs)


def dkdv(q, k, v, do, lse, delta, dk, dv, spec: AttnSpec) -> None:
    """Fill ``dk``, ``dv`` (``bwd_eligible`` holds) from ``lse`` and the dQ kernel's ``delta``
    (both contiguous float32 ``(B, H, Sq)``): the deterministic backward."""
    _bwd(q, k, v, do, lse, delta, None, dk, dv, spec)


def _prologue(q, out, do, delta, zero: bool = True, counter=None, lse=None, bound=None,
              cols: int = 0):
    """The Hopper backward's prologue: ``delta = rowsum(dO * O)``, for the fused kernel
    (``zero``) a zeroed float32 dQ accumulator like ``q``, which it returns (without, ``delta``
    stands in for the accumulator the kernel then does not write), and ``counter`` (int32
    ``(1,)``, the persistent kernel's work counter) zeroed where given.  With ``lse``
    (float32 ``(B, H, Sq)``) ``(dq_acc, lse, delta)`` for the fused kernel: where ``Sq`` is not
    a multiple of the kernel's query tile (:func:`bwd_rows`), lse and delta padded to whole
    tiles as :func:`_pad_rows`
    pads them, in the same launch (``delta`` then unused; None: allocated here), and
    ``launched``: ``(launch's result, grid)`` where the launch was direct, for a plan's
    :class:`fastlaunch.BoundLaunch`, else None.  ``bound``: that BoundLaunch of an earlier call
    under the same plan key, which then launches (same geometry, these tensors).  ``cols``
    wider than ``D`` (:func:`padded_backward`): the accumulator ``(B, Sq, H, cols)``, every
    column zeroed, delta from ``D`` columns of ``out`` and ``do``."""
    batch, sq, nheads, head_dim = q.shape
    cols = cols or head_dim
    tile = bwd_rows(cols)
    width = sq if lse is None or sq % tile == 0 else sq + (-sq % tile)
    if delta is None or width != sq:
        delta = empty((batch, nheads, width), torch.float32, q.device)
    dq_acc = (torch.empty((batch, sq, nheads, cols), dtype=torch.float32, device=q.device)
              if zero else delta)
    lse_p = delta
    if width != sq:
        lse_p = empty((batch, nheads, width), torch.float32, q.device)
    # (SRC unused here; LSE too without lse, COUNTER without counter: delta stands in)
    ptrs = (out, do, delta, dq_acc, delta if lse is None else lse, lse_p, delta,
            delta if counter is None else counter)
    launched = None
    if bound is not None:
        bound(ptrs, q.device.index)
    else:
        rows = batch * width * nheads
        grid = (-(-rows // DELTA_ROWS),)
        launched = launch(attn_bwd_delta_kernel, grid, **dict(zip(_PROLOGUE_PTRS, ptrs)),
                          stride_db=do.stride(0), stride_ds=do.stride(1),
                          stride_dh=do.stride(2), n_rows=rows, seqlen_q=width, nheads=nheads,
                          total=sq, HEAD_DIM=cols, O_COLS=head_dim, ROWS=DELTA_ROWS,
                          ZERO=zero, PACKED=False, COUNT=counter is not None,
                          PAD=width != sq, num_warps=4)
        launched = launched and (launched, grid)
    if lse is None:
        return dq_acc
    return dq_acc, (lse if width == sq else lse_p), delta, launched


def fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec: AttnSpec,
                   plan_key=None, key_mask=None, sparse=None, varlen=None,
                   width: int = 0) -> None:
    """Fill ``dq``, ``dk``, ``dv`` (``bwd_eligible`` holds; ``out`` contiguous; ``lse`` and the
    buffer ``delta`` contiguous float32 ``(B, H, Sq)``): a prologue kernel computes ``delta``
    (where ``Sq`` is not a multiple of the query tile, into a padded buffer of its own, with
    lse's padded copy) and zeroes a float32 dQ accumulator, the backward kernel adds every dQ
    tile into it, and one copy converts it into ``dq``.  With ``plan_key``
    (:func:`bwd_plan_key`) a direct launch leaves a plan that :func:`planned_backward`
    repeats; ``key_mask`` as :func:`forward`'s; ``sparse`` as :func:`_bwd`'s (its plan key
    sees the lists' geometry: :func:`bwd_plan_key`); ``varlen``: ``(cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of packed ``(total, H, D)`` tensors
    (:func:`varlen_bwd_eligible`; lse ``(H, total_q)``; ``delta`` unused:
    :func:`packed_prologue` lays out its own); ``width`` wider than ``D``
    (:func:`padded_backward`): the kernel of that width, ``dk`` and ``dv`` that wide (or, packed,
    as wide as the head: ``PAD_NARROW_DKDV``), the accumulator cropped into ``dq`` (a plan keeps
    the width: :func:`planned_backward` crops as well)."""
    counter = None
    if varlen is not None:  # one batch entry of the packed rows (forward's views)
        q, k, v, out, do, dq, dk, dv = (x.unsqueeze(0) for x in (q, k, v, out, do, dq, dk, dv))
        dq_acc, lse, delta, counter, prologue = packed_prologue(
            q, out, do, lse, varlen[0], cols=width, masked=spec.has_window)
    else:  # (lse and delta padded where the lengths are not multiples of the row tile)
        if bwd_persistent(width or q.shape[-1]):  # the prologue zeroes the work counter too
            counter = empty((1,), torch.int32, q.device)
        dq_acc, lse, delta, prologue = _prologue(q, out, do, delta, counter=counter, lse=lse,
                                                 cols=width)
    launched = _bwd(q, k, v, do, lse, delta, dq_acc, dk, dv, spec, key_mask, sparse, varlen,
                    counter, width)
    dq.copy_(dq_acc[..., :dq.shape[-1]] if width else dq_acc)
    if plan_key is not None and launched is not None:
        _bwd_plans.put(plan_key, _BwdPlan(*launched, q.device.index or 0, prologue, width))


# Plans of the fused backward: a call whose q, k, v, out, dO and lse have the shapes, strides
# and alignment of an earlier direct launch's, with its dtype, device, spec and the launcher's
# setting (``bwd_plan_key``), repeats the prologue, the kernel and the dQ copy with its own
# tensors, skipping the eligibility checks and the argument building (docs/dev/tuning-log.md,
# step 55).
_bwd_plans = PlanCache()
_BWD_ROLES = ("desc_q", "desc_do", "desc_k", "desc_v", "desc_lse", "desc_delta", "desc_dq",
              "desc_dk", "desc_dv")


class _BwdPlan:
    __slots__ = ("compiled", "grid", "values", "descs", "at", "mask_at", "cu_at", "persistent",
                 "ragged", "device", "fast", "prologue", "width", "wide_dkdv", "narrow_switch")

    def __init__(self, launched, grid, descs, persistent, ragged, device, prologue=None,
                 width: int = 0):
        # (a split head dim's kernel: the second descriptors take their tensors' roles)
        names = _kernel("bwd_split" if "desc_q2" in descs else "bwd").arg_names
        self.compiled, self.grid, self.device = launched[0], grid, device
        # a padded head dim's kernel width (padded_backward: the accumulator that wide,
        # cropped), else 0; whether dK and dV went into buffers that wide too (else the kernel
        # stored them narrow: PAD_NARROW_DKDV)
        self.width = width
        self.persistent, self.ragged = persistent, ragged
        self.values = list(launched[1])
        self.wide_dkdv = bool(width) and self.values[names.index("DK_COLS")] == width
        self.narrow_switch = PAD_NARROW_DKDV  # (a plan serves calls under the same setting)
        # positions of DK, DV and Counter; (position, role, shape, strides, block, layout)
        # of each descriptor
        self.at = tuple(names.index(n) for n in ("DK", "DV", "Counter"))
        # KeyMask, Ranges; Lists (lse stands in for those a call does not have)
        self.mask_at = (names.index("KeyMask"), names.index("Ranges"), names.index("Lists"))
        self.cu_at = (names.index("CuQ"), names.index("CuK"))  # (packed sequences)
        self.descs = tuple((names.index(n), _BWD_ROLES.index(n.rstrip("2")), *d[1:])
                           for n, d in descs.items())
        self.fast = _tma_launch(self.compiled, grid, self.descs)
        # the prologue's direct launch, bound (its scalars are the key's: shapes, strides,
        # count); None where it was not direct
        self.prologue = prologue and BoundLaunch(attn_bwd_delta_kernel, *prologue,
                                                 _PROLOGUE_PTRS)
        # the plan keeps no tensor of the call it was made from alive (every call fills them)
        for at in (*self.at, *self.mask_at, *self.cu_at, *(d[0] for d in self.descs)):
            self.values[at] = None


def bwd_plan_key(q, k, v, out, do, lse, spec: AttnSpec, setting, key_mask=None,
                 varlen=None, sparse=None) -> tuple:
    """The key of a fused backward's plan: the tensors' signatures, dtype, device, spec,
    ``setting`` (what else the caller's choice of path reads), the key mask's view's
    signature, packed sequences' count and longest lengths (``varlen`` as
    :func:`fused_backward`'s), the transposed block-mask lists' geometry
    (:func:`_sparse_key`) and ``BWD128_SPLIT``."""
    return (signature(q, k, v, out, do, lse), q.dtype, q.device, spec, setting,
            _mask_key(key_mask),
            None if varlen is None else (varlen[0].shape[0], varlen[2], varlen[3]),
            _sparse_key(sparse), BWD128_SPLIT)


def planned_backward(q, k, v, out, do, lse, spec: AttnSpec, setting, key_mask=None,
                     varlen=None, sparse=None):
    """``(dq, dk, dv)`` of :func:`fused_backward` through the plan of an earlier call like this
    one (``lse`` contiguous; ``key_mask`` as :func:`forward`'s, ``varlen`` and ``sparse`` as
    :func:`fused_backward`'s), or None where there is none or plans are off (the caller then
    takes its full path)."""
    plan = _plan_of(_bwd_plans, lambda: bwd_plan_key(q, k, v, out, do, lse, spec, setting,
                                                      key_mask, varlen, sparse))
    if plan is None or (plan.width and (not PAD_BWD_VIEWS
                                         or plan.narrow_switch != PAD_NARROW_DKDV)):
        return None
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    width = plan.width
    if varlen is None:
        cu = (lse, lse)  # (stand-ins without packed sequences)
        counter = empty((1,), torch.int32, q.device) if plan.persistent else dk
        dq_acc, lse, delta, _ = _prologue(q, out, do, None, lse=lse, bound=plan.prologue,
                                          counter=counter if plan.persistent else None,
                                          cols=width)
    else:  # one batch entry of the packed rows, as fused_backward's
        cu = varlen[:2]
        q, k, v, out, do, dq, dk, dv = (x.unsqueeze(0) for x in (q, k, v, out, do, dq, dk, dv))
        dq_acc, lse, delta, counter, _ = packed_prologue(q, out, do, lse, varlen[0],
                                                         bound=plan.prologue, cols=width,
                                                         masked=spec.has_window)
    # a padded head dim's dK and dV: buffers of the kernel's width (padded_backward's), unless
    # the kernel stored them narrow
    dk_w, dv_w = ((empty((*x.shape[:-1], width), x.dtype, x.device) for x in (dk, dv))
                  if plan.wide_dkdv else (dk, dv))
    values = plan.values.copy()
    values[plan.at[0]], values[plan.at[1]] = dk_w, dv_w
    values[plan.at[2]] = counter
    values[plan.cu_at[0]], values[plan.cu_at[1]] = cu
    _fill_mask(values, plan.mask_at, key_mask, lse, sparse)
    _run_plan(plan, values, (q, do, k, v, lse, delta, dq_acc, dk_w, dv_w))
    dq.copy_(dq_acc[..., :dq.shape[-1]] if width else dq_acc)
    if plan.wide_dkdv:
        dk.copy_(dk_w[..., :dk.shape[-1]])
        dv.copy_(dv_w[..., :dv.shape[-1]])
    if varlen is not None:
        return dq[0], dk[0], dv[0]
    return dq, dk, dv
