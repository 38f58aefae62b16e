"""Bytes moved by attention: the paper's IO analysis (Theorem 2) written out per kernel.

All counts are exact integers in bytes for one call over ``batch x heads`` heads of ``n``
queries and ``n_k`` keys of head dim ``d`` (``e`` bytes an element, 4 for the float32
statistics).  Three levels:

``compulsory``  what any exact attention must move: the forward reads Q, K, V and writes O and
                the log-sum-exp (LSE); the backward reads Q, K, V, O, dO, LSE and writes dQ,
                dK, dV::

                    fwd = e (2 n d H + 2 n_k d Hk) + 4 n H          (per batch element)
                    bwd = e (3 n d H + 2 n_k d Hk) + 4 n H + e (n d H + 2 n_k d Hk)

``tile``        what the kernels' tile loads and stores move between global memory and the
                SMs (through L2): Theorem 2's count, every tile load counted.  flashtile's
                forward walks query tiles outside (``B_r = block_m`` rows) and key tiles
                inside (``B_c = block_n``), so K and V are read once per query tile::

                    fwd:  Q n d e + (K + V) T_r n_k d e + O n d e + LSE 4 n,  T_r = ceil(n / B_r)

                The paper's Algorithm 1 has the loops the other way round and re-reads Q and O
                (``T_c = ceil(n_k / B_c)`` passes, :func:`paper_forward`): the same
                ``Theta(N^2 d^2 / M)`` once ``B ~ M / d``, with the re-read operand swapped.
                The backward runs as flashtile runs it (:func:`flashtile_backward`): a dQ
                kernel over query tiles that also computes ``delta = rowsum(dO * O)`` in its
                prologue, then a dK/dV kernel over key tiles that re-reads Q, dO, LSE and delta
                per visited tile (``fused_delta=False`` gives the older three-kernel
                backward with a separate preprocess).

``dram``        the HBM bytes once a cache holds the re-read tiles: every tensor a kernel
                touches is read once.  On an H100 the 50 MB L2 holds one head's K and V
                (``2 n d e``, 256 KB at n=1024, d=64, bf16) for all the programs of the heads
                in flight, so DRAM traffic hardly depends on the tile sizes while the
                tile (L2 <-> SM) traffic does.  :func:`dram_bytes` falls back to the tile count
                when the re-read operands of the heads in flight do not fit in ``cache_bytes``.

``standard``    Algorithm 0 (forward) and its backward: S and P (and dP, dS) materialised in
                HBM, ``Theta(N d + N^2)`` (:func:`standard_forward`, :func:`standard_backward`).

Masks: ``causal`` counts exactly the (query tile, key tile) pairs the kernels visit (bottom-
right aligned, as flashtile); ``density`` scales the visited pairs of a block-sparse call.
"""
from __future__ import annotations

import dataclasses

STAT_BYTES = 4  # LSE, delta: float32 per row


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call: ``batch x heads`` heads of ``n`` queries, ``n_k`` keys, head dim
    ``d``, ``dtype_bytes`` per element; ``heads_k`` key/value heads (GQA)."""
    n: int
    d: int
    heads: int = 1
    batch: int = 1
    dtype_bytes: int = 2
    n_k: int | None = None
    heads_k: int | None = None
    causal: bool = False
    density: float = 1.0

    @property
    def nk(self) -> int:
        return self.n if self.n_k is None else self.n_k

    @property
    def hk(self) -> int:
        return self.heads if self.heads_k is None else self.heads_k

    def q_bytes(self) -> int:
        """One ``(batch, n, heads, d)`` tensor (Q, O, dO, dQ)."""
        return self.batch * self.n * self.heads * self.d * self.dtype_bytes

    def kv_bytes(self) -> int:
        """One ``(batch, n_k, heads_k, d)`` tensor (K, V, dK, dV)."""
        return self.batch * self.nk * self.hk * self.d * self.dtype_bytes

    def stat_bytes(self) -> int:
        """One float32 ``(batch, heads, n)`` row statistic (LSE, delta)."""
        return self.batch * self.heads * self.n * STAT_BYTES


@dataclasses.dataclass(frozen=True)
class KernelIO:
    """Bytes of one kernel: ``tile_*`` every tile load/store (L2 <-> SM), ``dram_*`` each
    tensor touched once (HBM with a cache that holds the re-read tiles)."""
    kernel: str
    tile_read: int
    tile_write: int
    dram_read: int
    dram_write: int
    reread_per_head: int = 0  # bytes one head's programs re-read from the cache
    programs_per_head: int = 1

    @property
    def tile(self) -> int:
        return self.tile_read + self.tile_write

    @property
    def dram(self) -> int:
        return self.dram_read + self.dram_write


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_rows_per_query_tile(p: Problem, block_m: int, block_n: int) -> list[int]:
    """For each query tile, the key rows it loads (whole visited key tiles, the last one
    partial): what the forward and dQ kernels read of K and V per query tile."""
    shift = p.nk - p.n
    out = []
    for i in range(cdiv(p.n, block_m)):
        if p.causal:
            last_q = min((i + 1) * block_m, p.n) - 1
            last_key = min(last_q + shift, p.nk - 1)  # visible keys are j <= i + shift
            tiles = 0 if last_key < 0 else cdiv(last_key + 1, block_n)
        else:
            tiles = cdiv(p.nk, block_n)
        out.append(min(p.nk, tiles * block_n))  # tiles 0 .. tiles-1, the last one may be partial
    return out


def query_rows_per_key_tile(p: Problem, block_m: int, block_n: int) -> list[int]:
    """For each key tile, the query rows the dK/dV kernel loads (whole visited query tiles)."""
    shift = p.nk - p.n
    out = []
    for j in range(cdiv(p.nk, block_n)):
        if p.causal:
            first_q = max(0, j * block_n - shift)  # first query that sees key j * block_n
            first_tile = first_q // block_m
            rows = 0 if first_q >= p.n else p.n - first_tile * block_m
        else:
            rows = p.n
        out.append(rows)
    return out


def _per_head(p: Problem) -> int:
    return p.batch * p.heads


def compulsory(p: Problem, pass_: str = "fwd_bwd") -> int:
    """Bytes any exact attention must move for ``pass_`` (``fwd``, ``bwd`` or ``fwd_bwd``)."""
    fwd = p.q_bytes() + 2 * p.kv_bytes() + p.q_bytes() + p.stat_bytes()
    bwd = (2 * p.q_bytes() + 2 * p.kv_bytes() + p.q_bytes() + p.stat_bytes()  # Q dO K V O LSE
           + p.q_bytes() + 2 * p.kv_bytes())  # dQ dK dV
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[pass_]


def _scaled(x: int, density: float) -> int:
    return x if density >= 1.0 else int(round(x * density))


def flashtile_forward(p: Problem, block_m: int, block_n: int) -> list[KernelIO]:
    """The forward kernel (grid: query tiles x heads)."""
    e, d = p.dtype_bytes, p.d
    kv_rows = _scaled(sum(key_rows_per_query_tile(p, block_m, block_n)), p.density)
    tile_read = p.q_bytes() + 2 * _per_head(p) * kv_rows * d * e
    write = p.q_bytes() + p.stat_bytes()
    dram_read = p.q_bytes() + 2 * p.kv_bytes()
    return [KernelIO("fwd", tile_read, write, min(dram_read, tile_read), write,
                     2 * p.nk * d * e, cdiv(p.n, block_m))]


def flashtile_backward(p: Problem, dkdv: tuple[int, int], dq: tuple[int, int],
                       fused_delta: bool = True, pre_block_m: int = 64) -> list[KernelIO]:
    """The backward's kernels in launch order.  ``dkdv`` / ``dq``: ``(block_m, block_n)`` of
    the two kernels.  ``fused_delta``: the dQ kernel runs first and computes
    ``delta = rowsum(dO * O)`` itself (reads O, writes delta), the dK/dV kernel reads LSE and
    delta; otherwise a preprocess kernel writes delta and ``lse2 = log2(e) lse`` first."""
    e, d, s = p.dtype_bytes, p.d, p.stat_bytes()
    kernels = []
    # dQ: Q, dO (and O) tiles once, K and V per visited key tile, one LSE/delta row each.
    kv_rows = _scaled(sum(key_rows_per_query_tile(p, *dq)), p.density)
    dq_read = 2 * p.q_bytes() + 2 * s + 2 * _per_head(p) * kv_rows * d * e
    dq_dram = 2 * p.q_bytes() + 2 * s + 2 * p.kv_bytes()
    dq_write = p.q_bytes()
    if fused_delta:
        dq_read += p.q_bytes() - s  # reads O, and LSE only (it writes delta)
        dq_dram += p.q_bytes() - s
        dq_write += s
    else:
        pre_read, pre_write = 2 * p.q_bytes() + s, 2 * s
        kernels.append(KernelIO("pre", pre_read, pre_write, pre_read, pre_write))
    dq_kernel = KernelIO("dq", dq_read, dq_write, min(dq_dram, dq_read), dq_write,
                         2 * p.nk * d * e, cdiv(p.n, dq[0]))
    # dK/dV: K, V tiles once; per visited query tile Q, dO tiles and two row statistics,
    # for each query head of the key/value head's group.
    q_rows = _scaled(sum(query_rows_per_key_tile(p, *dkdv)), p.density)
    dkdv_read = 2 * p.kv_bytes() + 2 * _per_head(p) * q_rows * (d * e + STAT_BYTES)
    dkdv_dram = 2 * p.kv_bytes() + 2 * p.q_bytes() + 2 * s
    dkdv_write = 2 * p.kv_bytes()
    dkdv_kernel = KernelIO("dkdv", dkdv_read, dkdv_write, min(dkdv_dram, dkdv_read), dkdv_write,
                           2 * p.n * (d * e + STAT_BYTES) * (p.heads // p.hk),
                           cdiv(p.nk, dkdv[1]))
    kernels += [dq_kernel, dkdv_kernel] if fused_delta else [dkdv_kernel, dq_kernel]
    return kernels


def flashtile_kernels(p: Problem, fwd: tuple[int, int], dkdv: tuple[int, int],
                      dq: tuple[int, int], fused_delta: bool = True) -> dict[str, list[KernelIO]]:
    """``{"fwd": [...], "bwd": [...]}`` for the given ``(block_m, block_n)`` of each kernel."""
    return {"fwd": flashtile_forward(p, *fwd),
            "bwd": flashtile_backward(p, dkdv, dq, fused_delta)}


def total(kernels: list[KernelIO], level: str = "dram") -> int:
    return sum(getattr(k, level) for k in kernels)


def dram_bytes(p: Problem, kernels: list[KernelIO], cache_bytes: int = 50 * 2**20,
               programs_in_flight: int = 2 * 132) -> int:
    """HBM bytes of ``kernels`` with a cache of ``cache_bytes``: a kernel moves its ``dram``
    count when the re-read operands (K and V of a head in the forward and dQ kernels; Q, dO
    and two row statistics in the dK/dV kernel) of the heads in flight fit in the cache
    (``programs_in_flight`` programs, consecutive programs working on the same head), else its
    ``tile`` count."""
    out = 0
    for k in kernels:
        heads = min(cdiv(programs_in_flight, k.programs_per_head), p.batch * p.hk) + 1
        out += k.dram if k.reread_per_head * heads <= cache_bytes else k.tile
    return out


def sram_tiles(sram_bytes: int, d: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """The paper's block sizes for an on-chip memory of ``M`` elements:
    ``B_c = ceil(M / 4d)``, ``B_r = min(ceil(M / 4d), d)``."""
    m = sram_bytes // dtype_bytes
    bc = cdiv(m, 4 * d)
    return min(bc, d), bc


def paper_forward(p: Problem, block_r: int, block_c: int) -> int:
    """Tile bytes of the paper's Algorithm 1 (outer loop over K/V blocks): K and V read once;
    for each of the ``T_c`` key blocks every query block reads Q_i, O_i, l_i, m_i and writes
    O_i, l_i, m_i (``l``, ``m`` in float32).  ``Theta(N d T_c) = Theta(N^2 d^2 / M)``."""
    tc = cdiv(p.nk, block_c)
    rows = _per_head(p) * p.n
    per_pass = rows * (3 * p.d * p.dtype_bytes + 4 * STAT_BYTES)  # Q, O in, O out; l, m in/out
    return 2 * p.kv_bytes() + _scaled(tc * per_pass, p.density)


def standard_forward(p: Problem, score_bytes: int | None = None) -> int:
    """Algorithm 0: ``S = Q K^T`` (read Q, K, write S), ``P = softmax(S)`` (read S, write P),
    ``O = P V`` (read P, V, write O): ``4 n d e + 4 n^2 s`` per head (``s`` bytes a score)."""
    s = p.dtype_bytes if score_bytes is None else score_bytes
    nn = _per_head(p) * p.n * p.nk * s
    return (p.q_bytes() + p.kv_bytes() + nn) + 2 * nn + (nn + p.kv_bytes() + p.q_bytes())


def standard_backward(p: Problem, score_bytes: int | None = None) -> int:
    """The standard backward (the paper's Algorithm 3) with P saved:
    ``dV = P^T dO`` (read P, dO; write dV), ``dP = dO V^T`` (read dO, V; write dP),
    ``D = rowsum(dO * O)`` (read dO, O; write D), ``dS = P o (dP - D)`` (read P, dP, D; write
    dS), ``dQ = dS K`` (read dS, K; write dQ), ``dK = dS^T Q`` (read dS, Q; write dK):
    ``7 n^2 s`` score bytes, ten ``n d`` tensors, two row statistics."""
    s = p.dtype_bytes if score_bytes is None else score_bytes
    nn = _per_head(p) * p.n * p.nk * s
    qb, kb, st = p.q_bytes(), p.kv_bytes(), p.stat_bytes()
    dv = nn + qb + kb
    dp = qb + kb + nn
    dd = 2 * qb + st
    ds = 2 * nn + st + nn
    dq = nn + kb + qb
    dk = nn + qb + kb
    return dv + dp + dd + ds + dq + dk


def standard(p: Problem, pass_: str = "fwd_bwd", score_bytes: int | None = None) -> int:
    fwd, bwd = standard_forward(p, score_bytes), standard_backward(p, score_bytes)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[pass_]


def figure2_problem() -> Problem:
    """The paper's Figure 2 shape: GPT-2 medium, N=1024, d=64, 16 heads, batch 64, 2-byte."""
    return Problem(n=1024, d=64, heads=16, batch=64, dtype_bytes=2)


def gb(x: int | float) -> float:
    return x / 1e9


__all__ = ["Problem", "KernelIO", "compulsory", "flashtile_forward", "flashtile_backward",
           "flashtile_kernels", "total", "dram_bytes", "sram_tiles", "paper_forward",
           "standard_forward", "standard_backward", "standard", "figure2_problem",
           "key_rows_per_query_tile", "query_rows_per_key_tile", "cdiv", "gb"]
