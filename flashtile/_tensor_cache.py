"""Values computed from the contents of small index tensors, reused while those tensors are
unchanged.

A model's layers pass the same cumulative-length tensor (or attention mask) to every
attention call of a step; what flashtile derives from its values (the value checks' host read,
the unpadding indices, launch-order tables) is computed once and reused by the other layers.

A cached value belongs to the very tensor objects it was computed from (weak references, so a
new tensor allocated at a freed one's address is never mistaken for it) as long as their
version counters are unchanged (every in-place write, through any view, bumps the counter).
Inference tensors (made under ``torch.inference_mode``) have no version counter, and a value
made while a CUDA graph is captured holds device memory that is filled only when the graph
replays: neither is cached, nor is anything while ``torch.compile`` traces.
"""
from __future__ import annotations

import weakref
from typing import Callable, Hashable, Sequence

import torch


def _trackable(tensors: Sequence[torch.Tensor]) -> bool:
    if torch.compiler.is_compiling():  # traced code runs once; the graph holds no cache
        return False
    for t in tensors:
        if t.is_inference():
            return False
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
    return True


class TensorCache:
    """``get(key, tensors, make)``: ``make()``, or the value an earlier call with the same
    ``key`` and the same, unchanged ``tensors`` made.  At most ``size`` entries (all dropped
    when full: a step reuses a handful)."""

    def __init__(self, size: int = 64):
        self._entries: dict = {}
        self._size = size

    def get(self, key: Hashable, tensors: Sequence[torch.Tensor], make: Callable):
        if not _trackable(tensors):
            return make()
        full_key = (key, *(id(t) for t in tensors))
        versions = tuple(t._version for t in tensors)
        hit = self._entries.get(full_key)
        if hit is not None and hit[1] == versions and all(
                ref() is t for ref, t in zip(hit[0], tensors)):
            return hit[2]
        value = make()
        if len(self._entries) >= self._size:
            self._entries.clear()
        self._entries[full_key] = (tuple(weakref.ref(t) for t in tensors), versions, value)
        return value

    def get_view(self, key: Hashable, view: torch.Tensor, make: Callable):
        """:meth:`get` for the contents of ``view``: keyed by its address and geometry, for
        its base tensor unchanged (views of one tensor share its version counter), so that a
        new view of the same elements finds the value."""
        base = view if view._base is None else view._base
        return self.get((key, view.data_ptr(), view.shape, view.stride()), (base,), make)
