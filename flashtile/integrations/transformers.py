"""flashtile as an attention implementation of HuggingFace transformers (5.x).

Usage::

    from flashtile.integrations.transformers import register

    name = register()                                  # "tile_attention"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    # or AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    # or model.set_attn_implementation(name)

``register`` adds one attention function to ``transformers.AttentionInterface`` and its mask
function to ``transformers.masking_utils.AttentionMaskInterface`` under the same name.  Both
are needed: a model asks the mask interface for the mask of the name it runs with, and a name
without a mask function gets no padding mask at all.  The name must not contain "flash":
transformers takes every such name for a flash-attention kernel to load from the hub.

What the attention function does (the module's own parameters are forwarded, as transformers'
flash-attention path does):

- ``scaling`` -> ``softmax_scale``; ``softcap`` (Gemma 2) -> ``softcap``; ``sliding_window``
  (Mistral, Gemma) -> ``window_size=(sliding_window - 1, 0)``; ``dropout`` (the module passes 0
  in eval); grouped-query attention runs on the key/value heads as they are (no repeat).
- Causal attention is bottom-right aligned (flash-attn's convention, which transformers' flash
  path relies on): with a KV cache the new queries are the last positions.
- Padding-free batches (several sequences packed in one row, recognised from ``position_ids``
  by transformers) run through :func:`flashtile.flash_attn_varlen_func`, as do batches that
  carry flash-attn's ``cu_seq_lens_q/k`` and ``max_length_q/k`` arguments.
- Padded batches: by default (``padded="mask"``) the padding becomes a key mask of shape
  ``(batch, 1, 1, seqlen_k)`` read by the kernels through broadcast strides together with the
  causal rule (no ``(L, S)`` mask is built); ``padded="varlen"`` removes the padding and runs
  the varlen kernel instead (the way transformers' flash path does it; it reads the lengths on
  the host, so compiled graphs always use the mask).
- Any other mask (static caches, image-token overlays, chunked attention, ...) is built by
  transformers' SDPA mask function and applied as a boolean ``attn_mask``.
- Under ``torch.autocast`` the inputs are cast to the autocast dtype first (as with SDPA).
- A value head dim other than the query's (multi-head latent attention: DeepSeek-V2/V3) runs
  at the larger of the two with zeros padded in, the output cropped (exact; transformers'
  flash path pads the value the same way).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .. import _validate as V
from .._tensor_cache import TensorCache
from ..autograd import attention, dropout_seed
from ..block_sparse import block_sparse_attn_func, global_block_mask, local_block_mask
from ..interface import flash_attn_func, flash_attn_varlen_func, pad_head_dims
from ..padding import unpad_index

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import (AttentionMaskInterface, bidirectional_mask_function,
                                            causal_mask_function, sdpa_mask)
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("flashtile.integrations.transformers needs the `transformers` package "
                      "(pip install transformers)") from e

__all__ = ["register", "register_block_sparse", "attention_forward", "mask_function",
           "DEFAULT_NAME", "BLOCK_SPARSE_NAME"]

DEFAULT_NAME = "tile_attention"
BLOCK_SPARSE_NAME = "tile_block_sparse"
_PADDED = ("mask", "varlen")


# --------------------------------------------------------------------------- mask function

_MASKING = "transformers.masking_utils"


def _made_by(fn, factory: str) -> bool:
    """True when ``fn`` is the inner function of ``transformers.masking_utils.<factory>``."""
    return (getattr(fn, "__module__", None) == _MASKING
            and getattr(fn, "__qualname__", "").startswith(factory + ".<locals>."))


def _captured(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _pattern(fn):
    """What a transformers mask function describes, when flashtile can apply it from the
    attention call's own arguments: ``"causal"`` (optionally with the module's sliding window),
    ``"bidirectional"``, ``("packed", segment_ids)`` (causal within packed sequences) or None
    (anything else: the mask is then built in full)."""
    if fn is causal_mask_function:
        return "causal"
    if fn is bidirectional_mask_function:
        return "bidirectional"
    if _made_by(fn, "and_masks"):
        parts = tuple(_captured(fn).get("mask_functions", ()))
        if (len(parts) == 2 and parts[1] is causal_mask_function
                and _made_by(parts[0], "sliding_window_overlay")):
            return "causal"  # the window comes with the call (sliding_window=...)
        if len(parts) == 2:
            # causal within packed sequences: the sequence-id mask and the causal rule on
            # positions remapped per sequence, in either order (transformers 5.24 puts the
            # remapped rule first, earlier 5.x releases the sequence ids)
            packed = [f for f in parts if _made_by(f, "packed_sequence_mask_function")]
            remap = [f for f in parts if _made_by(f, "remap_positions_for_packed_sequence")]
            if (packed and remap
                    and _pattern(_captured(remap[0]).get("mask_function")) == "causal"):
                return ("packed", _captured(packed[0])["packed_sequence_mask"])
    return None


def _is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def mask_function(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                  mask_function=causal_mask_function, attention_mask=None, use_vmap=False,
                  **kwargs):
    """The mask function registered with ``AttentionMaskInterface`` (same arguments as
    transformers' ``sdpa_mask``).  Returns what :func:`attention_forward` expects:

    - ``None``: plain causal (or bidirectional) attention over all keys; the sliding window,
      if any, comes from the attention call's ``sliding_window``;
    - bool ``(batch, n)``: key padding (True = token) of positions ``0 .. n - 1``, the queries
      being the last ``q_length`` of them (left padding, or right padding without cache; the
      convention of transformers' flash path); a sliding-window cache holds only the last
      keys, which see the last entries of the mask;
    - int64 ``(batch, seqlen)``: sequence ids of a padding-free (packed) batch;
    - bool ``(batch, 1, q_length, kv_length)``: any other pattern, built by ``sdpa_mask``.
    """
    if torch.compiler.is_compiling():
        # Introspecting closures does not trace; plain causal / bidirectional are recognised.
        pattern = ("causal" if mask_function is causal_mask_function else
                   "bidirectional" if mask_function is bidirectional_mask_function else None)
    else:
        pattern = _pattern(mask_function)
    aligned = _is_int(q_offset) and _is_int(kv_offset)  # static caches pass a tensor offset
    if isinstance(pattern, tuple):
        if aligned and attention_mask is None and q_offset == 0 and kv_offset == 0 \
                and q_length == kv_length:
            return pattern[1]
        pattern = None
    if pattern is not None and not use_vmap and aligned:
        end = kv_offset + kv_length
        if attention_mask is None:
            if q_offset + q_length == end:
                return None
        elif attention_mask.dim() == 2 and attention_mask.shape[-1] == end \
                and q_offset + q_length == end:
            # Returned whole (not cut to the cached window): generate() may feed a mask
            # made here back into mask creation, which must then give the same mask.
            padding = attention_mask.bool()
            if torch.compiler.is_compiling() or not bool(padding[:, -kv_length:].all()):
                return padding
            return None
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask,
                     use_vmap=use_vmap, **kwargs)


# ---------------------------------------------------------------------- attention function

def _masked(q, k, v, bias, dropout, scaling, causal, window, softcap):
    """Dense attention with a bool/float ``bias (B|1, 1|H, Sq|1, Sk)`` on top of the causal /
    window rule (bottom-right) and softcap; ``q (B, Sq, H, D)``, ``k``/``v (B, Sk, Hk, D)``."""
    V.check_qkv(q, k, v, "(batch, seqlen, nheads, headdim)",
                "(batch, seqlen_k, nheads_k, headdim)", 4)
    V.attn_mask(bias, q, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    spec = V.spec(q, scaling, causal, window, softcap, dropout)
    out, _ = attention(q, k, v, spec, attn_bias=bias, rng_seed=dropout_seed(spec, q.device))
    return out


# What the varlen paths derive from a mask or a lengths tensor, computed once per tensor: every
# layer of a step passes the same one, and each derivation reads it on the host
_per_mask = TensorCache(size=16)


def _varlen_packed(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    cu_q, cu_k = (cu if cu.dtype == torch.int32 else
                  _per_mask.get_view("int32", cu, lambda c=cu: c.to(torch.int32))
                  for cu in (cu_q, cu_k))
    out = flash_attn_varlen_func(*flat, cu_q, cu_k, int(max_q), int(max_k), **kw)
    return out.view(q.shape)


def _segments_to_cu(segment_ids: torch.Tensor):
    """Packed rows: a sequence starts where the id changes and at the start of every row."""
    def make():
        batch, seqlen = segment_ids.shape
        start = torch.ones_like(segment_ids, dtype=torch.bool)
        start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        idx = start.reshape(-1).nonzero().flatten().to(torch.int32)
        cu = torch.cat([idx, idx.new_tensor([batch * seqlen])])
        return cu, int((cu[1:] - cu[:-1]).max())
    return _per_mask.get_view("segments", segment_ids, make)


def _unpad(padding: torch.Tensor):
    """:func:`flashtile.padding.unpad_index` of a ``(batch, n)`` bool padding mask, once per
    mask."""
    return _per_mask.get_view("unpad", padding, lambda: unpad_index(padding))


def _unpadded(q, k, v, padding, **kw):
    """transformers' flash-path unpadding: keys/values of the valid positions, queries of the
    last ``Sq`` positions (one per row when ``Sq == 1``)."""
    batch, sq = q.shape[:2]
    idx_k, cu_k, max_k = _unpad(padding)
    k_u, v_u = (x.reshape(-1, *x.shape[2:]).index_select(0, idx_k) for x in (k, v))
    if sq == padding.shape[1]:
        idx_q, cu_q, max_q = idx_k, cu_k, max_k
    elif sq == 1:
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        idx_q, max_q = cu_q[:-1].long(), 1
    else:
        idx_q, cu_q, max_q = _unpad(padding[:, -sq:])
    q_u = q.reshape(-1, *q.shape[2:]).index_select(0, idx_q)
    out = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, **kw)
    # (the indices are the mask's own: pad_input's range check, a host read, is not needed)
    full = out.new_zeros((batch * sq, *out.shape[1:])).index_copy(0, idx_q, out)
    return full.view(batch, sq, *out.shape[1:])


def _inputs(query, key, value):
    """(B, H, L, D) views -> flash layout (B, L, H, D), in the autocast dtype when active."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        q, k, v = (x if x.dtype == dt else x.to(dt) for x in (q, k, v))
    elif not (q.dtype == k.dtype == v.dtype):
        # e.g. rotary embeddings computed in float32 on half-precision projections
        q, k = q.to(v.dtype), k.to(v.dtype)
    return q, k, v


def _common(module, kwargs):
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("flashtile does not implement attention sinks (s_aux)")
    if kwargs.get("cache") is not None:
        raise NotImplementedError("flashtile's transformers integration does not run paged "
                                  "caches (continuous batching); use generate()")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("flashtile's transformers integration does not take a "
                                  "position_bias; use attn_implementation='sdpa' for this model")


def _make_attention(padded: str) -> Callable:
    def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          is_causal=None, sliding_window=None, softcap=None, cu_seq_lens_q=None,
                          cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
        _common(module, kwargs)
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        q, k, v = _inputs(query, key, value)
        d_v = v.shape[-1]
        if d_v != q.shape[-1]:  # (the scale stays the query head dim's)
            scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
            q, k, v = pad_head_dims(q, k, v)
        window = (-1, -1)
        if sliding_window is not None:
            window = (int(sliding_window) - 1, int(sliding_window) - 1)  # causal sets right = 0
        kw = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal,
                  window_size=window, softcap=float(softcap) if softcap else 0.0)
        with torch.autocast(q.device.type, enabled=False):
            if attention_mask is None:
                if all(x is not None for x in (cu_seq_lens_q, cu_seq_lens_k, max_length_q,
                                               max_length_k)):
                    out = _varlen_packed(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q,
                                         max_length_k, **kw)
                else:
                    out = flash_attn_func(q, k, v, **kw)
            elif attention_mask.dim() == 4:
                # the mask holds the whole pattern (causal, window, padding, overlays)
                out = _masked(q, k, v, attention_mask, kw["dropout_p"], scaling, False,
                              (-1, -1), kw["softcap"])
            elif attention_mask.dtype == torch.bool:
                n, sk = attention_mask.shape[1], k.shape[1]
                if n > sk:  # sliding-window caches hold the last sk positions
                    attention_mask = attention_mask[:, n - sk:]
                elif n < sk:  # static caches: unused slots at the end
                    k, v = k[:, :n], v[:, :n]
                if padded == "varlen" and not torch.compiler.is_compiling():
                    out = _unpadded(q, k, v, attention_mask, **kw)
                else:
                    out = _masked(q, k, v, attention_mask[:, None, None, :], kw["dropout_p"],
                                  scaling, causal, window, kw["softcap"])
            else:  # sequence ids of a packed batch
                cu, longest = _segments_to_cu(attention_mask)
                out = _varlen_packed(q, k, v, cu, cu, longest, longest, **kw)
        return (out if out.shape[-1] == d_v else out[..., :d_v]), None

    attention_forward.__qualname__ = attention_forward.__name__ = f"attention_forward_{padded}"
    return attention_forward


attention_forward = _make_attention("mask")


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    low = name.lower()
    for bad, why in (("flash", "transformers loads every name containing 'flash' as a flash "
                      "kernel from the hub"),
                     ("sdpa", "transformers runs its SDPA checks on names containing 'sdpa'"),
                     ("flex_attention", "transformers runs its flex-attention checks on it")):
        if bad in low:
            raise ValueError(f"name {name!r} must not contain {bad!r}: {why}")
    if "/" in name or ":" in name or "|" in name or name == "eager":
        raise ValueError(f"name {name!r} must not contain '/', ':' or '|' (hub kernel and "
                         "prefix syntax) nor be 'eager'")
    return name


def register(name: str = DEFAULT_NAME, *, padded: str = "mask") -> str:
    """Register flashtile with transformers; returns the name to pass as
    ``attn_implementation=`` (to ``from_pretrained``, ``from_config``,
    ``set_attn_implementation``).

    Arguments:
        name: the implementation's name (default ``"tile_attention"``); it must not contain
            "flash" (transformers would try to load a flash kernel of that name from the hub),
            "sdpa" or "flex_attention".
        padded: how padded batches run: ``"mask"`` (a key-padding mask read by the dense
            kernel, the default) or ``"varlen"`` (padding removed, varlen kernel; eager only).

    Calling it again with the same arguments is harmless; a different ``padded`` re-registers
    the name.
    """
    _check_name(name)
    if padded not in _PADDED:
        raise ValueError(f"padded must be one of {_PADDED}, got {padded!r}")
    AttentionInterface.register(name, _make_attention(padded))
    AttentionMaskInterface.register(name, mask_function)
    return name


# --------------------------------------------------------------------------- block-sparse

def register_block_sparse(name: str = BLOCK_SPARSE_NAME, *, block_size: int = 128,
                          window_blocks: int = 2, global_blocks: int = 1) -> str:
    """Register a block-sparse causal attention (``flashtile.block_sparse_attn_func``) with a
    local + global block pattern: block row ``r`` sees block columns ``r - window_blocks .. r``
    and the first ``global_blocks`` columns (the first ``global_blocks`` rows see all earlier
    blocks), causal inside the blocks.  This changes the model (it is not exact attention);
    it is for training long contexts.  Padded batches are refused; returns the name.
    """
    _check_name(name)
    for arg, val in (("block_size", block_size), ("window_blocks", window_blocks),
                     ("global_blocks", global_blocks)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ValueError(f"{arg} must be a non-negative int, got {val!r}")
    V.block_size(block_size)

    def block_sparse_forward(module, query, key, value, attention_mask, dropout=0.0,
                             scaling=None, is_causal=None, sliding_window=None, softcap=None,
                             **kwargs):
        _common(module, kwargs)
        if attention_mask is not None or kwargs.get("cu_seq_lens_q") is not None:
            raise NotImplementedError(f"{name}: padded or packed batches are not supported by "
                                      "the block-sparse attention; pass unpadded batches")
        if softcap or sliding_window is not None:
            raise NotImplementedError(f"{name}: softcap and sliding windows are not supported")
        q, k, v = _inputs(query, key, value)
        sq, sk = q.shape[1], k.shape[1]
        bs = (block_size, block_size)
        blocks = (local_block_mask(sq, sk, bs, window_blocks, causal=True, device=q.device)
                  | global_block_mask(sq, sk, bs, global_blocks, device=q.device))
        with torch.autocast(q.device.type, enabled=False):
            out = block_sparse_attn_func(q, k, v, blocks, bs, dropout_p=float(dropout),
                                         softmax_scale=scaling, causal=True)
        return out, None

    AttentionInterface.register(name, block_sparse_forward)
    AttentionMaskInterface.register(name, mask_function)
    return name


def block_sparse_density(seqlen: int, block_size: int = 128, window_blocks: int = 2,
                         global_blocks: int = 1) -> float:
    """Fraction of the causal ``(seqlen, seqlen)`` block grid that ``register_block_sparse``'s
    pattern computes (1.0 = dense causal)."""
    bs = (block_size, block_size)
    blocks = (local_block_mask(seqlen, seqlen, bs, window_blocks, causal=True)
              | global_block_mask(seqlen, seqlen, bs, global_blocks)).tril()
    n = math.ceil(seqlen / block_size)
    return float(blocks.sum()) / (n * (n + 1) / 2)
