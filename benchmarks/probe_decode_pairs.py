"""Does reading K and V at the same offsets cost bandwidth? (GPU):
``python benchmarks/probe_decode_pairs.py OUT.json``.

``probe_decode_stripped.py`` / ``probe_decode_oneshot.py`` found every split kernel at batch 1,
16K (64 MiB of K and V) at 27.5-28.5 us, the library's pipelined loop or not, math or not,
against 24.9 us for a plain read of one 64 MiB buffer.  A split kernel reads two buffers (K
and V) at the same offsets at the same time.  This probe times plain reads (8 KB per program,
as ``bench_decode.plain_read``) of:

- ``one``: one 64 MiB buffer;
- ``pair``: two 32 MiB buffers, program ``p`` reading chunk ``p`` of each, at offsets
  ``shift`` chunks apart (0: the same offsets, as K and V of one key tile);
- ``pair_kv``: the K and V caches of the decode bench, same shapes;
- ``stripped``: the probe split kernel of ``probe_decode_stripped.py`` with V read from the
  V cache, from K itself (one buffer, read once per tile... twice: the loads are separate), and
  from a copy of V placed at an offset inside a larger allocation.
"""
import json
import sys
import time

import torch
import triton
import triton.language as tl

from flashtile.bench_decode import graph_ms, plain_read

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_decode_stripped import stripped_fn  # noqa: E402


@triton.jit
def _pair_read(a_ptr, b_ptr, out_ptr, n_chunks, shift, BLOCK: tl.constexpr):
    """``out[p] = sum(a[chunk p]) + sum(b[chunk (p + shift) % n_chunks])``."""
    i_p = tl.program_id(0)
    o_a = i_p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    o_b = ((i_p + shift) % n_chunks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    b_a = tl.load(a_ptr + o_a).to(tl.float32)  # [BLOCK]
    b_b = tl.load(b_ptr + o_b).to(tl.float32)  # [BLOCK]
    tl.store(out_ptr + i_p, tl.sum(b_a, 0) + tl.sum(b_b, 0))


def pair_read(a, b, shift, chunk_bytes=4096):
    block = chunk_bytes // a.element_size()
    n_chunks = a.numel() // block
    out = torch.empty(n_chunks, device=a.device, dtype=torch.float32)
    return lambda: _pair_read[(n_chunks,)](a, b, out, n_chunks, shift, BLOCK=block, num_warps=4)


def main(path):
    h, hk, d, dt, cache = 32, 8, 128, torch.bfloat16, 16384
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command="python benchmarks/probe_decode_pairs.py OUT.json")
    nbytes = 2 * cache * hk * d * 2

    def add(**r):
        if r.get("ms"):
            r["GBps"] = nbytes / r["ms"] / 1e6
        rows.append(r)
        print(json.dumps(r), flush=True)

    one = torch.randn(nbytes // 2, device="cuda", dtype=dt)
    for rep in range(2):
        add(impl="one", rep=rep, ms=graph_ms(plain_read(one)))
        add(impl="one_halves_as_pair", rep=rep, ms=graph_ms(pair_read(one[: one.numel() // 2], one[one.numel() // 2:], 0)))
    del one
    a, b = (torch.randn(nbytes // 4, device="cuda", dtype=dt) for _ in range(2))
    add(impl="pair_addresses", a=a.data_ptr(), b=b.data_ptr(), diff=b.data_ptr() - a.data_ptr())
    for chunk in (4096, 8192, 16384):
        for shift in (0, 1, 7, 64, 1000, None):
            n_chunks = a.numel() * 2 // chunk
            s = n_chunks // 2 if shift is None else shift
            add(impl="pair", chunk=chunk, shift=s, ms=graph_ms(pair_read(a, b, s, chunk)))
    del a, b
    q = torch.randn(1, 1, h, d, device="cuda", dtype=dt)
    kc, vc = (torch.randn(1, cache, hk, d, device="cuda", dtype=dt) for _ in range(2))
    add(impl="pair_kv", shift=0, ms=graph_ms(pair_read(kc.view(-1), vc.view(-1), 0)))
    for splits, block_n, warps, stages in ((16, 64, 4, 3), (32, 64, 2, 2), (64, 64, 4, 1)):
        cfg = dict(splits=splits, block_n=block_n, warps=warps, stages=stages)
        add(impl="stripped", v="v_cache", **cfg, ms=graph_ms(stripped_fn(q, kc, vc, splits, block_n, warps, stages, 0, 1)[0]))
        add(impl="stripped", v="k_cache", **cfg, ms=graph_ms(stripped_fn(q, kc, kc, splits, block_n, warps, stages, 0, 1)[0]))
        for off_kb in (4, 68, 1028):
            big = torch.empty(vc.numel() + off_kb * 512, device="cuda", dtype=dt)
            v_off = big[off_kb * 512:].view_as(vc)
            v_off.copy_(vc)
            add(impl="stripped", v=f"v_at_{off_kb}KB", **cfg,
                ms=graph_ms(stripped_fn(q, kc, v_off, splits, block_n, warps, stages, 0, 1)[0]))
            del big, v_off
    with open(path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode_pairs.json")
