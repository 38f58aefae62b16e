"""Does the K/V cache layout bound the batch-1 split kernel? (GPU)
``python benchmarks/probe_decode_layout.py OUT.json``

Batch 1, 16K and 64K caches, nheads 32 / nheads_k 8, d=128, bf16, timed as the decode bench
times (graph replay, L2 emptied by a read).  The same kernel reads the cache in flash-attn's
``(batch, seqlen, nheads_k, d)`` layout (a key tile of one head is 64 rows of 256 B, 2 KB
apart) and through a ``(batch, nheads_k, seqlen, d)`` tensor viewed with the same shape (a
tile is 16 KB in one piece), with its combine and without, over pipeline stages.
"""
import json
import sys
import time

import torch

import flashtile
import flashtile.decode
from flashtile.backends.triton import launch_decode
from flashtile.bench_decode import graph_ms, plain_read

H, HK, D, DT = 32, 8, 128, torch.bfloat16
# the launch internals are patched below: replaying a recorded eager call would bypass that
flashtile.decode.EAGER_PLANS = False



def main(path):
    rows = []
    real_cfg, real_merge = launch_decode._attn_config, launch_decode._merge
    for cache in (16384, 65536):
        q = torch.randn(1, 1, H, D, device="cuda", dtype=DT)
        lens = torch.full((1,), cache, dtype=torch.int32, device="cuda")
        layouts = {
            "token_major": [torch.randn(1, cache, HK, D, device="cuda", dtype=DT) for _ in range(2)],
            "head_major": [torch.randn(1, HK, cache, D, device="cuda", dtype=DT).transpose(1, 2) for _ in range(2)],
        }
        rows.append(dict(cache=cache, impl="read_same_bytes",
                         ms=graph_ms(plain_read(torch.randn(2 * cache * HK * D, device="cuda", dtype=DT)))))
        print(rows[-1], flush=True)
        for stages in (3, 4, 5):
            launch_decode._attn_config = lambda *a, st=stages: (16, 64, 128, 4, st)
            launch_decode._plan.cache_clear()
            for name, (kc, vc) in layouts.items():
                for combine in (True, False):
                    launch_decode._merge = real_merge if combine else (lambda *a, **k: None)
                    ms = graph_ms(lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens))
                    rows.append(dict(cache=cache, impl=("split+combine" if combine else "split_only"),
                                     layout=name, stages=stages, splits=16, ms=ms))
                    print(rows[-1], flush=True)
        launch_decode._attn_config, launch_decode._merge = real_cfg, real_merge
        launch_decode._plan.cache_clear()
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                       command="python benchmarks/probe_decode_layout.py OUT.json", rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode_layout.json")
