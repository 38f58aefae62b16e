"""Where batch-1 decode loses bandwidth (GPU): ``python benchmarks/probe_decode.py OUT.json``.

Batch 1, nheads 32 / nheads_k 8, d=128, bf16, one query token, caches of 16K and 64K.  Every
timing is a CUDA-graph replay timed as ``python -m flashtile.bench decode`` times it (median,
L2 emptied by a read before each replay):
- the split-KV kernel alone (the combine replaced by nothing) and with its combine, over split
  counts, key tiles, pipeline stages and warps;
- a plain read of the same number of bytes (``bench_decode.plain_read``), the floor at this size.
"""
import itertools
import json
import sys
import time

import torch

import flashtile
import flashtile.decode
from flashtile.backends.triton import launch_decode
from flashtile.bench_decode import graph_ms, plain_read

# the launch internals are patched below: replaying a recorded eager call would bypass that
flashtile.decode.EAGER_PLANS = False


def main(path):
    h, hk, d, dt = 32, 8, 128, torch.bfloat16
    rows = []
    real_attn_config, real_merge = launch_decode._attn_config, launch_decode._merge
    for cache in (16384, 65536):
        q = torch.randn(1, 1, h, d, device="cuda", dtype=dt)
        kc, vc = (torch.randn(1, cache, hk, d, device="cuda", dtype=dt) for _ in range(2))
        lens = torch.full((1,), cache, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * kc.element_size()
        src = torch.randn(nbytes // 2, device="cuda", dtype=dt)
        base = dict(cache=cache, bytes=nbytes)
        rows.append(dict(base, impl="read_same_bytes", ms=graph_ms(plain_read(src))))
        rows.append(dict(base, impl="default", splits=launch_decode.default_num_splits(q, hk, cache),
                         ms=graph_ms(lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))))
        print(rows[-2:], flush=True)
        del src
        for block_n, stages, warps in itertools.product((32, 64, 128), (2, 3, 4, 5), (4, 8)):
            if block_n * stages > 384:  # past the shared memory of one SM
                continue
            launch_decode._attn_config = lambda *a, bn=block_n, st=stages, w=warps: (16, bn, 128, w, st)
            launch_decode._plan.cache_clear()
            for splits in (8, 16, 24, 32, 64):
                for combine in (True, False):
                    launch_decode._merge = real_merge if combine else (lambda *a: None)
                    try:
                        ms = graph_ms(lambda: flashtile.flash_attn_with_kvcache(
                            q, kc, vc, cache_seqlens=lens, num_splits=splits))
                    except Exception as exc:  # an invalid config: record and go on
                        ms = None
                        print(type(exc).__name__, exc, file=sys.stderr)
                    rows.append(dict(base, impl="split+combine" if combine else "split_only",
                                     block_n=block_n, stages=stages, warps=warps, splits=splits, ms=ms))
            launch_decode._merge = real_merge
        launch_decode._attn_config = real_attn_config
        launch_decode._plan.cache_clear()
        for r in rows:
            if r.get("ms") and "GBps" not in r:
                r["GBps"] = r["bytes"] / r["ms"] / 1e6
        best = sorted((r for r in rows if r["cache"] == cache and r.get("ms") and r["impl"] == "split+combine"),
                      key=lambda r: r["ms"])[:8]
        best_split = sorted((r for r in rows if r["cache"] == cache and r.get("ms") and r["impl"] == "split_only"),
                            key=lambda r: r["ms"])[:5]
        print("best split+combine", json.dumps(best), "\nbest split only", json.dumps(best_split), flush=True)
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode.json")
