"""The one differentiable attention op.

``FlashAttnFunction`` is the autograd function: its forward saves ``(q, k, v, out, lse)`` and
its backward recomputes the probabilities from the saved log-sum-exp (no N x N tensor is ever
saved).  For ``torch.compile`` the same two halves are registered as the ``torch.library``
custom ops ``flashtile::attn_fwd`` / ``flashtile::attn_bwd`` with fake (meta) implementations,
so ``torch.compile(fullgraph=True)`` traces through them without graph breaks.  Eager calls skip
the custom-op dispatcher (tens of microseconds a call, which shows at short sequences); compiled
graphs call the ops.  Both run ``_forward`` / ``_backward_impl`` below, which pick a backend
(``flashtile.backends``) at run time.  An eager dense call with no optional input also keeps the
backend and spec its forward used (``_lane``): its backward, which autograd runs on a worker
thread for CUDA tensors, calls that backend directly.

Optional inputs: ``attn_bias`` (a bool mask or an additive float bias of shape
``(B|1, H|1, Sq|1, Sk|1)``; its gradient ``dS`` is returned when it requires grad),
``rng_seed`` (int64 ``(1,)``, required when ``dropout_p > 0``; saved with the LSE so the
backward regenerates the same keep mask), ``block_mask`` (bool ``(B|1, H|1, R, C)`` over
blocks of ``block_m x block_n``) and ``block_table`` (varlen only: int32 ``(B, max_num_blocks)``,
``k``/``v`` are then page pools ``(num_blocks, page_size, Hk, D)``).  With a block table the
backends' forward reads the pages (the Triton kernel in place); the backward gathers the keys
and values the call used into packed ``(total_k, Hk, D)`` tensors, runs the ordinary varlen
backward on them and adds dK/dV back into the paged layout (``flashtile.paged_kv``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from . import backends, paged_kv
from . import _validate as V
from .backends.spec import AttnSpec, spec_of
from .rng import draw_seed


def _spec(softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p,
          deterministic=False):
    return spec_of(
        (softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p,
         deterministic),
        lambda: AttnSpec(float(softmax_scale), int(window_left), int(window_right),
                         bool(bottom_right), float(softcap), float(dropout_p),
                         deterministic=bool(deterministic)))


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int,
               heads_first: bool = False):
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    if heads_first:
        return (q.shape[0], q.shape[1], q.shape[2])
    return (q.shape[0], q.shape[2], q.shape[1])


def _as_promised(x: Tensor, like: Optional[Tensor] = None) -> Tensor:
    """``x`` with the strides the ops' fake implementations promise (the compiled graph reads
    the result with those): contiguous, or with ``like`` those of ``torch.empty_like(like)``.
    A copy only where the backend's layout differs (PyTorch's CPU kernel returns a transposed
    ``lse`` and flash-layout gradients); eager calls skip this."""
    if like is None or like.is_contiguous():
        return x.contiguous()
    want = torch.empty_like(like, device="meta").stride()
    if all(a == b for n, a, b in zip(x.shape, x.stride(), want) if n != 1):
        return x
    return torch.empty_like(like).copy_(x)


def _kwargs(alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_bias,
            rng_seed, block_mask, block_m, block_n, block_table=None):
    kw = dict(alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    # Only pass the optional features that are used, so backends without them keep working.
    if attn_bias is not None:
        kw["attn_bias"] = attn_bias
    if rng_seed is not None:
        kw["rng_seed"] = rng_seed
    if block_mask is not None:
        kw["block_mask"] = block_mask
        kw["block_size"] = (block_m, block_n)
    if block_table is not None:
        kw["block_table"] = block_table
    return kw


def _no_autocast(device: torch.device):
    """The backends compute in their inputs' dtype: inside the op, autocast (which would turn
    the engines' float32 tile matmuls into half-precision ones) is off.  The cast to the
    autocast dtype happens once, in :func:`attention`."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _native_heads_first(name: str) -> bool:
    """Whether backend ``name`` takes dense ``(B, H, S, D)`` tensors itself (the torch backend:
    PyTorch's fused CPU kernel reads that layout); the others get flash-layout views."""
    return name == "torch"


def _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p,
             attn_bias, rng_seed, block_mask, block_m, block_n, block_table=None,
             heads_first=False, deterministic=False, backend=None):
    # ``deterministic`` matters to the backward only (the forward never uses atomics);
    # ``backend``: the backend's name when the caller has chosen it (else chosen here)
    if cu_seqlens_q is not None:
        # the value checks run here, inside the op, so they hold eager and compiled alike
        if V.value_checks_enabled(q.device):
            V.varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k, max_seqlen_q,
                            max_seqlen_k, block_table)
        else:  # CUDA-graph capture: no host read; clamped indices keep the kernels in bounds
            cu_seqlens_q, cu_seqlens_k, block_table = V.varlen_guard(
                cu_seqlens_q, cu_seqlens_k, q.shape[0], k, max_seqlen_q, max_seqlen_k,
                block_table)
            out, lse = _forward_body(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, softmax_scale, window_left,
                                     window_right, bottom_right, softcap, dropout_p, attn_bias,
                                     rng_seed, block_mask, block_m, block_n, block_table,
                                     heads_first, backend)
            # tokens the clamped sequences leave out: output 0, lse -inf (a query with no key)
            return (V.zero_uncovered(out, cu_seqlens_q),
                    V.zero_uncovered(lse, cu_seqlens_q, dim=lse.dim() - 1, fill=float("-inf")))
    return _forward_body(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, softmax_scale, window_left, window_right, bottom_right,
                         softcap, dropout_p, attn_bias, rng_seed, block_mask, block_m, block_n,
                         block_table, heads_first, backend)


def _forward_body(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p,
                  attn_bias, rng_seed, block_mask, block_m, block_n, block_table, heads_first,
                  backend=None):
    spec = _spec(softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p)
    name = backend or backends.select(q.device)
    impl = backends.get(name)
    kw = _kwargs(alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_bias,
                 rng_seed, block_mask, block_m, block_n, block_table)
    with _no_autocast(q.device):
        if not heads_first:
            return impl.forward(q, k, v, spec, **kw)
        if _native_heads_first(name):
            return impl.forward(q, k, v, spec, heads_first=True, **kw)
        out, lse = impl.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec,
                                **kw)
        return out.transpose(1, 2), lse


def _backward_impl(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, softmax_scale, window_left, window_right, bottom_right, softcap,
                   dropout_p, attn_bias, rng_seed, block_mask, block_m, block_n, bias_grad,
                   block_table=None, heads_first=False, deterministic=False):
    """``(dq, dk, dv, dbias)``; ``dbias`` is an empty ``(0,)`` tensor unless ``bias_grad``.

    Paged ``k``/``v`` (``block_table``): the backward runs on the packed keys/values the call
    read, and dK/dV come back in the paged layout (zero in slots no key maps to, summed where
    sequences share a page)."""
    dq, dk, dv, dbias = _backward_eager(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q,
                                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                        window_left, window_right, bottom_right, softcap,
                                        dropout_p, attn_bias, rng_seed, block_mask, block_m,
                                        block_n, bias_grad, block_table, heads_first,
                                        deterministic)
    return dq, dk, dv, q.new_empty((0,)) if dbias is None else dbias


def _backward_eager(*args):
    """``_backward_impl`` with ``dbias`` None unless ``bias_grad`` (no placeholder tensor)."""
    with _no_autocast(args[1].device):
        return _backward_body(*args)


def _backward_body(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, softmax_scale, window_left, window_right, bottom_right, softcap,
                   dropout_p, attn_bias, rng_seed, block_mask, block_m, block_n, bias_grad,
                   block_table, heads_first, deterministic=False):
    guarded = cu_seqlens_q is not None and not V.value_checks_enabled(q.device)
    if guarded:
        # the forward's guard (CUDA-graph capture): the same clamped indices
        cu_seqlens_q, cu_seqlens_k, block_table = V.varlen_guard(
            cu_seqlens_q, cu_seqlens_k, q.shape[0], k, max_seqlen_q, max_seqlen_k, block_table)
    spec = _spec(softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p,
                 deterministic)
    name = backends.select(q.device)
    impl = backends.get(name)
    kw = _kwargs(alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 attn_bias, rng_seed, block_mask, block_m, block_n)
    flip = heads_first and not _native_heads_first(name)
    if heads_first and not flip:
        kw["heads_first"] = True
    if flip:  # flash-layout views for a backend that takes only that layout
        do, q, k, v, out = (x.transpose(1, 2) for x in (do, q, k, v, out))
    k_pool, v_pool, slots = k, v, None
    if block_table is not None:
        slots = paged_kv.varlen_slots(block_table, cu_seqlens_k, int(k.shape[1]))
        k, v = paged_kv.gather_varlen(k, slots), paged_kv.gather_varlen(v, slots)
    if bias_grad:
        dbias = torch.empty_like(attn_bias, memory_format=torch.contiguous_format)
        dq, dk, dv = impl.backward(do, q, k, v, out, lse, spec, dbias=dbias, **kw)
    else:
        dbias = None
        dq, dk, dv = impl.backward(do, q, k, v, out, lse, spec, **kw)
    if guarded:  # tokens the clamped sequences leave out: no kernel wrote their gradients
        dq = V.zero_uncovered(dq, cu_seqlens_q)
        if slots is None:
            dk, dv = V.zero_uncovered(dk, cu_seqlens_k), V.zero_uncovered(dv, cu_seqlens_k)
    if slots is not None:
        dk = paged_kv.scatter_add_varlen(dk, slots, k_pool)
        dv = paged_kv.scatter_add_varlen(dv, slots, v_pool)
    if flip:
        dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, dk, dv, dbias


@torch.library.custom_op("flashtile::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
             cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
             max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
             bottom_right: bool, softcap: float, dropout_p: float, attn_bias: Optional[Tensor],
             rng_seed: Optional[Tensor], block_mask: Optional[Tensor], block_m: int,
             block_n: int, block_table: Optional[Tensor],
             heads_first: bool, deterministic: bool) -> tuple[Tensor, Tensor]:
    out, lse = _forward(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, window_left, window_right, bottom_right,
                        softcap, dropout_p, attn_bias, rng_seed, block_mask, block_m, block_n,
                        block_table, heads_first)
    return _as_promised(out, q if heads_first else None), lse.contiguous()


@attn_fwd.register_fake
def _(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p, attn_bias,
      rng_seed, block_mask, block_m, block_n, block_table, heads_first, deterministic):
    # heads-first: PyTorch's CPU kernel allocates out with empty_like(q)
    out = torch.empty_like(q) if heads_first else q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q, max_seqlen_q, heads_first),
                      dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=())
def attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             alibi_slopes: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
             cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
             softmax_scale: float, window_left: int, window_right: int, bottom_right: bool,
             softcap: float, dropout_p: float, attn_bias: Optional[Tensor],
             rng_seed: Optional[Tensor], block_mask: Optional[Tensor], block_m: int,
             block_n: int, bias_grad: bool, block_table: Optional[Tensor],
             heads_first: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dbias = _backward_impl(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q,
                                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                       window_left, window_right, bottom_right, softcap,
                                       dropout_p, attn_bias, rng_seed, block_mask, block_m,
                                       block_n, bias_grad, block_table, heads_first,
                                       deterministic)
    return _as_promised(dq, q), _as_promised(dk, k), _as_promised(dv, v), dbias


@attn_bwd.register_fake
def _(do, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p,
      attn_bias, rng_seed, block_mask, block_m, block_n, bias_grad, block_table, heads_first,
      deterministic):
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_grad else q.new_empty((0,))
    # the gradients come in their inputs' layouts (launch_bwd allocates them with empty_like)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


_N_INPUTS = 22
_BIAS_INDEX = 14
_FN_BIAS_INDEX = 3  # attn_bias among FlashAttnFunction's five arguments


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
     softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p, attn_bias,
     rng_seed, block_mask, block_m, block_n, block_table, heads_first, deterministic) = inputs
    out, lse = output
    # The dropout seed is saved next to the LSE: the backward regenerates the keep mask.
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                          attn_bias, rng_seed, block_mask, block_table)
    ctx.params = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right,
                  bottom_right, softcap, dropout_p)
    ctx.block = (block_m, block_n)
    ctx.heads_first = heads_first
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, bwd, bias_at=_BIAS_INDEX):
    # The log-sum-exp is an auxiliary output (as in flash-attn): its gradient is not propagated.
    (q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, attn_bias, rng_seed,
     block_mask, block_table) = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    # ``bias_at``: attn_bias's position among the arguments of the function ``ctx`` belongs to
    bias_grad = bool(attn_bias is not None and ctx.needs_input_grad[bias_at])
    dq, dk, dv, dbias = bwd(dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                            *ctx.params, attn_bias, rng_seed, block_mask, *ctx.block, bias_grad,
                            block_table, ctx.heads_first, ctx.deterministic)
    grads = [None] * _N_INPUTS
    grads[0], grads[1], grads[2] = dq, dk, dv
    if bias_grad:
        grads[_BIAS_INDEX] = dbias
    return tuple(grads)


attn_fwd.register_autograd(lambda ctx, dout, dlse: _grads(ctx, dout, attn_bwd),
                           setup_context=_setup_context)


def _unpack(q, k, v, attn_bias, rest):
    """The op's 22 inputs from ``FlashAttnFunction``'s five arguments (``rest``: every input
    but q, k, v and attn_bias, in order)."""
    return (q, k, v, *rest[:_BIAS_INDEX - 3], attn_bias, *rest[_BIAS_INDEX - 3:])


def _lane(inputs, name: str):
    """``(backward, spec, flip, kw)`` that the backward of a dense call with no optional input
    calls directly (``backward(do, q, k, v, out, lse, spec, **kw)`` of backend ``name``, in the
    flash layout when ``flip``), chosen in the forward; None for other calls (the general path
    of :func:`_grads`).

    Chosen in the forward because autograd runs a CUDA backward on its own worker thread: there
    the forward's ``use_backend`` block does not reach (the backward follows the forward's
    backend), and every line of Python costs ~2x the forward's (a cold core; on the H100/H200
    machines ~0.18 against ~0.08 ms for the same replayed backward launch)."""
    (q, _, _, alibi_slopes, cu_seqlens_q, _, _, _, softmax_scale, window_left, window_right,
     bottom_right, softcap, dropout_p, attn_bias, rng_seed, block_mask, _, _, block_table,
     heads_first, deterministic) = inputs
    if (alibi_slopes is not None or cu_seqlens_q is not None or attn_bias is not None
            or rng_seed is not None or block_mask is not None or block_table is not None):
        return None
    native = heads_first and _native_heads_first(name)
    return (backends.get(name).backward,
            _spec(softmax_scale, window_left, window_right, bottom_right, softcap, dropout_p,
                  deterministic),
            heads_first and not native, {"heads_first": True} if native else {})


class FlashAttnFunction(torch.autograd.Function):
    """Eager autograd function: the same forward/backward as the custom ops, minus the
    dispatcher.  ``forward`` takes ``ctx`` itself (no separate ``setup_context``):
    ``Function.apply`` binds the arguments through ``inspect.signature`` on every call when
    ``setup_context`` is defined, ~80 us of host time a call on the H100 host.  It takes five
    arguments (q, k, v, attn_bias: the inputs that can require grad; then a tuple of the
    others), not the op's 22: ``apply`` walks each argument in Python and C++."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, rest):
        # No zero-filled gradient for the LSE output (never used) or an unused output: the
        # backward handles None itself, so autograd launches no fill kernel for it.
        ctx.set_materialize_grads(False)
        inputs = _unpack(q, k, v, attn_bias, rest)
        # one choice of backend for the forward and the backward
        ctx.backend = backends.select(q.device)
        output = _forward(*inputs, backend=ctx.backend)
        _setup_context(ctx, inputs, output)
        ctx.lane = _lane(inputs, ctx.backend)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        lane = ctx.lane
        if lane is None or dout is None:
            # the forward's backend (this may be autograd's worker thread, outside the
            # forward's use_backend block)
            with backends.use_backend(ctx.backend):
                grads = _grads(ctx, dout, _backward_eager, bias_at=_FN_BIAS_INDEX)
            return grads[0], grads[1], grads[2], grads[_BIAS_INDEX], None
        backward, spec, flip, kw = lane
        q, k, v, out, lse = ctx.saved_tensors[:5]
        if flip:  # flash-layout views for a backend that takes only that layout
            dout, q, k, v, out = (x.transpose(1, 2) for x in (dout, q, k, v, out))
        with _no_autocast(q.device):
            dq, dk, dv = backward(dout, q, k, v, out, lse, spec, **kw)
        if flip:
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return dq, dk, dv, None, None


# ----------------------------------------------------------------------------------------------
# Under torch.func transforms (grad, vjp, vmap, ...)
#
# functorch needs an autograd.Function with a separate setup_context (and a vmap rule); the eager
# FlashAttnFunction binds ctx in forward instead, because setup_context costs tens of
# microseconds of argument binding on every call.  So attention() uses the two functions below
# only while a functorch transform is active (functorch_active()), and plain eager calls keep
# their low host cost.  The backward is itself a function with a vmap rule, so vmap(grad(f))
# (per-sample gradients) works.  The vmap rule runs the op once per mapped element and stacks
# the results: correct for every layout (dense, varlen, paged) and for dropout under
# randomness="different" (each element gets its own seed) or "same".


def functorch_active() -> bool:
    """True while a ``torch.func`` transform (vmap, grad, jvp, ...) is running."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _vmap_by_element(fn, info, in_dims, inputs):
    """Run ``fn`` on each mapped element (inputs with a batch dim are indexed along it) and
    stack every output along dim 0."""
    results = []
    for i in range(info.batch_size):
        args = [x.select(d, i) if d is not None else x for x, d in zip(inputs, in_dims)]
        results.append(fn(*args))
    outs = tuple(torch.stack(parts) for parts in zip(*results))
    return outs, (0,) * len(outs)


class FunctorchAttnBackward(torch.autograd.Function):
    """``_backward_impl`` as a function with a ``vmap`` rule (first-order only)."""

    @staticmethod
    def forward(*inputs):
        return _backward_impl(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(*output)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("flashtile attention does not support double backward (the "
                           "gradient of a gradient)")

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return _vmap_by_element(FunctorchAttnBackward.apply, info, in_dims, inputs)


class FunctorchAttnFunction(torch.autograd.Function):
    """The forward of ``FlashAttnFunction`` with a separate ``setup_context``."""

    @staticmethod
    def forward(*inputs):
        return _forward(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dout, dlse):
        return _grads(ctx, dout, FunctorchAttnBackward.apply)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return _vmap_by_element(FunctorchAttnFunction.apply, info, in_dims, inputs)


def dropout_seed(spec: AttnSpec, device: torch.device) -> Optional[Tensor]:
    """A fresh seed from the default generator of ``device`` when ``spec`` has dropout."""
    return draw_seed(device) if spec.dropout_p > 0 else None


def attention(q, k, v, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, attn_bias=None, rng_seed=None,
              block_mask=None, block_size=(0, 0), block_table=None, heads_first=False):
    """Differentiable ``(out, lse)`` for validated inputs (layouts of ``backends.spec``).

    With ``spec.dropout_p > 0``, ``rng_seed`` (see :func:`dropout_seed`) fixes the keep mask;
    one is drawn here when it is None.  ``heads_first`` (dense calls): ``q``, ``k``, ``v`` and
    ``out`` are ``(B, H, S, D)`` (``F.scaled_dot_product_attention``'s layout) instead of
    ``(B, S, H, D)``; ``lse`` is ``(B, H, Sq)`` either way.

    Strides: eager calls return what the backend produced (PyTorch's CPU kernel: ``out`` in
    the layout of ``q``, ``lse`` a transposed view, gradients contiguous in the flash layout,
    exactly as ``F.scaled_dot_product_attention``); the compiled op returns the strides its
    fake implementation promises (``_as_promised``), copying only where they differ.
    """
    if spec.dropout_p > 0 and rng_seed is None:
        rng_seed = draw_seed(q.device)
    if torch.is_autocast_enabled(q.device.type):
        # as torch's SDPA under autocast: compute in the autocast dtype and return it
        dtype = torch.get_autocast_dtype(q.device.type)
        if q.dtype != dtype and dtype in V.SUPPORTED_DTYPES:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            if attn_bias is not None and attn_bias.is_floating_point() \
                    and attn_bias.dtype != torch.float32:
                attn_bias = attn_bias.to(dtype)
    args = (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
            int(max_seqlen_k), spec.softmax_scale, spec.window_left, spec.window_right,
            spec.bottom_right, spec.softcap, spec.dropout_p, attn_bias, rng_seed, block_mask,
            int(block_size[0]), int(block_size[1]), block_table, bool(heads_first),
            spec.deterministic)
    if torch.compiler.is_compiling():
        return attn_fwd(*args)
    if functorch_active():  # torch.func transforms need setup_context and a vmap rule
        return FunctorchAttnFunction.apply(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (attn_bias is not None and attn_bias.requires_grad)):
        rest = args[3:_BIAS_INDEX] + args[_BIAS_INDEX + 1:]  # (_unpack's inverse)
        return FlashAttnFunction.apply(q, k, v, attn_bias, rest)
    return _forward(*args)
