"""Split counts for a paged KV cache (GPU): ``python benchmarks/probe_decode_paged.py OUT.json``.

nheads 32 / nheads_k 8, d=128, bf16, one query token, full caches read through a block table
in random page order; batches 1/8/16/64, caches 16K/64K, pages of 16 (a 64-key tile spans four
pages: per-key lookups) and 64/256 (one lookup per tile).  Each split count, and the default,
is timed as the decode bench times (graph replay, L2 emptied by a read), with the contiguous
cache's default alongside.
"""
import json
import sys
import time

import torch

import flashtile
from flashtile.backends.triton import launch_decode
from flashtile.bench_decode import graph_ms

H, HK, D, DT = 32, 8, 128, torch.bfloat16



def main(path):
    rows = []
    for batch in (1, 8, 16, 64):
        for cache in (16384, 65536):
            q = torch.randn(batch, 1, H, D, device="cuda", dtype=DT)
            kc, vc = (torch.randn(batch, cache, HK, D, device="cuda", dtype=DT) for _ in range(2))
            lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
            base = dict(batch=batch, cache=cache, bytes=2 * kc.numel() * 2)
            ms = graph_ms(lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))
            rows.append(dict(base, impl="contiguous_default", splits=launch_decode.default_num_splits(q, HK, cache), ms=ms))
            print(rows[-1], flush=True)
            for page in (16, 64, 256):
                per = cache // page
                kp, vp = kc.view(batch * per, page, HK, D), vc.view(batch * per, page, HK, D)
                table = torch.randperm(batch * per, device="cuda").reshape(batch, per).to(torch.int32)
                default = launch_decode.default_num_splits(q, HK, cache, page_size=page)
                for s in sorted({0, 1, 2, 4, 8, 16, 33, 66} - ({16, 33, 66} if batch >= 16 else set())):
                    ms = graph_ms(lambda s=s: flashtile.flash_attn_with_kvcache(
                        q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=s))
                    rows.append(dict(base, impl="paged", page=page, splits=s or default, default=s == 0, ms=ms))
                    print(rows[-1], flush=True)
            del q, kc, vc, kp, vp, table
            torch.cuda.empty_cache()
    for r in rows:
        r["GBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                       command="python benchmarks/probe_decode_paged.py OUT.json", rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode_paged.json")
