"""The attention op under ``torch.func`` transforms (``grad``, ``vjp``, ``vmap``, ...).

functorch needs an ``autograd.Function`` with a separate ``setup_context`` (and a ``vmap``
rule); the eager ``FlashAttnFunction`` binds ``ctx`` in ``forward`` instead, because
``setup_context`` costs tens of microseconds of argument binding on every call.  So
``autograd.attention`` uses the two functions below only while a functorch transform is
active (:func:`active`), and plain eager calls keep their low host cost.

The backward is itself a function with a ``vmap`` rule, so ``vmap(grad(f))`` (per-sample
gradients) works.  The ``vmap`` rule runs the op once per mapped element and stacks the
results: correct for every layout (dense, varlen, paged) and for dropout under
``randomness="different"`` (each element gets its own seed) or ``"same"``.
"""
from __future__ import annotations

import torch


def active() -> bool:
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


class AttnBackward(torch.autograd.Function):
    """``_backward_impl`` as a function with a ``vmap`` rule (first-order only)."""

    @staticmethod
    def forward(*inputs):
        from .autograd import _backward_impl
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
        return _vmap_by_element(AttnBackward.apply, info, in_dims, inputs)


class AttnFunction(torch.autograd.Function):
    """The forward of ``autograd.FlashAttnFunction`` with a separate ``setup_context``."""

    @staticmethod
    def forward(*inputs):
        from .autograd import _forward
        return _forward(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        from .autograd import _setup_context
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dout, dlse):
        from .autograd import _grads
        return _grads(ctx, dout, AttnBackward.apply)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return _vmap_by_element(AttnFunction.apply, info, in_dims, inputs)
