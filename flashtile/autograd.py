"""The one differentiable attention op.

``FlashAttnFunction`` is the autograd function: its forward saves ``(q, k, v, out, lse)`` and
its backward recomputes the probabilities from the saved log-sum-exp (no N x N tensor is ever
saved).  For ``torch.compile`` the same two halves are registered as the ``torch.library``
custom ops ``flashtile::attn_fwd`` / ``flashtile::attn_bwd`` with fake (meta) implementations,
so ``torch.compile(fullgraph=True)`` traces through them without graph breaks.  Eager calls skip
the custom-op dispatcher (tens of microseconds a call, which shows at short sequences); compiled
graphs call the ops.  Both run ``_forward`` / ``_backward_impl`` below, which pick a backend
(``flashtile.backends``) at run time.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backends
from .backends.spec import AttnSpec


def _spec(softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p):
    return AttnSpec(float(softmax_scale), int(window_left), int(window_right), bool(bottom_right),
                    float(softcap), float(dropout_p))


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def _varlen_kwargs(alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return dict(alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p):
    spec = _spec(softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p)
    impl = backends.get(backends.select(q.device))
    return impl.forward(q, k, v, spec, **_varlen_kwargs(alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                                        max_seqlen_q, max_seqlen_k))


def _backward_impl(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, softmax_scale, window_left, window_right, bottom_right, softcap,
                   dropout_p):
    spec = _spec(softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p)
    impl = backends.get(backends.select(q.device))
    return impl.backward(do, q, k, v, out, lse, spec,
                         **_varlen_kwargs(alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k))


@torch.library.custom_op("flashtile::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
             cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
             max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
             bottom_right: bool, softcap: float, dropout_p: float) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p)


@attn_fwd.register_fake
def _(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q, max_seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=())
def attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             alibi_slopes: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
             cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
             softmax_scale: float, window_left: int, window_right: int, bottom_right: bool,
             softcap: float, dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                          bottom_right, softcap, dropout_p)


@attn_bwd.register_fake
def _(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_PARAMS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "window_left", "window_right",
           "bottom_right", "softcap", "dropout_p")


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *params) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
    ctx.params = params
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, bwd):
    # The log-sum-exp is an auxiliary output (as in flash-attn): its gradient is not propagated.
    q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                     *ctx.params)
    return (dq, dk, dv) + (None,) * (3 + len(_PARAMS))


attn_fwd.register_autograd(lambda ctx, dout, dlse: _grads(ctx, dout, attn_bwd),
                           setup_context=_setup_context)


class FlashAttnFunction(torch.autograd.Function):
    """Eager autograd function: the same forward/backward as the custom ops, minus the
    dispatcher."""

    @staticmethod
    def forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *params):
        return _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *params)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        return _grads(ctx, dout, _backward_impl)


def attention(q, k, v, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    """Differentiable ``(out, lse)`` for validated inputs (layouts of ``backends.spec``)."""
    args = (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
            int(max_seqlen_k), spec.softmax_scale, spec.window_left, spec.window_right,
            spec.bottom_right, spec.softcap, spec.dropout_p)
    if torch.compiler.is_compiling():
        return attn_fwd(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FlashAttnFunction.apply(*args)
    return _forward(*args)
