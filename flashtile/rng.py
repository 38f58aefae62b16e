"""Dropout randomness shared by every backend: Triton's ``tl.rand`` reproduced in PyTorch.

A dropout call draws one seed from PyTorch's default generator of the device
(:func:`draw_seed`), so ``torch.manual_seed(s)`` makes calls reproducible.  Whether element
``(b, h, i, j)`` (batch, query head, query, key) is kept depends only on the seed and the
element's *counter*::

    counter = ((b * nheads + h) * seqlen_q + i) * seqlen_k + j          (int64)
    u       = tl.rand(seed, counter)                                     (uniform in [0, 1))
    keep    = u >= dropout_p

For varlen calls ``i``/``j`` are positions inside sequence ``b`` and ``seqlen_q``/``seqlen_k``
are ``max_seqlen_q``/``max_seqlen_k``.  The forward kernel, the backward kernels (which
regenerate the mask instead of storing it), the torch backend and ``S_dmask`` all evaluate the
same function, so they agree bit for bit.

``tl.rand(seed, offset)`` is Philox-4x32 with 10 rounds: counter words
``(offset_lo, offset_hi, 0, 0)``, key words ``(seed_lo, seed_hi)``; the first output word is
read as int32, folded to ``[0, 2^31)`` (``x < 0 -> -x - 1``), converted to float32 and
multiplied by the float32 constant ``4.6566127342e-10``.  :func:`philox_uniform` computes the
same thing with int64 tensor arithmetic (16-bit limbs keep every product below 2^63).
"""
from __future__ import annotations

import torch

__all__ = ["draw_seed", "philox_uniform", "keep_mask", "dropout_counters"]

_MASK32 = 0xFFFFFFFF
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_N_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10
SEED_BOUND = 1 << 62


def draw_seed(device: torch.device) -> torch.Tensor:
    """One int64 seed in ``[0, 2^62)`` from the default generator of ``device``, shape ``(1,)``.

    The tensor lives on ``device`` so that a GPU kernel reads it without a host sync.
    """
    return torch.randint(0, SEED_BOUND, (1,), dtype=torch.int64, device=device)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a constant ``a < 2^32`` and ``b`` holding
    uint32 values in int64."""
    b_hi = b >> 16
    b_lo = b & 0xFFFF
    t_lo = b_lo * a  # < 2^48
    t_hi = b_hi * a  # < 2^48
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & _MASK32
    return hi, lo


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offsets)`` for int64 ``offsets`` (any shape): float32 in ``[0, 1)``."""
    seed = int(seed) & ((1 << 64) - 1)
    offsets = offsets.to(torch.int64)
    c0 = offsets & _MASK32
    c1 = (offsets >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    for _ in range(_N_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    x = torch.where(c0 >= (1 << 31), c0 - (1 << 32), c0)  # bit-cast to int32
    x = torch.where(x < 0, -x - 1, x).to(torch.int32)
    scale = torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=x.device)
    return x.to(torch.float32) * scale


def dropout_counters(b: torch.Tensor | int, h: torch.Tensor | int, i: torch.Tensor | int,
                     j: torch.Tensor | int, nheads: int, seqlen_q: int,
                     seqlen_k: int) -> torch.Tensor:
    """The int64 Philox counter of element ``(b, h, i, j)`` (broadcasting tensors)."""
    as64 = lambda x: torch.as_tensor(x, dtype=torch.int64)  # noqa: E731
    return ((as64(b) * nheads + as64(h)) * seqlen_q + as64(i)) * seqlen_k + as64(j)


def keep_mask(seed: int, dropout_p: float, batch: int, nheads: int, seqlen_q: int,
              seqlen_k: int, device=None, batch_offset: int = 0) -> torch.Tensor:
    """Bool ``(batch, nheads, seqlen_q, seqlen_k)``: True where the element is kept.

    ``batch_offset`` shifts the batch index (``b`` of entry 0), for slices of a batch.
    """
    b = torch.arange(batch_offset, batch_offset + batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nheads, device=device).view(1, -1, 1, 1)
    i = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    u = philox_uniform(seed, dropout_counters(b, h, i, j, nheads, seqlen_q, seqlen_k))
    return u >= torch.tensor(dropout_p, dtype=torch.float32, device=u.device)
