"""Public attention functions: flash-attn 2.x compatible calls and a PyTorch SDPA drop-in.

Every function validates its arguments (``flashtile._validate``) before any kernel runs, builds
an ``AttnSpec`` and calls the one differentiable op in ``flashtile.autograd``.
"""
from __future__ import annotations

import torch

from . import _validate as V
from ._tensor_cache import TensorCache
from . import backends, paged_kv
from .autograd import attention, dropout_seed
from ._validate import check_qkv as _check_qkv
from ._validate import spec as _spec
from .masks import attention_probs, attention_probs_varlen, sign_dropped


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def pad_head_dims(q, k, v):
    """``q``, ``k``, ``v`` (head dim last) whose value head dim ``Ev`` differs from the query's
    ``E`` (multi-head latent attention: DeepSeek-V2/V3), with zeros padded onto the smaller of
    the two so that all three share ``max(E, Ev)``: exact, because zero columns of q and k add
    nothing to ``q.k`` and zero columns of v give output columns of zero, which the caller
    crops to ``Ev`` (the softmax scale must stay ``E``'s: pass it explicitly).  Padding is
    differentiable; it costs what the larger head dim costs.  The padded key or value takes
    the other's memory layout (the Hopper kernels walk K and V with the same coordinates).
    The value head dim is checked here (the kernels' limit), the query's by the caller."""
    e, ev = q.shape[-1], v.shape[-1]
    V.head_dim(ev, "value")
    if ev < e:
        return q, k, _pad_last(v, e, like=k)
    return _pad_last(q, ev, like=q), _pad_last(k, ev, like=v), v


def _pad_last(x, size, like):
    """``x`` with zeros padded onto its last dimension up to ``size``, laid out in memory as
    ``like`` is: its dimensions but the last in ``like``'s stride order, outermost first."""
    order = list(range(x.dim() - 1))
    for i in range(1, len(order)):  # (an insertion sort: torch.compile sorts no symbolic keys)
        j = i
        while j and like.stride(order[j - 1]) < like.stride(order[j]):
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    order.append(x.dim() - 1)
    back = [order.index(i) for i in range(x.dim())]
    return torch.nn.functional.pad(x.permute(order), (0, size - x.shape[-1])).permute(back)


def _maybe_contiguous(x):
    """A last dimension with stride != 1 is copied (flash-attn's ``maybe_contiguous``): the
    kernels read each row of ``headdim`` values as one contiguous vector."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[-1] > 1 and x.stride(-1) != 1:
        return x.contiguous()
    return x


def _no_probs(q: torch.Tensor) -> torch.Tensor:
    """``S_dmask`` of a call without dropout: an empty tensor of q's dtype, as flash-attn."""
    return q.new_empty((0,))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Exact attention ``softmax(q k^T * softmax_scale) v`` without an N x N matrix.

    Arguments (flash-attn 2.x names, order and defaults):
        q: ``(batch, seqlen_q, nheads, headdim)``, float16 / bfloat16 / float32.
        k, v: ``(batch, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (GQA/MQA:
            query head ``h`` uses key/value head ``h // (nheads // nheads_k)``).
        dropout_p: probability in ``[0, 1)`` of dropping each normalised attention
            probability; kept ones are scaled by ``1 / (1 - dropout_p)`` (``lse`` is
            unaffected).  The keep mask comes from a seed drawn from PyTorch's default
            generator for q's device, so ``torch.manual_seed(s)`` makes calls repeatable; the
            backward regenerates it (no N x N mask is stored).  See ``flashtile.rng``.
        softmax_scale: defaults to ``1 / sqrt(headdim)``.
        causal: bottom-right aligned when ``seqlen_q != seqlen_k`` (query ``i`` sees keys
            ``j <= i + seqlen_k - seqlen_q``); a query row that sees no key outputs 0::

                seqlen_q=2, seqlen_k=5        seqlen_q=5, seqlen_k=2
                    1 1 1 1 0                     0 0
                    1 1 1 1 1                     0 0
                                                  0 0
                                                  1 0
                                                  1 1
        window_size: ``(left, right)``; query ``i`` sees keys in
            ``[i + sk - sq - left, i + sk - sq + right]``, -1 meaning unbounded::

                window_size=(2, 1), seqlen_q = seqlen_k = 6
                    1 1 0 0 0 0
                    1 1 1 0 0 0
                    1 1 1 1 0 0
                    0 1 1 1 1 0
                    0 0 1 1 1 1
                    0 0 0 1 1 1
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch, nheads)``; adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores.
        deterministic: the backward's gradients bitwise reproducible.  The default backward
            on Hopper (H100/H200) adds dQ with float32 atomics in no fixed order (its last
            bits vary between calls); ``True``, or ``torch.use_deterministic_algorithms(True)``,
            selects a backward without atomics (slower there).  Elsewhere the backward is
            always deterministic.
        return_attn_probs: also return the log-sum-exp and, with dropout, the dropout pattern
            (testing only: ``S_dmask`` is an N x N tensor built on the device after the call).

    q, k and v may be strided views (e.g. slices of a packed tensor); one whose last
    dimension has a stride other than 1 is copied first, as flash-attn does.

    Returns:
        out ``(batch, seqlen_q, nheads, headdim)`` in the input dtype; with
        ``return_attn_probs=True``, ``(out, softmax_lse, S_dmask)`` where ``softmax_lse`` is
        float32 ``(batch, nheads, seqlen_q)`` (natural log, ``-inf`` for rows that see no key).
        With ``dropout_p == 0``, ``S_dmask`` is an empty ``(0,)`` tensor of q's dtype (as in
        flash-attn; nothing N x N is built).  With dropout it is float32
        ``(batch, nheads, seqlen_q, seqlen_k)`` (exact sizes, no padding) and holds the
        normalised probabilities ``P = exp(scores - softmax_lse)`` (before dropout, scaling
        ``1``: rows sum to 1) with the sign flipped where dropout dropped the element:
        ``S_dmask >= 0`` is the keep mask and ``S_dmask.abs()`` is P.  Entries that are
        exactly 0 (masked keys) count as kept.  flash-attn documents its ``S_dmask`` as "the
        output of softmax (possibly with different scaling)": its CUDA kernels store
        block-wise unnormalised values that its tests rescale; flashtile's are normalised.
    """
    q, k, v = _maybe_contiguous(q), _maybe_contiguous(k), _maybe_contiguous(v)
    _check_qkv(q, k, v, "(batch, seqlen, nheads, headdim)", "(batch, seqlen_k, nheads_k, headdim)", 4)
    if k.shape[0] != q.shape[0]:
        raise V.FlashtileInputError(f"batch of q ({q.shape[0]}) and k/v ({k.shape[0]}) must match")
    spec = _spec(q, softmax_scale, causal, window_size, softcap, dropout_p,
                 deterministic=deterministic)
    slopes = V.alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    seed = dropout_seed(spec, q.device)
    out, lse = attention(q, k, v, spec, alibi_slopes=slopes, rng_seed=seed)
    if not return_attn_probs:
        return out
    lse = lse.contiguous()  # PyTorch's CPU kernel hands back a transposed view
    if spec.dropout_p == 0:
        return out, lse, _no_probs(q)
    with torch.no_grad():
        probs = sign_dropped(attention_probs(q, k, lse, spec, slopes), seed, spec.dropout_p)
    return out, lse, probs


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Attention over sequences of different lengths packed into one tensor.

    Arguments:
        q: ``(total_q, nheads, headdim)``: the queries of all sequences, one after another.
        k, v: ``(total_k, nheads_k, headdim)``; with ``block_table``, page pools
            ``(num_blocks, page_size, nheads_k, headdim)`` (see below).
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, starting at 0: sequence ``b`` owns
            rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.  No attention crosses sequences::

                cu_seqlens = [0, 2, 5]      keys  0 1 | 2 3 4
                                query 0           1 1 | 0 0 0
                                query 1           1 1 | 0 0 0
                                query 2           0 0 | 1 1 1
                                ...
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (ints).
        block_table: None, or int32 ``(batch, max_num_blocks)`` for paged keys/values (as in
            flash-attn 2.x): ``k`` and ``v`` are then ``(num_blocks, page_size, nheads_k,
            headdim)`` pools, ``page_size`` a positive multiple of 16, and sequence ``b`` still
            has ``len_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys, key ``j`` of it being
            ``k[block_table[b, j // page_size], j % page_size]``.  Pages may be in any order
            and shared between sequences; row ``b`` needs ``ceil(len_k / page_size)`` valid
            entries (the rest is never read), and ``cu_seqlens_k[-1]`` is not tied to
            ``k.shape[0]``::

                page_size = 16, cu_seqlens_k = [0, 40, 50], block_table = [[7, 2, 9], [4, 0, 0]]
                sequence 0: keys 0..15 in page 7, 16..31 in page 2, 32..39 in page 9[0:8]
                sequence 1: keys 0..9 in page 4[0:10]

            The Triton forward reads the pages inside the kernel (one table lookup per key
            row); the torch backend gathers them.  The backward (both backends) gathers the
            keys/values the call read into packed ``(total_k, nheads_k, headdim)`` tensors,
            runs the varlen backward and adds the gradients back into the pages: ``dk``/``dv``
            have the pools' shape, are 0 in slots no key maps to, and a page read by two
            sequences receives the sum of both gradients.  Results equal those of the same
            call on the gathered contiguous keys/values (bitwise, apart from the float32 sum
            of a shared page's gradients).
        Other arguments as in ``flash_attn_func``; causal and windows are bottom-right aligned
        per sequence, and every feature composes with ``block_table``.
        Dropout decides element ``(b, h, i, j)`` (``i``, ``j`` local to sequence ``b``) with
        the counter ``((b * nheads + h) * max_seqlen_q + i) * max_seqlen_k + j``, so the mask
        depends on the ``max_seqlen_*`` values passed (equal-length sequences with exact
        maxima give the dense call's mask) and is the same with or without ``block_table``.

    Returns:
        out ``(total_q, nheads, headdim)``; with ``return_attn_probs=True``
        ``(out, softmax_lse, S_dmask)`` with ``softmax_lse`` float32 ``(nheads, total_q)`` and
        ``S_dmask`` as in ``flash_attn_func`` (empty without dropout); with dropout float32
        ``(batch, nheads, max_seqlen_q, max_seqlen_k)``, sequence ``b`` in the top-left
        ``(len_q, len_k)`` corner of ``S_dmask[b]`` (zeros elsewhere).
    """
    paged = block_table is not None
    q, k, v = _maybe_contiguous(q), _maybe_contiguous(k), _maybe_contiguous(v)
    if paged:
        _check_qkv(q, k, v, "(total_q, nheads, headdim)",
                   "(num_blocks, page_size, nheads_k, headdim) (paged, with block_table)", 3,
                   ndim_kv=4)
    else:
        _check_qkv(q, k, v, "(total_q, nheads, headdim)", "(total_k, nheads_k, headdim)", 3)
    # static checks here; the values (cu_seqlens, max_seqlen, block_table entries) are checked
    # where the op runs, so they hold under torch.compile too (_validate.varlen_values)
    batch = V.cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, "max_seqlen_q", q.device)
    V.cu_seqlens("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, "max_seqlen_k", q.device)
    if paged:
        V.block_table(block_table, batch, k, q.device)
    spec = _spec(q, softmax_scale, causal, window_size, softcap, dropout_p,
                 deterministic=deterministic)
    slopes = V.alibi(alibi_slopes, batch, q.shape[1], q.device)
    seed = dropout_seed(spec, q.device)
    out, lse = attention(q, k, v, spec, alibi_slopes=slopes, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, rng_seed=seed, block_table=block_table)
    if not return_attn_probs:
        return out
    if spec.dropout_p == 0:
        return out, lse, _no_probs(q)
    with torch.no_grad():
        if paged:
            k = paged_kv.gather_varlen(k, paged_kv.varlen_slots(block_table, cu_seqlens_k,
                                                                int(k.shape[1])))
        probs = attention_probs_varlen(q, k, lse, spec, cu_seqlens_q, cu_seqlens_k,
                                       int(max_seqlen_q), int(max_seqlen_k), slopes)
        probs = sign_dropped(probs, seed, spec.dropout_p)
    return out, lse, probs


def _unpacked(name, packed, dim, shape):
    """The tensors packed along ``dim`` of ``packed``, after checking it has ``shape`` (a
    string such as ``"(batch, seqlen, 3, nheads, headdim)"``, the packed count at ``dim``)."""
    n_dims = len(shape.split(", "))
    V.tensor(name, packed, n_dims, shape)
    if packed.shape[dim] != int(shape.strip("()").split(", ")[dim]):
        raise V.FlashtileInputError(f"{name} must have shape {shape}, got "
                                    f"{tuple(packed.shape)}")
    return packed.unbind(dim=dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on ``qkv`` of shape ``(batch, seqlen, 3, nheads, headdim)``."""
    q, k, v = _unpacked("qkv", qkv, 2, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` with ``kv`` of shape ``(batch, seqlen_k, 2, nheads_k, headdim)``."""
    k, v = _unpacked("kv", kv, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_func`` on ``qkv`` of shape ``(total, 3, nheads, headdim)``: queries,
    keys and values of the same packed sequences (``cu_seqlens`` int32 ``(batch + 1,)``,
    ``max_seqlen`` an int), as flash-attn 2.x.  ``dqkv`` comes back in ``qkv``'s layout."""
    q, k, v = _unpacked("qkv", qkv, 1, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """``flash_attn_varlen_func`` with ``q`` ``(total_q, nheads, headdim)`` and ``kv`` of shape
    ``(total_k, 2, nheads_k, headdim)``, as flash-attn 2.x (GQA/MQA allowed)."""
    k, v = _unpacked("kv", kv, 1, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, *, scale=None, enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Arguments follow PyTorch (``scale`` and ``enable_gqa`` keyword-only): ``query
    (..., H, L, E)``, ``key``/``value (..., H_kv, S, E)``; 2-D ``(L, E)`` inputs work.  All
    dimensions before the last two broadcast as in PyTorch (a key/value batch of 1 serves
    every query batch; ``H_kv = 1`` serves every head); ``enable_gqa=True`` lets ``H`` be a
    multiple of ``H_kv`` (query head ``h`` uses key/value head ``h // (H // H_kv)``).
    Zero-size ``L``, ``S``, ``H``, ``E`` or batch return what PyTorch returns (empty, or zeros
    when ``S == 0``).  ``is_causal`` must be a bool and is *top-left* aligned (query ``i``
    sees keys ``j <= i``), as in PyTorch::

        L=2, S=5, is_causal=True
            1 0 0 0 0
            1 1 0 0 0

    ``attn_mask``: broadcastable to ``(..., H, L, S)``; either bool (True = attend) or a float
    additive mask of the query's dtype or float32, added to ``scale * q.k`` before the softmax
    (``-inf`` hides a key).  It is read tile by tile through its broadcast strides (a
    ``(1, H, 1, S)`` mask is never expanded in memory)::

        bool attn_mask (L=3, S=4)        float attn_mask
            1 1 0 1                         0    -1.5  -inf  0
            1 0 0 1                         0     0     0.7  -inf
            0 0 0 0   -> output row 0       ...

    A row whose mask hides every key outputs 0 with zero gradients, as PyTorch 2.13 does on
    every backend (and flash-attn).  When a float mask requires grad, its gradient is
    ``dS = P * (dP - rowsum(dO * O))``, the gradient with respect to the (natural-log) score,
    summed over the mask's broadcast dimensions.  A full ``(..., H, L, S)`` mask receives it
    directly; a broadcast mask costs a temporary float32 ``(B, H, L, S)`` buffer in the
    Triton backend (the torch backend reduces tile by tile).  ``attn_mask`` together with
    ``is_causal=True`` is rejected (PyTorch's documented semantics); put the causal mask into
    ``attn_mask`` instead.

    ``dropout_p`` in ``[0, 1)`` drops normalised probabilities (kept ones are scaled by
    ``1 / (1 - dropout_p)``), always applied like PyTorch's (pass 0.0 in eval); the keep mask
    is drawn as in ``flash_attn_func`` (``torch.manual_seed`` makes it repeatable).
    ``scale`` (a finite float, or a one-element tensor) defaults to ``1 / sqrt(E)``.  The
    value head dim ``Ev`` may differ from ``E`` (the output is then ``(..., H, L, Ev)``): the
    call runs at head dim ``max(E, Ev)`` with zeros padded in (:func:`pad_head_dims`, exact).
    Dtypes are float16, bfloat16, float32; float64 calls, and ``dropout_p = 1`` (an output of
    zeros), are PyTorch's own function's.
    ``torch.func`` transforms (``grad``, ``vjp``, ``vmap`` and their compositions) work; under
    ``vmap`` the op runs once per mapped element.  Nested tensors with the jagged layout
    (``torch.nested``, ``(B, H, j, E)`` with the ragged dimension third, as PyTorch takes them)
    run each sequence through the varlen kernels on the packed values and return a jagged
    ``(B, H, j, Ev)`` tensor sharing the query's ragged dimension (no ``attn_mask``).

    Returns ``(..., H, L, Ev)`` in the input dtype.  On the Triton backend it is a transposed
    view of a ``(..., L, H, E)`` buffer, like PyTorch's CUDA flash backend; on the torch
    backend, calls PyTorch's fused CPU kernel computes exactly (no float mask, dropout or empty
    dimension) run that kernel on the inputs as they are: the output and the gradients have
    the strides ``F.scaled_dot_product_attention`` gives them on the CPU.
    """
    names = ("query", "key", "value")
    for name, x in zip(names, (query, key, value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise V.FlashtileInputError(f"{name} must have shape (..., L|S, E) with at least 2 "
                             f"dimensions, got {tuple(x.shape)}")
    if type(is_causal) is not bool:  # noqa: E721  (PyTorch accepts exactly a bool)
        raise TypeError(f"is_causal must be bool, not {type(is_causal).__name__}")
    dtypes = (query.dtype, key.dtype, value.dtype)
    if torch.float64 in dtypes or (type(dropout_p) in (int, float) and dropout_p == 1):
        # Outside what the kernels compute (16/32-bit inputs, dropout below 1): PyTorch's own
        # function, with its semantics and its errors (on the CPU its fused kernel, which never
        # holds L x S scores, wherever that applies)
        if len(set(dtypes)) > 1:
            raise TypeError(f"query, key and value must share one dtype, got "
                            f"{', '.join(str(d).replace('torch.', '') for d in dtypes)}")
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    if type(enable_gqa) is not bool:  # noqa: E721
        raise TypeError(f"enable_gqa must be bool, not {type(enable_gqa).__name__}")
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and not _compiling():
        scale = float(scale)
    if query.is_nested or key.is_nested or value.is_nested:
        return _sdpa_jagged(query, key, value, attn_mask, dropout_p, is_causal, scale,
                            enable_gqa)
    ndim = max(query.dim(), key.dim(), value.dim())
    L, E, S, Ev = query.shape[-2], query.shape[-1], key.shape[-2], value.shape[-1]
    if key.shape[-1] != E:
        raise V.FlashtileInputError(f"query and key must share the head dim E, got {E} and "
                                    f"{key.shape[-1]}")
    if value.shape[-2] != S:
        raise V.FlashtileInputError(f"key and value must have the same number of keys S, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    q4, k4, v4 = query, key, value
    kshape = key.shape
    if ndim == query.dim() == key.dim() == value.dim() >= 3 and kshape[:-2] == value.shape[:-2] \
            and query.shape[:-3] == kshape[:-3]:  # the common case: nothing broadcasts
        lead, nheads_kv, expand = kshape[:-3], kshape[-3], False
    else:  # lift to (..., H, L|S, E) with one rank; missing leading dims broadcast as 1
        q4, k4, v4 = (x if x.dim() == max(ndim, 3) else
                      x.reshape((1,) * (max(ndim, 3) - x.dim()) + tuple(x.shape))
                      for x in (query, key, value))
        lead = _broadcast(q4.shape[:-3], k4.shape[:-3], v4.shape[:-3])
        heads_kv = _broadcast(k4.shape[-3:-2], v4.shape[-3:-2])
        if lead is None or heads_kv is None:
            raise V.FlashtileInputError(f"the batch dimensions of query {tuple(query.shape)}, key "
                             f"{tuple(key.shape)} and value {tuple(value.shape)} (all but "
                             "the last two) are not broadcastable")
        nheads_kv, expand = heads_kv[0], True
    nheads_q = q4.shape[-3]
    if enable_gqa and nheads_kv != 0 and nheads_q % nheads_kv == 0:
        nheads = nheads_q
    elif nheads_q == nheads_kv or nheads_kv == 1 or nheads_q == 1:
        nheads = max(nheads_q, nheads_kv) if min(nheads_q, nheads_kv) else 0
    else:
        hint = ("; pass enable_gqa=True for grouped-query attention"
                if not enable_gqa and nheads_kv and nheads_q % nheads_kv == 0 else "")
        raise V.FlashtileInputError(f"query has {nheads_q} heads but key/value have {nheads_kv}: the "
                         f"number of query heads must be a multiple of the key/value heads "
                         f"with enable_gqa=True, or one of them must be 1{hint}")
    out_shape = (*lead, nheads, L, Ev) if ndim >= 3 else (L, Ev)
    target = (*lead, nheads, L, S)
    if attn_mask is not None:
        V.attn_mask(attn_mask, query, target)
        if is_causal:
            raise V.FlashtileInputError("attn_mask cannot be combined with is_causal=True (PyTorch's "
                             "semantics); fold the causal mask into attn_mask")
    spec = _spec(max(E, 1), scale, is_causal, (-1, -1), 0.0, dropout_p,
                 bottom_right=False, scale_name="scale")
    if min(L, S, E, Ev, nheads, *lead) == 0:
        # Nothing to tile: PyTorch's own function computes exactly what it returns here
        # (empty outputs, or zeros when S == 0), with gradients.
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=spec.dropout_p,
            is_causal=is_causal, scale=None if scale is None else spec.softmax_scale,
            enable_gqa=enable_gqa)
    if Ev != E:  # one head dim for the kernels (the output cropped below)
        q4, k4, v4 = pad_head_dims(q4, k4, v4)
    # key/value heads: one per query head, a group per key/value head (GQA), or one (MQA)
    if expand or nheads_q != nheads:
        q4, k4, v4 = (x if x.shape[:-2] == want else x.expand(*want, *x.shape[-2:])
                      for x, want in ((q4, (*lead, nheads)), (k4, (*lead, nheads_kv)),
                                      (v4, (*lead, nheads_kv))))
    bias = _mask_4d(attn_mask, target) if attn_mask is not None else None
    # The torch backend takes SDPA's (B, H, L, E) layout as it is (PyTorch's CPU kernel reads
    # it directly); the others get flash-layout (B, L, H, E) views.
    heads_first = backends.select(q4.device) == "torch"

    def to_4d(x):  # (..., H, L, E) -> (B, H, L, E) or (B, L, H, E) views; copies only a
        # strided last dim
        if x.dim() != 4:
            x = x.reshape(-1, *x.shape[-3:])
        return _maybe_contiguous(x if heads_first else x.transpose(1, 2))

    q, k, v = to_4d(q4), to_4d(k4), to_4d(v4)
    _check_qkv(q, k, v, "(..., heads, seq, headdim)", "(..., heads_kv, seq, headdim)", 4,
               names=names, heads_dim=1 if heads_first else 2)
    out, _ = attention(q, k, v, spec, attn_bias=bias, rng_seed=dropout_seed(spec, q.device),
                       heads_first=heads_first)
    if not heads_first:
        out = out.transpose(1, 2)
    if Ev != E:
        out = out[..., :Ev]
    return out if out.shape == out_shape else out.reshape(out_shape)


# int32 copies of nested tensors' offsets, per offsets tensor: the varlen path's tables are
# cached by the identity of the cumulative-length tensors it is given, so each nested tensor
# keeps handing it the same one
_offsets32 = TensorCache()


def _max_seqlen(x, values):
    """The longest sequence of the jagged ``x``: PyTorch's cached value, or read from its
    offsets (one host read, then cached) - except while ``torch.compile`` traces, where a
    read would be a data-dependent value: the packed total bounds it (the varlen path takes
    any bound at least the longest; only the grid grows)."""
    cached = x._maybe_max_seqlen
    if cached is not None:
        return cached
    return values.shape[0] if _compiling() else x._get_max_seqlen()


def _sdpa_jagged(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """:func:`scaled_dot_product_attention` of nested tensors with the jagged layout
    (``torch.nested``, ``layout=torch.jagged``), ``(B, H, j, E)`` with the ragged dimension
    ``j`` third, as PyTorch takes them: each batch entry a sequence with its own length, run
    through the varlen path on the packed values (no padding), causal top-left per sequence
    as PyTorch's.  Returns a jagged ``(B, H, j, Ev)`` tensor with the query's ragged
    structure."""
    names = ("query", "key", "value")
    for name, x in zip(names, (query, key, value)):
        if not (x.is_nested and x.layout == torch.jagged and x.dim() == 4
                and getattr(x, "_ragged_idx", None) == 2):
            raise V.FlashtileInputError(
                f"{name}: nested tensors must all have the jagged layout (layout=torch.jagged) "
                f"and shape (B, H, j, E) with the ragged dimension third, got "
                f"{'a nested' if x.is_nested else 'a dense'} tensor of shape {tuple(x.shape)}")
    if attn_mask is not None:
        raise V.FlashtileInputError("attn_mask is not supported with nested (jagged) tensors")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))     # (B, j, H, E), j ragged
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or (
            k.shape[1] != v.shape[1] and not torch.equal(k.offsets(), v.offsets())):
        raise V.FlashtileInputError(
            f"key and value must have the same sequences, and as many as query: got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    E, Ev, heads, heads_kv = q.shape[-1], v.shape[-1], q.shape[2], k.shape[2]
    if k.shape[-1] != E:
        raise V.FlashtileInputError(f"query and key must share the head dim E, got {E} and "
                                    f"{k.shape[-1]}")
    if heads != heads_kv and not (enable_gqa and heads_kv and heads % heads_kv == 0):
        raise V.FlashtileInputError(
            f"query has {heads} heads but key/value have {heads_kv}: with nested tensors the "
            "query heads must equal the key/value heads, or be a multiple of them with "
            "enable_gqa=True")
    # (causal: top-left per sequence; where query and key share their ragged dimension, every
    # sequence has as many keys as queries and bottom-right, the Hopper kernels' case, is the
    # same mask; nested ints compare equal only to themselves, and under torch.compile the
    # traced one is a new object each time it is read, so ``==`` and not ``is``)
    spec = _spec(max(E, 1), scale, is_causal, (-1, -1), 0.0, dropout_p,
                 bottom_right=k.shape[1] == q.shape[1], scale_name="scale")
    qv, kv, vv = q.values(), k.values(), v.values()                # (total, H, E)
    if Ev != E:
        qv, kv, vv = pad_head_dims(qv, kv, vv)
    qv, kv, vv = _maybe_contiguous(qv), _maybe_contiguous(kv), _maybe_contiguous(vv)
    _check_qkv(qv, kv, vv, "(B, H, j, E) jagged", "(B, H_kv, j, E) jagged", 3, names=names)
    cu_q, cu_k = q.offsets(), k.offsets()
    cu_q32, cu_k32 = (_offsets32.get("int32", (cu,), lambda c=cu: c.to(torch.int32))
                      for cu in (cu_q, cu_k))
    out, _ = attention(qv, kv, vv, spec, cu_seqlens_q=cu_q32,
                       cu_seqlens_k=cu_k32, max_seqlen_q=_max_seqlen(q, qv),
                       max_seqlen_k=_max_seqlen(k, kv),
                       rng_seed=dropout_seed(spec, qv.device))
    if out.shape[-1] != Ev:
        out = out[..., :Ev]
    # (the query's offsets: the output shares its ragged dimension)
    return torch.nested.nested_tensor_from_jagged(out, offsets=cu_q).transpose(1, 2)


def _broadcast(*shapes):
    """PyTorch's broadcast of equal-length shapes (tuples), or None when they do not
    broadcast (a plain loop: ``torch.broadcast_shapes`` costs ~100 us a call)."""
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes[1:]):
        return first
    out = []
    for sizes in zip(*shapes):
        big = {n for n in sizes if n != 1}
        if len(big) > 1:
            return None
        out.append(big.pop() if big else 1)
    return tuple(out)


def _mask_4d(mask: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor:
    """``attn_mask`` as ``(B|1, H|1, L|1, S|1)`` over the flattened batch ``B``, keeping size-1
    (broadcast) dimensions so the kernels read it with stride 0.  Views where possible;
    autograd carries the gradient back to the caller's shape."""
    nlead = len(target) - 3
    m = mask.reshape((1,) * (len(target) - mask.dim()) + tuple(mask.shape))
    lead_m = m.shape[:nlead]
    if all(n == 1 for n in lead_m):
        return m.reshape(1, *m.shape[nlead:])
    return m.expand(*target[:nlead], *m.shape[nlead:]).reshape(-1, *m.shape[nlead:])
