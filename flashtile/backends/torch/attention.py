"""Exact attention for the torch backend: PyTorch's fused CPU kernel, or a tiled engine in ops.

Two paths, chosen per call (``forward``/``backward`` follow the interface in ``spec.py``):

* **PyTorch's fused CPU kernel** (``aten_route``): a call that needs only what
  ``F.scaled_dot_product_attention``'s CPU flash kernel computes - dense CPU tensors in
  float32/float16/bfloat16, no window or plain causal with the kernel's top-left diagonal
  (``bottom_right=False``, or ``Sq == Sk``), a softmax scale, grouped-query heads, and nothing
  else - runs that kernel and its backward: one ATen op a pass, one parallel region, so it
  keeps its speed when other processes compete for the cores.  Nothing is copied around it:
  ``heads_first`` calls (``F.scaled_dot_product_attention``'s ``(B, H, S, D)`` layout, what
  ``flashtile.scaled_dot_product_attention`` passes) reach the kernel as they are, flash-layout
  ones as transposed views, and ``out``/``lse``/gradients come back in the buffers the kernel
  allocated (with a ``TorchDispatchMode`` counting, one causal fwd+bwd through the SDPA
  drop-in issues exactly the 4 ATen ops of torch's own SDPA).  A varlen call with nothing per
  sequence hands it each sequence it computes exactly (``_sequence_route``).
* **The tiled engine** below, for everything else: sliding windows, bottom-right causal with
  ``Sq != Sk``, softcap, ALiBi, dropout (flashtile's Philox stream), biases and bool masks
  (with their gradient), block-sparse masks, paged calls, the other sequences of varlen
  calls, and empty inputs.

Both return the same natural-log ``lse``, so a forward of one path and a backward of the
other agree.

Forward of the tiled engine, for a block of ``BLOCK_M`` queries and every key tile ``j`` it can see::

    S     = tau Q_i K_j^T                       (softcap: c tanh(S / c); ALiBi; window mask)
    m_new = max(m, rowmax(S))
    P     = exp(S - m_new)
    l     = exp(m - m_new) l + rowsum(P)
    acc   = exp(m - m_new) acc + P V_j
    ...last tile:  O_i = acc / l,   lse_i = m + log l

Backward recomputes ``P = exp(S - lse)`` tile by tile and uses ``D = rowsum(dO o O)``::

    dV_j += P^T dO_i,   dP = dO_i V_j^T,   dS = P o (dP - D_i)
    dS   *= 1 - tanh^2(tau q.k / c)          (softcap: d/dx c tanh(x/c) = 1 - tanh^2(x/c))
    dQ_i += tau dS K_j,  dK_j += tau dS^T Q_i

The tiles hold scores in base 2 (``S * log2(e)``, folded into the pre-scaling of Q and
the ALiBi slopes) and use ``exp2``: on the x86 builds measured, ATen's float32 ``exp`` takes
a path 10-50x slower for every input whose result underflows, ``-inf`` included, i.e. for
every masked score, while ``exp2`` only slows down for results in the denormal range.
``m`` and ``l`` are kept in base 2 as well, and ``lse = ln(2) * (m + log2 l)``.

Nothing ``Sq x Sk`` is ever allocated: the live temporaries are a few
``[B*Hk, BLOCK_M*G, BLOCK_N]`` tiles, so the extra memory is ``O(N * tile)`` on top of
fp32 copies of the inputs and outputs.  The tiles are as large as a fixed memory budget
allows (``TILE_ELEMS``, ``_tile_shape``): each step is one ATen op over a whole tile, and a
few large ops instead of thousands of small ones is what keeps the engine fast when a core is
shared (every op is a parallel region that waits for its slowest thread).

All heads of all batch entries go through one ``bmm`` per tile.  Grouped-query attention
needs no copy of K/V: for key/value head ``hk`` the ``G = H // Hk`` query heads that read it
are stacked as extra rows, ordered ``(query, group member)``, so ``Q`` is viewed as
``[B*Hk, Sq*G, D]`` against ``K`` as ``[B*Hk, Sk, D]``; ``dK``/``dV`` then sum over the group
for free inside the matmul.

Key tiles that no query of the block can see (causal / sliding window) are skipped, and the
mask is only built for tiles that straddle the band's edge.  Everything is computed in
float32; results come back in the input dtype, ``lse`` in float32.

Optional features, with the Triton kernels' semantics (``_Extras``):

* ``attn_bias``: bool mask or additive float bias ``(B|1, H|1, Sq|1, Sk|1)``, sliced per tile
  and broadcast into it (never expanded in memory); its gradient ``dS`` is summed over the
  broadcast dims tile by tile into ``dbias``.
* dropout: the keep mask of a tile comes from ``flashtile.rng`` (the same Philox counters as
  the kernels, so both backends drop the same elements for the same seed); it multiplies
  ``P`` after ``l`` is updated, and the output is scaled by ``1 / (1 - p)``; the backward
  regenerates it (``dV += (P Z r)^T dO``, ``dP = (dO V^T) Z r``).
* ``block_mask`` over ``block_size`` blocks: expanded per tile into an element mask; tiles
  whose blocks are all zero are skipped.
* ``block_table`` (varlen, forward only): ``k``/``v`` are page pools; the keys of the call are
  gathered into packed ``(total_k, Hk, D)`` copies first (``flashtile.paged_kv``).  The
  backward is called with gathered keys (``flashtile.autograd``).
"""
from __future__ import annotations

import functools
import math

import torch

from ... import paged_kv
from ...rng import dropout_counters, philox_uniform
from ..spec import AttnSpec

__all__ = ["forward", "backward", "aten_route"]

# Tile shape.  Every elementwise step of the engine is one ATen op over a whole tile of all
# heads (a parallel region of its own), so the tile is chosen as large as a memory budget
# allows: one score tile ``[B*Hk, BLOCK_M*G, BLOCK_N]`` holds at most about TILE_ELEMS floats
# (16 MiB; the backward keeps about four such tiles alive).  The budget does not grow with the
# sequence length, so the engine's extra memory stays ``O(N * tile)``.
TILE_ELEMS = 1 << 22
BLOCK_N_MAX = 1024
BLOCK_N_MIN = 64
BLOCK_M_MAX = 1024
BLOCK_M_MIN = 16

# Calls PyTorch's own fused CPU kernel computes exactly go to it (see ``aten_route``); tests
# turn this off to run the tiled engine on the same calls.
USE_ATEN = True
_ATEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_NEG_INF = float("-inf")
_F32_LOWEST = torch.finfo(torch.float32).min
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------
# shared helpers


def _check(q, k, v, spec: AttnSpec, varlen: bool, heads_first: bool = False):
    nd = 3 if varlen else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != nd:
            raise ValueError(f"{name} must have {nd} dimensions, got shape {tuple(x.shape)}")
    hdim = 1 if heads_first else -2
    H, D = q.shape[hdim], q.shape[-1]
    Hk = k.shape[hdim]
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[-1] != D:
        raise ValueError(f"head dims differ: q has {D}, k has {k.shape[-1]}")
    if Hk == 0 or H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hk})")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError("q and k must have the same batch size")
    if varlen and spec.is_partial:
        raise ValueError("partial calls (global offsets) take the dense layout, not varlen")
    if varlen and heads_first:
        raise ValueError("heads_first is a dense layout; varlen calls take (total, H, D)")


def _slopes(alibi_slopes, B, H):
    """ALiBi slopes as float32 ``(B, H)``, or None."""
    if alibi_slopes is None:
        return None
    s = alibi_slopes.to(torch.float32)
    if tuple(s.shape) not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must be ({H},) or ({B}, {H}), got {tuple(s.shape)}")
    return s.expand(B, H)


def _rows_first(x, B, S, Hk, G, D):
    """``(B, S, Hk*G, D)`` (any dtype, any strides) -> contiguous float32 ``[B*Hk, S*G, D]``."""
    y = torch.empty((B, Hk, S, G, D), dtype=torch.float32, device=x.device)
    y.copy_(x.reshape(B, S, Hk, G, D).permute(0, 2, 1, 3, 4))
    return y.view(B * Hk, S * G, D)


def _rows_view(x, B, S, Hk, G, D):
    """``(B, S, Hk*G, D)`` -> a ``[B, Hk, S, G, D]`` view, to write tiles straight into."""
    return x.view(B, S, Hk, G, D).permute(0, 2, 1, 3, 4)


def _lse_view(lse, B, Hk, G, S):
    """lse ``(B, Hk*G, S)`` -> a ``[B, Hk, S, G]`` view (rows in the ``(query, member)`` order)."""
    return lse.view(B, Hk, G, S).permute(0, 1, 3, 2)


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (B + 1)")
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _tile_shape(BH, G, D, sk, band_width=None):
    """``(block_m, block_n)``: queries and keys per tile, within the ``TILE_ELEMS`` budget.

    Keys per tile: the whole key range up to ``BLOCK_N_MAX``; queries per tile: as many as fit
    the budget (also for the ``[BH, BM*G, D]`` accumulator of very wide heads), between
    ``BLOCK_M_MIN`` and ``BLOCK_M_MAX``; with many heads the key tile shrinks in turn.  A
    sliding window of ``band_width`` keys caps the queries per tile near that width (a block
    of ``BM`` queries spans ``BM + band_width - 1`` keys, so a taller block mostly computes
    scores the window hides) and sizes the key tile to that span, one tile per block."""
    rows = max(1, BH * G)
    bm_cap = BLOCK_M_MAX
    span = sk
    if band_width is not None:
        bm_cap = min(bm_cap, -(-band_width // 16) * 16)
        span = min(sk, bm_cap + band_width - 1)
    bn = max(1, min(BLOCK_N_MAX, span))
    bm = TILE_ELEMS // (rows * max(bn, D))
    bm = int(max(BLOCK_M_MIN, min(bm_cap, bm)))
    if rows * bm * bn > TILE_ELEMS:
        bn = int(max(min(BLOCK_N_MIN, bn), TILE_ELEMS // (rows * bm)))
    return bm, bn


class _Band:
    """Which keys a block of queries can see, per the window rule of ``spec.py``."""

    def __init__(self, spec: AttnSpec, sq: int, sk: int):
        self.sk = sk
        self.shift = spec.shift(sq, sk)  # global positions for partial calls
        self.wl = spec.window_left
        self.wr = spec.window_right
        self._rel = None  # int32 [BM, 1, BN] offsets j - i, built on first use
        self.tile = (0, 0)  # the caller's (block_m, block_n)
        # keys a query sees at most, when the window bounds both sides
        self.width = self.wl + self.wr + 1 if self.wl >= 0 and self.wr >= 0 else None

    def key_range(self, i0, i1):
        """Half-open range of keys visible to at least one query of ``[i0, i1)``."""
        lo, hi = 0, self.sk
        if self.wl >= 0:
            lo = max(lo, i0 + self.shift - self.wl)
        if self.wr >= 0:
            hi = min(hi, (i1 - 1) + self.shift + self.wr + 1)
        return lo, max(lo, hi)

    def fully_visible(self, i0, i1, j0, j1):
        """True when every key of ``[j0, j1)`` is visible to every query of ``[i0, i1)``."""
        if self.wl >= 0 and j0 < (i1 - 1) + self.shift - self.wl:
            return False
        if self.wr >= 0 and j1 - 1 > i0 + self.shift + self.wr:
            return False
        return True

    def hidden(self, i0, i1, j0, j1, device):
        """Boolean ``[BM, 1, BN]``: True where the pair is NOT visible.

        Built from one cached table of offsets ``j - i``: one op a tile (three for a band
        with both edges) instead of building index ranges for every tile."""
        bm, bn = i1 - i0, j1 - j0
        rel = self._rel
        if rel is None or rel.shape[0] < bm or rel.shape[2] < bn or rel.device != device:
            # [BM, 1, BN]: j - i for a tile starting at (0, 0), as large as the largest tile
            m, n = max(bm, self.tile[0]), max(bn, self.tile[1])
            rel = (torch.arange(n, device=device, dtype=torch.int32).view(1, 1, -1)
                   - torch.arange(m, device=device, dtype=torch.int32).view(-1, 1, 1))
            self._rel = rel
        rel = rel[:bm, :, :bn]
        base = i0 - j0 + self.shift  # j - i > wr  <=>  rel > i0 - j0 + shift + wr
        hide = None
        if self.wr >= 0:
            hide = rel > base + self.wr
        if self.wl >= 0:
            left = rel < base - self.wl
            hide = left if hide is None else hide.logical_or_(left)
        return hide


class _Extras:
    """Bias / bool mask, block mask and dropout of one dense batch (all optional).

    Tiles are ``[B, Hk, BM, G, BN]`` views of the ``[BH, BM*G, BN]`` score tiles; a
    ``(B|1, H|1, ...)`` tensor is brought to ``(B|1, Hk|1, BM, G|1, BN)`` to broadcast into it.
    """

    def __init__(self, B, H, Hk, attn_bias=None, block_mask=None, block_size=None,
                 seed=None, dropout_p=0.0, batch_offset=0, seqlen_q=0, seqlen_k=0,
                 q_offset=0, k_offset=0, head_offset=0, nheads_total=0):
        self.B, self.H, self.Hk, self.G = B, H, Hk, H // Hk
        self.bias = attn_bias
        self.bias_bool = attn_bias is not None and attn_bias.dtype == torch.bool
        self.block_mask = block_mask
        self.bm, self.bn = block_size if block_size is not None else (1, 1)
        self.seed = seed
        self.dropout_p = float(dropout_p)
        self.b0, self.cq, self.ck = batch_offset, seqlen_q, seqlen_k
        self.q0, self.k0 = q_offset, k_offset  # global position of local query / key 0
        self.h0, self.HT = head_offset, nheads_total or H  # global head of local head 0, count

    @property
    def active(self) -> bool:
        return self.bias is not None or self.block_mask is not None

    def _heads(self, t):
        """``(B|1, H|1, BM, BN)`` -> ``(B|1, Hk|1, BM, G|1, BN)``."""
        b, h, m, n = t.shape
        if h == 1:
            return t.view(b, 1, m, 1, n)
        return t.view(b, self.Hk, self.G, m, n).permute(0, 1, 3, 2, 4)

    def _block_tile(self, i0, i1, j0, j1):
        dev = self.block_mask.device
        rb = torch.arange(i0, i1, device=dev) // self.bm
        cb = torch.arange(j0, j1, device=dev) // self.bn
        return self.block_mask[:, :, rb][:, :, :, cb]  # [B|1, H|1, BM, BN]

    def skip(self, i0, i1, j0, j1) -> bool:
        """True when the block mask zeroes the whole tile (it is then never computed)."""
        if self.block_mask is None:
            return False
        sub = self.block_mask[:, :, i0 // self.bm:(i1 - 1) // self.bm + 1,
                              j0 // self.bn:(j1 - 1) // self.bn + 1]
        return not bool(sub.any())

    def apply(self, b_s5, i0, i1, j0, j1):
        """Adds the bias (base 2) / hides masked elements of a ``[B, Hk, BM, G, BN]`` tile."""
        if self.bias is not None:
            rows = slice(i0, i1) if self.bias.shape[2] > 1 else slice(0, 1)
            cols = slice(j0, j1) if self.bias.shape[3] > 1 else slice(0, 1)
            t = self.bias[:, :, rows, cols]
            if self.bias_bool:
                b_s5.masked_fill_(~self._heads(t), _NEG_INF)
            else:
                b_s5.add_(self._heads(t.to(torch.float32)), alpha=_LOG2E)
        if self.block_mask is not None:
            b_s5.masked_fill_(~self._heads(self._block_tile(i0, i1, j0, j1)), _NEG_INF)

    def keep(self, i0, i1, j0, j1, device):
        """Dropout keep mask of the tile, float32 ``[B*Hk, BM*G, BN]`` of 0 / ``1 / (1 - p)``."""
        b = torch.arange(self.b0, self.b0 + self.B, device=device).view(-1, 1, 1, 1, 1)
        h = torch.arange(self.h0, self.h0 + self.H, device=device).view(1, self.Hk, 1, self.G, 1)
        i = torch.arange(self.q0 + i0, self.q0 + i1, device=device).view(1, 1, -1, 1, 1)
        j = torch.arange(self.k0 + j0, self.k0 + j1, device=device).view(1, 1, 1, 1, -1)
        u = philox_uniform(self.seed, dropout_counters(b, h, i, j, self.HT, self.cq, self.ck))
        p32 = torch.tensor(self.dropout_p, dtype=torch.float32, device=device)
        z = (u >= p32).to(torch.float32) * (1.0 / (1.0 - self.dropout_p))
        return z.view(self.B * self.Hk, (i1 - i0) * self.G, j1 - j0)

    def reduce_ds(self, b_ds, dbias, i0, i1, j0, j1):
        """Adds the tile's ``dS`` (``[BH, BM*G, BN]``) to ``dbias`` (the bias's shape)."""
        BM, BN = i1 - i0, j1 - j0
        t = b_ds.view(self.B, self.Hk, BM, self.G, BN).permute(0, 1, 3, 2, 4)
        t = t.reshape(self.B, self.H, BM, BN)
        dims = [d for d in range(4) if dbias.shape[d] == 1 and t.shape[d] != 1]
        if dims:
            t = t.sum(dim=dims, keepdim=True)
        rows = slice(i0, i1) if dbias.shape[2] > 1 else slice(0, 1)
        cols = slice(j0, j1) if dbias.shape[3] > 1 else slice(0, 1)
        dbias[:, :, rows, cols] += t


class _Scores:
    """Builds the score tile ``S`` (scale, softcap, ALiBi, mask) shared by forward and backward."""

    def __init__(self, spec: AttnSpec, band: _Band, slopes, B, Hk, G, sq, sk, extras=None):
        self.extras = extras if extras is not None and extras.active else None
        self.softcap = float(spec.softcap)
        self.band = band
        self.G = G
        self.sq, self.sk = sq, sk
        self.alibi_shift = float(spec.alibi_shift(sq, sk))
        # [B*Hk, 1, G, 1]: one slope per (batch, kv head, group member), in base 2
        self.slopes = None if slopes is None else (slopes * _LOG2E).reshape(B * Hk, 1, G, 1)
        # what Q is pre-multiplied by, on top of tau, so that Q K^T comes out ready to use:
        # S / c for softcap's tanh (the outer c and log2(e) are applied after it), else S
        # already in base 2
        self.q_factor = 1.0 / self.softcap if self.softcap > 0 else _LOG2E

    def tile(self, b_q, b_kt, i0, i1, j0, j1, keep_tanh=False):
        """Base-2 score tile ``[BH, BM*G, BN]`` and, with ``keep_tanh``, the tanh tile for dS."""
        b_s = torch.bmm(b_q, b_kt)  # [BH, BM*G, BN]
        b_t = None
        if self.softcap > 0:
            if keep_tanh:
                b_t = torch.tanh(b_s)  # [BH, BM*G, BN]
                b_s = b_t * (self.softcap * _LOG2E)
            else:
                b_s.tanh_().mul_(self.softcap * _LOG2E)
        BH, BN = b_s.shape[0], b_s.shape[2]
        b_s4 = b_s.view(BH, i1 - i0, self.G, BN)  # [BH, BM, G, BN]
        if self.slopes is not None:
            i = torch.arange(i0, i1, dtype=torch.float32, device=b_s.device)
            j = torch.arange(j0, j1, dtype=torch.float32, device=b_s.device)
            # ALiBi distance is always measured from the bottom-right diagonal
            dist = (i.view(-1, 1) + self.alibi_shift - j.view(1, -1)).abs_()
            b_s4.addcmul_(self.slopes, dist.view(1, i1 - i0, 1, BN), value=-1.0)
        if self.extras is not None:
            self.extras.apply(b_s4.view(self.extras.B, self.extras.Hk, i1 - i0, self.G, BN),
                              i0, i1, j0, j1)
        if not self.band.fully_visible(i0, i1, j0, j1):
            b_s4.masked_fill_(self.band.hidden(i0, i1, j0, j1, b_s.device), _NEG_INF)
        return b_s, b_t


# ---------------------------------------------------------------------------------------
# PyTorch's fused CPU kernel


@functools.lru_cache(maxsize=None)
def _aten_ops():
    """The kernel's forward and backward overloads (the overload itself, not the packet: the
    packet resolves it on every call), or None in a PyTorch build without the kernel."""
    ops = torch.ops.aten
    try:
        return (ops._scaled_dot_product_flash_attention_for_cpu.default,
                ops._scaled_dot_product_flash_attention_for_cpu_backward.default)
    except AttributeError:
        return None


def aten_route(q, k, v, spec: AttnSpec, *, varlen=False, alibi_slopes=None, attn_bias=None,
               block_mask=None, block_table=None, heads_first=False):
    """``is_causal`` for PyTorch's fused CPU kernel when it computes exactly this call, else None.

    ``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``) is the kernel
    behind ``F.scaled_dot_product_attention`` on the CPU: FlashAttention-2's schedule in C++,
    one parallel region for the whole call, with the natural-log ``lse`` ``(B, H, Sq)`` float32
    that this backend returns, and grouped-query attention by head index ``h // (H // Hk)``.
    It is used when the call needs nothing else: dense (not varlen or paged) CPU tensors of
    one dtype among float32 / float16 / bfloat16, no dropout, softcap, ALiBi, float bias or
    block mask, and either no window or plain causal masking where its top-left diagonal is
    the one asked for (``bottom_right=False``, or ``Sq == Sk``).  A bool ``attn_bias``
    (True = visible) is passed as the additive 0 / ``-inf`` mask the kernel takes (same
    shape, the input dtype: memory in proportion to the caller's mask); a row it hides
    completely gets output 0 from the kernel but ``lse = 0``, which ``_aten_forward`` sets to
    ``-inf`` as everywhere in flashtile (and ``_aten_backward`` hands back as 0, where the
    kernel's ``exp(-inf - 0)`` gives the row no gradient).  Float biases stay on the tiled
    engine: their gradient needs ``dS``, and a row of huge finite negatives (``finfo.min``)
    overflows to ``-inf`` in the engine's base-2 scores but not in the kernel.  Empty inputs
    stay on the tiled engine too (the kernel does not accept them).  ``heads_first``: q/k/v
    are ``(B, H, S, D)`` (the kernel's own layout) instead of ``(B, S, H, D)``.
    """
    if not USE_ATEN or varlen or block_table is not None:
        return None
    if spec.is_partial or spec.head_offset or spec.nheads_total:
        return None  # global offsets / lengths of a partial call: the kernel has no such frame
    if alibi_slopes is not None or block_mask is not None:
        return None
    if attn_bias is not None and (attn_bias.dtype != torch.bool or attn_bias.dim() != 4
                                  or attn_bias.device != q.device):
        return None
    if spec.dropout_p > 0 or spec.softcap > 0 or spec.window_left >= 0:
        return None
    if q.device.type != "cpu" or q.dtype not in _ATEN_DTYPES:
        return None
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.numel() == 0 or k.numel() == 0:
        return None
    seq = 2 if heads_first else 1
    if spec.window_right < 0:
        causal = False
    elif spec.window_right == 0 and (not spec.bottom_right or q.shape[seq] == k.shape[seq]):
        causal = True
    else:
        return None
    if _aten_ops() is None:
        return None
    return causal


def _kernel_view(x, heads_first: bool):
    """``x`` as the kernel reads it: ``(B, H, S, D)`` with a unit last stride.

    Views only (a transpose of the flash layout ``(B, S, H, D)``); the kernel takes any other
    strides (zero ones included), but it reads a row of ``D`` values as one contiguous vector,
    so a strided last dimension is copied first."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x if heads_first else x.transpose(1, 2)


def _aten_mask(attn_bias, dtype, causal: bool, sq: int):
    """A bool ``attn_bias`` -> the kernel's additive mask, and the rows it leaves without a
    visible key (bool, broadcastable to lse's ``(B, H, Sq)``; None when there are none)."""
    if attn_bias is None:
        return None, None
    mask = torch.zeros(attn_bias.shape, dtype=dtype, device=attn_bias.device)
    mask.masked_fill_(attn_bias.logical_not(), _NEG_INF)
    seen = attn_bias.any(dim=-1)  # [B|1, H|1, Sq|1]
    if causal:  # top-left: query i sees keys j <= i, so its first visible key must be <= i
        first = attn_bias.to(torch.uint8).argmax(dim=-1)  # [B|1, H|1, Sq|1]
        rows = torch.arange(sq, device=attn_bias.device)
        seen = seen & (first <= rows)
    empty = seen.logical_not_()
    return mask, (empty if bool(empty.any()) else None)


def _aten_forward(q, k, v, spec: AttnSpec, causal: bool, attn_bias=None, heads_first=False):
    """The kernel's ``(out, lse)`` as it allocates them, nothing copied: ``out`` has q's
    layout (``empty_like`` of the kernel's view of q), ``lse`` ``(B, H, Sq)`` is a view of a
    ``(B, Sq, H)`` buffer."""
    fwd, _ = _aten_ops()
    mask, empty = _aten_mask(attn_bias, q.dtype, causal, q.shape[2 if heads_first else 1])
    out, lse = fwd(_kernel_view(q, heads_first), _kernel_view(k, heads_first),
                   _kernel_view(v, heads_first), 0.0, causal, attn_mask=mask,
                   scale=spec.softmax_scale)
    if empty is not None:  # the kernel gives them lse = 0 (and output 0)
        lse.masked_fill_(empty, _NEG_INF)
    return (out if heads_first else out.transpose(1, 2)), lse


def _aten_backward(do, q, k, v, out, lse, spec: AttnSpec, causal: bool, attn_bias=None,
                   heads_first=False):
    """``(dq, dk, dv)`` as the kernel allocates them (a ``(B, S, H, D)`` buffer each: contiguous
    in the flash layout, a transposed view in the heads-first one); ``out``/``lse`` are read
    with whatever strides they have."""
    _, bwd = _aten_ops()
    mask, _ = _aten_mask(attn_bias, q.dtype, causal, q.shape[2 if heads_first else 1])
    lse = lse.to(torch.float32)
    if mask is not None:  # rows that see no key: lse 0 as the kernel's forward leaves it
        lse = lse.masked_fill(lse == _NEG_INF, 0.0)
    grads = bwd(_kernel_view(do.to(q.dtype), heads_first), _kernel_view(q, heads_first),
                _kernel_view(k, heads_first), _kernel_view(v, heads_first),
                _kernel_view(out.to(q.dtype), heads_first), lse, 0.0, causal, attn_mask=mask,
                scale=spec.softmax_scale)
    return tuple(grads) if heads_first else tuple(g.transpose(1, 2) for g in grads)


def _flash(*xs):
    """Heads-first ``(B, H, S, D)`` tensors as flash-layout ``(B, S, H, D)`` views."""
    return tuple(x.transpose(1, 2) for x in xs)


# ---------------------------------------------------------------------------------------
# forward


def _forward_dense(q, k, v, spec: AttnSpec, slopes, out, lse, extras=None):
    """One dense batch: q ``(B, Sq, H, D)``, k/v ``(B, Sk, Hk, D)``; writes ``out``/``lse``."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    BH = B * Hk
    out_rows = _rows_view(out, B, Sq, Hk, G, D)  # [B, Hk, Sq, G, D]
    lse_rows = _lse_view(lse, B, Hk, G, Sq)  # [B, Hk, Sq, G]
    if Sq == 0 or BH == 0:
        return
    band = _Band(spec, Sq, Sk)
    scores = _Scores(spec, band, slopes, B, Hk, G, Sq, Sk, extras)
    dropout = extras is not None and extras.seed is not None
    qs = _rows_first(q, B, Sq, Hk, G, D)  # [BH, Sq*G, D]
    qs.mul_(spec.softmax_scale * scores.q_factor)
    ks = _rows_first(k, B, Sk, Hk, 1, D)  # [BH, Sk, D]
    vs = _rows_first(v, B, Sk, Hk, 1, D)  # [BH, Sk, D]
    block_m, block_n = band.tile = _tile_shape(BH, G, D, Sk, band.width)
    for i0 in range(0, Sq, block_m):
        i1 = min(i0 + block_m, Sq)
        rows = (i1 - i0) * G
        lo, hi = band.key_range(i0, i1)
        if lo >= hi:  # no query of this block sees any key
            out_rows[:, :, i0:i1] = 0
            lse_rows[:, :, i0:i1] = _NEG_INF
            continue
        b_q = qs[:, i0 * G:i1 * G]  # [BH, BM*G, D]
        b_m = torch.full((BH, rows), _NEG_INF, device=q.device)  # [BH, BM*G]
        b_l = torch.zeros((BH, rows), device=q.device)  # [BH, BM*G]
        b_acc = torch.zeros((BH, rows, D), device=q.device)  # [BH, BM*G, D]
        for j0 in range(lo, hi, block_n):
            j1 = min(j0 + block_n, hi)
            if extras is not None and extras.skip(i0, i1, j0, j1):
                continue
            b_s, _ = scores.tile(b_q, ks[:, j0:j1].transpose(1, 2), i0, i1, j0, j1)
            b_mnew = torch.maximum(b_m, b_s.amax(dim=-1))  # [BH, BM*G]
            # A row that has not met a visible key yet still has max -inf, and
            # exp2(-inf - (-inf)) would be NaN.  Clamping the offset to the most negative
            # finite float keeps exp2(-inf - offset) = 0 for all such a row's scores and for
            # its rescale factor, so it keeps l = 0 and acc = 0 until a visible key turns up
            # (or forever); rows with a finite max are left untouched.
            b_off = b_mnew.clamp_min(_F32_LOWEST)  # [BH, BM*G]
            b_alpha = torch.exp2(b_m.sub_(b_off))  # [BH, BM*G]
            b_p = b_s.sub_(b_off.unsqueeze(-1)).exp2_()  # [BH, BM*G, BN]
            b_l = b_p.sum(dim=-1).addcmul_(b_l, b_alpha)  # [BH, BM*G]
            if dropout:  # after l: dropout acts on the normalised probabilities
                b_p.mul_(extras.keep(i0, i1, j0, j1, q.device))
            b_acc.mul_(b_alpha.unsqueeze(-1)).baddbmm_(b_p, vs[:, j0:j1])
            b_m = b_mnew
        # l = 0 exactly for rows that saw nothing: their acc is 0 too, so divide by 1
        b_lsafe = b_l.masked_fill(b_l == 0, 1.0)
        b_acc.div_(b_lsafe.unsqueeze(-1))
        # (dropout's 1 / (1 - p) is already inside the keep tiles)
        out_rows[:, :, i0:i1] = b_acc.view(B, Hk, i1 - i0, G, D)
        b_lse = torch.where(b_l > 0, (b_m + torch.log2(b_lsafe)) * _LN2, _NEG_INF)  # [BH, BM*G]
        lse_rows[:, :, i0:i1] = b_lse.view(B, Hk, i1 - i0, G)


def _extras(q, k, spec: AttnSpec, varlen, attn_bias, rng_seed, block_mask, block_size,
            max_seqlen_q, max_seqlen_k):
    """Per-call ``_Extras`` (None when no optional feature is used), for batch entry 0."""
    if attn_bias is None and block_mask is None and spec.dropout_p <= 0:
        return None
    seed = None
    if spec.dropout_p > 0:
        if rng_seed is None:
            raise ValueError("dropout_p > 0 needs rng_seed (an int64 tensor of shape (1,))")
        seed = int(rng_seed.reshape(-1)[0])
    H, Hk = q.shape[-2], k.shape[-2]
    if varlen:
        B, cq, ck = 1, int(max_seqlen_q or 0), int(max_seqlen_k or 0)
    else:
        B, (cq, ck) = q.shape[0], spec.totals(q.shape[1], k.shape[1])
    return _Extras(B, H, Hk, attn_bias, block_mask, block_size, seed, spec.dropout_p,
                   spec.batch_offset, cq, ck, spec.q_offset, spec.k_offset, spec.head_offset,
                   spec.nheads_total)


def _for_sequence(extras, b):
    """The extras of varlen sequence ``b`` (batch offset ``b``, batch-sliced tensors)."""
    if extras is None:
        return None
    pick = lambda t: None if t is None else t[b:b + 1] if t.shape[0] > 1 else t  # noqa: E731
    return _Extras(1, extras.H, extras.Hk, pick(extras.bias), pick(extras.block_mask),
                   (extras.bm, extras.bn), extras.seed, extras.dropout_p, b, extras.cq,
                   extras.ck, head_offset=extras.h0, nheads_total=extras.HT)


def forward(q, k, v, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
            rng_seed=None, block_mask=None, block_size=None, block_table=None, out_dtype=None,
            heads_first=False):
    """Exact attention, tiled.  Returns ``(out, lse)``; layouts as in ``spec.py``; ``out`` in
    ``out_dtype`` (default q's dtype; partial calls ask for float32).

    ``max_seqlen_*`` only matter with dropout (they are the varlen counter strides).  With
    ``block_table`` (varlen), ``k``/``v`` are page pools ``(num_blocks, page_size, Hk, D)``.
    ``heads_first`` (dense only): q, k, v and out are ``(B, H, S, D)``, the layout of
    ``F.scaled_dot_product_attention`` and of PyTorch's fused kernel, which then reads them as
    they are; ``lse`` is ``(B, H, Sq)`` either way.

    The strides of the results are those of the path that ran, nothing is copied to change
    them: the tiled engine returns contiguous ``out``/``lse`` (in the flash layout), the fused
    kernel ``out`` in the layout of q and ``lse`` as a view of a ``(B, Sq, H)`` buffer.
    """
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
    if block_table is not None:
        if not varlen:
            raise ValueError("block_table needs the varlen layout (cu_seqlens_q/cu_seqlens_k)")
        slots = paged_kv.varlen_slots(block_table, cu_seqlens_k, int(k.shape[1]))
        k, v = paged_kv.gather_varlen(k, slots), paged_kv.gather_varlen(v, slots)
    _check(q, k, v, spec, varlen, heads_first)
    causal = None
    if out_dtype in (None, q.dtype):
        causal = aten_route(q, k, v, spec, varlen=varlen, alibi_slopes=alibi_slopes,
                            attn_bias=attn_bias, block_mask=block_mask, block_table=block_table,
                            heads_first=heads_first)
    if causal is not None:
        with torch.no_grad():
            return _aten_forward(q, k, v, spec, causal, attn_bias, heads_first)
    if heads_first:  # the tiled engine works in the flash layout: views there and back
        out, lse = forward(*_flash(q, k, v), spec, alibi_slopes=alibi_slopes,
                           attn_bias=attn_bias, rng_seed=rng_seed, block_mask=block_mask,
                           block_size=block_size, out_dtype=out_dtype)
        return out.transpose(1, 2), lse
    H = q.shape[-2]
    with torch.no_grad():
        extras = _extras(q, k, spec, varlen, attn_bias, rng_seed, block_mask, block_size,
                         max_seqlen_q, max_seqlen_k)
        if not varlen:
            out = torch.empty_like(q, dtype=out_dtype, memory_format=torch.contiguous_format)
            lse = torch.empty((q.shape[0], H, q.shape[1]), dtype=torch.float32,
                              device=q.device)
            _forward_dense(q, k, v, spec, _slopes(alibi_slopes, q.shape[0], H), out, lse,
                           extras)
            return out, lse
        out = torch.zeros_like(q, dtype=out_dtype, memory_format=torch.contiguous_format)
        lse = torch.full((H, q.shape[0]), _NEG_INF, dtype=torch.float32, device=q.device)
        seqs = _sequences(cu_seqlens_q, cu_seqlens_k)
        slopes = _slopes(alibi_slopes, len(seqs), H)
        for b, (q0, q1, k0, k1) in enumerate(seqs):
            qs, ks, vs = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
            causal = _sequence_route(qs, ks, vs, spec, extras, out_dtype, alibi_slopes)
            if causal is not None:
                out[q0:q1], lse[:, q0:q1] = (x[0] for x in _aten_forward(qs, ks, vs, spec,
                                                                        causal))
                continue
            _forward_dense(qs, ks, vs, spec, None if slopes is None else slopes[b:b + 1],
                           out[None, q0:q1], lse[None, :, q0:q1], _for_sequence(extras, b))
        return out, lse


def _sequence_route(q, k, v, spec: AttnSpec, extras, dtype, alibi_slopes):
    """:func:`aten_route` of one sequence of a varlen call (``(1, S, H, D)`` slices), where
    the call has nothing per sequence (no bias, block mask, dropout or ALiBi: ``extras`` None)
    and its results are in the inputs' dtype (``dtype``): a plain causal call whose sequence
    has as many queries as keys, or a call without a mask, runs PyTorch's fused kernel like a
    dense one (1.2-1.7x the tiled engine's speed at 4-32 sequences of 32-512 tokens, 2 CPU
    threads; docs/dev/tuning-log.md, step 117)."""
    if extras is not None or alibi_slopes is not None or dtype not in (None, q.dtype):
        return None
    return aten_route(q, k, v, spec)


# ---------------------------------------------------------------------------------------
# backward


def _backward_dense(do, q, k, v, out, lse, spec: AttnSpec, slopes, dq, dk, dv, extras=None,
                    dbias=None):
    """One dense batch; writes ``dq`` ``(B, Sq, H, D)`` and ``dk``/``dv`` ``(B, Sk, Hk, D)``;
    adds the bias gradient into ``dbias`` (float32, the bias's shape) when given."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    BH = B * Hk
    if BH == 0 or Sq == 0 or Sk == 0:
        return  # dq, dk, dv arrive zeroed
    band = _Band(spec, Sq, Sk)
    scores = _Scores(spec, band, slopes, B, Hk, G, Sq, Sk, extras)
    dropout = extras is not None and extras.seed is not None
    factor = spec.softmax_scale * scores.q_factor
    qs = _rows_first(q, B, Sq, Hk, G, D)  # [BH, Sq*G, D]
    qs.mul_(factor)
    dos = _rows_first(do, B, Sq, Hk, G, D)  # [BH, Sq*G, D]
    ks = _rows_first(k, B, Sk, Hk, 1, D)  # [BH, Sk, D]
    vs = _rows_first(v, B, Sk, Hk, 1, D)  # [BH, Sk, D]
    # reshape, not view: the caller's out/lse may have any strides (they are only read)
    out_rows = out.reshape(B, Sq, Hk, G, D).permute(0, 2, 1, 3, 4)  # [B, Hk, Sq, G, D]
    # rows that saw no key have lse = -inf; +inf instead makes exp2(S - lse) exactly 0 there,
    # so they contribute nothing to dK/dV and get dQ = 0
    lse_rows = lse.to(torch.float32).reshape(B, Hk, G, Sq).permute(0, 1, 3, 2)
    lse_rows = lse_rows.reshape(BH, Sq * G) * _LOG2E
    lse_rows.masked_fill_(lse_rows == _NEG_INF, float("inf"))  # [BH, Sq*G], base 2
    dq_rows = _rows_view(dq, B, Sq, Hk, G, D)  # [B, Hk, Sq, G, D]
    # float32 accumulators (the outputs may be fp16/bf16); rows of one group land on the
    # same kv head, so the matmuls below also do GQA's sum over the group
    dk_acc = torch.zeros((BH, Sk, D), device=q.device)  # [BH, Sk, D]
    dv_acc = torch.zeros((BH, Sk, D), device=q.device)  # [BH, Sk, D]
    block_m, block_n = band.tile = _tile_shape(BH, G, D, Sk, band.width)
    for i0 in range(0, Sq, block_m):
        i1 = min(i0 + block_m, Sq)
        rows = (i1 - i0) * G
        lo, hi = band.key_range(i0, i1)
        if lo >= hi:
            continue
        b_q = qs[:, i0 * G:i1 * G]  # [BH, BM*G, D]
        b_do = dos[:, i0 * G:i1 * G]  # [BH, BM*G, D]
        b_lse = lse_rows[:, i0 * G:i1 * G].unsqueeze(-1)  # [BH, BM*G, 1]
        b_o = out_rows[:, :, i0:i1].to(torch.float32).reshape(BH, rows, D)  # [BH, BM*G, D]
        b_delta = (b_o * b_do).sum(dim=-1, keepdim=True)  # [BH, BM*G, 1]
        b_dq = torch.zeros((BH, rows, D), device=q.device)  # [BH, BM*G, D]
        for j0 in range(lo, hi, block_n):
            j1 = min(j0 + block_n, hi)
            if extras is not None and extras.skip(i0, i1, j0, j1):
                continue
            b_k = ks[:, j0:j1]  # [BH, BN, D]
            b_v = vs[:, j0:j1]  # [BH, BN, D]
            b_s, b_t = scores.tile(b_q, b_k.transpose(1, 2), i0, i1, j0, j1, keep_tanh=True)
            b_p = b_s.sub_(b_lse).exp2_()  # [BH, BM*G, BN]
            b_dp = torch.bmm(b_do, b_v.transpose(1, 2))  # [BH, BM*G, BN]
            if dropout:
                b_z = extras.keep(i0, i1, j0, j1, q.device)  # [BH, BM*G, BN], 0 or 1/(1-p)
                dv_acc[:, j0:j1].baddbmm_((b_p * b_z).transpose(1, 2), b_do)
                b_dp.mul_(b_z)
            else:
                dv_acc[:, j0:j1].baddbmm_(b_p.transpose(1, 2), b_do)
            b_ds = b_dp.sub_(b_delta).mul_(b_p)  # [BH, BM*G, BN]
            if dbias is not None:
                extras.reduce_ds(b_ds, dbias, i0, i1, j0, j1)
            if b_t is not None:
                b_ds.mul_(b_t.square_().neg_().add_(1.0))
            b_dq.baddbmm_(b_ds, b_k)
            dk_acc[:, j0:j1].baddbmm_(b_ds.transpose(1, 2), b_q)
        b_dq.mul_(spec.softmax_scale)
        dq_rows[:, :, i0:i1] = b_dq.view(B, Hk, i1 - i0, G, D)
    # dK was accumulated against the pre-multiplied Q (factor * Q); tau is what it needs
    dk_acc.mul_(spec.softmax_scale / factor)
    dk.copy_(dk_acc.view(B, Hk, Sk, D).permute(0, 2, 1, 3))
    dv.copy_(dv_acc.view(B, Hk, Sk, D).permute(0, 2, 1, 3))


def backward(do, q, k, v, out, lse, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
             rng_seed=None, block_mask=None, block_size=None, dbias=None, grad_dtype=None,
             heads_first=False):
    """Gradients ``(dq, dk, dv)`` of :func:`forward`, in the dtypes of ``q``, ``k``, ``v`` (or
    ``grad_dtype``), and the layout of ``q``/``k``/``v`` given by ``heads_first`` (strides: the
    tiled engine's are contiguous in the flash layout, as are the fused kernel's).

    With ``dbias`` (a tensor shaped like ``attn_bias``) the bias gradient is written into it.
    """
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
    _check(q, k, v, spec, varlen, heads_first)
    causal = None
    if grad_dtype in (None, q.dtype):
        causal = aten_route(q, k, v, spec, varlen=varlen, alibi_slopes=alibi_slopes,
                            attn_bias=attn_bias, block_mask=block_mask, heads_first=heads_first)
    if causal is not None:
        with torch.no_grad():
            return _aten_backward(do, q, k, v, out, lse, spec, causal, attn_bias, heads_first)
    if heads_first:  # the tiled engine works in the flash layout: views there and back
        grads = backward(*_flash(do, q, k, v, out), lse, spec, alibi_slopes=alibi_slopes,
                         attn_bias=attn_bias, rng_seed=rng_seed, block_mask=block_mask,
                         block_size=block_size, dbias=dbias, grad_dtype=grad_dtype)
        return _flash(*grads)
    H = q.shape[-2]
    with torch.no_grad():
        extras = _extras(q, k, spec, varlen, attn_bias, rng_seed, block_mask, block_size,
                         max_seqlen_q, max_seqlen_k)
        db_acc = None
        if dbias is not None:
            db_acc = torch.zeros(dbias.shape, dtype=torch.float32, device=dbias.device)
        dq = torch.zeros_like(q, dtype=grad_dtype, memory_format=torch.contiguous_format)
        dk = torch.zeros_like(k, dtype=grad_dtype, memory_format=torch.contiguous_format)
        dv = torch.zeros_like(v, dtype=grad_dtype, memory_format=torch.contiguous_format)
        if not varlen:
            _backward_dense(do, q, k, v, out, lse, spec, _slopes(alibi_slopes, q.shape[0], H),
                            dq, dk, dv, extras, db_acc)
        else:
            seqs = _sequences(cu_seqlens_q, cu_seqlens_k)
            slopes = _slopes(alibi_slopes, len(seqs), H)
            for b, (q0, q1, k0, k1) in enumerate(seqs):
                qs, ks, vs = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
                causal = _sequence_route(qs, ks, vs, spec, extras, grad_dtype, alibi_slopes)
                if causal is not None:
                    dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in _aten_backward(
                        do[None, q0:q1], qs, ks, vs, out[None, q0:q1], lse[None, :, q0:q1],
                        spec, causal))
                    continue
                db_b = None
                if db_acc is not None:
                    db_b = db_acc[b:b + 1] if db_acc.shape[0] > 1 else db_acc
                _backward_dense(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1],
                                v[None, k0:k1], out[None, q0:q1], lse[None, :, q0:q1], spec,
                                None if slopes is None else slopes[b:b + 1],
                                dq[None, q0:q1], dk[None, k0:k1], dv[None, k0:k1],
                                _for_sequence(extras, b), db_b)
        if dbias is not None:
            dbias.copy_(db_acc)
        return dq, dk, dv
