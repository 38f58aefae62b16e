"""Allocation and grids of the backward kernels: dQ (which also writes ``delta``), then dK/dV.

A plain backward launches these two kernels and nothing else: no preprocess pass, no fills,
casts or copies.  On Hopper a call the Gluon kernel covers (``launch_sm90.bwd_eligible``) takes
it instead: by default one kernel for all three gradients (``launch_sm90.fused_backward``, with
a prologue for ``delta`` and a float32 dQ accumulator, and a copy into ``dq``); with
``spec.deterministic`` or ``torch.use_deterministic_algorithms(True)`` (and where the one
kernel does not pay, ``launch_sm90.fused_pays``), a dQ kernel (at d = 256 the Gluon one after a
``delta`` prologue, ``launch_sm90.dq_pass``; else the Triton one) then the Gluon dK/dV kernel
(no floating-point atomics).  The gradients are allocated in the
layout of their inputs (``empty_like``), so a ``q`` that is a transposed view (the SDPA layout)
gets a ``dq`` that autograd hands to the caller's tensor without a copy.  The byte counts are
in ``flashtile.reference.algorithms``.
"""
from __future__ import annotations


import torch

from .. import env_reader
from ..spec import AttnSpec
from .args import (alibi_args, bias_args, block_d, broadcast_strides, cdiv, dot_precision,
                   dropout_args, layout, lse_strides, scalar_args, seq_strides)
from . import launch_sm90
from .configs import get_config
from .fastlaunch import (STREAM_ARG, PlanCache, bind_slots, empty, empty_like, launch, plan_roles,
                         plans_enabled, record_plan, recording, signature)
from .kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from .sparse_index import fit_block, sparse_args

# Launch plans of plain backward calls (no optional feature; fastlaunch.Plan), as the forward
# keeps them: at short sequences the launches' host work (configs, ~60 arguments each,
# direct-launch keys) costs as much as their GPU time.  Inputs (do, q, k, v, out, lse), placed
# in the kernel parameters below even when one tensor is passed as two of them.
_plans = PlanCache()
_chunk_env = env_reader("FLASHTILE_BWD_CHUNK")
_ROLES = {attn_bwd_dq_kernel: plan_roles(attn_bwd_dq_kernel, DO=0, Q=1, K=2, V=3, O=4, LSE=5),
          attn_bwd_dkdv_kernel: plan_roles(attn_bwd_dkdv_kernel, DO=0, Q=1, K=2, V=3, LSE=5)}


def batch_chunk(batch: int, sq: int, sk: int, nheads: int, nheads_k: int, head_dim: int,
                elem: int, device: torch.device) -> int:
    """Batch entries per chunk of the backward (0: one launch of each kernel for the whole
    batch), from ``FLASHTILE_BWD_CHUNK`` (read per call): ``off`` (the default) or ``0``, none;
    a number, that many entries; ``auto``, as many entries as fill half the device's L2 with
    the tensors both kernels read (Q, dO, O, K, V), when the whole batch does not fit and one
    entry does.

    Chunked, each chunk launches the dQ kernel and then the dK/dV kernel, so the dK/dV kernel
    finds the Q, dO, K and V tiles the dQ kernel has just read in L2 instead of reading them
    from HBM again: fewer bytes (the IO benchmark, ``python -m flashtile.bench io``), more
    launches, each with a smaller grid."""
    mode = (_chunk_env() or "off").strip().lower()
    if mode in ("", "off", "0"):
        return 0
    if mode == "auto":
        if device.type != "cuda":
            return 0
        per_entry = (3 * sq * nheads + 2 * sk * nheads_k) * head_dim * elem
        budget = torch.cuda.get_device_properties(device).L2_cache_size // 2
        entries = budget // max(per_entry, 1)  # 0: one entry does not fit, chunks cannot help
    else:
        try:
            entries = int(mode)
        except ValueError:
            raise ValueError(f"FLASHTILE_BWD_CHUNK={mode!r}: expected off, auto or a number of "
                             "batch entries") from None
        if entries < 0:
            raise ValueError(f"FLASHTILE_BWD_CHUNK={mode!r}: must be >= 0")
    return entries if 0 < entries < batch else 0


def _blocks(cfg, sparse) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of a pass: its config's, fitted to the block-sparse mask's blocks
    when there is one (``sparse_args``)."""
    if sparse[0] is None:
        return cfg.block_m, cfg.block_n
    return fit_block(cfg.block_m, sparse[2]), fit_block(cfg.block_n, sparse[3])


def _cutter(b0: int, b1: int, chunk: int):
    """Batch entries ``[b0, b1)`` of a tensor (None stays None); the tensor itself unchunked."""
    if not chunk:
        return lambda x: x
    return lambda x: x if x is None else x[b0:b1]


_SIDE: dict = {}  # device index -> the side stream of chunked backwards


class _Relaunch:
    """The first chunk's direct launch of a kernel, launched again for a later chunk: the same
    compiled kernel and arguments, each tensor argument's address moved by ``b0`` batch entries
    (every tensor a chunked call passes is a batch slice of a whole one), the grid's batch
    dimension resized.  A chunk's launch then costs a list copy and a C call instead of the
    argument mapping, the heuristics and the direct-launch key (~40 us on the H100 machine)."""

    __slots__ = ("function", "args", "moves", "per_entry")

    def __init__(self, launched, grid, per_entry: int):
        compiled, values = launched
        template, moves = list(values), []
        for pos, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                template[pos] = None
                moves.append((pos, v.data_ptr(), v.stride(0) * v.element_size()))
        self.function, self.args, self.moves = bind_slots(compiled, grid, template, moves)
        self.per_entry = per_entry  # grid rows per batch entry (heads)

    def run(self, b0: int, b1: int, stream: int) -> bool:
        """Launch for entries ``[b0, b1)`` on ``stream``; False (nothing launched) when a moved
        address would lose the 16-byte alignment the kernel was compiled for."""
        args = self.args.copy()
        for pos, base, step in self.moves:
            addr = base + b0 * step
            if (addr ^ base) & 15:
                return False
            args[pos] = addr
        args[1] = (b1 - b0) * self.per_entry
        args[STREAM_ARG] = stream
        self.function(*args)
        return True


def _chunked(launch_dq, launch_dkdv, batch: int, chunk: int, nheads: int, nheads_k: int,
             device: torch.device) -> None:
    """The backward in batch chunks.  On a GPU the dK/dV launches go to a side stream, each
    after its chunk's dQ launch (an event: it reads the chunk's delta), so chunk ``i``'s dK/dV
    kernel runs alongside chunk ``i + 1``'s dQ kernel and fills the other's last, partial wave;
    the caller's stream waits for the side stream at the end (also inside CUDA-graph capture,
    where this forks and joins the captured stream).  Chunks after the first relaunch the first
    one's kernels (:class:`_Relaunch`)."""
    if device.type != "cuda":
        for b0 in range(0, batch, chunk):
            launch_dq(b0, min(batch, b0 + chunk))
            launch_dkdv(b0, min(batch, b0 + chunk))
        return
    main = torch.cuda.current_stream(device)
    side = _SIDE.get(device.index)
    if side is None:
        side = _SIDE[device.index] = torch.cuda.Stream(device)
    side.wait_stream(main)  # the inputs, delta and the gradients were made on the main stream
    dq_again = kv_again = None
    main_raw, side_raw = main.cuda_stream, side.cuda_stream
    done = torch.cuda.Event()  # re-recorded per chunk: a wait waits for the record before it
    for b0 in range(0, batch, chunk):
        b1 = min(batch, b0 + chunk)
        if dq_again is None or not dq_again.run(b0, b1, main_raw):
            grid, launched = launch_dq(b0, b1)
            if b0 == 0 and launched is not None:
                dq_again = _Relaunch(launched, grid, nheads)
        done.record(main)
        side.wait_event(done)
        if kv_again is None or not kv_again.run(b0, b1, side_raw):
            with torch.cuda.stream(side):
                grid, launched = launch_dkdv(b0, b1)
            if b0 == 0 and launched is not None:
                kv_again = _Relaunch(launched, grid, nheads_k)
    main.wait_stream(side)


def _dbias_target(dbias, full_shape):
    """Where the dQ kernel writes dS: ``dbias`` itself when it has the full ``(B, H, Sq, Sk)``
    shape, else a float32 full-shape buffer reduced afterwards (B*H*Sq*Sk*4 bytes)."""
    if dbias is None:
        return None
    if tuple(dbias.shape) == tuple(full_shape):
        return dbias.zero_()
    return torch.zeros(full_shape, dtype=torch.float32, device=dbias.device)


def backward(do, q, k, v, out, lse, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
             rng_seed=None, block_mask=None, block_size=None, dbias=None, grad_dtype=None):
    """Returns ``(dq, dk, dv)`` (in ``grad_dtype``, default the inputs' dtypes); with ``dbias``
    (shaped like ``attn_bias``) also writes the gradient of the additive bias into it."""
    if not lse.is_contiguous():
        # the kernels index the contiguous ``delta`` buffer with lse's strides
        lse = lse.contiguous()
    plain = (alibi_slopes is None and cu_seqlens_q is None and attn_bias is None
             and rng_seed is None and block_mask is None and dbias is None and grad_dtype is None
             and do.stride(-1) == 1 and plans_enabled())
    # two kernels (dQ, then dK/dV) or, on Hopper, the fused backward where it pays (at a
    # head dim the forward pads, at the kernels' width: launch_sm90.padded_backward)
    two = plain and (_deterministic(spec) or not launch_sm90.fused_pays(
        q.shape[1], k.shape[1], spec.causal,
        launch_sm90.padded_width(q.shape[-1]) or q.shape[-1]))
    if plain and not two:
        # the fused Hopper backward's own plan (the switch is read per call)
        grads = launch_sm90.planned_backward(q, k, v, out, do, lse, spec, _chunk_env())
        if grads is not None:
            return grads
    if (cu_seqlens_q is not None and alibi_slopes is None and attn_bias is None
            and rng_seed is None and block_mask is None and dbias is None and grad_dtype is None
            and do.stride(-1) == 1 and not _deterministic(spec) and plans_enabled()
            and launch_sm90.on_hopper(q)):
        # packed sequences: the fused Hopper backward's plan of an earlier call like this one
        packed = launch_sm90.packed_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        grads = launch_sm90.planned_backward(q, k, v, out, do, lse, spec, _chunk_env(),
                                             varlen=packed)
        if grads is not None:
            return grads
    if (block_mask is not None and alibi_slopes is None and cu_seqlens_q is None
            and attn_bias is None and rng_seed is None and dbias is None and grad_dtype is None
            and do.stride(-1) == 1 and q.dim() == 4 and not _deterministic(spec)
            and plans_enabled() and launch_sm90.on_hopper(q)):
        # a block mask's plan (the transposed lists are cached per mask)
        sparse = sparse_args(block_mask, block_size, q.shape[1], k.shape[1], spec, transpose=True)
        grads = launch_sm90.planned_backward(q, k, v, out, do, lse, spec, _chunk_env(),
                                             sparse=sparse)
        if grads is not None:
            return grads
    mask = None
    if not plain and do.stride(-1) == 1:  # (a plain call has no mask)
        mask = _key_mask(q, k, spec, attn_bias, dbias, alibi_slopes, cu_seqlens_q, rng_seed,
                         block_mask, grad_dtype)
    if mask is not None:
        # a key mask's plan (the forward has summarised the mask: launch_sm90.key_mask_of)
        grads = launch_sm90.planned_backward(q, k, v, out, do, lse, spec, _chunk_env(), mask)
        if grads is not None:
            return grads
    # the fused Hopper backward keeps its own plans (above): a call it serves (its gradients
    # shaped like k and v) runs the full path, which leaves one; the two-kernel backward, on
    # Hopper as elsewhere, replays a launch plan of this module
    if not plain:
        return _backward(do, q, k, v, out, lse, spec, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, attn_bias, rng_seed, block_mask, block_size,
                         dbias, grad_dtype)
    if not two and launch_sm90.bwd_eligible(q, k, v, do, k, v, spec, False):
        return _backward(do, q, k, v, out, lse, spec)
    inputs = (do, q, k, v, out, lse)
    # the chunk setting and the switches of the Hopper kernels decide the launches (a chunked
    # call records no plan: its kernels get views of the tensors)
    key = (signature(*inputs), q.dtype, q.device, spec, _chunk_env(), two,
           launch_sm90.setting())
    plan = _plans.get(key)
    if plan is not None:
        res = plan.run(inputs)
        if res is not None:
            return res
    with recording() as rec:
        grads = _backward(do, q, k, v, out, lse, spec)
    plan = record_plan(rec, inputs, grads, _ROLES)
    if plan is not None:
        _plans.put(key, plan)
    return grads


def _plan_key(q, k, v, out, do, lse, spec: AttnSpec, key_mask=None, varlen=None, sparse=None):
    """The key under which a fused Hopper backward's direct launch leaves its plan
    (``launch_sm90.bwd_plan_key`` with this module's chunk setting), or None with plans off."""
    if not plans_enabled():
        return None
    return launch_sm90.bwd_plan_key(q, k, v, out, do, lse, spec, _chunk_env(), key_mask, varlen,
                                    sparse)


def _padded_backward(do, q, k, v, out, lse, spec: AttnSpec, width: int, dq, dk, dv):
    """The backward of a head dim the Hopper forward pads (``launch_sm90.pad_backward``) on
    copies of its tensors padded with zeros to ``width`` (zero columns add nothing to the
    scores and get zero gradients), on the Hopper kernels of that width; the gradients'
    first columns go into ``dq``, ``dk``, ``dv``; or, where ``launch_sm90.padded_view_width``
    admits the call, with no copy of the inputs (``launch_sm90.padded_backward``).  None
    (nothing launched) where neither serves: copies below ``launch_sm90.PAD_BWD_KEYS`` keys."""
    if launch_sm90.padded_view_width(q, k, v, out, do, dq, spec, width):
        launch_sm90.padded_backward(q, k, v, out, do, lse, dq, dk, dv, spec, width,
                                    plan_key=_plan_key(q, k, v, out, do, lse, spec))
        return dq, dk, dv
    if k.shape[1] < launch_sm90.PAD_BWD_KEYS:
        return None
    pad = (0, width - q.shape[-1])
    grads = _backward(*(torch.nn.functional.pad(x, pad) for x in (do, q, k, v, out)), lse, spec)
    for dst, g in zip((dq, dk, dv), grads):
        dst.copy_(g[..., :dst.shape[-1]])
    return dq, dk, dv


def _key_mask(q, k, spec: AttnSpec, attn_bias, dbias, alibi_slopes, cu_seqlens_q, rng_seed,
              block_mask, grad_dtype):
    """``launch_sm90.key_mask_of`` of a dense call on a Hopper GPU whose one optional input is
    a bool key mask (no bias gradient) and that does not ask for deterministic gradients, else
    None."""
    if (attn_bias is None or dbias is not None or alibi_slopes is not None
            or cu_seqlens_q is not None or rng_seed is not None or block_mask is not None
            or grad_dtype is not None or q.dim() != 4 or _deterministic(spec)
            or not launch_sm90.on_hopper(q)):
        return None
    return launch_sm90.key_mask_of(attn_bias, q.shape[0], k.shape[1])


def _deterministic(spec: AttnSpec) -> bool:
    """Whether the call asked for bitwise-reproducible gradients (flash-attn's argument, or
    PyTorch's global switch, read per call)."""
    return spec.deterministic or torch.are_deterministic_algorithms_enabled()


def _backward(do, q, k, v, out, lse, spec: AttnSpec, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
              rng_seed=None, block_mask=None, block_size=None, dbias=None, grad_dtype=None):
    varlen, batch, sq, sk, nheads, nheads_k, head_dim = layout(q, k, cu_seqlens_q, max_seqlen_q,
                                                               max_seqlen_k)
    # the gradients in their inputs' layouts: what autograd's accumulation wants (a gradient
    # of another layout is copied into the input's, one read and one write of the whole tensor)
    dq, dk, dv = (empty_like(x, grad_dtype) for x in (q, k, v))
    if batch == 0 or sq == 0 or sk == 0 or q.numel() == 0 or k.numel() == 0:
        if dbias is not None:
            dbias.zero_()
        return dq.zero_(), dk.zero_(), dv.zero_()
    if do.stride(-1) != 1:
        do = do.contiguous()
    if (not varlen and alibi_slopes is None and attn_bias is None and rng_seed is None
            and block_mask is None and dbias is None and grad_dtype is None
            and not _deterministic(spec)):
        width = launch_sm90.pad_backward(q, k, v, spec)
        grads = width and _padded_backward(do, q, k, v, out, lse, spec, width, dq, dk, dv)
        if grads:
            return grads
    delta = empty(lse.shape, torch.float32, lse.device)  # written by the dQ kernel
    mask = _key_mask(q, k, spec, attn_bias, dbias, alibi_slopes, cu_seqlens_q, rng_seed,
                     block_mask, grad_dtype)
    if (mask is not None and out.is_contiguous()
            and launch_sm90.bwd_eligible(q, k, v, do, dk, dv, spec)):
        # a padded batch's key mask: the fused Hopper backward reads it (launch_sm90.key_mask),
        # at every length (where plain calls take the Triton dQ and Gluon dK/dV kernels,
        # fused_pays, a masked call would otherwise take the Triton kernels alone)
        launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec,
                                   _plan_key(q, k, v, out, do, lse, spec, mask), key_mask=mask)
        return dq, dk, dv
    width = mask is not None and launch_sm90.padded_view_width(q, k, v, out, do, dq, spec)
    if width:
        # ... at a head dim the forward pads: the fused Hopper backward of the next width
        # through views of the head's columns (launch_sm90.padded_backward)
        launch_sm90.padded_backward(q, k, v, out, do, lse, dq, dk, dv, spec, width,
                                    key_mask=mask,
                                    plan_key=_plan_key(q, k, v, out, do, lse, spec, mask))
        return dq, dk, dv
    if (block_mask is not None and not varlen and alibi_slopes is None and attn_bias is None
            and rng_seed is None and dbias is None and grad_dtype is None
            and not _deterministic(spec) and out.is_contiguous()
            and launch_sm90.sparse_bwd_eligible(q, k, v, do, dk, dv, spec, block_mask,
                                                block_size)):
        # a block mask of whole items and blocks: the fused Hopper backward walks each key
        # block's column of the transposed lists
        sparse = sparse_args(block_mask, block_size, sq, sk, spec, transpose=True)
        launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec,
                                   _plan_key(q, k, v, out, do, lse, spec, sparse=sparse),
                                   sparse=sparse)
        return dq, dk, dv
    packed_plain = (varlen and alibi_slopes is None and attn_bias is None and rng_seed is None
                    and block_mask is None and dbias is None and grad_dtype is None
                    and not _deterministic(spec) and out.is_contiguous()
                    and lse.is_contiguous())
    native = packed_plain and launch_sm90.varlen_bwd_eligible(q, k, v, do, dk, dv, spec)
    width = packed_plain and not native and launch_sm90.varlen_pad_width(q, k, v, out, do, dq,
                                                                          spec)
    if native or width:
        # packed sequences: the fused Hopper backward takes each one's rows from the
        # cumulative lengths (the int32 the kernel reads); a direct launch leaves a plan.  At a
        # head dim the forward pads to 128, the kernel of that width through views of the
        # head's columns (launch_sm90.padded_backward)
        packed = launch_sm90.packed_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        key = _plan_key(q, k, v, out, do, lse, spec, varlen=packed)
        if native:
            launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec, key,
                                       varlen=packed)
        else:
            launch_sm90.padded_backward(q, k, v, out, do, lse, dq, dk, dv, spec, width, packed,
                                        plan_key=key)
        return dq, dk, dv
    features = (varlen or alibi_slopes is not None or attn_bias is not None
                or rng_seed is not None or block_mask is not None or dbias is not None)
    chunk = 0 if features else batch_chunk(batch, sq, sk, nheads, nheads_k, head_dim,
                                           q.element_size(), q.device)
    if (not chunk and not features and not _deterministic(spec) and out.is_contiguous()
            and launch_sm90.fused_pays(sq, sk, spec.causal, head_dim)
            and launch_sm90.bwd_eligible(q, k, v, do, dk, dv, spec)):
        # Hopper: one Gluon kernel for dQ, dK and dV (none of the Triton kernels' arguments);
        # a direct launch leaves a plan for the next call like this one (backward above)
        launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec,
                                   _plan_key(q, k, v, out, do, lse, spec))
        return dq, dk, dv
    group = nheads // nheads_k
    bd = block_d(head_dim)
    prec = dot_precision(q.dtype)
    scalars = scalar_args(spec, sq, sk, nheads)
    alibi, stride_ab = alibi_args(alibi_slopes, batch)
    lse_b, lse_h = lse_strides(lse, varlen)
    bias, bias_strides = bias_args(attn_bias)
    seed, dropout_p, dropout_scale = dropout_args(spec, rng_seed)
    db_full = _dbias_target(dbias, (batch, nheads, sq, sk))
    db_strides = (0, 0, 0, 0) if db_full is None else broadcast_strides(db_full)

    q_st, k_st, v_st = seq_strides(q, varlen), seq_strides(k, varlen), seq_strides(v, varlen)
    do_st = seq_strides(do, varlen)
    common = dict(
        Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, ALIBI=alibi, CU_Q=cu_seqlens_q,
        CU_K=cu_seqlens_k, BIAS=bias, RNG=seed,
        stride_qb=q_st[0], stride_qm=q_st[1], stride_qh=q_st[2],
        stride_kb=k_st[0], stride_kn=k_st[1], stride_kh=k_st[2],
        stride_vb=v_st[0], stride_vn=v_st[1], stride_vh=v_st[2],
        stride_dob=do_st[0], stride_dom=do_st[1], stride_doh=do_st[2],
        stride_lb=lse_b, stride_lh=lse_h, stride_ab=stride_ab,
        stride_biasb=bias_strides[0], stride_biash=bias_strides[1],
        stride_biasm=bias_strides[2], stride_biasn=bias_strides[3],
        seqlen_q=sq, seqlen_k=sk, GROUP=group, scale=spec.softmax_scale,
        dropout_p=dropout_p, dropout_scale=dropout_scale, **scalars,
        HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC=prec)

    dq_cfg = get_config("dq", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    dq_bs = sparse_args(block_mask, block_size, sq, sk, spec)
    kv_cfg = get_config("dkdv", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    kv_bs = sparse_args(block_mask, block_size, sq, sk, spec, transpose=True)
    dq_st, o_st = seq_strides(dq, varlen), seq_strides(out, varlen)
    dk_st, dv_st = seq_strides(dk, varlen), seq_strides(dv, varlen)
    dq_blocks, kv_blocks = _blocks(dq_cfg, dq_bs), _blocks(kv_cfg, kv_bs)
    # Batch entries [b0, b1) at a time (all of them unless chunked): dQ first, its prologue
    # writes delta, which the dK/dV kernel reads.  Chunked, the dK/dV kernel re-reads the Q, dO,
    # K and V tiles the dQ kernel has just read while they are still in L2 (the tensors are
    # views of the whole ones, with the same strides: the same compiled kernels).
    def chunk_args(b0, b1):
        cut = _cutter(b0, b1, chunk)
        return cut, dict(common, Q=cut(q), K=cut(k), V=cut(v), DO=cut(do), LSE=cut(lse),
                         DELTA=cut(delta))

    def launch_dq(b0, b1):
        cut, part = chunk_args(b0, b1)
        block_m, block_n = dq_blocks
        bs_idx, bs_strides, bs_m, bs_n = dq_bs
        grid = (cdiv(sq, block_m), (b1 - b0) * nheads)
        return grid, launch(
            attn_bwd_dq_kernel, grid, **part, DQ=cut(dq),
            O=cut(out), BS_IDX=bs_idx, DBIAS=db_full,
            stride_dqb=dq_st[0], stride_dqm=dq_st[1], stride_dqh=dq_st[2],
            stride_ob=o_st[0], stride_om=o_st[1], stride_oh=o_st[2],
            stride_dbb=db_strides[0], stride_dbh=db_strides[1], stride_dbm=db_strides[2],
            stride_dbn=db_strides[3],
            stride_bsb=bs_strides[0], stride_bsh=bs_strides[1], stride_bsr=bs_strides[2],
            bs_m=bs_m, bs_n=bs_n, H=nheads, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages)

    def launch_dkdv(b0, b1):
        cut, part = chunk_args(b0, b1)
        block_m, block_n = kv_blocks
        bs_idx, bs_strides, bs_m, bs_n = kv_bs
        grid = (cdiv(sk, block_n), (b1 - b0) * nheads_k)
        return grid, launch(
            attn_bwd_dkdv_kernel, grid, **part,
            DK=cut(dk), DV=cut(dv), BS_IDX=bs_idx,
            stride_dkb=dk_st[0], stride_dkn=dk_st[1], stride_dkh=dk_st[2],
            stride_dvb=dv_st[0], stride_dvn=dv_st[1], stride_dvh=dv_st[2],
            stride_bsb=bs_strides[0], stride_bsh=bs_strides[1], stride_bsr=bs_strides[2],
            bs_m=bs_m, bs_n=bs_n, HK=nheads_k, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=kv_cfg.num_warps, num_stages=kv_cfg.num_stages)

    if not chunk:
        if not features and launch_sm90.bwd_eligible(q, k, v, do, dk, dv, spec, True):
            # Hopper: the Gluon dQ kernel (d = 256) or the Triton one, which computes delta
            if not launch_sm90.dq_pass(q, k, v, out, do, lse, delta, dq, spec):
                launch_dq(0, batch)
            # Hopper: the warp-specialised dK/dV kernel (Gluon), reading the dQ pass's delta
            launch_sm90.dkdv(q, k, v, do, lse, delta, dk, dv, spec)
        else:
            launch_dq(0, batch)
            launch_dkdv(0, batch)
    else:
        _chunked(launch_dq, launch_dkdv, batch, chunk, nheads, nheads_k, q.device)
    if db_full is not None and db_full is not dbias:
        dims = [d for d in range(4) if dbias.shape[d] == 1 and db_full.shape[d] != 1]
        dbias.copy_(db_full.sum(dim=dims, keepdim=True) if dims else db_full)
    return dq, dk, dv
