"""The interactive FlashAttention explainer: step-by-step traces of the reference algorithms,
and the page that displays them.

    python -m flashtile explain [--out DIR] [--n N [N ...]] [--d D] [--tiles T [T ...]] [--open]

writes ``DIR/index.html`` (default: a new temporary directory), one static, self-contained page:
the template ``flashtile/explainer.html`` (markup, style and script in one file) with the traces
of the chosen sequence lengths, head dimension and tile sizes inlined.  It needs no network and
no server.  ``docs/explainer/index.html`` in the repository is this command's output for the
defaults (``python -m flashtile explain --out docs/explainer``).

Traces
------
:func:`export_trace` runs one algorithm of :mod:`flashtile.reference.algorithms` on small random
inputs with a recorder attached to its ``trace`` hook, and returns a JSON-ready dict: one entry
per block step with the tile pair, the score tile ``S``, the running max ``m`` and denominator
``l`` before and after, the rescale factor ``alpha = exp(m_old - m_new)``, the output block, the
blocks a causal or block-sparse mask skips, and the bytes moved so far.  The numbers come from
the algorithm itself; the page only displays them.  The naive (materialised) result of
:mod:`flashtile.reference.naive` is included, so the page can show that the tiled output equals it
for every tile size.

Views (``view=``):

``fa1``       Algorithm 1: outer loop over K/V tiles, inner over Q tiles; ``O``, ``l``, ``m`` in HBM.
``fa2``       FlashAttention-2: outer loop over Q tiles; ``m``, ``l`` and an unnormalised
              accumulator stay on chip, ``O`` and ``lse`` are written once per Q tile.
``backward``  Algorithm 4: ``P`` recomputed from ``S`` and the saved statistics, per tile.
``sparse``    Algorithm 5: Algorithm 1 skipping the tiles a block-sparsity layout switches off.
``decode``    one query against the whole cache, keys cut into splits, merged by log-sum-exp.

IO model (counted in elements, reported in bytes with ``elem_bytes`` per element; ``Sq``, ``Sk``
queries and keys, head dimension ``d``; ``Tr``/``Tc`` tiles of ``Br`` rows / ``Bc`` keys).  HBM
counts every element an algorithm line reads from or writes to HBM, as the paper's proofs do:

* standard forward (Algorithm 0): ``2 Sq d + 2 Sk d + 4 Sq Sk`` (``S`` and ``P`` written and read)
* ``fa1``/``sparse``: initialise ``O, l, m`` (``Sq d + 2 Sq``); per K/V tile ``2 Bc d``; per
  visited tile ``3 Br d + 4 Br`` (read ``Q_i, O_i, l_i, m_i``, write ``O_i, l_i, m_i``).  Without a
  mask that is ``Sq d + 2 Sq + 2 Sk d + Tc (3 Sq d + 4 Sq)`` = Theta(N^2 d^2 / M) for
  ``Bc = Theta(M / d)``.
* ``fa2``: per Q tile ``Br d`` in and ``Br d + Br`` out (``O_i``, ``lse_i``); per visited tile
  ``2 Bc d``.  Without a mask ``2 Sq d + Sq + 2 Tr Sk d``.
* standard backward (Algorithm 3): ``7 Sq Sk + 4 Sq d + 4 Sk d``.
* ``backward``: initialise ``dQ, dK, dV`` (``Sq d + 2 Sk d``); per K/V tile ``2 Bc d`` in and
  ``2 Bc d`` out; per visited tile ``5 Br d + 2 Br`` (read ``Q_i, O_i, dO_i, dQ_i, l_i, m_i``,
  write ``dQ_i``).
* ``decode``: each split is the ``fa2`` count on its keys (its partial ``O`` and ``lse`` go to
  HBM); the merge reads them (``n (Sq d + Sq)``) and writes ``O`` and ``lse`` (``Sq d + Sq``).

On-chip (SRAM) traffic uses one rule for both algorithms: every element that enters on-chip
memory is written there once and read once, whether it is loaded from HBM, computed on chip or
read out to be stored.  So SRAM = 2 x HBM, plus, for FlashAttention, ``2 Br Bc`` for each
Br x Bc tile it keeps on chip (``S`` and ``P``; in the backward also ``dP`` and ``dS``), which
standard attention sends through HBM instead.  Per-row scalars computed on chip (``rowmax``, ``alpha``)
are not counted.

Numbers are rounded to ``digits`` significant digits; ``-inf`` (a masked score, the running
max of a row that has seen no key yet) is ``None``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import webbrowser
from importlib import resources
from pathlib import Path

import numpy as np

from .reference import algorithms as alg
from .reference import naive

__all__ = ["VIEWS", "DEFAULT_NS", "DEFAULT_TILES", "export_trace", "export_traces", "io_formula",
           "traces_js", "sparse_layout", "template", "page_html", "write_page", "build_parser",
           "main"]

DEFAULT_NS = (8, 16, 32)
DEFAULT_TILES = (2, 4, 8)
# The tiled result and the naive one differ only by float64 rounding (~1e-16).  Below this
# bound the exact value depends on the BLAS build of the machine that exports the traces, so a
# trace records the bound instead (the page shows "<= 1e-14") and the exported page is the same
# on every machine.
DIFF_BOUND = 1e-14
TEMPLATE = "explainer.html"
TRACES_SLOT = "/* TRACES */"  # where the template takes the traces script


VIEWS = ("fa1", "fa2", "backward", "sparse", "decode")

VIEW_TITLES = {
    "fa1": "Forward, FlashAttention-1 order (outer loop over K/V tiles)",
    "fa2": "Forward, FlashAttention-2 order (outer loop over Q tiles)",
    "backward": "Backward: recompute P tile by tile",
    "sparse": "Block-sparse: skip the tiles the layout switches off",
    "decode": "Decode: split the KV cache, merge by log-sum-exp",
}


def _num(x, digits):
    x = float(x)
    if math.isinf(x) and x < 0:
        return None
    if not math.isfinite(x):
        raise ValueError(f"trace value {x} is not finite")
    return float(f"{x:.{digits}g}")


def _arr(a, digits):
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 0:
        return _num(a, digits)
    return [_arr(x, digits) for x in a]


def sparse_layout(n_rows: int, n_cols: int, group: int) -> np.ndarray:
    """Boolean ``(n_rows, n_cols)`` token mask of the ``sparse`` view: a local + global pattern.

    Tokens are grouped by ``group``; query group ``a`` sees key group ``a`` (local) and the
    first group is global: it sees every key and every query sees it.  Tile sizes that divide
    ``group`` turn this into an exact block mask, so every such tile size computes the same
    function.
    """
    ga = np.arange(n_rows)[:, None] // group
    gb = np.arange(n_cols)[None, :] // group
    return (gb == 0) | (ga == 0) | (gb == ga)


def _block_mask(token_mask, br, bc):
    sq, sk = token_mask.shape
    tr, tc = -(-sq // br), -(-sk // bc)
    out = np.zeros((tr, tc), dtype=bool)
    for i in range(tr):
        for j in range(tc):
            blk = token_mask[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            if blk.any() and not blk.all():
                raise ValueError(f"tile size ({br}, {bc}) does not divide the sparsity group")
            out[i, j] = blk.all()
    return out


def io_formula(view: str, sq: int, sk: int, d: int, br: int, bc: int, *, num_splits: int = 2):
    """The closed-form HBM element counts of an unmasked run: ``{"flash": ..., "standard": ...}``."""
    tr, tc = -(-sq // br), -(-sk // bc)
    std_fwd = 2 * sq * d + 2 * sk * d + 4 * sq * sk
    if view in ("fa1", "sparse"):
        flash = sq * d + 2 * sq + 2 * sk * d + tc * (3 * sq * d + 4 * sq)
        return {"flash": flash, "standard": std_fwd}
    if view == "fa2":
        return {"flash": 2 * sq * d + sq + 2 * tr * sk * d, "standard": std_fwd}
    if view == "backward":
        flash = sq * d + 2 * sk * d + 4 * sk * d + tc * (5 * sq * d + 2 * sq)
        return {"flash": flash, "standard": 7 * sq * sk + 4 * sq * d + 4 * sk * d}
    if view == "decode":
        n = max(1, min(num_splits, tc))
        per = -(-tc // n)
        n = -(-tc // per)  # splits that hold keys
        flash = n * (2 * sq * d + sq) + 2 * sk * d + n * (sq * d + sq) + sq * d + sq
        return {"flash": flash, "standard": std_fwd}
    raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")


class _Recorder:
    """Turns the algorithms' trace events into display steps with running byte counts."""

    def __init__(self, d, elem_bytes, digits, trc, tcc):
        self.d, self.eb, self.digits = d, elem_bytes, digits
        self.steps = []
        self.hbm = 0  # elements
        self.chip = 0  # elements of the Br x Bc tiles kept on chip (each written and read once)
        self.pending = []  # loads done before the next step
        self.pending_hbm = 0
        self.trc, self.tcc = trc, tcc  # tile sizes, to number the tiles

    def _flush(self, step, hbm=0, chip=0):
        self.hbm += self.pending_hbm + hbm
        self.chip += chip
        step["loads"] = self.pending + step.get("loads", [])
        self.pending, self.pending_hbm = [], 0
        step["hbm"] = self.hbm * self.eb
        step["sram"] = (2 * self.hbm + 2 * self.chip) * self.eb
        self.steps.append(step)

    def load(self, names, elements):
        self.pending += names
        self.pending_hbm += elements

    def load_or_skip(self, ev, f):
        """Records a K/V or Q tile load, or a skipped tile; False for any other event."""
        if ev == "load_kv":
            self.load(["K", "V"], 2 * (f["c1"] - f["c0"]) * self.d)
        elif ev == "load_q":
            self.load(["Q"], (f["r1"] - f["r0"]) * self.d)
        elif ev == "skip":
            self._flush({"k": "skip", "why": f["reason"], **self.tile_ids(f)})
        else:
            return False
        return True

    def events(self, tile, other=None):
        """A ``trace`` callable: loads and skips recorded here, ``tile(f, rows, cols)`` for each
        computed tile, ``other(ev, f)`` for any other event."""
        def on(ev, **f):
            if self.load_or_skip(ev, f):
                return
            if ev == "tile":
                tile(f, f["r1"] - f["r0"], f["c1"] - f["c0"])
            elif other is not None:
                other(ev, f)
        return on

    def tile_ids(self, f):
        return {"i": f["r0"] // self.trc, "j": f["c0"] // self.tcc,
                "r": [f["r0"], f["r1"]], "c": [f["c0"], f["c1"]]}

    def a(self, x):
        return _arr(x, self.digits)


def _inputs(n, d, seed, sq=None):
    rng = np.random.default_rng(seed)
    sq = n if sq is None else sq
    q = rng.standard_normal((sq, d))
    k = rng.standard_normal((n, d))
    v = rng.standard_normal((n, d))
    do = rng.standard_normal((sq, d))
    return q, k, v, do


def _naive(q, k, v, causal, token_mask=None, do=None):
    bias = None
    if token_mask is not None:
        bias = np.where(token_mask, 0.0, -np.inf)[None, None]
    kw = dict(window_left=-1, window_right=0 if causal else -1, attn_bias=bias)
    out, lse = naive.attention(q[None, :, None], k[None, :, None], v[None, :, None], **kw)
    grads = None
    if do is not None:
        grads = naive.attention_backward(do[None, :, None], q[None, :, None], k[None, :, None],
                                         v[None, :, None], **kw)[:3]
        grads = [g[0, :, 0] for g in grads]
    return out[0, :, 0], lse[0, 0], grads


def export_trace(view: str = "fa1", *, n: int = 16, d: int = 4, br: int = 4, bc: int = 4,
                 causal: bool = False, seed: int = 0, elem_bytes: int = 2, digits: int = 9,
                 num_splits: int = 2, sparse_group: int = 4) -> dict:
    """Run ``view``'s algorithm on seeded random ``(n, d)`` inputs and record every block step.

    ``br``/``bc``: query/key tile sizes (``decode`` uses one query row and ``bc`` only);
    ``elem_bytes``: bytes per element (2 = fp16/bf16); ``sparse_group``: the group size of
    :func:`sparse_layout` (``br`` and ``bc`` must divide it).  Returns a JSON-ready dict.
    """
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    for name, val in (("n", n), ("d", d), ("br", br), ("bc", bc)):
        if int(val) < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if view == "decode":
        causal = False  # the new token sees the whole cache
        br = 1
    sq = 1 if view == "decode" else n
    q, k, v, do = _inputs(n, d, seed, sq=sq)
    tau = 1.0 / math.sqrt(d)
    token_mask = None
    block_mask = None
    if view == "sparse":
        token_mask = sparse_layout(sq, n, sparse_group)
        block_mask = _block_mask(token_mask, br, bc)
    rec = _Recorder(d, elem_bytes, digits, br, bc)
    A = rec.a
    m_fwd, l_fwd = None, None

    if view in ("fa1", "sparse"):
        rec._flush({"k": "init", "text": "initialise O = 0, l = 0, m = -inf in HBM"},
                   hbm=sq * d + 2 * sq)

        def tile(f, rows, cols):
            rec._flush({"k": "tile", **rec.tile_ids(f), "loads": ["Q", "O", "l", "m"],
                        "stores": ["O", "l", "m"], "s": A(f["s"]),
                        "m_old": A(f["m_old"]), "m_new": A(f["m_new"]),
                        "l_old": A(f["l_old"]), "l_new": A(f["l_new"]),
                        "alpha": A(f["alpha"]), "o": A(f["o"])},
                       hbm=3 * rows * d + 4 * rows, chip=2 * rows * cols)
        on = rec.events(tile)
        out, l_fwd, m_fwd = alg.flash_attention_forward_v1(q, k, v, block_r=br, block_c=bc,
                                                           causal=causal, block_mask=block_mask,
                                                           trace=on)
        with np.errstate(divide="ignore"):
            lse = np.where(l_fwd > 0, m_fwd + np.log(l_fwd), -np.inf)
        final = {"o": A(out), "m": A(m_fwd), "l": A(l_fwd), "lse": A(lse)}

    elif view == "fa2":
        def tile(f, rows, cols):
            rec._flush({"k": "tile", **rec.tile_ids(f), "loads": ["K", "V"], "s": A(f["s"]),
                        "m_old": A(f["m_old"]), "m_new": A(f["m_new"]),
                        "l_old": A(f["l_old"]), "l_new": A(f["l_new"]),
                        "alpha": A(f["alpha"]), "acc": A(f["acc"])},
                       hbm=2 * cols * d, chip=2 * rows * cols)

        def other(ev, f):
            if ev == "store_o":
                rows = f["r1"] - f["r0"]
                rec._flush({"k": "store", "i": f["r0"] // br, "r": [f["r0"], f["r1"]],
                            "stores": ["O", "lse"], "o": A(f["o"]), "lse": A(f["lse"]),
                            "m": A(f["m"]), "l": A(f["l"])}, hbm=rows * d + rows)
        on = rec.events(tile, other)
        m_fwd = np.full(sq, -np.inf)
        l_fwd = np.zeros(sq)
        out, lse = alg.flash_attention_forward_v2(q, k, v, block_m=br, block_n=bc, causal=causal,
                                                  trace=on)
        for st in rec.steps:
            if st["k"] == "store":
                r0, r1 = st["r"]
                m_fwd[r0:r1] = [-np.inf if x is None else x for x in st["m"]]
                l_fwd[r0:r1] = st["l"]
        final = {"o": A(out), "m": A(m_fwd), "l": A(l_fwd), "lse": A(lse)}

    elif view == "backward":
        out, l_fwd, m_fwd = alg.flash_attention_forward_v1(q, k, v, block_r=br, block_c=bc,
                                                           causal=causal)
        rec._flush({"k": "init", "text": "initialise dQ, dK, dV = 0 in HBM"},
                   hbm=sq * d + 2 * n * d)

        def tile(f, rows, cols):
            rec._flush({"k": "tile", **rec.tile_ids(f),
                        "loads": ["Q", "O", "dO", "dQ", "l", "m"], "stores": ["dQ"],
                        "s": A(f["s"]), "p": A(f["p"]), "ds": A(f["ds"]),
                        "dq": A(f["dq"]), "dk": A(f["dk"]), "dv": A(f["dv"])},
                       hbm=5 * rows * d + 2 * rows, chip=4 * rows * cols)

        def other(ev, f):
            if ev == "store_kv":
                cols = f["c1"] - f["c0"]
                rec._flush({"k": "store", "j": f["c0"] // bc, "c": [f["c0"], f["c1"]],
                            "stores": ["dK", "dV"], "dk": A(f["dk"]), "dv": A(f["dv"])},
                           hbm=2 * cols * d)
        on = rec.events(tile, other)
        dq, dk, dv = alg.flash_attention_backward(do, q, k, v, out, m=m_fwd, l=l_fwd, block_r=br,
                                                  block_c=bc, causal=causal, trace=on)
        with np.errstate(divide="ignore"):
            lse = np.where(l_fwd > 0, m_fwd + np.log(l_fwd), -np.inf)
        final = {"o": A(out), "m": A(m_fwd), "l": A(l_fwd), "lse": A(lse),
                 "dq": A(dq), "dk": A(dk), "dv": A(dv)}

    else:  # decode
        m_fwd = np.full(sq, -np.inf)
        l_fwd = np.zeros(sq)
        n_split = [0]

        def on(ev, **f):
            if ev == "split":
                n_split[0] += 1
                return
            if ev == "load_q":
                rec.load(["q"], (f["r1"] - f["r0"]) * d)
            elif ev == "tile":
                cols = f["c1"] - f["c0"]
                rec._flush({"k": "tile", "split": f["split"], **rec.tile_ids(f),
                            "loads": ["K", "V"], "s": A(f["s"]),
                            "m_old": A(f["m_old"]), "m_new": A(f["m_new"]),
                            "l_old": A(f["l_old"]), "l_new": A(f["l_new"]),
                            "alpha": A(f["alpha"]), "acc": A(f["acc"])},
                           hbm=2 * cols * d, chip=2 * sq * cols)
            elif ev == "store_o":
                rec._flush({"k": "store", "split": f["split"], "i": 0, "r": [0, sq],
                            "stores": ["O_split", "lse_split"], "o": A(f["o"]),
                            "lse": A(f["lse"]), "m": A(f["m"]), "l": A(f["l"])},
                           hbm=sq * d + sq)
            elif ev == "merge":
                ns = len(f["lses"])
                rec._flush({"k": "merge", "loads": ["O_split", "lse_split"],
                            "stores": ["O", "lse"], "lses": A(f["lses"]),
                            "weights": A(f["weights"]), "o": A(f["o"]), "lse": A(f["lse"])},
                           hbm=ns * (sq * d + sq) + sq * d + sq)
        out, lse = alg.split_kv_decode(q, k, v, num_splits=num_splits, block_n=bc, trace=on)
        # the statistics over the whole cache from the splits': m = max m_s, l = sum l_s e^(m_s - m)
        ms = np.array([[-np.inf if x is None else x for x in st["m"]] for st in rec.steps
                       if st["k"] == "store"])  # [splits, Sq]
        ls = np.array([st["l"] for st in rec.steps if st["k"] == "store"])
        m_fwd = ms.max(axis=0)
        l_fwd = (ls * alg.exp_sub(ms.T, m_fwd).T).sum(axis=0)
        final = {"o": A(out), "m": A(m_fwd), "l": A(l_fwd), "lse": A(lse)}

    naive_o, naive_lse, grads = _naive(q, k, v, causal, token_mask,
                                       do if view == "backward" else None)
    naive_d = {"o": A(naive_o), "lse": A(naive_lse)}
    err = float(np.max(np.abs(out - naive_o))) if out.size else 0.0
    if grads is not None:
        naive_d.update(dq=A(grads[0]), dk=A(grads[1]), dv=A(grads[2]))
        err = max(err, *(float(np.max(np.abs(a - b))) for a, b in zip((dq, dk, dv), grads)))
    n_tiles = sum(1 for s in rec.steps if s["k"] == "tile")
    n_skip = sum(1 for s in rec.steps if s["k"] == "skip")
    std = io_formula(view, sq, n, d, br, bc, num_splits=num_splits)["standard"]
    # peak on-chip footprint of one step: the Q, K, V, O tiles, one Br x Bc tile, row stats
    footprint = (2 * br * d + 2 * bc * d + br * bc + 4 * br) * elem_bytes
    inputs = {"q": A(q), "k": A(k), "v": A(v)}
    if view == "backward":
        inputs["do"] = A(do)
    return {
        "meta": {"view": view, "title": VIEW_TITLES[view], "n": n, "d": d, "sq": sq, "sk": n,
                 "br": br, "bc": bc, "tr": -(-sq // br), "tc": -(-n // bc), "causal": causal,
                 "seed": seed, "scale": _num(tau, digits), "elem_bytes": elem_bytes,
                 "num_splits": num_splits if view == "decode" else None,
                 "sparse_group": sparse_group if view == "sparse" else None,
                 "block_mask": block_mask.astype(int).tolist() if block_mask is not None else None,
                 "tiles_visited": n_tiles, "tiles_skipped": n_skip,
                 "sram_footprint": footprint, "digits": digits},
        "inputs": inputs,
        "steps": rec.steps,
        "final": final,
        "naive": naive_d,
        "max_abs_diff": max(err, DIFF_BOUND),
        "bytes": {"flash_hbm": rec.hbm * elem_bytes,
                  "flash_sram": (2 * rec.hbm + 2 * rec.chip) * elem_bytes,
                  "standard_hbm": std * elem_bytes, "standard_sram": 2 * std * elem_bytes},
    }


def _key(view, n, br, bc, causal):
    return f"{view}|{n}|{br}|{bc}|{int(bool(causal))}"


def export_traces(ns=DEFAULT_NS, d: int = 4, tiles=DEFAULT_TILES, seed: int = 0,
                  elem_bytes: int = 2, digits: int = 9, max_tiles: int = 8) -> dict:
    """Every view x sequence length x tile pair x causal flag, keyed ``view|n|br|bc|causal``.

    Tile sizes larger than ``n``, or giving more than ``max_tiles`` tiles per side, are left
    out.  The sparse view groups tokens by the largest tile size that still makes 4 groups and
    offers the tile sizes that divide it, so every tile pair computes the same function.
    """
    ns = sorted({int(x) for x in ns})
    tiles = sorted({int(x) for x in tiles})
    if any(max(tiles) % t for t in tiles):
        raise ValueError(f"every tile size must divide the largest one ({max(tiles)}), got {tiles}")
    traces = {}
    for n in ns:
        # at most max_tiles tiles per side, so every trace stays short enough to watch
        ts = [t for t in tiles if t <= n and -(-n // t) <= max_tiles] or [n]
        # the sparse view's groups: the largest tile size that still gives 4 groups, and only
        # the tile sizes that divide it (so the layout is the same function for all of them)
        group = max([t for t in ts if n // t >= 4] or [min(ts)])
        for view in VIEWS:
            vts = [t for t in ts if group % t == 0] if view == "sparse" else ts
            for causal in ((False,) if view == "decode" else (False, True)):
                for br in ((1,) if view == "decode" else vts):
                    for bc in vts:
                        tr = export_trace(view, n=n, d=d, br=br, bc=bc, causal=causal, seed=seed,
                                          elem_bytes=elem_bytes, digits=digits,
                                          sparse_group=group)
                        traces[_key(view, n, br, bc, causal)] = tr
    # the same formulas at a realistic size: one head, N = 4096, d = 64, 128 x 128 tiles
    at_scale = {"n": 4096, "d": 64, "br": 128, "bc": 128,
                "views": {v: {k: x * elem_bytes for k, x in
                              io_formula(v, 1 if v == "decode" else 4096, 4096, 64, 128, 128).items()}
                          for v in VIEWS}}
    return {"ns": ns, "d": d, "tiles": tiles, "views": list(VIEWS), "titles": VIEW_TITLES,
            "seed": seed, "elem_bytes": elem_bytes, "at_scale": at_scale, "traces": traces}


def traces_js(bundle: dict) -> str:
    """The bundle as a script that sets ``window.FLASHTILE_TRACES``."""
    body = json.dumps(bundle, separators=(",", ":"), allow_nan=False)
    return ("// Generated by python -m flashtile explain (flashtile.explain.export_traces).\n"
            f"window.FLASHTILE_TRACES = {body};\n")


# ----------------------------------------------------------------------------------------------
# The page


def template() -> str:
    """The page template shipped in the package (``flashtile/explainer.html``)."""
    return (resources.files("flashtile") / TEMPLATE).read_text(encoding="utf-8")


def page_html(bundle: dict) -> str:
    """The self-contained page: the template with ``bundle`` (:func:`export_traces`) inlined."""
    # "</" inside an inline script would end it early; "<\/" is the same string to JavaScript
    script = traces_js(bundle).replace("</", "<\\/")
    page = template()
    if page.count(TRACES_SLOT) != 1:
        raise RuntimeError(f"the template {TEMPLATE} must hold {TRACES_SLOT} exactly once")
    return page.replace(TRACES_SLOT, script.rstrip("\n"))


def write_page(out, *, ns=DEFAULT_NS, d: int = 4, tiles=DEFAULT_TILES, seed: int = 0,
               elem_bytes: int = 2, max_tiles: int = 8) -> Path:
    """Write ``out/index.html`` with the traces of these sizes inlined; returns its path."""
    out = Path(out)
    bundle = export_traces(ns=ns, d=d, tiles=tiles, seed=seed, elem_bytes=elem_bytes,
                           max_tiles=max_tiles)
    out.mkdir(parents=True, exist_ok=True)
    index = out / "index.html"
    index.write_text(page_html(bundle), encoding="utf-8")
    return index


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile explain",
        description="Write the interactive FlashAttention explainer (one static page, "
                    "DIR/index.html) and optionally open it in a browser.")
    p.add_argument("--out", type=Path, default=None,
                   help="directory to write index.html to (default: a new temporary directory)")
    p.add_argument("--n", type=_positive, nargs="+", default=list(DEFAULT_NS), metavar="N",
                   help="sequence lengths offered by the page (default: %(default)s)")
    p.add_argument("--d", type=_positive, default=4, metavar="D",
                   help="head dimension (default: %(default)s)")
    p.add_argument("--tiles", type=_positive, nargs="+", default=list(DEFAULT_TILES),
                   metavar="T", help="tile sizes offered for Br and Bc; each must divide the "
                                     "largest (default: %(default)s)")
    p.add_argument("--max-tiles", type=_positive, default=8,
                   help="leave out tile sizes that cut N into more tiles than this "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random Q, K, V")
    p.add_argument("--elem-bytes", type=_positive, default=2,
                   help="bytes per element in the IO counts (default: %(default)s, fp16/bf16)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if max(args.n) > 256 or args.d > 64:
        print("explain: keep N <= 256 and D <= 64 so the page stays readable "
              f"(got N up to {max(args.n)}, D = {args.d})", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="flashtile-explainer-"))
    try:
        index = write_page(out, ns=args.n, d=args.d, tiles=args.tiles, seed=args.seed,
                           elem_bytes=args.elem_bytes, max_tiles=args.max_tiles)
    except ValueError as e:
        print(f"explain: {e}", file=sys.stderr)
        return 2
    print(f"wrote {index}")
    if args.open:
        webbrowser.open(index.resolve().as_uri())
    return 0


if __name__ == "__main__":
    sys.exit(main())
