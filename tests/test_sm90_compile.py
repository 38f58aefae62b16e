"""The Hopper forward and backward kernels (Gluon) compiled for sm_90a on this CPU-only machine: Triton's own
compiler and ptxas run without a GPU, so a change that breaks the kernel's compilation, its
shared-memory budget or its structure fails here and not first on the H100.  Its numerics are
tested on the GPU (``tests/gpu/test_sm90_forward.py``).

The compilation runs in a child process without ``TRITON_INTERPRET``: this test session set it
before Triton's language library was imported (tests/conftest.py), and an interpreted library
function cannot be compiled."""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

SMEM_LIMIT = 227 * 1024  # per block on sm_90
# ptxas's spill stores per kernel: the variants spill 0-132 bytes (the most: the causal d = 256
# forward, once a work item, none in its key loops: nvdisasm, docs/dev/tuning-log.md, step
# 133); a consumer that spills in its loop, as the fused backward's did with lse and delta in
# registers (740 bytes, ~15% of its time; step 41), fails here
SPILL_LIMIT = 160
WIDE_SPILL_LIMIT = 640  # the d = 256 fused backward (key masks only): 376-516 bytes

# Prints one JSON line per variant: what the compiled kernel is made of.
_COMPILE = r'''
import json, os, re, subprocess, tempfile
import torch, triton
from triton.backends.nvidia.compiler import get_ptxas
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from flashtile.backends.triton import launch_sm90
from flashtile.backends.triton.kernels.attn_fwd_sm90 import (attn_fwd_sm90_kernel,
                                                              attn_fwd_split_sm90_kernel)
from flashtile.backends.triton.kernels.attn_bwd_sm90 import (attn_bwd_sm90_kernel,
                                                              attn_bwd_split_sm90_kernel)
from flashtile.backends.triton.kernels.attn_bwd_dq_sm90 import (attn_bwd_dq_sm90_kernel,
                                                                attn_bwd_dq_split_sm90_kernel)
from triton.experimental.gluon import language as gl


def desc(ty, rows, head_dim, dtype, ragged, heads=False):
    # a RAGGED launch's descriptors are 3-D: one tile of one sequence; a padded head dim's
    # with heads side by side have a dimension for the heads (4-D with RAGGED)
    layout = launch_sm90._layout(rows, head_dim, dtype, ragged, heads)
    block = ", ".join(map(str, launch_sm90._block(rows, head_dim, ragged, heads)))
    return f"tensordesc<{ty}[{block}],{layout!r}>"


# this process compiles every SHARDS-th variant from the SHARD-th on (the fixture runs one
# process per core)
SHARD, SHARDS = map(int, os.environ.get("SM90_COMPILE_SHARD", "0/1").split("/"))
_emitted = [0]


def emit(name, kernel, types, head_dim, causal, maxnreg=None, **flags):
    _emitted[0] += 1
    if (_emitted[0] - 1) % SHARDS != SHARD:
        return
    # every other argument an integer, none equal to 1 (as the launcher specialises a call)
    names = kernel.arg_names
    if "DK_COLS" in names:  # dK, dV as wide as the kernel unless a variant says otherwise
        flags.setdefault("DK_COLS", head_dim)
    mask = "MASKED" if "MASKED" in names else "CAUSAL"  # the forward masks any window
    types = dict(types, STAGES="constexpr", num_warps="constexpr",
                 **{flag: "constexpr" for flag in (mask, *flags)})
    types.update({n: "i32" for n in names if n not in types})
    constexprs = {(names.index(mask),): causal, (names.index("STAGES"),): launch_sm90.STAGES,
                  (names.index("num_warps"),): launch_sm90.NUM_WARPS}
    constexprs.update({(names.index(flag),): value for flag, value in flags.items()})
    src = GluonASTSource(kernel, {n: types[n] for n in names}, constexprs)
    options = {"num_warps": launch_sm90.NUM_WARPS}
    if flags.get("CONSUMERS") == 1:  # two or three CTAs an SM: the launcher's register cap
        options["maxnreg"] = maxnreg or launch_sm90._ONE_CONSUMER[2][1]
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm["ptx"]
    # ptxas's resource report of the same PTX: spilled registers (local memory) of the kernel
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(ptx)
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o",
                                 os.path.join(tmp, "k.cubin")], capture_output=True,
                                text=True, check=True).stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
    print(json.dumps(dict(
        variant=f"{name}-d{head_dim}-{'causal' if causal else 'full'}", head_dim=head_dim,
        shared=k.metadata.shared, num_warps=k.metadata.num_warps,
        cubin_bytes=len(k.asm["cubin"]),
        ops={op: op in ptx for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg",
                                      "mbarrier.try_wait")},
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.[2-5]d\.global\.shared", ptx)),
        tma_reductions=ptx.count("cp.reduce.async.bulk.tensor"),
        atomics=len(re.findall(r"\s(?:atom|red)\.", ptx)), spill_bytes=spills,
        maxnreg=int(re.search(r"\.maxnreg (\d+)", ptx).group(1)))))


# "r": RAGGED (lengths that are not multiples of the tiles), "k": a key mask (its ranges int32,
# its rows uint8; without one the lse pointer stands in), bf16 only
for dtype, ragged, keymask in ((torch.bfloat16, False, False), (torch.float16, False, False),
                               (torch.bfloat16, True, False), (torch.bfloat16, False, True)):
    ty = "bf16" if dtype == torch.bfloat16 else "fp16"
    r = ("r" if ragged else "") + ("k" if keymask else "")
    masks = dict(Ranges="*i32", KeyMask="*u8") if keymask else dict(Ranges="*fp32",
                                                                     KeyMask="*fp32")
    for causal in (False, True):
        for head_dim in (64, 128, 256):
            bq, bn = launch_sm90.BLOCK_M // 2, launch_sm90.block_n(head_dim)
            fwd_types = dict(desc_q=desc(ty, bq, head_dim, dtype, ragged),
                             desc_k=desc(ty, bn, head_dim, dtype, ragged),
                             desc_v=desc(ty, bn, head_dim, dtype, ragged),
                             desc_o=desc(ty, bq, head_dim, dtype, ragged), Lse="*fp32",
                             qk_scale="fp32", **masks, CuQ="*fp32", CuK="*fp32", Items="*fp32",
                             Out=f"*{ty}")
            # (and three consumers with masking: causal from THREE_CONSUMER_ROWS queries)
            three = {3} if head_dim == 64 and causal and not (ragged or keymask) else set()
            for n_c in {2, launch_sm90.consumers(head_dim, causal, 0, ragged or keymask)} | three:
                emit(f"fwd{'' if n_c == 2 else n_c}{r}-{ty}", attn_fwd_sm90_kernel,
                     dict(fwd_types, Lists="*fp32"), head_dim, causal, CONSUMERS=n_c)
                if n_c == 1:  # "1t": three CTAs an SM (launch_sm90.ONE_CONSUMER_CTAS = 3)
                    tn, regs = launch_sm90._ONE_CONSUMER[3]
                    emit(f"fwd1t{r}-{ty}", attn_fwd_sm90_kernel,
                         dict(fwd_types, Lists="*fp32",
                              desc_k=desc(ty, tn, head_dim, dtype, ragged),
                              desc_v=desc(ty, tn, head_dim, dtype, ragged)),
                         head_dim, causal, maxnreg=regs, CONSUMERS=1)
            if ty == "bf16" and head_dim != 64:
                # "h": a head dim narrower than the tiles (96 at 128, 192 at 256) with heads
                # side by side: each tensor's descriptor a view of one head's columns (with
                # or without a key mask)
                hd = dict(fwd_types, **{n: desc(ty, rows, head_dim, dtype, ragged, True)
                                        for n, rows in (("desc_q", bq), ("desc_k", bn),
                                                        ("desc_v", bn), ("desc_o", bq))})
                emit(f"fwdh{r}-{ty}", attn_fwd_sm90_kernel, dict(hd, Lists="*fp32"), head_dim,
                     causal, CONSUMERS=2)
                if not r:  # "hv": packed sequences (their last row tiles stored by the kernel)
                    emit(f"fwdhv-{ty}", attn_fwd_sm90_kernel,
                         dict(hd, Lists="*fp32", CuQ="*i32", CuK="*i32", Items="*i32"),
                         head_dim, causal, CONSUMERS=2)
            if not r and ty == "bf16":
                # "s": a block mask (its lists int32, lengths multiples of the tiles)
                emit("fwds-bf16", attn_fwd_sm90_kernel, dict(fwd_types, Lists="*i32"),
                     head_dim, causal, CONSUMERS=2)
                # "v": packed sequences (cumulative lengths int32; 2-D descriptors; one or two
                # consumers as the launcher chooses for them)
                for n_c in {2, launch_sm90.consumers(head_dim, causal, 0, True)}:
                    emit(f"fwd{'' if n_c == 2 else n_c}v-bf16", attn_fwd_sm90_kernel,
                         dict(fwd_types, Lists="*fp32", CuQ="*i32", CuK="*i32", Items="*i32"),
                         head_dim,
                         causal, CONSUMERS=n_c)
                    if n_c == 1:  # (three CTAs an SM, as "1t" above)
                        tn, regs = launch_sm90._ONE_CONSUMER[3]
                        emit("fwd1tv-bf16", attn_fwd_sm90_kernel,
                             dict(fwd_types, Lists="*fp32", CuQ="*i32", CuK="*i32",
                                  Items="*i32", desc_k=desc(ty, tn, head_dim, dtype, False),
                                  desc_v=desc(ty, tn, head_dim, dtype, False)),
                             head_dim, causal, maxnreg=regs, CONSUMERS=1)
        for head_dim in (192, 96) if ty == "bf16" else ():
            # "p": a head dim of two tile widths (launch_sm90.split_width: 128 + 64, 64 + 32),
            # two descriptors a tensor, the key tiles of the next width's kernel (with or
            # without a key mask; "pv": packed sequences)
            first = launch_sm90.split_width(head_dim)
            bq = launch_sm90.BLOCK_M // 2
            bn = launch_sm90.block_n(launch_sm90.padded_width(head_dim))
            pieces = {f"desc_{n}{s}": desc(ty, rows, cols, dtype, ragged)
                      for s, cols in (("", first), ("2", head_dim - first))
                      for n, rows in (("q", bq), ("k", bn), ("v", bn), ("o", bq))}
            p_types = dict(pieces, Lse="*fp32", qk_scale="fp32", **masks, CuQ="*fp32",
                           CuK="*fp32", Items="*fp32", Out=f"*{ty}", Lists="*fp32")
            emit(f"fwdp{r}-{ty}", attn_fwd_split_sm90_kernel, p_types, head_dim, causal,
                 CONSUMERS=2)
            if not r:
                emit(f"fwdpv-{ty}", attn_fwd_split_sm90_kernel,
                     dict(p_types, CuQ="*i32", CuK="*i32", Items="*i32"), head_dim, causal,
                     CONSUMERS=2)
            if head_dim == 192 and not keymask:
                # "dqp": the split dQ kernel (launch_sm90.DQ_SPLIT: 128 + 64, two descriptors
                # of q, dO, k, v and dq each)
                rows, dq_n = launch_sm90.DQ_ROWS, launch_sm90.DQ_SPLIT_BLOCK_N
                flat = f"tensordesc<fp32[{rows}],{launch_sm90._flat_layout()!r}>"
                pieces = {f"desc_{n}{s}": desc(ty, nr, cols, dtype, ragged)
                          for s, cols in (("", 128), ("2", head_dim - 128))
                          for n, nr in (("q", rows), ("do", rows), ("k", dq_n), ("v", dq_n),
                                        ("dq", rows))}
                emit(f"dqp{r}-{ty}", attn_bwd_dq_split_sm90_kernel,
                     dict(pieces, desc_lse=flat, desc_delta=flat, scale="fp32",
                          qk_scale="fp32"), head_dim, causal, WINDOW=False, RAGGED=ragged)
        for head_dim in (64, 128, 256):
            # K/V tiles: each consumer's 64 keys, or with RAGGED both consumers' 128; at d = 256
            # the item's 64 keys (both consumers')
            keys = launch_sm90.bwd_keys(head_dim)
            bm = launch_sm90.bwd_rows(head_dim)
            bn = keys // (1 if ragged or head_dim == 256 else 2)
            flat = f"tensordesc<fp32[{bm}],{launch_sm90._flat_layout()!r}>"
            acc_cols = head_dim // (8 if head_dim == 256 else 2)
            types = dict(desc_q=desc(ty, bm, head_dim, dtype, ragged),
                         desc_do=desc(ty, bm, head_dim, dtype, ragged),
                         desc_k=desc(ty, bn, head_dim, dtype, ragged),
                         desc_v=desc(ty, bn, head_dim, dtype, ragged), desc_lse=flat,
                         desc_delta=flat, desc_dq=desc("fp32", bm, acc_cols, torch.float32,
                                                       ragged),
                         DK=f"*{ty}", DV=f"*{ty}", Counter="*i32", scale="fp32",
                         qk_scale="fp32", **masks, Lists="*fp32", CuQ="*fp32", CuK="*fp32",
                         # dK and dV stored by TMA in tiles of a consumer's keys (never read
                         # where the kernel stores them itself)
                         desc_dk=desc(ty, keys // 2, head_dim, dtype, False),
                         desc_dv=desc(ty, keys // 2, head_dim, dtype, False))
            tma_dkdv = not ragged and head_dim != 256
            if head_dim == 256 and ty == "bf16" and not keymask:
                # "dkdvp": the split dK/dV kernel at d = 192 (launch_sm90.BWD_SPLIT: q, dO, k
                # and v through two descriptors each, 128 + 64 columns; the 64-key items of
                # d = 256, dK and dV stored by the kernel)
                split_types = dict(types, **{f"desc_{n}{s}": desc(ty, rows, cols, dtype, ragged)
                                             for s, cols in (("", 128), ("2", 64))
                                             for n, rows in (("q", bm), ("do", bm), ("k", keys),
                                                             ("v", keys))},
                                   desc_dq2=types["desc_dq"])
                emit(f"dkdvp{r}-{ty}", attn_bwd_split_sm90_kernel, split_types, 192, causal,
                     WINDOW=False, DQ=False, PERSISTENT=False, RAGGED=ragged, DKDV_TMA=False)
            if head_dim == 128 and ty == "bf16":
                # "bwdp": the kernel at d = 96 (launch_sm90.BWD128_SPLIT: q, dO, k and v
                # through two descriptors each, 64 + 32 columns, K and V one tile of the
                # item's keys; the dQ accumulator's second tile through desc_dq2; the consumers
                # of d = 128, persistent as there), fused, any lengths, with or without a key
                # mask
                split_types = dict(types, **{f"desc_{n}{s}": desc(ty, rows, cols, dtype, ragged)
                                             for s, cols in (("", 64), ("2", 32))
                                             for n, rows in (("q", bm), ("do", bm), ("k", keys),
                                                             ("v", keys))},
                                   desc_dq=desc("fp32", bm, 64, torch.float32, ragged),
                                   desc_dq2=desc("fp32", bm, 32, torch.float32, ragged))
                emit(f"bwdp{r}-{ty}", attn_bwd_split_sm90_kernel, split_types, 96, causal,
                     WINDOW=False, DQ=True, PERSISTENT=launch_sm90.bwd_persistent(head_dim),
                     RAGGED=ragged, DKDV_TMA=False)
            if not keymask and head_dim == 256:  # the dQ kernel (no key mask)
                dq_n = launch_sm90.DQ_BLOCK_N
                emit(f"dq{r}-{ty}", attn_bwd_dq_sm90_kernel, dict(
                    desc_q=desc(ty, launch_sm90.DQ_ROWS, head_dim, dtype, ragged),
                    desc_do=desc(ty, launch_sm90.DQ_ROWS, head_dim, dtype, ragged),
                    desc_k=desc(ty, dq_n, head_dim, dtype, ragged),
                    desc_v=desc(ty, dq_n, head_dim, dtype, ragged), desc_lse=flat,
                    desc_delta=flat, desc_dq=desc(ty, launch_sm90.DQ_ROWS, head_dim, dtype,
                                                  ragged),
                    scale="fp32", qk_scale="fp32"), head_dim, causal, WINDOW=False,
                     RAGGED=ragged)
            if ty == "bf16" and head_dim != 64:
                # "h": a head dim narrower than the tiles (96 at 128, 192 at 256) with heads
                # side by side: q, dO, k and v read through views of one head's columns
                # (launch_sm90.padded_backward: the fused kernel at 128; at 256 the dQ kernel,
                # storing dQ through such a view, and the dK/dV kernel); K and V one tile of
                # the item's keys (a reshaped slice of the buffer is not a TMA target)
                views = {n: desc(ty, rows, head_dim, dtype, ragged, True)
                         for n, rows in (("desc_q", bm), ("desc_do", bm), ("desc_k", keys),
                                         ("desc_v", keys))}
                # (a key mask: the fused kernel at either width, "bwdhk")
                fused = head_dim == 128 or keymask
                emit(f"{'bwd' if fused else 'dkdv'}h{r}-{ty}", attn_bwd_sm90_kernel,
                     dict(types, **views), head_dim, causal, WINDOW=False, DQ=fused,
                     PERSISTENT=launch_sm90.bwd_persistent(head_dim), RAGGED=ragged,
                     DKDV_TMA=tma_dkdv)
                if head_dim == 128 and not r:
                    # "hv": packed sequences (dK, dV stored by the kernel); "hvn": into dK and
                    # dV of the head's own width (96), the columns past it masked
                    for n, cols in (("", 128), ("n", 96)):
                        emit(f"bwdhv{n}-{ty}", attn_bwd_sm90_kernel,
                             dict(types, **views, CuQ="*i32", CuK="*i32"), head_dim, causal,
                             WINDOW=False, DQ=True, PERSISTENT=True, RAGGED=False,
                             DKDV_TMA=False, DK_COLS=cols)
                if head_dim == 128 or not ragged:
                    # "n": storing into dK and dV of the head's own width (96, 192) by the
                    # kernel's own stores, the columns past it masked: the fused kernel at 128
                    # (any lengths, with or without a key mask), the dK/dV kernel (or with a key
                    # mask the fused one) at 256
                    emit(f"{'bwd' if fused else 'dkdv'}h{r}n-{ty}", attn_bwd_sm90_kernel,
                         dict(types, **views), head_dim, causal, WINDOW=False, DQ=fused,
                         PERSISTENT=launch_sm90.bwd_persistent(head_dim), RAGGED=ragged,
                         DKDV_TMA=False, DK_COLS=head_dim * 3 // 4)
                if not fused:
                    dq_rows, dq_n = launch_sm90.DQ_ROWS, launch_sm90.DQ_BLOCK_N
                    emit(f"dqh{r}-{ty}", attn_bwd_dq_sm90_kernel, dict(
                        desc_q=desc(ty, dq_rows, head_dim, dtype, ragged, True),
                        desc_do=desc(ty, dq_rows, head_dim, dtype, ragged, True),
                        desc_k=desc(ty, dq_n, head_dim, dtype, ragged, True),
                        desc_v=desc(ty, dq_n, head_dim, dtype, ragged, True), desc_lse=flat,
                        desc_delta=flat,
                        desc_dq=desc(ty, dq_rows, head_dim, dtype, ragged, True),
                        scale="fp32", qk_scale="fp32"), head_dim, causal, WINDOW=False,
                         RAGGED=ragged)
            # (a key mask: the fused kernel only)
            for fused in (True, False) if not keymask else (True,):
                kind = ("bwd" if fused else "dkdv") + r
                persistent = launch_sm90.bwd_persistent(head_dim)
                emit(f"{kind}-{ty}", attn_bwd_sm90_kernel, types, head_dim, causal, WINDOW=False,
                     DQ=fused, PERSISTENT=persistent, RAGGED=ragged, DKDV_TMA=tma_dkdv)
                if causal and not r:  # a window other than the causal one: "-causal"
                    emit(f"{kind}w-{ty}", attn_bwd_sm90_kernel, types, head_dim, True,
                         WINDOW=True, DQ=fused, PERSISTENT=persistent, RAGGED=ragged,
                         DKDV_TMA=tma_dkdv)
            if not r and ty == "bf16" and head_dim != 256:
                # "s": the fused persistent backward with a block mask (d <= 128; its lists
                # int32)
                emit("bwds-bf16", attn_bwd_sm90_kernel, dict(types, Lists="*i32"), head_dim,
                     causal, WINDOW=False, DQ=True, PERSISTENT=True, RAGGED=False,
                     DKDV_TMA=True)
                # "v": packed sequences (cumulative lengths int32; 2-D views; dK and dV
                # stored by the kernel, masked)
                # (their query tiles: launch_sm90.bwd_rows(..., packed=True, masked=causal))
                pm = launch_sm90.bwd_rows(head_dim, packed=True, masked=causal)
                p_flat = f"tensordesc<fp32[{pm}],{launch_sm90._flat_layout()!r}>"
                packed = dict(types, desc_q=desc(ty, pm, head_dim, dtype, False),
                              desc_do=desc(ty, pm, head_dim, dtype, False), desc_lse=p_flat,
                              desc_delta=p_flat,
                              desc_dq=desc("fp32", pm, acc_cols, torch.float32, False))
                emit("bwdv-bf16", attn_bwd_sm90_kernel, dict(packed, CuQ="*i32", CuK="*i32"),
                     head_dim, causal, WINDOW=False, DQ=True, PERSISTENT=True, RAGGED=False,
                     DKDV_TMA=False)
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # one process per core, each compiling a share of the variants (ptxas and Triton's
    # compiler run on one core each): 4 min on two cores where one process took 15; their
    # output goes into files (a process blocked on a full pipe would stall the others)
    shards = max(1, min(4, os.cpu_count() or 1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        outs = [(open(os.path.join(tmp, f"{i}.out"), "w+"), open(os.path.join(tmp, f"{i}.err"),
                                                              "w+")) for i in range(shards)]
        procs = [subprocess.Popen([sys.executable, "-c", _COMPILE], stdout=out, stderr=err,
                                  env=dict(env, SM90_COMPILE_SHARD=f"{i}/{shards}"))
                 for i, (out, err) in enumerate(outs)]
        try:
            for proc, (out, err) in zip(procs, outs):
                proc.wait(timeout=2400)
                err.seek(0)
                assert proc.returncode == 0, err.read()[-4000:]
                out.seek(0)
                rows += [json.loads(line) for line in out if line.startswith("{")]
        finally:
            for proc, files in zip(procs, outs):
                proc.kill()
                for f in files:
                    f.close()
    return {row["variant"]: row for row in rows}


# fwdr, bwdr, dkdvr: lengths that are not multiples of the tiles (3-D descriptors); fwdk, bwdk:
# a key mask; fwds, bwds: a block mask; fwdv, bwdv: packed sequences
VARIANTS = [f"fwd{r}-{ty}-d{d}-{mode}" for r, ty in (("", "bf16"), ("", "fp16"), ("r", "bf16"),
                                                     ("k", "bf16"), ("s", "bf16"),
                                                     ("v", "bf16"))
            for d in (64, 128, 256) for mode in ("full", "causal")] + [
    f"fwdh{r}-bf16-d{d}-{mode}" for r in ("", "r", "k", "v") for d in (128, 256)
    for mode in ("full", "causal")]  # (a padded head dim's views of heads side by side)
BWD_VARIANTS = [f"{kind}{r}-{ty}-d{d}-{mode}" for kind in ("bwd", "dkdv")
                for r, ty in (("", "bf16"), ("", "fp16"), ("r", "bf16"), ("k", "bf16"))
                if not (kind == "dkdv" and r == "k")
                for d in (64, 128, 256) for mode in ("full", "causal")] + [
    f"{kind}w-{ty}-d{d}-causal" for kind in ("bwd", "dkdv") for ty in ("bf16", "fp16")
    for d in (64, 128, 256)] + [f"bwd{x}-bf16-d{d}-{mode}" for x in "sv" for d in (64, 128)
                                for mode in ("full", "causal")] + [  # (a block mask, packed)
    f"{kind}h{r}-bf16-d{d}-{mode}" for kind, d in (("bwd", 128), ("dkdv", 256))
    for r in ("", "r") for mode in ("full", "causal")] + [
    f"bwdh{x}-bf16-d{d}-{mode}" for x, ds in (("v", (128,)), ("k", (128, 256)), ("vn", (128,)),
                                              ("n", (128,)), ("rn", (128,)),
                                              ("kn", (128, 256))) for d in ds
    for mode in ("full", "causal")] + [  # (a padded head dim's views; n: narrow dK, dV)
    f"dkdvhn-bf16-d256-{mode}" for mode in ("full", "causal")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sm90_forward_compiles_for_hopper_with_its_structure(compiled, variant):
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    # Q (two 64-row halves) + STAGES K and V tiles (+ barriers), within the per-block limit
    rows = launch_sm90.BLOCK_M + 2 * launch_sm90.STAGES * launch_sm90.block_n(row["head_dim"])
    # the output tiles, stored by TMA: one per consumer, or one shared at d = 256
    rows += launch_sm90.BLOCK_M if row["head_dim"] <= 128 else launch_sm90.BLOCK_M // 2
    tiles = rows * row["head_dim"] * 2
    assert tiles <= row["shared"] <= SMEM_LIMIT
    # 4 warps per consumer warpgroup, 2 consumers, 1 producer warp padded to a warpgroup
    assert row["num_warps"] == 12
    # asynchronous warpgroup matrix products, TMA loads, per-partition register budgets and the
    # producer/consumer handshakes are all in the code
    assert all(row["ops"].values()), row["ops"]
    # each consumer (both partitions' code) stores its output tile by TMA
    assert row["tma_stores"] == 2
    assert row["spill_bytes"] <= SPILL_LIMIT


SPLIT_VARIANTS = [f"fwdp{r}-bf16-d{d}-{mode}" for r in ("", "r", "k", "v") for d in (192, 96)
                  for mode in ("full", "causal")]


@pytest.mark.parametrize("variant", SPLIT_VARIANTS)
def test_sm90_split_forward_compiles_for_hopper_with_its_structure(compiled, variant):
    """A head dim of two tile widths (``launch_sm90.split_width``: 192 = 128 + 64, 96 = 64 +
    32) in the split kernel: Q, the K/V rings (the key tiles of the next width's kernel) and
    each consumer's output tile in two buffers each, within the shared memory; the output
    stored by two TMA stores a consumer; asynchronous matrix products of both widths, spills
    within the limit."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    d = row["head_dim"]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    tile_n = launch_sm90.block_n(launch_sm90.padded_width(d))
    rows = 2 * launch_sm90.BLOCK_M + 2 * launch_sm90.STAGES * tile_n
    assert rows * d * 2 <= row["shared"] <= SMEM_LIMIT
    assert row["num_warps"] == 12
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 4
    assert row["spill_bytes"] <= SPILL_LIMIT


@pytest.mark.parametrize("variant", ["fwd3-bf16-d64-full", "fwd3-fp16-d64-full",
                                     "fwd3-bf16-d64-causal", "fwd3-fp16-d64-causal"])
def test_sm90_forward_with_three_consumers_compiles_without_spills(compiled, variant):
    """d = 64: three consumer warpgroups at 160 registers a thread, each with its own Q and
    output tile, and no spilled register without masking; with it (causal) ptxas keeps a few of
    an item's values in local memory outside the key loops (72 bytes; nvdisasm: none in the loop
    without the mask, two loads a step in the other; with a branch on the tile in the masked
    loop, 612 bytes and 30-35 local loads and stores a step in both: docs/dev/tuning-log.md,
    step 137)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    half = launch_sm90.BLOCK_M // 2
    rows = 3 * half + 2 * launch_sm90.STAGES * launch_sm90.block_n(64) + 3 * half
    assert rows * 64 * 2 <= row["shared"] <= SMEM_LIMIT
    # 3 consumer warpgroups and the producer's (the default partition)
    assert row["num_warps"] == 16
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 3
    assert row["spill_bytes"] <= (80 if variant.endswith("causal") else 0), row["spill_bytes"]


@pytest.mark.parametrize("variant", ["fwd1-bf16-d64-causal", "fwd1-fp16-d64-causal",
                                     "fwd1r-bf16-d64-causal"])
def test_sm90_forward_with_one_consumer_fits_two_ctas_an_sm(compiled, variant):
    """d = 64 with masking over few keys: one consumer warpgroup and the producer, two CTAs an
    SM: launched at 128 registers a thread (2 x 256 threads x 128 = the register file), half
    the SM's shared memory at most, and no spill in the tile loop: ptxas keeps 4 of the item's
    values (16 bytes) in local memory from before the loop to the epilogue, with the window
    test that made the causal 1K forward 5% faster (docs/dev/tuning-log.md, step 70)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    half = launch_sm90.BLOCK_M // 2
    rows = half + 2 * launch_sm90.STAGES * launch_sm90.block_n(64) + half
    assert rows * 64 * 2 <= row["shared"] and 2 * row["shared"] <= 228 * 1024
    # 1 consumer warpgroup, 1 producer warp padded to a warpgroup
    assert row["num_warps"] == 8 and 2 * 8 * 32 * row["maxnreg"] <= 65536
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 1
    assert row["spill_bytes"] <= 16


@pytest.mark.parametrize("variant", ["fwd1t-bf16-d64-causal", "fwd1t-fp16-d64-causal",
                                     "fwd1tr-bf16-d64-causal", "fwd1tk-bf16-d64-causal",
                                     "fwd1tv-bf16-d64-causal"])
def test_sm90_forward_with_one_consumer_fits_three_ctas_an_sm(compiled, variant):
    """``launch_sm90.ONE_CONSUMER_CTAS = 3``: the one-consumer forward with 64-key tiles,
    launched at 80 registers a thread (3 x 256 threads x 80 of the 65,536), a third of the SM's
    shared memory at most (Q, two stages of K and V, the output tile), and no more spills than
    with two CTAs (16 bytes, kept from before the loop to the epilogue)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    tile_n, regs = launch_sm90._ONE_CONSUMER[3]
    half = launch_sm90.BLOCK_M // 2
    rows = half + 2 * launch_sm90.STAGES * tile_n + half
    assert rows * 64 * 2 <= row["shared"] and 3 * (row["shared"] + 1024) <= 228 * 1024
    assert row["num_warps"] == 8 and row["maxnreg"] == regs and 3 * 8 * 32 * regs <= 65536
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 1
    assert row["spill_bytes"] <= 16


@pytest.mark.parametrize("variant", BWD_VARIANTS)
def test_sm90_backward_compiles_for_hopper_with_its_structure(compiled, variant):
    """``bwd``: the fused kernel (dQ added by TMA reductions); ``dkdv``: the deterministic
    variant, which has no reduction instruction and no atomic but the persistent kernel's claims
    of work items (an integer counter, which leaves the gradients bitwise reproducible)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    d = row["head_dim"]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    keys = launch_sm90.bwd_keys(d)
    rows = launch_sm90.bwd_rows(d, variant.startswith("bwdv"), variant.endswith("causal"))
    # K and V of an item's keys + STAGES (Q, dO) tiles (+ lse, delta, barriers)
    tiles = (2 * keys + 2 * launch_sm90.STAGES * rows) * d * 2
    if variant.startswith("bwd") and d <= 128:
        # + two ds buffers [128 keys, BLOCK_M] and one float32 dq tile [BLOCK_M, D / 2] per
        # consumer
        tiles += 2 * keys * rows * 2 + 2 * rows * d // 2 * 4
    elif d == 256:
        # + the p and ds buffers [BLOCK_M, 64 keys]; with dQ one float32 tile [BLOCK_M, D / 8]
        # per consumer
        tiles += 2 * rows * keys * 2 + (2 * rows * d // 8 * 4 if variant.startswith("bwd") else 0)
    assert tiles <= row["shared"] <= SMEM_LIMIT
    assert row["num_warps"] == 12
    assert all(row["ops"].values()), row["ops"]
    if variant.startswith("bwd") and d == 256:
        # the d = 256 fused kernel, which runs for calls with a key mask only, keeps a few of
        # its loop-invariant shared-memory descriptors in local memory (376-516 bytes)
        assert row["spill_bytes"] <= WIDE_SPILL_LIMIT
    else:
        assert row["spill_bytes"] <= SPILL_LIMIT
    # persistent (d = 64): the producer's two claims of a work item, its only atomics
    claims = 2 if launch_sm90.bwd_persistent(d) else 0
    if variant.startswith("bwd"):
        # one dq reduction in each consumer's loop and one after it; at d = 256 a reduction
        # per quarter tile, in the loop and after it
        assert row["tma_reductions"] == (16 if d == 256 else 4) and row["atomics"] == claims
    else:
        assert row["tma_reductions"] == 0 and row["atomics"] == claims
    # dK and dV: one TMA store each in each consumer, but with ragged lengths, packed
    # sequences, narrower than the kernel ("n": the kernel's own stores) and at d = 256
    kind = variant.split("-")[0]
    own = (kind.rstrip("w").endswith("r") or kind.endswith("n")
           or kind in ("bwdv", "bwdhv"))
    assert row["tma_stores"] == (0 if own or d == 256 else 4), row["tma_stores"]


DQ_VARIANTS = [f"dq{r}-{ty}-d256-{mode}" for r, ty in (("", "bf16"), ("", "fp16"), ("r", "bf16"),
                                                     ("h", "bf16"), ("hr", "bf16"))
               for mode in ("full", "causal")]  # (h: a padded head dim's views)


@pytest.mark.parametrize("variant", DQ_VARIANTS)
def test_sm90_dq_kernel_compiles_for_hopper_with_its_structure(compiled, variant):
    """The Gluon dQ kernel (d = 256): Q and dO of 128 rows and a 2-stage K/V ring in shared
    memory, asynchronous matrix products, TMA loads, one TMA store of dQ a consumer, no
    reduction and no atomic (dQ is written once); ptxas spills 0-28 bytes (28: ragged), and up
    to 64 with a padded head dim's views (48 causal: their coordinates, tuning log step
    104)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    d = row["head_dim"]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    rows, keys = 2 * launch_sm90.DQ_ROWS, launch_sm90.DQ_BLOCK_N
    tiles = (2 * rows + 2 * launch_sm90.STAGES * keys) * d * 2
    assert tiles <= row["shared"] <= SMEM_LIMIT
    assert row["num_warps"] == 12
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 2
    assert row["tma_reductions"] == 0 and row["atomics"] == 0
    assert row["spill_bytes"] <= (64 if variant.startswith("dqh") else 32), row["spill_bytes"]


SPLIT_DQ_VARIANTS = [f"dqp{r}-bf16-d192-{mode}" for r in ("", "r") for mode in ("full", "causal")]
SPLIT_DKDV_VARIANTS = [f"dkdvp{r}-bf16-d192-{mode}" for r in ("", "r")
                       for mode in ("full", "causal")]


SPLIT_BWD128_VARIANTS = [f"bwdp{r}-bf16-d96-{mode}" for r in ("", "r", "k")
                         for mode in ("full", "causal")]


@pytest.mark.parametrize("variant", SPLIT_BWD128_VARIANTS)
def test_sm90_split_backward_of_width_128_compiles_for_hopper_with_its_structure(compiled,
                                                                                variant):
    """The fused split kernel at d = 96 (64 + 32) with the consumers of d = 128: Q and dO rings
    and the item's 128 keys of K and V, each in two buffers, within the shared memory; dK and
    dV stored by the kernel (no TMA store); each consumer's dq added by TMA reductions (two
    call sites a consumer); the work counter's atomics only; no spill (0 bytes)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    rows = 2 * launch_sm90.STAGES * launch_sm90.bwd_rows(128) + 2 * launch_sm90.bwd_keys(128)
    assert rows * row["head_dim"] * 2 <= row["shared"] <= SMEM_LIMIT
    assert row["num_warps"] == 12
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 0
    assert row["tma_reductions"] == 4
    assert row["atomics"] == (2 if launch_sm90.bwd_persistent(128) else 0)
    assert row["spill_bytes"] <= 32, row["spill_bytes"]


@pytest.mark.parametrize("variant", SPLIT_DKDV_VARIANTS)
def test_sm90_split_dkdv_kernel_compiles_for_hopper_with_its_structure(compiled, variant):
    """The split dK/dV kernel at d = 192 (128 + 64): Q and dO rings and the item's 64 keys of K
    and V, each in two buffers, within the shared memory; dK and dV stored by the kernel (no
    TMA store), no reduction and no atomic; no spill (0 bytes)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    rows = 2 * launch_sm90.STAGES * launch_sm90.bwd_rows(256) + 2 * launch_sm90.bwd_keys(256)
    assert rows * row["head_dim"] * 2 <= row["shared"] <= SMEM_LIMIT
    assert row["num_warps"] == 12
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 0
    assert row["tma_reductions"] == 0 and row["atomics"] == 0
    assert row["spill_bytes"] <= 32, row["spill_bytes"]




@pytest.mark.parametrize("variant", SPLIT_DQ_VARIANTS)
def test_sm90_split_dq_kernel_compiles_for_hopper_with_its_structure(compiled, variant):
    """The split dQ kernel at d = 192 (128 + 64): Q and dO of 128 rows and a 2-stage ring of
    ``DQ_SPLIT_BLOCK_N``-key K/V tiles, each in two buffers, within the shared memory; dQ
    stored by two TMA stores a consumer; no reduction and no atomic; spills within 32 bytes
    (0-20)."""
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    rows = 2 * 2 * launch_sm90.DQ_ROWS + 2 * launch_sm90.STAGES * launch_sm90.DQ_SPLIT_BLOCK_N
    assert rows * row["head_dim"] * 2 <= row["shared"] <= SMEM_LIMIT
    assert row["num_warps"] == 12
    assert all(row["ops"].values()), row["ops"]
    assert row["tma_stores"] == 4
    assert row["tma_reductions"] == 0 and row["atomics"] == 0
    assert row["spill_bytes"] <= 32, row["spill_bytes"]


@pytest.mark.parametrize("sq, sk, window, head_dim, expected", [
    (1024, 1024, (-1, 0), 64, 1),     # causal 1K: 512 keys a row on average
    (128, 512, (-1, 0), 64, 1),       # sk > sq: 448
    (2048, 2048, (-1, 0), 64, 2),     # causal 2K: 1024
    (3072, 3072, (-1, 0), 64, 3),     # causal from 3K queries: three consumers
    (2048, 8192, (-1, 0), 64, 2),     # sk > sq: 2K queries
    (4096, 4096, (-1, 100), 64, 3),   # no lower edge
    (8192, 8192, (255, 0), 64, 1),    # a 256-key window
    (4096, 4096, (1023, 0), 64, 2),   # a 1024-key window
    (1024, 1024, (-1, -1), 64, 3),    # no mask: three consumers
    (1024, 1024, (-1, 0), 128, 2),
    (1024, 1024, (-1, 0), 256, 2),
], ids=["causal-1k", "causal-sk>sq", "causal-2k", "causal-3k", "causal-2k-sk>sq",
        "right-edge-only-4k", "window-256", "window-1024", "full", "d128", "d256"])
def test_sm90_forward_consumer_count_follows_the_keys_a_row_sees(sq, sk, window, head_dim,
                                                                  expected):
    """The forward's consumer count: one (two CTAs an SM) for masked d = 64 calls whose rows see
    few keys, where an item's first tile and epilogue weigh most; three at d = 64 without
    masking, or with a window without a lower edge from 3K queries; two otherwise."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    spec = AttnSpec(softmax_scale=0.125, window_left=window[0], window_right=window[1])
    w = launch_sm90._window(spec, sq, sk)
    keys = launch_sm90._mean_keys(sq, sk, w["wl"], w["wr"])
    assert launch_sm90.consumers(head_dim, w["MASKED"], keys, False, sq,
                                 window[0] >= 0) == expected


def _worst_over_mean(n_m, n_bh, sq, sk, n_ctas, lpt):
    """Most tiles any CTA of the persistent causal forward gets, over the mean (the kernel's
    ``_work_item`` order, written out independently)."""
    load = [0] * n_ctas
    rounds = -(-n_m * n_bh // n_ctas)
    for k in range(rounds):
        for pid in range(n_ctas):
            w = k * n_ctas + (pid if k % 2 == 0 else n_ctas - 1 - pid)
            if w >= n_m * n_bh:
                continue
            i_m = n_m - 1 - (w // n_bh if lpt else w % n_m)
            load[pid] += -(-min(sk, (i_m + 1) * 128 + sk - sq) // 128) + 1
    return max(load) * n_ctas / sum(load)


@pytest.mark.parametrize("batch,heads,n", [(1, 16, 16384), (1, 8, 16384), (2, 16, 8192),
                                           (16, 16, 1024), (1, 32, 16384), (1, 1, 32768)])
def test_sm90_causal_order_keeps_every_cta_near_the_mean(batch, heads, n):
    """The launcher keeps the head-local order unless it leaves a CTA over 8% above the mean
    work and sorting longest-first does better; the choice is never worse than 8% over the mean
    or than the alternative."""
    from flashtile.backends.triton import launch_sm90

    n_m, n_bh = n // 128, batch * heads
    lpt = launch_sm90.causal_order(n_m, n_bh, n, n, 132)
    chosen = _worst_over_mean(n_m, n_bh, n, n, 132, lpt)
    other = _worst_over_mean(n_m, n_bh, n, n, 132, 1 - lpt)
    assert chosen <= 1.08 or chosen <= other
    if lpt:
        assert _worst_over_mean(n_m, n_bh, n, n, 132, 0) > 1.08


def _bwd_makespan(steps: list, n_bh: int, bh_group: int, n_sm: int = 132) -> int:
    """When the last backward CTA ends if the GPU issues them in ``_item_keys``' order (groups
    of ``bh_group`` pairs, key block by key block) each to the SM that frees first."""
    order = [w for g0 in range(0, n_bh, bh_group) for w in steps
             for _ in range(min(bh_group, n_bh - g0))]
    free = [0] * n_sm
    for w in order:
        free[free.index(min(free))] += w
    return max(free)


@pytest.mark.parametrize("batch,heads,n,head_dim", [
    (16, 16, 1024, 128), (8, 16, 2048, 128), (4, 16, 4096, 128), (2, 16, 8192, 128),
    (1, 16, 16384, 128), (8, 12, 2048, 128), (2, 32, 8192, 128), (1, 8, 4096, 128),
    (3, 5, 2048, 128), (8, 32, 2048, 64), (16, 8, 1024, 256), (4, 8, 4096, 256),
    (1, 8, 16384, 256)], ids=lambda x: str(x))
def test_sm90_backward_group_order_shortens_the_causal_tail(batch, heads, n, head_dim):
    """``bwd_group``: 1 without masking; with causal masking a group whose issue order ends
    within 1% of the whole work's even share (or 1 where nothing does better), never later
    than the plain order, Q, dO and dQ of a group within the L2 budget (or no more pairs than
    the plain order has in flight); d = 64 keeps the plain order (measured no faster).  At
    d = 256 a work item is 64 keys."""
    from flashtile.backends.triton import launch_sm90

    keys = launch_sm90.bwd_keys(head_dim)
    n_bh, n_kb = batch * heads, n // keys
    assert launch_sm90.bwd_group(n_bh, 1, n, n, head_dim, 2 * n, n, False, 132) == 1
    g = launch_sm90.bwd_group(n_bh, 1, n, n, head_dim, 2 * n, 0, True, 132)
    assert 1 <= g <= n_bh and (head_dim != 64 or g == 1)
    # key block j sees the query tiles from its own rows on, plus the CTA's setup
    steps = [(n - j * keys) // launch_sm90.bwd_rows(head_dim)
             + launch_sm90.BWD_CTA_SETUP for j in range(n_kb)]
    share = sum(steps) * n_bh / 132
    plain, chosen = _bwd_makespan(steps, n_bh, 1), _bwd_makespan(steps, n_bh, g)
    assert chosen <= plain
    if g > 1:
        assert chosen < 0.99 * plain
        assert (g * n * head_dim * 8 <= launch_sm90.BWD_GROUP_L2
                or g <= -(-132 // n_kb) + 1)
    if head_dim != 64 and n_bh * n_kb >= 2 * 132:  # two waves or more: ends near the share
        assert chosen <= 1.03 * share


def test_sm90_launchers_pass_exactly_the_kernels_parameters(monkeypatch):
    """``forward``, ``dkdv`` and ``fused_backward`` hand each Gluon kernel every parameter it
    declares, by name, and nothing else (a renamed or dropped parameter would otherwise first
    fail on an H100); the fused backward's prologue (a Triton kernel, interpreted here) writes
    ``delta = rowsum(dO * O)``, a strided dO included (with ragged lengths lse and delta padded),
    and zeroes the accumulator that the dQ copy then reads."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = []
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        calls.append((name, key, {**args, **descs})))
    monkeypatch.setattr(launch_sm90, "_sm_count", lambda index: 132)
    # (dK and dV in a layout the TMA writes: their stores by TMA, as on an H100)
    monkeypatch.setattr(launch_sm90, "_dense", lambda q, *tensors: all(
        launch_sm90._plan(x) is not None for x in (q, *tensors)))
    for head_dim in (64, 128, 256):
        q, k, v, do, out = (torch.randn(2, 128, 4, head_dim) for _ in range(5))
        if head_dim == 128:
            # slices of a fused QKV projection, dO in the SDPA layout: read with their strides
            q, k, v = torch.randn(2, 128, 3 * 4 * head_dim).view(2, 128, 12, head_dim).split(4, 2)
            do = torch.randn(2, 4, 128, head_dim).transpose(1, 2)
        lse = torch.randn(2, 4, 128)
        spec = AttnSpec(softmax_scale=head_dim ** -0.5, window_right=0)
        launch_sm90.forward(q, k, v, spec)
        if head_dim == 256:
            continue
        dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
        delta = torch.full_like(lse, float("nan"))
        launch_sm90.dkdv(q, k, v, do, lse, delta, dk, dv, spec)
        launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec)
        torch.testing.assert_close(delta, (do * out).sum(-1).transpose(1, 2))
        assert (dq == 0).all()  # the accumulator the (mocked) kernel did not add into
    # lengths that are not multiples of the tiles (3-D descriptors, lse and delta padded)
    q, do, out = (torch.randn(2, 100, 4, 128) for _ in range(3))
    k, v = (torch.randn(2, 200, 2, 128) for _ in range(2))
    lse = torch.randn(2, 4, 100)
    spec = AttnSpec(softmax_scale=128 ** -0.5)
    launch_sm90.forward(q, k, v, spec)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    delta = torch.full_like(lse, float("nan"))
    launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec)
    # the prologue lays lse and delta out padded to whole row tiles (+inf and 0 past Sq)
    args = calls[-1][2]
    lse_p, delta_p = args["desc_lse"][0], args["desc_delta"][0]
    assert lse_p.shape == delta_p.shape == (2, 4, 128) and args["sq_pad"] == 128
    assert torch.equal(lse_p[..., :100], lse) and torch.all(lse_p[..., 100:] == float("inf"))
    torch.testing.assert_close(delta_p[..., :100], (do * out).sum(-1).transpose(1, 2))
    assert torch.all(delta_p[..., 100:] == 0)
    # (d = 64 causal over 128 keys: one consumer, two CTAs an SM)
    # (the forward's consumer count and ragged flag; the backward's fused and ragged flags)
    assert [key[3:5] if name == "fwd" else (key[4], key[6]) for name, key, _ in calls] == [
        (1, False), (False, False), (True, False), (2, False), (False, False), (True, False),
        (2, False), (2, True), (True, True)]
    for name, key, args in calls:
        # every parameter by name, and the launch option of the one-consumer forward
        options = {"maxnreg"} if name == "fwd" and key[3] == 1 else set()
        assert sorted(args) == sorted([*launch_sm90._kernel(name).arg_names, *options]), name
        ragged = key[4] if name == "fwd" else key[6]
        assert args.get("RAGGED", ragged) == ragged
        # 3-D descriptors exactly for ragged lengths (lse and delta stay flat; dK and dV are
        # stored by TMA only without, else their descriptors are of one tile, never read)
        stores = ("desc_dk", "desc_dv")
        assert {len(args[n][1]) for n in args if n.startswith("desc_")
                and n not in ("desc_lse", "desc_delta", *stores)} == {3 if ragged else 2}, name
        if name == "bwd":
            d = args["desc_q"][0].shape[-1]
            assert args["DKDV_TMA"] == (not ragged and d != 256), name
            for n in stores:
                tensor, shape, strides, block = args[n][:4]
                assert block == [launch_sm90.bwd_keys(d) // 2, d]
                if args["DKDV_TMA"]:  # the 2-D view of dK / dV: rows (b, s), columns (h, d)
                    assert shape == [tensor.shape[0] * tensor.shape[1], tensor.shape[2] * d]
    (_, _, args), = [c for c in calls if c[0] == "bwd" and c[1][6]]
    assert args["sq_pad"] == 128 and args["desc_lse"][0].shape == (2, 4, 128)


def _key_mask_rows(sk: int = 300):
    """A ``(3, 1, 1, sk)`` bool key mask: left padding, right padding with a hole, no key."""
    import torch

    mask = torch.ones(3, 1, 1, sk, dtype=torch.bool)
    mask[0, ..., :37] = False                       # left-padded: keys [37, sk)
    mask[1, ..., 200:] = False                      # right-padded, and key 5 hidden
    mask[1, ..., 5] = False
    mask[2] = False                                 # a row of padding only
    return mask


@pytest.mark.parametrize("case", ["padded", "random", "one-key", "empty", "broadcast-batch",
                                  "strided-keys"])
def test_sm90_key_ranges_summarise_each_rows_visible_keys(case):
    """``launch_sm90.key_ranges`` (a Triton kernel, interpreted here) gives per batch entry the
    first visible key, one past the last, and whether every key between them is visible,
    against the same quantities computed in Python from the mask."""
    import torch

    from flashtile.backends.triton import launch_sm90

    gen = torch.Generator().manual_seed(zlib_crc(case))
    batch, sk = 3, 300
    if case == "padded":
        bias = _key_mask_rows()
    elif case == "random":
        bias = torch.rand(batch, 1, 1, sk, generator=gen) < 0.7
    elif case == "one-key":
        bias = torch.zeros(batch, 1, 1, sk, dtype=torch.bool)
        bias[0, ..., 0] = bias[1, ..., sk - 1] = bias[2, ..., 150] = True
    elif case == "empty":
        bias = torch.zeros(batch, 1, 1, sk, dtype=torch.bool)
    elif case == "broadcast-batch":
        bias = torch.rand(1, 1, 1, sk, generator=gen) < 0.9
    else:  # a mask sliced out of a wider one: keys 2 elements apart
        bias = (torch.rand(batch, 1, 1, 2 * sk, generator=gen) < 0.8)[..., ::2]
    mask = launch_sm90.key_mask(bias, batch, sk)
    assert mask.dtype == torch.uint8 and mask.shape == (batch, sk) and mask.stride(1) == 1
    ranges = torch.full((batch, 3), -7, dtype=torch.int32)
    ranges.copy_(launch_sm90.key_ranges(mask))
    for b in range(batch):
        row = bias[b if bias.shape[0] > 1 else 0, 0, 0]
        assert torch.equal(mask[b].bool(), row)
        vis = row.nonzero().flatten().tolist()
        lo, hi = (vis[0], vis[-1] + 1) if vis else (sk, 0)
        full = int(len(vis) == max(hi - lo, 0))
        assert ranges[b].tolist() == [lo, hi, full], (b, ranges[b])


def zlib_crc(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())


@pytest.mark.parametrize("shape,strides,expected", [
    ((2, 1, 1, 64), None, True),
    ((1, 1, 1, 64), None, True),                    # one row for the whole batch
    ((2, 4, 5, 64), (64, 0, 0, 1), True),           # broadcast over heads and queries
    ((2, 4, 1, 64), None, False),                   # a mask per head
    ((2, 1, 5, 64), None, False),                   # a mask per query
    ((2, 1, 1, 32), None, False),                   # not the keys' length
], ids=["per-batch", "one-row", "expanded", "per-head", "per-query", "short"])
def test_sm90_key_mask_accepts_masks_over_batch_and_keys_only(shape, strides, expected):
    """``launch_sm90.key_mask`` takes a bool mask for the Hopper kernels only when it varies
    along the batch and the keys alone (a padded batch); a float bias is never one."""
    import torch

    from flashtile.backends.triton import launch_sm90

    bias = torch.ones(shape, dtype=torch.bool)
    if strides is not None:
        bias = torch.ones(shape[0], 1, 1, shape[3], dtype=torch.bool).expand(shape)
        assert bias.stride() == strides
    mask = launch_sm90.key_mask(bias, 2, 64)
    assert (mask is not None) == expected
    if expected:
        assert mask.shape == (2, 64) and mask.dtype == torch.uint8
    assert launch_sm90.key_mask(bias.float(), 2, 64) is None


def test_sm90_key_mask_reaches_both_kernels(monkeypatch):
    """A key mask goes to the forward and the fused backward kernel as its ranges and rows
    (and its own compiled variant); a call without one passes the lse in their places."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = []
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        calls.append((name, key, args)))
    monkeypatch.setattr(launch_sm90, "_sm_count", lambda index: 132)
    bias = _key_mask_rows(256)
    q, do, out = (torch.randn(3, 256, 4, 64) for _ in range(3))
    k, v = (torch.randn(3, 256, 2, 64) for _ in range(2))
    lse = torch.randn(3, 4, 256)
    spec = AttnSpec(softmax_scale=0.125)
    mask, ranges = launch_sm90.key_mask_of(bias, 3, 256)
    launch_sm90.forward(q, k, v, spec, (mask, ranges))
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    delta = torch.empty_like(lse)
    launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec,
                               key_mask=(mask, ranges))
    launch_sm90.forward(q, k, v, spec)
    expected = torch.tensor([[37, 256, 1], [0, 200, 0], [256, 0, 1]], dtype=torch.int32)
    for name, key, args in calls[:2]:
        assert key[-1] is True, name  # the key-mask variant
        assert torch.equal(args["Ranges"], expected), name
        assert args["KeyMask"] is mask and args["stride_mb"] == 256
    # d = 64 without causal masking: two consumers with a key mask (three spill with its
    # code), three without
    assert calls[0][1][3] == 2 and calls[2][1][3] == 3
    name, key, args = calls[2]
    assert key[-1] is False and args["Ranges"] is args["Lse"] is args["KeyMask"]


def test_sm90_key_mask_summary_is_reused_while_the_mask_is_unchanged(monkeypatch):
    """``launch_sm90.key_mask_of`` summarises a mask once for the calls that pass it (every
    layer of a padded batch, forward and backward), views of it included, and again after an
    in-place change or for another mask."""
    import torch

    from flashtile.backends.triton import launch_sm90

    monkeypatch.setattr(launch_sm90, "_key_masks", type(launch_sm90._key_masks)())
    summaries = []
    real = launch_sm90.key_ranges
    monkeypatch.setattr(launch_sm90, "key_ranges", lambda m: summaries.append(1) or real(m))
    padding = torch.ones(2, 64, dtype=torch.bool)
    padding[0, :10] = False
    first = launch_sm90.key_mask_of(padding[:, None, None, :], 2, 64)
    again = launch_sm90.key_mask_of(padding[:, None, None, :], 2, 64)   # a new view of it
    assert len(summaries) == 1 and again[1] is first[1]
    padding[1, 60:] = False                                             # changed in place
    changed = launch_sm90.key_mask_of(padding[:, None, None, :], 2, 64)
    assert len(summaries) == 2 and changed[1].tolist() == [[10, 64, 1], [0, 60, 1]]
    other = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    assert launch_sm90.key_mask_of(other, 2, 64)[1].tolist() == [[0, 64, 1], [0, 64, 1]]
    assert len(summaries) == 3
    assert launch_sm90.key_mask_of(other.float(), 2, 64) is None
    with torch.inference_mode():  # no version counter: summarised on every call
        frozen = torch.ones(2, 64, dtype=torch.bool)
        for _ in range(2):
            assert launch_sm90.key_mask_of(frozen[:, None, None, :], 2, 64)[1].tolist() == [
                [0, 64, 1], [0, 64, 1]]
    assert len(summaries) == 5


def _layouts_of(batch, seq, heads, head_dim):
    """(name, tensor) pairs of the (B, S, H, D) layouts callers hand the kernels."""
    import torch

    qkv = torch.randn(batch, seq, 3 * heads * head_dim)
    return [
        ("contiguous", torch.randn(batch, seq, heads, head_dim)),
        ("fused-qkv-slice", qkv.view(batch, seq, 3 * heads, head_dim)[:, :, heads:2 * heads]),
        ("sdpa-transposed", torch.randn(batch, heads, seq, head_dim).transpose(1, 2)),
        ("sdpa-padded-rows",
         torch.randn(batch, heads, seq, head_dim + 8)[..., :head_dim].transpose(1, 2)),
    ]


@pytest.mark.parametrize("batch,heads", [(2, 3), (1, 1), (1, 4), (3, 1)],
                         ids=["b2h3", "b1h1", "b1h4", "b3h1"])
def test_sm90_plan_addresses_every_row_of_each_layout(batch, heads):
    """The 2-D view and tile coordinates ``launch_sm90._plan`` gives the TMA address exactly
    the tensor's rows: view[b * rb + h * rh + s, h * ch : h * ch + D] is x[b, s, h] for every
    layout it accepts, and layouts whose heads or rows it cannot walk are refused."""
    import torch

    from flashtile.backends.triton import launch_sm90

    seq, head_dim = 8, 16
    for name, x in _layouts_of(batch, seq, heads, head_dim):
        plan = launch_sm90._plan(x)
        assert plan is not None, name
        shape, row_stride, (rb, rh, ch) = plan
        view = torch.as_strided(x, shape, (row_stride, 1))  # from x's own first element
        for b in range(batch):
            for h in range(heads):
                rows = view[b * rb + h * rh:b * rb + h * rh + seq, h * ch:h * ch + head_dim]
                assert torch.equal(rows, x[b, :, h]), (name, b, h)
    y = torch.randn(batch, seq, 2 * heads, head_dim)
    every_other_head = y[:, :, ::2]
    assert heads == 1 or launch_sm90._plan(every_other_head) is None
    assert launch_sm90._plan(torch.randn(batch, seq, heads, 2 * head_dim)[..., ::2]) is None


@pytest.mark.parametrize("left,right,masked,wl,wr", [
    (-1, -1, False, None, None), (-1, 0, True, None, 0), (100, 0, True, 100, 0),
    (150, 37, True, 150, 37), (-1, 64, True, None, 64), (200, -1, True, 200, None),
    (2 ** 40, 2 ** 31 - 8, True, None, None)],
    ids=["full", "causal", "local", "band", "right-only", "left-only", "wider-than-int32"])
def test_sm90_forward_takes_windows_and_passes_their_edges(monkeypatch, left, right, masked,
                                                           wl, wr):
    """Windows (bottom-right, ``sk >= sq``) are in the Hopper kernels' scope; the launchers pass
    each edge, an edge no key reaches for a side without one (``wl = sq + sk``, ``wr = sk``;
    wider edges are cut to it, so the kernels' int32 index sums cannot overflow), and
    ``MASKED`` for any window (causal included)."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = []
    monkeypatch.setattr(launch_sm90, "_dense", lambda *tensors: True)
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        calls.append((key, args)))
    monkeypatch.setattr(launch_sm90, "_sm_count", lambda index: 132)
    sq, sk = 256, 384
    q = torch.randn(1, sq, 2, 64)
    k = v = torch.randn(1, sk, 2, 64)
    spec = AttnSpec(softmax_scale=0.125, window_left=left, window_right=right)
    assert launch_sm90.eligible(q, k, v, spec)
    launch_sm90.forward(q, k, v, spec)
    assert launch_sm90.bwd_eligible(q, k, v, q, k, v, spec)
    launch_sm90.dkdv(q, k, v, q, torch.zeros(1, 2, sq), torch.zeros(1, 2, sq), k, v, spec)
    assert [key[0] for key, _ in calls] == [torch.float32] * 2
    for key, args in calls:
        assert key[2] == masked and args["MASKED"] == masked
        assert args["wl"] == (sq + sk if wl is None else wl)
        assert args["wr"] == (sk if wr is None else wr)
    # the backward compiles a window's edge checks only where it is not the causal diagonal
    (_, bwd_args), = [c for c in calls if "WINDOW" in c[1]]
    window = masked and (wl is not None or wr != 0)
    assert bwd_args["WINDOW"] == window and calls[1][0][3] == window
    # sk < sq is outside the scope with a window
    assert launch_sm90.eligible(k, q[:, :128], q[:, :128], spec) == (not masked)
    assert launch_sm90.bwd_eligible(k, q[:, :128], q[:, :128], k, q[:, :128], q[:, :128],
                                    spec) == (not masked)
    assert not launch_sm90.eligible(q, k, v, AttnSpec(softmax_scale=0.125, window_left=left,
                                                      window_right=right, softcap=5.0))


@pytest.mark.parametrize("scale", [0.125, 0.0, -0.125], ids=["positive", "zero", "negative"])
def test_sm90_forward_takes_only_positive_scales(monkeypatch, scale):
    """The Hopper forward's row maxima are of the raw scores (the scale folded into exp2), which
    bound the exponents only for a positive scale (with 0 the first tile's alpha would be
    exp2(-inf * 0), NaN): others take the portable kernels (the backward, whose exponents come
    from lse, keeps any)."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    monkeypatch.setattr(launch_sm90, "_dense", lambda *tensors: True)
    q = k = v = torch.randn(1, 256, 2, 64)
    spec = AttnSpec(softmax_scale=scale)
    assert launch_sm90.eligible(q, k, v, spec) == (scale > 0)
    assert launch_sm90.eligible(q, k, v, spec, padded=True) == (scale > 0)
    assert launch_sm90.varlen_eligible(q[0], k[0], v[0], spec) == (scale > 0)
    assert launch_sm90.bwd_eligible(q, k, v, q, k, v, spec)


@pytest.mark.parametrize("layout", ["contiguous", "sdpa", "fused-qkv"])
@pytest.mark.parametrize("ragged", [False, True], ids=["aligned", "ragged"])
@pytest.mark.parametrize("d", [64, 96], ids=["d64", "d96-padded"])
def test_sm90_descriptor_coordinates_address_the_tensors_elements(layout, ragged, d):
    """``launch_sm90._rows``: the coordinates the kernels compute for (batch entry, head, row,
    column) (``{prefix}_rb``, ``_rh``, ``_ch``; ``kernels/attn_fwd_sm90._tma_load``) address
    that element of the tensor, in the 2-D view of aligned lengths and in the 3-D view
    ``(sequences, S, columns)`` of lengths that are not multiples of the tiles, whose middle
    dimension is exactly the sequence (the TMA reads zeros past it).  A head dim of 96 in
    tiles 128 wide (``padded_width``): the view's last dimension ends at the head's last
    column (zeros past it), with heads side by side through a dimension for the heads whose
    coordinate is the head's index (the kernel's ``_ch`` is 1)."""
    from flashtile.backends.triton import launch_sm90

    batch, seq, heads = 3, 5, 4
    width = launch_sm90.padded_width(d)
    if layout == "contiguous":
        x = torch.randn(batch, seq, heads, d)
    elif layout == "sdpa":
        x = torch.randn(batch, heads, seq, d).transpose(1, 2)
    else:  # the k slice of a fused (B, S, 3, H, D) projection
        x = torch.randn(batch, seq, 3, heads, d)[:, :, 1]
    args = {}
    _, shape, strides, block, _ = launch_sm90._rows(x, 16, ragged, "x", args, width)
    heads_view = width > d and layout != "sdpa"
    assert len(shape) == len(strides) == len(block) == 2 + ragged + heads_view
    assert block == [1] * ragged + [16] + [1] * heads_view + [width] and strides[-1] == 1
    # (the view's edge: one head's last column, or in the 2-D view of heads side by side the
    # last head's)
    assert shape[-1] == (d if heads_view or layout == "sdpa" else heads * d)
    if ragged:
        assert shape[1] == seq and block[0] == 1
    if heads_view:
        assert args["x_ch"] == 1 and shape[-2] == heads
    base = x.storage_offset()
    for b in range(batch):
        for h in range(heads):
            for m in (0, seq - 1):
                for c in (0, d - 1):
                    seq_at = b * args["x_rb"] + h * args["x_rh"]
                    if heads_view:  # (_tma_load: the head's index, then its column)
                        coords = [seq_at, m, h * args["x_ch"], c] if ragged else [
                            seq_at + m, h * args["x_ch"], c]
                    else:
                        col = h * args["x_ch"] + c
                        coords = [seq_at, m, col] if ragged else [seq_at + m, col]
                    assert all(0 <= i < n for i, n in zip(coords, shape))
                    offset = sum(i * st for i, st in zip(coords, strides))
                    want = b * x.stride(0) + m * x.stride(1) + h * x.stride(2) + c
                    assert base + offset == x.storage_offset() + want


def test_sm90_backward_pads_lse_and_delta_to_whole_tiles():
    """Ragged lengths: each head's lse and delta rows are padded to whole query tiles with
    +inf and 0 (a last tile's rows past Sq then have p = 0 and delta = 0)."""
    from flashtile.backends.triton import launch_sm90

    lse, delta = torch.randn(2, 3, 70), torch.randn(2, 3, 70)
    lse_p, delta_p = launch_sm90._pad_rows(lse, delta, 64)
    assert lse_p.shape == delta_p.shape == (2, 3, 128) and lse_p.is_contiguous()
    assert launch_sm90._pad_rows(lse, delta, 128)[0].shape == (2, 3, 128)
    assert launch_sm90._pad_rows(lse[..., :64], delta[..., :64], 128)[1].shape == (2, 3, 128)
    assert torch.equal(lse_p[..., :70], lse) and torch.equal(delta_p[..., :70], delta)
    assert torch.all(lse_p[..., 70:] == float("inf")) and torch.all(delta_p[..., 70:] == 0)


def _direct_launches(monkeypatch, kernel: str) -> list:
    """``launch_sm90`` as on an H100 of 132 SMs that reads every tensor by TMA, its launches
    direct (``_launch`` returns a compiled kernel and argument values) and its plan caches
    empty: the ``(name, key, arguments and descriptors)`` of each launch of ``kernel``'s."""
    from flashtile.backends.triton import launch_sm90
    from flashtile.backends.triton.fastlaunch import PlanCache

    calls = []
    n_args = len(launch_sm90._kernel(kernel).arg_names)
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        calls.append((name, key, {**args, **descs})) or ("k", [0] * n_args))
    monkeypatch.setattr(launch_sm90, "_sm_count", lambda index: 132)
    monkeypatch.setattr(launch_sm90, "_dense", lambda q, *tensors: True)
    monkeypatch.setattr(launch_sm90, "_fwd_plans", PlanCache())
    monkeypatch.setattr(launch_sm90, "_bwd_plans", PlanCache())
    return calls


def test_sm90_block_sparse_forward_passes_its_lists(monkeypatch):
    """A block-sparse call takes the Hopper forward where its blocks are whole 128-row work
    items and whole key tiles and the lengths are multiples of the tiles: two consumers,
    every kernel parameter by name, the lists with their strides, the key tiles a block and
    the work items a mask row; its launch plan is kept under a key that sees the lists."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_fwd, launch_sm90
    from flashtile.backends.triton.sparse_index import sparse_args

    calls = _direct_launches(monkeypatch, "fwd")
    q, k, v = (torch.randn(2, 512, 4, 128) for _ in range(3))
    mask = torch.rand(2, 1, 2, 4) < 0.5
    spec = AttnSpec(softmax_scale=128 ** -0.5)
    assert launch_sm90.sparse_eligible(q, k, v, spec, (256, 128))
    assert not launch_sm90.sparse_eligible(q, k, v, spec, (64, 128))    # rows of half an item
    assert not launch_sm90.sparse_eligible(q, k, v, spec, (128, 64))    # keys of half a tile
    assert not launch_sm90.sparse_eligible(q[:, :500], k, v, spec, (256, 128))
    sparse = sparse_args(mask, (256, 128), 512, 512, spec)
    launch_sm90.forward(q, k, v, spec, sparse=sparse)
    (name, key, args), = calls
    assert name == "fwd" and key[3] == 2 and key[5] is True
    assert sorted(args) == sorted(launch_sm90._kernel("fwd").arg_names)
    assert args["Lists"] is sparse[0] and (args["tpb"], args["ipr"]) == (1, 2)
    assert (args["stride_xb"], args["stride_xh"], args["stride_xr"]) == tuple(sparse[1])
    # d = 256: 64-key tiles, two a 128-key block
    q2, k2, v2 = (torch.randn(1, 256, 2, 256) for _ in range(3))
    launch_sm90.forward(q2, k2, v2, spec, sparse=sparse_args(mask[:1, :, :1, :2], (256, 128),
                                                               256, 256, spec))
    assert (calls[-1][2]["tpb"], calls[-1][2]["ipr"]) == (2, 2)
    # a plan repeats a launch from its tensors' signature and the lists' geometry: the
    # block-sparse call's plan is not the dense call's; without a block mask the lse stands in
    # for the lists
    plan_key = launch_sm90._fwd_key(q, k, v, spec, None, None)
    assert launch_sm90._fwd_plans.get(plan_key) is None
    assert launch_sm90._fwd_plans.get(launch_sm90._fwd_key(q, k, v, spec, None, None,
                                                           sparse)) is not None
    launch_sm90.forward(q, k, v, spec)
    assert calls[-1][1][5] is False and calls[-1][2]["Lists"] is calls[-1][2]["Lse"]
    assert launch_sm90._fwd_plans.get(plan_key) is not None
    # the dispatch: a block mask goes to the Hopper forward with its lists where eligible
    # (after looking for a plan: none under the interpreter)
    seen = []
    monkeypatch.setattr(launch_sm90, "on_hopper", lambda q: True)
    monkeypatch.setattr(launch_sm90, "sparse_eligible", lambda *a: True)
    monkeypatch.setattr(launch_sm90, "forward", lambda *a, **kw: seen.append(kw["sparse"])
                        or (None, None))
    launch_fwd.forward(q, k, v, spec, block_mask=mask, block_size=(256, 128))
    assert len(seen) == 1 and torch.equal(seen[0][0], sparse[0])


def test_sm90_varlen_forward_passes_the_packed_sequences(monkeypatch):
    """Packed sequences take the Hopper forward as one batch entry of their rows: 2-D
    descriptors, the cumulative lengths as int32, the longest lengths as ``sq`` and ``sk``,
    lse ``(H, total)``, the output pointer and row stride for the last row tiles, two
    consumers where the dense call would take three; no launch plan; the dispatch sends
    ``cu_seqlens`` calls there and keeps top-left windows away."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_fwd, launch_sm90

    calls = _direct_launches(monkeypatch, "fwd")
    total_q, total_k = 700, 900
    q = torch.randn(total_q, 4, 64)
    k, v = (torch.randn(total_k, 2, 64) for _ in range(2))
    cu_q = torch.tensor([0, 100, 400, 700], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 500, 900], dtype=torch.int32)
    spec = AttnSpec(softmax_scale=0.125)
    assert launch_sm90.varlen_eligible(q, k, v, spec)
    assert not launch_sm90.varlen_eligible(q[None], k[None], v[None], spec)
    top_left = AttnSpec(softmax_scale=0.125, window_right=0, bottom_right=False)
    assert not launch_sm90.varlen_eligible(q, k, v, top_left)
    # causal per sequence with fewer keys than queries in all: each sequence's rows that see
    # no key output 0 (the dense rule sk >= sq means nothing across sequences)
    causal = AttnSpec(softmax_scale=0.125, window_right=0)
    assert launch_sm90.varlen_eligible(q, k[:500], v[:500], causal)
    assert not launch_sm90.eligible(q[None], k[None, :500], v[None, :500], causal)
    out, lse = launch_sm90.forward(q, k, v, spec, varlen=(cu_q, cu_k, 400, 400))
    (name, key, args), = calls
    assert out.shape == q.shape and lse.shape == (4, total_q)
    assert key[3] == 2 and key[6] is True and key[4] is False   # two consumers, 2-D views
    assert sorted(args) == sorted(launch_sm90._kernel("fwd").arg_names)
    assert args["CuQ"] is cu_q and args["CuK"] is cu_k and args["batch"] == 3
    assert (args["sq"], args["sk"], args["stride_lb"], args["stride_lh"]) == (400, 400, 0,
                                                                             total_q)
    assert args["Out"] is out and args["stride_om"] == 4 * 64
    # the items' order: (sequence, row block) pairs b * 4 + i by the key tiles they walk, most
    # first: sequence 2's three row blocks (400 keys: 4 tiles, + 1), sequence 0's one (300
    # keys), sequence 1's three (200 keys); the row blocks past a sequence's end last. The
    # same table again for the same tensors
    assert args["lpt"] == 0 and args["Items"].dtype == torch.int32
    assert args["Items"].tolist() == [8, 9, 10, 0, 4, 5, 6, 1, 2, 3, 7, 11]
    assert launch_sm90.packed_order(cu_q, cu_k, 4, 128, 128,
                                    launch_sm90._window(spec, 400, 400)) is args["Items"]
    # causal (bottom-right per sequence): a row block walks the tiles up to its diagonal
    causal_order = launch_sm90.packed_order(cu_q, cu_k, 4, 128, 128,
                                            launch_sm90._window(causal, 400, 400))
    # tiles + 1: seq 0 (shift 200) 4; seq 1 (shift -100) 2, 3, 3; seq 2 (shift 100) 3, 4, 5
    assert causal_order.tolist() == [10, 0, 9, 5, 6, 8, 4, 1, 2, 3, 7, 11]
    assert {len(args[n][1]) for n in args if n.startswith("desc_")} == {2}
    assert args["desc_q"][1] == [total_q, 4 * 64] and args["desc_k"][1] == [total_k, 2 * 64]
    # a plan under the packed tensors' key with the count and longest lengths (its test below)
    assert launch_sm90._fwd_plans.get(launch_sm90._fwd_key(q, k, v, spec, None, None)) is None
    assert launch_sm90._fwd_plans.get(launch_sm90._fwd_key(q, k, v, spec, None, (
        cu_q, cu_k, 400, 400))).order == (4, 128, 128, launch_sm90._window(spec, 400, 400))
    # the dispatch (cumulative lengths of int64 arrive as int32)
    seen = []
    monkeypatch.setattr(launch_sm90, "on_hopper", lambda q: True)
    monkeypatch.setattr(launch_sm90, "varlen_eligible", lambda *a, **kw: True)
    monkeypatch.setattr(launch_sm90, "forward", lambda *a, **kw: seen.append(kw["varlen"])
                        or (None, None))
    launch_fwd.forward(q, k, v, spec, cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_k.long(),
                       max_seqlen_q=400, max_seqlen_k=400)
    (cq, ck, mq, mk), = seen
    assert cq.dtype == ck.dtype == torch.int32 and torch.equal(cq, cu_q) and (mq, mk) == (400, 400)


def test_sm90_block_sparse_backward_passes_its_lists(monkeypatch):
    """A block-sparse backward takes the fused Hopper kernel where its blocks are whole 128-key
    items and 128-row blocks, d <= 128 and one mask serves a key/value head's query heads:
    every kernel parameter by name, the transposed lists with their strides, the query tiles a
    mask row and the work items a mask column; its launch plan is kept under a key that sees
    the lists."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_bwd, launch_sm90
    from flashtile.backends.triton.sparse_index import sparse_args

    calls = _direct_launches(monkeypatch, "bwd")
    q, do, out = (torch.randn(2, 512, 4, 128) for _ in range(3))
    k, v = (torch.randn(2, 512, 2, 128) for _ in range(2))
    lse = torch.randn(2, 4, 512)
    spec = AttnSpec(softmax_scale=128 ** -0.5)
    mask = torch.rand(2, 1, 2, 2) < 0.5
    ok = launch_sm90.sparse_bwd_eligible
    assert ok(q, k, v, do, k, v, spec, mask, (256, 256))
    assert not ok(q, k, v, do, k, v, spec, mask.expand(2, 4, 2, 2), (256, 256))  # GQA per head
    assert not ok(q, k, v, do, k, v, spec, mask, (256, 64))        # keys of half an item
    assert not ok(q[..., :64].contiguous(), k[..., :64].contiguous(), v[..., :64].contiguous(),
                  do[..., :64].contiguous(), k, v, spec, mask, (64, 256))   # rows of half a block
    sparse = sparse_args(mask, (256, 256), 512, 512, spec, transpose=True)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    delta = torch.empty_like(lse)
    key, dense_key = ("plan", "sparse"), ("plan",)
    launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec, key,
                               sparse=sparse)
    (name, launch_key, args), = calls
    # (the key ends with block mask, packed sequences, key mask)
    assert name == "bwd" and launch_key[-3:] == (True, False, False)
    assert sorted(args) == sorted(launch_sm90._kernel("bwd").arg_names)
    assert args["Lists"] is sparse[0] and (args["tpr"], args["ipc"]) == (4, 2)
    assert (args["stride_xb"], args["stride_xh"], args["stride_xr"]) == tuple(sparse[1])
    assert launch_sm90._bwd_plans.get(key) is not None
    assert launch_sm90._bwd_plans.get(dense_key) is None
    launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec, dense_key)
    # (without a block mask or key mask the lse stands in for both)
    assert calls[-1][1][-3] is False and calls[-1][2]["Lists"] is calls[-1][2]["Ranges"]
    assert launch_sm90._bwd_plans.get(dense_key) is not None
    # the plan keys: the lists' signature, strides and block size
    assert launch_sm90.bwd_plan_key(q, k, v, out, do, lse, spec, None, sparse=sparse) != \
        launch_sm90.bwd_plan_key(q, k, v, out, do, lse, spec, None)
    # the dispatch: a block mask goes to the fused kernel with the transposed lists
    seen = []
    monkeypatch.setattr(launch_sm90, "sparse_bwd_eligible", lambda *a: True)
    monkeypatch.setattr(launch_sm90, "fused_backward", lambda *a, **kw: seen.append(kw["sparse"]))
    launch_bwd.backward(do, q, k, v, out.contiguous(), lse, spec, block_mask=mask,
                        block_size=(256, 256))
    assert len(seen) == 1 and torch.equal(seen[0][0], sparse[0])


def test_sm90_varlen_backward_passes_the_packed_sequences(monkeypatch):
    """Packed sequences take the fused Hopper backward (d <= 128) as one batch entry of their
    rows: every kernel parameter by name, the cumulative lengths as int32, the sequences as
    the batch and the longest lengths as ``sq`` and ``sk`` (they size the key blocks), lse and
    delta flat with each sequence's rows from a whole tile on (a TMA load's start must be
    16-byte aligned), the gaps +inf and 0, 2-D descriptors, dK and dV stored by the kernel
    (not by TMA, which would reach into the next sequence), a launch plan; the dispatch sends
    plain ``cu_seqlens`` calls there, with fewer keys than queries in all, and keeps d = 256
    away."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_bwd, launch_sm90

    calls = _direct_launches(monkeypatch, "bwd")
    total_q, total_k = 700, 500
    q, do, out = (torch.randn(total_q, 4, 64) for _ in range(3))
    k, v = (torch.randn(total_k, 2, 64) for _ in range(2))
    lse = torch.randn(4, total_q)
    cu_q = torch.tensor([0, 100, 400, 700], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 350, 500], dtype=torch.int32)
    spec = AttnSpec(softmax_scale=0.125, window_right=0)   # causal, per sequence
    ok = launch_sm90.varlen_bwd_eligible
    assert ok(q, k, v, do, k, v, spec)
    assert not ok(q[None], k[None], v[None], do[None], k[None], v[None], spec)
    wide = [torch.randn(x.shape[0], x.shape[1], 256) for x in (q, k, v, do)]
    assert not ok(*wide, wide[1], wide[2], spec)
    top_left = AttnSpec(softmax_scale=0.125, window_right=0, bottom_right=False)
    assert not ok(q, k, v, do, k, v, top_left)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    delta = torch.empty_like(lse)
    launch_sm90.fused_backward(q, k, v, out, do, lse, delta, dq, dk, dv, spec, ("plan",),
                               varlen=(cu_q, cu_k, 300, 300))
    (name, launch_key, args), = calls
    assert name == "bwd" and launch_key[-3:] == (False, True, False)
    assert sorted(args) == sorted(launch_sm90._kernel("bwd").arg_names)
    assert args["CuQ"] is cu_q and args["CuK"] is cu_k
    width = 896  # 700 rows + a 64-row tile for each of 3 sequences, in whole tiles
    assert (args["sq"], args["sk"], args["sq_pad"], args["n_bh"]) == (300, 300, width, 3 * 2)
    assert args["RAGGED"] is False and args["DKDV_TMA"] is False and args["PERSISTENT"]
    assert args["desc_lse"][1] == [4 * width] and args["desc_delta"][1] == [4 * width]
    # one prologue launch lays lse and delta out, zeroes the dQ accumulator and the counter
    lse_p, delta_p = args["desc_lse"][0].view(4, width), args["desc_delta"][0].view(4, width)
    rowsum = (do * out).sum(-1).T                                       # [H, total_q]
    live = torch.zeros(width, dtype=torch.bool)
    for (a, b), first in zip(((0, 100), (100, 400), (400, 700)), (0, 128, 512)):
        # the kernel's offset: ((cu_q[b] + b * 64) // 64) * 64
        assert torch.equal(lse_p[:, first:first + b - a], lse[:, a:b])
        torch.testing.assert_close(delta_p[:, first:first + b - a], rowsum[:, a:b],
                                   rtol=1e-5, atol=1e-5)   # (fp32 sums in another order)
        live[first:first + b - a] = True
    assert bool((lse_p[:, ~live] == float("inf")).all()) and not delta_p[:, ~live].any()
    assert args["Counter"].tolist() == [0] and not args["desc_dq"][0].any()
    assert args["desc_q"][1] == [total_q, 4 * 64] and args["desc_k"][1] == [total_k, 2 * 64]
    assert args["DK"].shape == (1, total_k, 2, 64) and args["stride_kn"] == 2 * 64
    assert launch_sm90._bwd_plans.get(("plan",)) is not None
    # the dispatch (cumulative lengths of int64 arrive as int32)
    seen = []
    monkeypatch.setattr(launch_sm90, "fused_backward", lambda *a, **kw: seen.append(kw["varlen"]))
    launch_bwd.backward(do, q, k, v, out, lse, spec, cu_seqlens_q=cu_q.long(),
                        cu_seqlens_k=cu_k.long(), max_seqlen_q=300, max_seqlen_k=300)
    (cq, ck, mq, mk), = seen
    assert cq.dtype == ck.dtype == torch.int32 and torch.equal(cq, cu_q) and (mq, mk) == (300, 300)


@pytest.mark.parametrize("mode", ["dense", "dense-padded", "dense-whole-tiles", "dense-narrow",
                                  "packed"])
def test_sm90_backward_prologue_computes_delta_and_zeroes_accumulator_and_counter(mode):
    """The Hopper backward's prologue kernel (run by the interpreter): ``delta = rowsum(dO *
    O)`` per row, the float32 dQ accumulator and the persistent kernel's work counter zeroed
    (dense: where a counter is given; with the lse, lse and delta padded to whole row tiles
    where Sq is not a multiple of one, bitwise ``_pad_rows``' padding of the unpadded ones, and
    handed back as they are where it is; packed: lse and delta in the padded per-sequence
    layout, its gaps +inf and 0; narrow: a head dim the kernels run at a wider width, delta
    from the head's own columns and the accumulator zeroed at the kernels' width)."""
    import torch

    from flashtile.backends.triton import launch_sm90
    from flashtile.backends.triton.fastlaunch import poison_outputs

    total, heads = (128 if mode == "dense-whole-tiles" else 70), 2
    d, cols = (48, 64) if mode == "dense-narrow" else (64, 64)
    batch = 1 if mode in ("dense", "packed") else 2
    out, do = torch.randn(batch, total, heads, d), torch.randn(batch, total, heads, d)
    want = (out * do).sum(-1).transpose(1, 2)                              # [B, H, total]
    counter = torch.full((1,), 7, dtype=torch.int32)
    if mode == "dense":
        delta = torch.full((1, heads, total), float("nan"))
        dq_acc = launch_sm90._prologue(out, out, do, delta, counter=counter)
        torch.testing.assert_close(delta, want)
    elif mode.startswith("dense-"):
        lse = torch.randn(batch, heads, total)
        delta = torch.full((batch, heads, total), float("nan"))
        with poison_outputs():  # (fresh buffers start as NaN: every element written)
            dq_acc, lse_p, delta_p, _ = launch_sm90._prologue(out, out, do, delta,
                                                              counter=counter, lse=lse,
                                                              cols=cols)
        if mode == "dense-whole-tiles":
            assert lse_p is lse and delta_p is delta
            torch.testing.assert_close(delta, want)
        else:
            want_lse, want_delta = launch_sm90._pad_rows(lse, want, launch_sm90.bwd_rows(cols))
            assert lse_p.shape == delta_p.shape == (batch, heads, 128)
            assert torch.equal(lse_p, want_lse)
            torch.testing.assert_close(delta_p, want_delta)
            assert torch.all(delta_p[..., total:] == 0)
    else:
        want = want[0]                                                     # [H, total]
        cu = torch.tensor([0, 5, 70], dtype=torch.int32)
        lse = torch.randn(heads, total)
        dq_acc, lse_p, delta, counter, _ = launch_sm90.packed_prologue(out, out, do, lse, cu)
        # sequence 0 from row 0, sequence 1 from ((5 + t) // t) * t = t (t: the query tile)
        t = launch_sm90.bwd_rows(d, packed=True)
        assert delta.shape == lse_p.shape == (heads, -(-(total + 2 * t) // t) * t)
        torch.testing.assert_close(delta[:, :5], want[:, :5])
        torch.testing.assert_close(delta[:, t:t + 65], want[:, 5:])
        assert torch.equal(lse_p[:, t:t + 65], lse[:, 5:])
        assert (delta[:, 5:t] == 0).all() and (lse_p[:, 5:t] == float("inf")).all()
        assert (delta[:, t + 65:] == 0).all() and (lse_p[:, t + 65:] == float("inf")).all()
    assert dq_acc.shape == (*out.shape[:-1], cols) and dq_acc.dtype == torch.float32
    assert (dq_acc == 0).all() and counter.tolist() == [0]


def test_sm90_varlen_plans_replay_with_each_calls_own_tensors(monkeypatch):
    """A packed call leaves forward and backward plans under its tensors' signatures (the
    packed totals among them), the sequences' count and the longest lengths; a later call like
    it (other tensors, other lengths of the same totals, count and longest) replays them with
    its own tensors: its cumulative lengths, its own item order and lse/delta layout, its
    outputs; another count or longest length finds no plan."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    _direct_launches(monkeypatch, "fwd")
    calls, runs = [], []
    # (a direct launch's argument values: the call's tensors where the kernel takes them)
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        calls.append(name) or ("k", [args.get(n, 0) for n in
                                                     launch_sm90._kernel(name).arg_names]))
    monkeypatch.setattr(launch_sm90, "_plan_of", lambda plans, key: plans.get(key()))
    monkeypatch.setattr(launch_sm90, "_run", lambda compiled, grid, values, device:
                        runs.append((compiled, grid, values)))
    names = launch_sm90._kernel("fwd").arg_names

    def tensors(total_q, total_k):
        return ([torch.randn(total_q, 4, 64) for _ in range(3)],
                [torch.randn(total_k, 2, 64) for _ in range(2)])
    spec = AttnSpec(softmax_scale=0.125, window_right=0)   # causal, per sequence
    (q, do, o), (k, v) = tensors(700, 500)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in ([0, 100, 400, 700],
                                                               [0, 300, 350, 500]))
    launch_sm90.forward(q, k, v, spec, varlen=(cu_q, cu_k, 300, 300))
    assert len(calls) == 1 and not runs
    # other tensors, other lengths: 3 sequences, the longest 300 and 300
    (q2, do2, o2), (k2, v2) = tensors(700, 500)
    cu_q2, cu_k2 = (torch.tensor(c, dtype=torch.int32) for c in ([0, 300, 400, 700],
                                                                 [0, 200, 500, 500]))
    out, lse = launch_sm90.planned_forward(q2, k2, v2, spec, varlen=(cu_q2, cu_k2, 300, 300))
    (_, grid, values), = runs
    got = dict(zip(names, values))
    assert len(calls) == 1
    assert got["CuQ"] is cu_q2 and got["CuK"] is cu_k2 and got["Out"] is out
    assert got["Lse"] is lse and lse.shape == (4, 700) and out.shape == q2.shape
    plan = launch_sm90._fwd_plans.get(launch_sm90._fwd_key(q2, k2, v2, spec, None,
                                                           (cu_q2, cu_k2, 300, 300)))
    assert plan.order[3] == launch_sm90._window(spec, 300, 300)
    # the plan keeps none of the first call's tensors; the lists' stand-in is this call's lse
    assert not any(isinstance(x, torch.Tensor) for x in plan.values)
    assert got["Lists"] is lse and got["Ranges"] is lse
    assert got["Items"] is launch_sm90.packed_order(cu_q2, cu_k2, *plan.order)
    assert got["Items"].numel() == 3 * plan.order[0]
    assert got["desc_q"].base.data_ptr() == q2.data_ptr() and got["desc_q"].shape == [700, 256]
    assert got["desc_k"].shape == [500, 128] and got["desc_o"].base.data_ptr() == out.data_ptr()
    assert launch_sm90.planned_forward(q2, k2, v2, spec, varlen=(cu_q2, cu_k2, 300, 301)) is None
    four = (torch.tensor([0, 100, 300, 400, 700], dtype=torch.int32),
            torch.tensor([0, 100, 200, 500, 500], dtype=torch.int32), 300, 300)
    assert launch_sm90.planned_forward(q2, k2, v2, spec, varlen=four) is None
    # the backward
    lse = torch.randn(4, 700)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    packed = (cu_q, cu_k, 300, 300)
    key = launch_sm90.bwd_plan_key(q, k, v, o, do, lse, spec, None, varlen=packed)
    launch_sm90.fused_backward(q, k, v, o, do, lse, torch.empty_like(lse), dq, dk, dv, spec,
                               key, varlen=packed)
    lse2 = torch.randn(4, 700)
    packed2 = (cu_q2, cu_k2, 300, 300)
    runs.clear()
    dq2, dk2, dv2 = launch_sm90.planned_backward(q2, k2, v2, o2, do2, lse2, spec, None,
                                                 varlen=packed2)
    (_, _, values), = runs
    got = dict(zip(launch_sm90._kernel("bwd").arg_names, values))
    assert dq2.shape == q2.shape and dk2.shape == k2.shape and dv2.shape == v2.shape
    assert got["CuQ"] is cu_q2 and got["CuK"] is cu_k2
    (plan,) = launch_sm90._bwd_plans._plans.values()
    assert not any(isinstance(x, torch.Tensor) for x in plan.values)
    assert got["Lists"] is got["KeyMask"] and got["Lists"].shape == (4, 896)
    assert got["DK"].data_ptr() == dk2.data_ptr() and got["DV"].data_ptr() == dv2.data_ptr()
    # lse in this call's layout: sequence 1 of cu_q2 (rows 300:400) from row 320 on
    assert got["desc_lse"].shape == [4 * 896]
    assert torch.equal(got["desc_lse"].base.view(4, 896)[:, 320:420], lse2[:, 300:400])
    assert launch_sm90.planned_backward(q2, k2, v2, o2, do2, lse2, spec, None,
                                        varlen=(cu_q2, cu_k2, 301, 300)) is None
    assert launch_sm90.planned_backward(q2, k2, v2, o2, do2, lse2, spec, None,
                                        varlen=four) is None


def test_sm90_ragged_backward_plan_replays_with_lse_and_delta_padded(monkeypatch):
    """A dense fused backward whose query length is not a multiple of the row tile leaves a
    plan; its replay runs the prologue (interpreted here), which hands the kernel this call's
    lse and delta padded to whole tiles (lse bitwise ``_pad_rows``' padding, delta
    ``rowsum(dO * O)`` and 0 past ``Sq``), a zeroed work counter, and this call's dK and dV."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    _direct_launches(monkeypatch, "bwd")
    runs = []
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        ("k", [args.get(n, 0) for n in launch_sm90._kernel(name).arg_names]))
    monkeypatch.setattr(launch_sm90, "_plan_of", lambda plans, key: plans.get(key()))
    monkeypatch.setattr(launch_sm90, "_run", lambda compiled, grid, values, device:
                        runs.append(values))
    spec = AttnSpec(softmax_scale=0.125, window_right=0)

    def inputs():
        q, o, do = (torch.randn(2, 100, 4, 64) for _ in range(3))
        k, v = (torch.randn(2, 100, 2, 64) for _ in range(2))
        return q, k, v, o, do, torch.randn(2, 4, 100)
    q, k, v, o, do, lse = inputs()
    key = launch_sm90.bwd_plan_key(q, k, v, o, do, lse, spec, None)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    launch_sm90.fused_backward(q, k, v, o, do, lse, torch.empty_like(lse), dq, dk, dv, spec, key)
    q, k, v, o, do, lse = inputs()
    runs.clear()
    dq, dk, dv = launch_sm90.planned_backward(q, k, v, o, do, lse, spec, None)
    (values,) = runs
    got = dict(zip(launch_sm90._kernel("bwd").arg_names, values))
    lse_p = got["desc_lse"].base.view(2, 4, 128)
    delta_p = got["desc_delta"].base.view(2, 4, 128)
    assert torch.equal(lse_p, launch_sm90._pad_rows(lse, lse, launch_sm90.bwd_rows(64))[0])
    torch.testing.assert_close(delta_p[..., :100], (do * o).sum(-1).transpose(1, 2))
    assert torch.all(delta_p[..., 100:] == 0) and got["sq_pad"] == 128
    assert got["DK"] is dk and got["DV"] is dv
    if launch_sm90.bwd_persistent(64):
        assert got["Counter"].tolist() == [0]


@pytest.mark.parametrize("case", ["dense", "dense-ragged", "packed"])
def test_sm90_backward_plan_replays_its_prologue_bound(monkeypatch, case):
    """A fused backward's plan keeps its prologue's direct launch bound
    (``fastlaunch.BoundLaunch``): a replay launches it without ``launch``, handing it this
    call's O and dO, its lse, and the very buffers (delta, padded lse, dQ accumulator, work
    counter) the backward kernel then reads, every other argument (shape scalars, flags) the
    first call's."""
    from types import SimpleNamespace

    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import fastlaunch, launch_sm90
    from flashtile.backends.triton.kernels.bwd import attn_bwd_delta_kernel

    _direct_launches(monkeypatch, "bwd")
    runs, direct, replays = [], [], []
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        ("k", [args.get(n, 0) for n in launch_sm90._kernel(name).arg_names]))
    monkeypatch.setattr(launch_sm90, "_plan_of", lambda plans, key: plans.get(key()))
    monkeypatch.setattr(launch_sm90, "_run", lambda compiled, grid, values, device:
                        runs.append(values))
    monkeypatch.setattr(fastlaunch, "raw_stream", lambda device: 999)
    names = attn_bwd_delta_kernel.arg_names
    compiled = SimpleNamespace(run=lambda *args: replays.append(args), function="fn",
                               packed_metadata="meta")

    def direct_launch(kernel, grid, **kwargs):  # a direct launch of the prologue: none runs
        assert kernel is attn_bwd_delta_kernel
        direct.append(kwargs)
        return compiled, [kwargs[n] for n in names]
    monkeypatch.setattr(launch_sm90, "launch", direct_launch)
    spec = AttnSpec(softmax_scale=0.125, window_right=0)
    sq = 128 if case == "dense" else 100
    varlen = None
    if case == "packed":
        cu = torch.tensor([0, 30, 100], dtype=torch.int32)
        varlen = (cu, cu, 70, 70)

    def inputs():
        if varlen is not None:
            q, o, do = (torch.randn(sq, 4, 64) for _ in range(3))
            return (q, *(torch.randn(sq, 2, 64) for _ in range(2)), o, do, torch.randn(4, sq))
        q, o, do = (torch.randn(2, sq, 4, 64) for _ in range(3))
        k, v = (torch.randn(2, sq, 2, 64) for _ in range(2))
        return q, k, v, o, do, torch.randn(2, 4, sq)
    q, k, v, o, do, lse = inputs()
    key = launch_sm90.bwd_plan_key(q, k, v, o, do, lse, spec, None, varlen=varlen)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    launch_sm90.fused_backward(q, k, v, o, do, lse, torch.empty_like(lse), dq, dk, dv, spec, key,
                               varlen=varlen)
    (first,) = direct
    q, k, v, o, do, lse = inputs()
    runs.clear()
    launch_sm90.planned_backward(q, k, v, o, do, lse, spec, None, varlen=varlen)
    assert len(direct) == 1, "the replay's prologue went through launch"
    (args,) = replays
    got = dict(zip(names, args[-len(names):]))
    (values,) = runs
    kernel = dict(zip(launch_sm90._kernel("bwd").arg_names, values))
    assert got["O"] == o.data_ptr() and got["DO"] == do.data_ptr()
    assert got["LSE"] == lse.data_ptr()
    assert got["DELTA"] == kernel["desc_delta"].base.data_ptr()
    assert got["DQ_ACC"] == kernel["desc_dq"].base.data_ptr()
    if case == "dense":  # whole tiles: the kernel reads lse itself
        assert kernel["desc_lse"].base is lse
    else:
        assert got["LSE_P"] == kernel["desc_lse"].base.data_ptr() != lse.data_ptr()
    if case == "packed" or launch_sm90.bwd_persistent(64):
        assert got["COUNTER"] == kernel["Counter"].data_ptr()
    for n in names:
        if n not in launch_sm90._PROLOGUE_PTRS:
            assert got[n] == first[n], n
    if case == "packed":
        tile = launch_sm90.bwd_rows(64, packed=True, masked=True)
        assert got["SRC"] == launch_sm90._orders.get(("rows", sq, tile), (varlen[0],),
                                                     lambda: None).data_ptr()


@pytest.mark.parametrize("head_dim, width", [(64, 64), (128, 128), (256, 256), (80, 128),
                                             (96, 128), (120, 128), (136, 256), (192, 256),
                                             (248, 256), (32, 0), (56, 0), (100, 0),
                                             (264, 0), (512, 0)])
def test_sm90_padded_width_of_head_dims(head_dim, width):
    """``launch_sm90.padded_width``: the Hopper forward's tile width, the next of 64 / 128 /
    256 for a multiple of 8 between them (the TMA's rows are 16-byte multiples), 0 outside."""
    from flashtile.backends.triton import launch_sm90

    assert launch_sm90.padded_width(head_dim) == width


def test_sm90_forward_takes_padded_head_dims_only_where_asked(monkeypatch):
    """``eligible(..., padded=True)`` (the dense forward's dispatch, with or without a key
    mask, and packed sequences') takes d = 96 at width 128; without it (block masks, and every
    backward) d = 96 stays on the portable kernels; the launch's key tells the descriptors'
    ranks apart (the SDPA layout's 2-D views, heads side by side through 3-D ones), so one
    compiled variant never serves the other's descriptors (the kernel of the next width:
    ``FWD_SPLIT`` off; the split kernel reads both layouts through 2-D views)."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    monkeypatch.setattr(launch_sm90, "_dense", lambda *tensors: True)
    monkeypatch.setattr(launch_sm90, "FWD_SPLIT", False)
    keys = []
    monkeypatch.setattr(launch_sm90, "_launch", lambda name, device, key, grid, args, descs:
                        keys.append((key, {n: d[3] for n, d in descs.items()})))
    monkeypatch.setattr(launch_sm90, "_sm_count", lambda index: 132)
    spec = AttnSpec(softmax_scale=96 ** -0.5, window_right=0)
    q = torch.randn(2, 256, 4, 96)
    sdpa = torch.randn(2, 4, 256, 96).transpose(1, 2)
    assert launch_sm90.eligible(q, q, q, spec, padded=True)
    assert not launch_sm90.eligible(q, q, q, spec)
    assert not launch_sm90.bwd_eligible(q, q, q, q, q, q, spec)
    assert launch_sm90.varlen_eligible(q[0], q[0], q[0], spec, padded=True)
    assert not launch_sm90.varlen_eligible(q[0], q[0], q[0], spec)
    assert not launch_sm90.varlen_bwd_eligible(q[0], q[0], q[0], q[0], q[0], q[0], spec)
    launch_sm90.forward(q, q, q, spec)
    launch_sm90.forward(sdpa, sdpa, sdpa, spec)
    (heads_key, heads_blocks), (sdpa_key, sdpa_blocks) = keys
    assert heads_key != sdpa_key
    assert heads_blocks["desc_q"] == [64, 1, 128] and heads_blocks["desc_k"] == [128, 1, 128]
    assert heads_blocks["desc_o"] == [64, 1, 128]   # (the output: contiguous, heads side by side)
    assert sdpa_blocks["desc_q"] == [64, 128] and sdpa_blocks["desc_k"] == [128, 128]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["contiguous", "sdpa"])
def test_padded_backward_runs_at_the_next_width_on_zero_padded_copies(causal, layout,
                                                                       monkeypatch):
    """``launch_bwd._padded_backward``: where ``launch_sm90.pad_backward`` asks for it (long
    keys, a head dim the Hopper forward pads; forced here, on the Triton kernels of the
    interpreter), the backward runs once at the padded width on copies padded with zeros, and
    the gradients, cropped into the inputs' layouts, are within flash-attn's rule of float64;
    a call it declines runs at the head's own width."""
    import flashtile
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_bwd, launch_sm90
    from flashtile.reference.torch_ref import reference
    from helpers import check_flash_rule, make_gen, randn

    gen = make_gen(11)
    batch, seq, heads, d = 2, 40, 2, 24
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0 if causal else -1)

    def leaf(*shape):
        x = randn(*shape, gen=gen)
        if layout == "sdpa":  # (B, H, S, D) contiguous, seen as (B, S, H, D)
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x.requires_grad_()
    q, k, v = leaf(batch, seq, heads, d), leaf(batch, seq, heads, d), leaf(batch, seq, heads, d)
    do = randn(batch, seq, heads, d, gen=gen)
    widths = []
    real = launch_bwd._backward
    monkeypatch.setattr(launch_bwd, "_backward", lambda do_, q_, *a, **kw: widths.append(
        q_.shape[-1]) or real(do_, q_, *a, **kw))
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", False)  # (the copies' path)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_KEYS", 1)
    for forced in (32, 0):
        widths.clear()
        # (as the real rule: no padding at the padded width itself)
        monkeypatch.setattr(launch_sm90, "pad_backward",
                            lambda q_, *a, w=forced: w if q_.shape[-1] != w else 0)
        with flashtile.use_backend("triton"):
            out = flashtile.flash_attn_func(q, k, v, causal=causal)
            grads = torch.autograd.grad(out, (q, k, v), do)
        assert widths == ([d, 32] if forced else [d])
        assert all(g.shape == x.shape and g.stride() == x.stride()
                   for g, x in zip(grads, (q, k, v)))
        check_flash_rule(f"pad {forced}", out, grads, (q, k, v), do,
                         lambda q_, k_, v_, dtype: reference(q_, k_, v_, spec, dtype=dtype),
                         torch.float32)


@pytest.mark.parametrize("views", [True, False], ids=["views", "copies"])
def test_pad_backward_asks_for_long_keys_at_padded_head_dims_only(views, monkeypatch):
    """``launch_sm90.pad_backward``: the next width for a padded head dim from
    ``PAD_VIEW_KEYS`` keys on with ``PAD_BWD_VIEWS`` (else ``PAD_BWD_KEYS``), where the Hopper
    forward would take the call; 0 for the head dims the kernels have, for fewer keys, and for
    calls the Hopper kernels do not take."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    monkeypatch.setattr(launch_sm90, "_dense", lambda *tensors: True)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", views)
    spec = AttnSpec(softmax_scale=0.1, window_right=0)
    n = launch_sm90.PAD_VIEW_KEYS if views else launch_sm90.PAD_BWD_KEYS

    def call(d, sk, s=spec):
        q, k = torch.empty(1, 128, 2, d), torch.empty(1, sk, 2, d)
        return launch_sm90.pad_backward(q, k, k, s)
    assert call(96, n) == 128 and call(192, n) == 256 and call(80, 2 * n) == 128
    assert call(96, n - 1) == 0 and call(128, n) == 0 and call(40, n) == 0
    assert call(96, n, AttnSpec(softmax_scale=0.1, softcap=5.0)) == 0


def _tile_rows(block) -> int:
    """The rows of a descriptor's tile (``kernels/attn_fwd_sm90._tile_rows``)."""
    return block[1] if len(block) == 4 or (len(block) == 3 and block[1] != 1) else block[0]


def _tma_tile(desc, base: int, row: int, col: int):
    """The tile ``kernels/attn_fwd_sm90._tma_load`` reads through ``desc`` (``_descriptor``'s
    ``(tensor, shape, strides, block, layout)``) at a sequence's ``base``, ``row`` and ``col``
    (as the kernels compute them from ``*_rb``, ``*_rh``, ``*_ch``), zeros past the view's
    edges as the TMA fills them: ``[rows, width]``."""
    x, shape, strides, block = desc[:4]
    rows = _tile_rows(block)
    view = torch.as_strided(x, shape, strides, x.storage_offset())
    width = block[-1]
    # the view with zeros past each edge, a tile beyond each
    big = torch.zeros([n + b for n, b in zip(shape, block)], dtype=x.dtype)
    big[tuple(slice(0, n) for n in shape)] = view
    if len(block) == 2:
        return big[base + row:base + row + rows, col:col + width]
    if len(block) == 4:                                     # [1, rows, 1, width]
        return big[base, row:row + rows, col, :width]
    if block[1] == 1:                                       # heads: [rows, 1, width]
        return big[base + row:base + row + rows, col, :width]
    return big[base, row:row + rows, col:col + width]      # ragged: [1, rows, width]


def _heads_tensor(batch: int, seq: int, heads: int, d: int, layout: str):
    """Fresh fp16 ``(B, S, H, D)`` values, contiguous or in the SDPA layout's memory order
    (``(B, H, S, D)`` contiguous, transposed back)."""
    x = torch.randn(batch, seq, heads, d, dtype=torch.float16)
    return x.transpose(1, 2).contiguous().transpose(1, 2) if layout == "sdpa" else x


def _assert_unsplit(call, name: str, width: int) -> None:
    """A recorded launch ``(name, key, arguments)`` is of kernel ``name`` at its padded
    ``width`` with one descriptor a tensor (not a split launch)."""
    assert call[0] == name and call[2]["desc_q"][3][-1] == width, (call[0], call[2]["desc_q"][3])
    assert "desc_q2" not in call[2]


def _assert_split_tiles(a: dict, tensors, d: int, rows: int, keys: int,
                        first: int = 128) -> None:
    """A split launch's arguments ``a``: each ``(role, tensor, prefix)`` of ``tensors`` has two
    descriptors, ``desc_<role>`` over a head's ``first`` columns and ``desc_<role>2`` over the
    rest, tiles of ``rows`` rows (``keys`` for k and v); at the kernel's coordinates
    (``<prefix>_rb``, ``_rh``, ``_ch``, plus ``first`` for the second) the first and last tile
    of each head (emulated as the TMA reads them) are its rows of those columns, zeros past
    the sequence."""
    for role, x, prefix in tensors:
        for suffix, c0, c1 in (("", 0, first), ("2", first, d)):
            desc = a[f"desc_{role}{suffix}"]
            assert desc[0] is x and desc[3][-1] == c1 - c0, (role, suffix, desc[3])
            n = _tile_rows(desc[3])
            assert n == (keys if role in "kv" else rows), (role, n)
            for b in range(x.shape[0]):
                for h in range(x.shape[2]):
                    base = b * a[f"{prefix}_rb"] + h * a[f"{prefix}_rh"]
                    for row in (0, (x.shape[1] - 1) // n * n):  # (the last tile)
                        got = _tma_tile(desc, base, row, h * a[f"{prefix}_ch"] + c0)
                        want = torch.zeros(n, c1 - c0, dtype=x.dtype)
                        live = x[b, row:row + n, h, c0:c1]
                        want[:live.shape[0]] = live
                        assert torch.equal(got, want), (role, suffix, b, h, row)


def test_split_width_is_two_tiles_widths():
    """``launch_sm90.split_width``: the first of two power-of-two tile widths (64 or 128, the
    other smaller and at least 16) that make up the head dim, else 0."""
    from flashtile.backends.triton import launch_sm90

    got = {d: launch_sm90.split_width(d) for d in range(8, 264, 8)}
    assert {d: w for d, w in got.items() if w} == {80: 64, 96: 64, 144: 128, 160: 128,
                                                   192: 128}


@pytest.mark.parametrize("seq", [256, 200], ids=["aligned", "ragged"])
@pytest.mark.parametrize("layout", ["contiguous", "sdpa"])
@pytest.mark.parametrize("d", [192, 96])
def test_sm90_split_forward_reads_and_stores_a_heads_columns_in_two_tiles(d, layout, seq,
                                                                         monkeypatch):
    """With ``FWD_SPLIT`` a head dim of two tile widths launches the split kernel: each of q, k,
    v and the output has two descriptors, the first tiling a head's first ``split_width``
    columns and the second the rest; at the kernel's coordinates (a head's first column, plus
    the first width for the second tiles) their tiles (emulated as the TMA reads them) are the
    head's columns, in both layouts, lengths multiples of the tiles or not; the key tiles are
    the next width's kernel's; without the switch the same call launches the kernel of the
    next width."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = _direct_launches(monkeypatch, "fwd_split")
    monkeypatch.setattr(launch_sm90, "FWD_SPLIT", True)
    batch, heads, heads_k = 2, 4, 2

    def tensor(h):
        return _heads_tensor(batch, seq, h, d, layout)
    q, k, v = tensor(heads), tensor(heads_k), tensor(heads_k)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    out, _ = launch_sm90.forward(q, k, v, spec)
    (name, key, a), = calls
    assert name == "fwd_split"
    first = launch_sm90.split_width(d)
    out.copy_(torch.randn(out.shape))  # (what the kernel's stores would leave)
    pieces = (("", 0, first), ("2", first, d))
    tile_n = launch_sm90.block_n(launch_sm90.padded_width(d))
    for role, x, prefix, n_heads in (("q", q, "q", heads), ("k", k, "kv", heads_k),
                                     ("v", v, "kv", heads_k), ("o", out, None, heads)):
        for suffix, c0, c1 in pieces:
            desc = a[f"desc_{role}{suffix}"]
            assert desc[0] is x and desc[3][-1] == c1 - c0, (role, suffix, desc[3])
            rows = _tile_rows(desc[3])
            assert rows == (tile_n if role in "kv" else launch_sm90.BLOCK_M // 2)
            for b in range(batch):
                for h in range(n_heads):
                    if prefix is None:  # the output: contiguous, the kernel's own coordinates
                        base, col = (b if seq % 128 else b * seq), h * d
                    else:
                        base = b * a[f"{prefix}_rb"] + h * a[f"{prefix}_rh"]
                        col = h * a[f"{prefix}_ch"]
                    for row in (0, (seq - 1) // rows * rows):  # (the last tile)
                        got = _tma_tile(desc, base, row, col + c0)
                        want = torch.zeros(rows, c1 - c0, dtype=x.dtype)
                        live = x[b, row:row + rows, h, c0:c1]
                        want[:live.shape[0]] = live
                        assert torch.equal(got, want), (role, suffix, b, h, row)
    monkeypatch.setattr(launch_sm90, "FWD_SPLIT", False)
    launch_sm90.forward(q, k, v, spec)
    _assert_unsplit(calls[-1], "fwd", launch_sm90.padded_width(d))


@pytest.mark.parametrize("seq", [256, 200], ids=["aligned", "ragged"])
@pytest.mark.parametrize("layout", ["contiguous", "sdpa"])
@pytest.mark.parametrize("d", [192, 160])
def test_sm90_split_dq_reads_and_stores_a_heads_columns_in_two_tiles(d, layout, seq,
                                                                    monkeypatch):
    """With ``DQ_SPLIT`` the dQ pass of a padded head dim of 128 and a smaller tile's width
    launches the split dQ kernel: q, dO, k, v and dq have two descriptors each, the first
    tiling a head's first 128 columns and the second the rest; at the kernel's coordinates (a
    head's first column, plus 128 for the second tiles) their tiles (emulated as the TMA
    reads them) are the head's columns, in both layouts, lengths multiples of the tiles or
    not; K/V tiles of ``DQ_SPLIT_BLOCK_N`` keys; without the switch the kernel of width 256."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = _direct_launches(monkeypatch, "dq_split")
    monkeypatch.setattr(launch_sm90, "DQ_SPLIT", True)
    batch, heads, heads_k = 2, 4, 2

    def tensor(h):
        return _heads_tensor(batch, seq, h, d, layout)
    q, do, dq = tensor(heads), tensor(heads), tensor(heads)
    k, v = tensor(heads_k), tensor(heads_k)
    lse, delta = torch.randn(batch, heads, seq), torch.randn(batch, heads, seq)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    launch_sm90._dq(q, k, v, do, lse, delta, dq, spec, 256)
    (name, key, a), = calls
    # (the compiled variant's key holds the head dim: 192 and 160 tile their columns apart)
    assert name == "dq_split" and key[1] == 256 and key[-1] == d
    _assert_split_tiles(a, (("q", q, "q"), ("do", do, "do"), ("k", k, "kv"), ("v", v, "kv"),
                            ("dq", dq, "dq")), d, launch_sm90.DQ_ROWS,
                        launch_sm90.DQ_SPLIT_BLOCK_N)
    monkeypatch.setattr(launch_sm90, "DQ_SPLIT", False)
    launch_sm90._dq(q, k, v, do, lse, delta, dq, spec, 256)
    _assert_unsplit(calls[-1], "dq", 256)


@pytest.mark.parametrize("seq", [256, 200], ids=["aligned", "ragged"])
@pytest.mark.parametrize("layout", ["contiguous", "sdpa"])
@pytest.mark.parametrize("d", [96, 80])
def test_sm90_split_backward_of_width_128_reads_and_adds_a_heads_columns(d, layout, seq,
                                                                         monkeypatch):
    """With ``BWD128_SPLIT`` the fused backward of a padded head dim of 64 and a smaller tile's
    width (80, 96) at 128 launches the split kernel with the consumers of d = 128 (persistent,
    dK and dV stored by the kernel): q, dO, k and v have two descriptors each, the first
    tiling a head's first 64 columns and the second the rest, K and V one tile of the item's
    keys; at the kernel's coordinates their tiles (emulated as the TMA reads them) are the
    head's columns, in both layouts, lengths multiples of the tiles or not; the dQ
    accumulator (128 columns a head) has a descriptor of 64 columns and one of the rest, whose
    tiles at a head's columns 0 and 64 are the accumulator's columns of the head's dq; the
    launch key holds the head dim; the dK/dV kernel (no accumulator) and, without the switch,
    the fused call launch the kernel of width 128."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = _direct_launches(monkeypatch, "bwd_split")
    monkeypatch.setattr(launch_sm90, "BWD128_SPLIT", True)
    batch, heads, heads_k = 2, 4, 2

    def tensor(h):
        return _heads_tensor(batch, seq, h, d, layout)
    q, do, k, v = tensor(heads), tensor(heads), tensor(heads_k), tensor(heads_k)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq_acc = torch.randn(batch, seq, heads, 128)
    lse, delta = torch.randn(batch, heads, seq), torch.randn(batch, heads, seq)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    launch_sm90._bwd(q, k, v, do, lse, delta, dq_acc, dk, dv, spec, width=128)
    (name, key, a), = calls
    assert name == "bwd_split" and key[1] == 128 and key[9] == d
    assert a["DK"] is dk and a["DV"] is dv and a["DQ"]
    assert not a["DKDV_TMA"] and a["PERSISTENT"] == launch_sm90.bwd_persistent(128)
    _assert_split_tiles(a, (("q", q, "q"), ("do", do, "do"), ("k", k, "kv"), ("v", v, "kv")),
                        d, launch_sm90.bwd_rows(128), launch_sm90.bwd_keys(128), first=64)
    rows = launch_sm90.bwd_rows(128)
    for suffix, c0, c1 in (("", 0, 64), ("2", 64, d)):
        desc = a[f"desc_dq{suffix}"]
        assert desc[0] is dq_acc and desc[3][-1] == c1 - c0 and _tile_rows(desc[3]) == rows
        for b in range(batch):
            for h in range(heads):
                for row in (0, (seq - 1) // rows * rows):
                    # (the kernel's coordinates: a sequence's first row, or its index with
                    # ragged lengths; the head's columns of the accumulator)
                    base = b if seq % rows else b * seq
                    got = _tma_tile(desc, base, row, h * 128 + c0)
                    want = torch.zeros(rows, c1 - c0)
                    live = dq_acc[b, row:row + rows, h, c0:c1]
                    want[:live.shape[0]] = live
                    assert torch.equal(got, want), (suffix, b, h, row)
    for acc, split in ((None, True), (dq_acc, False)):
        monkeypatch.setattr(launch_sm90, "BWD128_SPLIT", split)
        launch_sm90._bwd(q, k, v, do, lse, delta, acc, dk, dv, spec, width=128)
        _assert_unsplit(calls[-1], "bwd", 128)


def test_launch_keeps_a_compiled_variant_per_descriptor_tiles(monkeypatch):
    """``launch_sm90._launch`` files each compiled variant under the descriptors' tiles as well
    as the caller's key: two launches alike in everything the caller names but a tile's width
    (as split kernels of head dims 144 and 192 are) compile two variants, and a third launch
    like the first finds the first's."""
    from flashtile.backends.triton import launch_sm90

    class Kernel:  # compiles a new (fake) variant per launch; its launches go nowhere
        arg_names = ["desc_q", "n"]

        def __getitem__(self, grid):
            return lambda **args: object()
    monkeypatch.setattr(launch_sm90, "INTERNALS_OK", True)
    monkeypatch.setattr(launch_sm90, "_kernel", lambda name: Kernel())
    monkeypatch.setattr(launch_sm90, "_descriptor", lambda *a: a)
    monkeypatch.setattr(launch_sm90, "run_direct", lambda *a: True)
    monkeypatch.setattr(launch_sm90, "_compiled", {})
    x = torch.zeros(4, 8)
    for cols in (16, 64, 16):
        launch_sm90._launch("dq_split", 0, ("same",), (1,), {"n": 32},
                            {"desc_q": (x, [4, 8], [8, 1], [64, cols], None)})
    assert sorted(k[-1] for k in launch_sm90._compiled) == [((64, 16),), ((64, 64),)]


@pytest.mark.parametrize("seq", [256, 200], ids=["aligned", "ragged"])
@pytest.mark.parametrize("layout", ["contiguous", "sdpa"])
@pytest.mark.parametrize("d", [192, 144])
def test_sm90_split_dkdv_reads_a_heads_columns_in_two_tiles(d, layout, seq, monkeypatch):
    """With ``BWD_SPLIT`` the dK/dV kernel of a padded head dim of 128 and a smaller tile's
    width launches the split kernel: q, dO, k and v have two descriptors each, the first
    tiling a head's first 128 columns and the second the rest; at the kernel's coordinates
    their tiles (emulated as the TMA reads them) are the head's columns, in both layouts,
    lengths multiples of the tiles or not; the items are d = 256's (64 keys), dK and dV stored
    by the kernel into the head-wide gradients; the launch key holds the head dim; without the
    switch the kernel of width 256."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = _direct_launches(monkeypatch, "bwd_split")
    monkeypatch.setattr(launch_sm90, "BWD_SPLIT", True)
    batch, heads, heads_k = 2, 4, 2

    def tensor(h):
        return _heads_tensor(batch, seq, h, d, layout)
    q, do, k, v = tensor(heads), tensor(heads), tensor(heads_k), tensor(heads_k)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    lse, delta = torch.randn(batch, heads, seq), torch.randn(batch, heads, seq)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    launch_sm90._bwd(q, k, v, do, lse, delta, None, dk, dv, spec, width=256)
    (name, key, a), = calls
    # (the key: dtype, width, window and kernel flags, DK_COLS, then the split head dim)
    assert name == "bwd_split" and key[1] == 256 and key[8:10] == (d, d)
    assert a["DK"] is dk and a["DV"] is dv and a["DK_COLS"] == d and not a["DQ"]
    assert not a["DKDV_TMA"] and not a["PERSISTENT"]
    _assert_split_tiles(a, (("q", q, "q"), ("do", do, "do"), ("k", k, "kv"), ("v", v, "kv")),
                        d, launch_sm90.bwd_rows(256), launch_sm90.bwd_keys(256))
    monkeypatch.setattr(launch_sm90, "BWD_SPLIT", False)
    launch_sm90._bwd(q, k, v, do, lse, delta, None, dk, dv, spec, width=256)
    _assert_unsplit(calls[-1], "bwd", 256)


@pytest.mark.parametrize("narrow", [False, True], ids=["wide-dkdv", "narrow-dkdv"])
@pytest.mark.parametrize("layout", ["contiguous", "sdpa"])
@pytest.mark.parametrize("seq", [256, 200], ids=["aligned", "ragged"])
@pytest.mark.parametrize("d", [96, 192])
def test_padded_backward_reads_each_head_through_views_of_the_kernels_width(d, seq, layout,
                                                                            narrow, monkeypatch):
    """``launch_sm90.padded_backward`` (no copies): every tile the kernels read of q, dO, k and
    v through the launcher's views (emulated as the TMA reads them, zeros past the view) is
    that head's rows with zeros past its last column, in both layouts, lengths multiples of
    the tiles or not; the prologue (run by the interpreter) computes delta from the head's
    own columns and zeroes a dQ accumulator of the kernels' width; 128 takes the fused kernel,
    256 the dQ kernel (storing through a view of ``dq``) and the dK/dV kernel; the gradients
    the kernels leave in buffers of that width come back cropped into the inputs' layouts; with
    ``PAD_NARROW_DKDV`` the kernels store into dk and dv themselves where they can (``DK_COLS``
    the head dim): in the SDPA layout at 128 with aligned lengths TMA stores through the 2-D
    view whose edge is the head's last column, else (at 256, ragged lengths, heads side by
    side) their own masked stores; no crops, and
    the two kernels' call (launches only) may be recorded as a launch plan."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import fastlaunch, launch_sm90

    calls = _direct_launches(monkeypatch, "bwd")
    width = launch_sm90.padded_width(d)
    batch, heads, heads_k = 2, 4, 2

    def tensor(h):
        return _heads_tensor(batch, seq, h, d, layout)
    q, do, k, v = tensor(heads), tensor(heads), tensor(heads_k), tensor(heads_k)
    out = torch.randn(batch, seq, heads, d, dtype=torch.float16)
    lse = torch.randn(batch, heads, seq)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    patterns = {}

    def kernel_writes(name, device, key, grid, args, descs):
        # the gradients the kernels would leave: a pattern in every buffer they write
        calls.append((name, key, {**args, **descs}))
        targets = ("DK", "DV") + (("desc_dq",) if args["DQ"] else ()) if name == "bwd" else ()
        for t in targets:
            buf = descs[t][0] if t.startswith("desc") else args[t]
            patterns[t] = torch.randn(buf.shape).to(buf.dtype)
            buf.copy_(patterns[t])
        return None
    monkeypatch.setattr(launch_sm90, "_launch", kernel_writes)
    monkeypatch.setattr(launch_sm90, "PAD_NARROW_DKDV", narrow)
    # (the split kernels' descriptors: test_sm90_split_dq_reads_and_stores_...,
    # test_sm90_split_dkdv_reads_... and test_sm90_split_backward_of_width_128_...)
    monkeypatch.setattr(launch_sm90, "DQ_SPLIT", False)
    monkeypatch.setattr(launch_sm90, "BWD_SPLIT", False)
    monkeypatch.setattr(launch_sm90, "BWD128_SPLIT", False)
    with fastlaunch.recording() as rec:
        launch_sm90.padded_backward(q, k, v, out, do, lse, dq, dk, dv, spec, width)
    # the crops and the fused kernel's dQ conversion are no launches: the call is marked as
    # one no launch plan repeats, unless it is launches only (the two kernels, narrow)
    assert ((None, None, None) in rec.launches) == (not (narrow and width == 256))
    names = [c[0] for c in calls]
    assert names == (["bwd"] if width == 128 else ["dq", "bwd"]), names
    for name, key, a in calls:
        assert key[1] == width   # the kernel's width in its compiled variant's key
        for role, x, prefix, n_heads in (("desc_q", q, "q", heads), ("desc_do", do, "do", heads),
                                         ("desc_k", k, "kv", heads_k),
                                         ("desc_v", v, "kv", heads_k)):
            desc = a[role]
            assert desc[0] is x and desc[3][-1] == width, (role, desc[3])
            rows = _tile_rows(desc[3])
            for b in range(batch):
                for h in range(n_heads):
                    base = b * a[f"{prefix}_rb"] + h * a[f"{prefix}_rh"]
                    for row in (0, (seq - 1) // rows * rows):  # (the last tile)
                        got = _tma_tile(desc, base, row, h * a[f"{prefix}_ch"])
                        want = torch.zeros(rows, width, dtype=x.dtype)
                        live = x[b, row:row + rows, h]
                        want[:live.shape[0], :d] = live
                        assert torch.equal(got, want), (name, role, b, h, row)
        if name == "dq":  # dQ stored through a view of dq: its tiles are the heads' rows
            desc = a["desc_dq"]
            assert desc[0] is dq and desc[3][-1] == width
    bwd = calls[-1][2]
    delta = bwd["desc_delta"][0].view(batch, heads, -1)[..., :seq]
    torch.testing.assert_close(delta, (out.float() * do.float()).sum(-1).transpose(1, 2),
                               rtol=1e-3, atol=1e-3)
    if narrow:  # the kernel's stores into dk and dv
        assert bwd["DK"] is dk and bwd["DV"] is dv and bwd["DK_COLS"] == d
        tma = width == 128 and layout == "sdpa" and seq == 256
        assert bwd["DKDV_TMA"] == tma
        if tma:  # tiles of the kernel's width on the 2-D view of each head's rows, D wide
            for role, x in (("desc_dk", dk), ("desc_dv", dv)):
                desc = bwd[role]
                assert desc[0] is x and desc[1][-1] == d and desc[3] == [64, width], desc[1:4]
        assert torch.equal(dk, patterns["DK"]) and torch.equal(dv, patterns["DV"])
    else:
        assert bwd["DK"].shape == bwd["DV"].shape == (batch, seq, heads_k, width)
        assert bwd["DK_COLS"] == width
        assert torch.equal(dk, patterns["DK"][..., :d])
        assert torch.equal(dv, patterns["DV"][..., :d])
    assert dk.stride() == k.stride() and dv.stride() == v.stride()
    if width == 128:  # the fused kernel's accumulator, width wide, cropped into dq
        assert bwd["DQ"] and bwd["desc_dq"][0].shape == (batch, seq, heads, width)
        assert torch.equal(dq, patterns["desc_dq"][..., :d].to(dq.dtype))
    else:
        assert not bwd["DQ"]


@pytest.mark.parametrize("narrow", [False, True], ids=["wide-dkdv", "narrow-dkdv"])
def test_padded_backward_of_packed_sequences_reads_views_and_crops(narrow, monkeypatch):
    """``launch_sm90.padded_backward`` of packed sequences (``varlen_pad_width``: 128 for a
    head dim the forward pads to it, with ``PAD_BWD_VIEWS``): one launch of the fused kernel
    at 128 over the packed rows as one batch entry, each sequence's tiles of q, dO, k and v its
    rows with zeros past the head's last column (emulated as the TMA reads them), delta in the
    packed prologue's per-sequence layout from the head's own columns, dK and dV stored by the
    kernel into buffers 128 wide, and the gradients cropped; with ``PAD_NARROW_DKDV`` into dk
    and dv themselves (``dk_cols`` the head dim, their strides: the kernel masks the columns
    past it), no crop."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    calls = _direct_launches(monkeypatch, "bwd")
    d, heads, heads_k = 96, 4, 2
    lengths = [100, 300, 29]
    cu = torch.tensor([0, 100, 400, 429], dtype=torch.int32)
    total = 429
    q, do = (torch.randn(total, heads, d, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(total, heads_k, d, dtype=torch.float16) for _ in range(2))
    out = torch.randn(total, heads, d, dtype=torch.float16)
    lse = torch.randn(heads, total)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", True)
    assert launch_sm90.varlen_pad_width(q, k, v, out, do, q, spec) == 128
    assert launch_sm90.varlen_pad_width(q[..., :64], k[..., :64], v[..., :64], out[..., :64],
                                        do[..., :64], q[..., :64], spec) == 0  # (its own kernel)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", False)
    assert launch_sm90.varlen_pad_width(q, k, v, out, do, q, spec) == 0
    monkeypatch.setattr(launch_sm90, "PAD_NARROW_DKDV", narrow)
    patterns = {}

    def kernel_writes(name, device, key, grid, args, descs):
        calls.append((name, key, {**args, **descs}))
        for t in ("DK", "DV", "desc_dq"):
            buf = descs[t][0] if t.startswith("desc") else args[t]
            patterns[t] = torch.randn(buf.shape).to(buf.dtype)
            buf.copy_(patterns[t])
    monkeypatch.setattr(launch_sm90, "_launch", kernel_writes)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    varlen = launch_sm90.packed_args(cu, cu, max(lengths), max(lengths))
    launch_sm90.padded_backward(q, k, v, out, do, lse, dq, dk, dv, spec, 128, varlen)
    (name, key, a), = calls
    assert name == "bwd" and key[1] == 128 and a["DQ"] and not a["DKDV_TMA"]
    assert a["CuQ"] is varlen[0] and (a["sq"], a["sk"]) == (300, 300)
    for role, x, prefix, n_heads in (("desc_q", q, "q", heads), ("desc_do", do, "do", heads),
                                     ("desc_k", k, "kv", heads_k), ("desc_v", v, "kv", heads_k)):
        desc = a[role]
        assert desc[3][-1] == 128 and desc[0].shape == (1, *x.shape)
        for i, n in enumerate(lengths):
            for h in range(n_heads):
                got = _tma_tile(desc, int(cu[i]) + h * a[f"{prefix}_rh"], 0,
                                h * a[f"{prefix}_ch"])
                rows = min(n, got.shape[0])
                assert torch.equal(got[:rows, :d], x[int(cu[i]):int(cu[i]) + rows, h]), role
                assert not got[:, d:].any(), role   # zeros past the head's last column
    delta = a["desc_delta"][0].view(heads, -1)
    rowsum = (out.float() * do.float()).sum(-1).T                           # [H, total]
    # sequence b from ((cu[b] + b * 64) // 64) * 64 (packed_prologue)
    for (s0, s1), first in zip(((0, 100), (100, 400), (400, 429)), (0, 128, 512)):
        torch.testing.assert_close(delta[:, first:first + s1 - s0], rowsum[:, s0:s1],
                                   rtol=1e-3, atol=1e-3)
    if narrow:  # the kernel's own masked stores into dk and dv (a view of one batch entry)
        assert a["DK"].shape == (1, total, heads_k, d) and a["DK_COLS"] == d
        assert a["DK"].data_ptr() == dk.data_ptr() and a["DV"].data_ptr() == dv.data_ptr()
        assert (a["stride_kn"], a["stride_kh"]) == dk.stride()[:2]
        assert torch.equal(dk, patterns["DK"][0]) and torch.equal(dv, patterns["DV"][0])
    else:
        assert a["DK"].shape == (1, total, heads_k, 128) and a["DK_COLS"] == 128
        assert torch.equal(dk, patterns["DK"][0, ..., :d])
        assert torch.equal(dv, patterns["DV"][0, ..., :d])
    assert torch.equal(dq, patterns["desc_dq"][0, ..., :d].to(dq.dtype))


@pytest.mark.parametrize("views", [True, False], ids=["views", "switch-off"])
def test_padded_head_dims_backward_dispatch(views, monkeypatch):
    """``launch_bwd.backward`` at a head dim the forward pads, on an H100 as far as the
    launcher can tell: with ``PAD_BWD_VIEWS`` a dense call, a padded batch's key mask and
    packed sequences take ``launch_sm90.padded_backward`` at 128 (the key mask passed on);
    with the switch off the dense call takes the copies' path (a backward at the width) and
    the others the portable kernels."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_bwd, launch_sm90

    monkeypatch.setattr(launch_sm90, "on_hopper", lambda q: True)
    monkeypatch.setattr(launch_sm90, "_dense", lambda *tensors: True)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_VIEWS", views)
    monkeypatch.setattr(launch_sm90, "PAD_BWD_KEYS", 64)
    seen, widths, portable = [], [], []
    monkeypatch.setattr(launch_sm90, "padded_backward", lambda *a, **kw: seen.append(
        (a[10], a[11] if len(a) > 11 else None, kw.get("key_mask"))))
    monkeypatch.setattr(launch_bwd, "_padded_backward", lambda *a: widths.append(a[7]) or a[8:])
    monkeypatch.setattr(launch_bwd, "_chunked", lambda *a: portable.append(1))
    monkeypatch.setattr(launch_bwd, "launch", lambda kernel, grid, **kw: portable.append(
        kernel))
    d, seq = 96, 128
    q, do, out = (torch.randn(2, seq, 4, d, dtype=torch.float16) for _ in range(3))
    k, v = (torch.randn(2, seq, 2, d, dtype=torch.float16) for _ in range(2))
    lse = torch.randn(2, 4, seq)
    spec = AttnSpec(softmax_scale=d ** -0.5, window_right=0)
    mask = torch.ones(2, 1, 1, seq, dtype=torch.bool)
    mask[0, ..., :17] = False
    launch_bwd.backward(do, q, k, v, out, lse, spec)
    launch_bwd.backward(do, q, k, v, out, lse, spec, attn_bias=mask)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (do, q, k, v, out)]
    launch_bwd.backward(*flat, lse.transpose(0, 1).reshape(4, -1).contiguous(), spec,
                        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
    if views:
        assert widths == [128]  # (the dense call: _padded_backward, which takes the views)
        (w_mask, packed_mask, key_mask), (w_packed, packed, none) = seen
        assert (w_mask, packed_mask, none) == (128, None, None) and w_packed == 128
        assert key_mask is not None and packed is not None and packed[0].dtype == torch.int32
    else:
        assert widths == [128] and seen == [] and portable


@pytest.mark.parametrize("d, case", [(64, "dense"), (64, "ragged"), (64, "packed"),
                                     (64, "packed-causal"), (128, "dense")],
                         ids=["d64-dense", "d64-ragged", "d64-packed", "d64-packed-causal",
                              "d128-dense"])
def test_sm90_fused_backward_steps_through_its_query_tile(monkeypatch, d, case):
    """The fused backward's query tile (``bwd_rows``): 128 rows at d = 64, 64 for packed
    sequences with causal masking and at d = 128.  Q's, dO's and the dQ accumulator's
    descriptors tile that many rows, lse's and delta's are tiles of as many values, and the
    lse and delta the kernel reads
    hold whole tiles (``sq_pad``; ragged lengths padded by the prologue, +inf and 0 past Sq;
    packed sequences each from a tile's first row)."""
    import torch

    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton import launch_sm90

    from flashtile.backends.triton.fastlaunch import poison_outputs

    calls = _direct_launches(monkeypatch, "bwd")
    packed, causal = case.startswith("packed"), case != "packed"
    rows = launch_sm90.bwd_rows(d, packed=packed, masked=causal)
    assert rows == (128 if d == 64 and case != "packed-causal" else 64)
    sq = {"dense": 256, "ragged": 150}.get(case, 200)  # (150: 192 in 64-row tiles)
    spec = AttnSpec(softmax_scale=0.125, window_right=0 if causal else -1)
    varlen, lead = None, (2,)
    if packed:
        cu = torch.tensor([0, 70, 200], dtype=torch.int32)
        varlen, lead = (cu, cu, 130, 130), ()
    q, o, do = (torch.randn(*lead, sq, 4, d) for _ in range(3))
    k, v = (torch.randn(*lead, sq, 2, d) for _ in range(2))
    lse = torch.randn(*lead, 4, sq) if lead else torch.randn(4, sq)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    with poison_outputs():  # (fresh buffers start as NaN: every element read is written)
        launch_sm90.fused_backward(q, k, v, o, do, lse, torch.empty_like(lse), dq, dk, dv, spec,
                                   varlen=varlen)
    (name, key, a), = calls
    for role in ("desc_q", "desc_do", "desc_dq"):
        assert _tile_rows(a[role][3]) == rows, role
    assert a["desc_lse"][3] == [rows] and a["desc_delta"][3] == [rows]
    sq_pad = a["sq_pad"]
    lse_k, delta_k = a["desc_lse"][0], a["desc_delta"][0]
    assert sq_pad % rows == 0 and lse_k.numel() == delta_k.numel() == lse.numel() // sq * sq_pad
    lse_k, delta_k = lse_k.view(*lse.shape[:-1], sq_pad), delta_k.view(*lse.shape[:-1], sq_pad)
    if packed:  # the second sequence from the first tile boundary past 70 + 1 rows
        start = (70 + rows) // rows * rows
        assert torch.equal(lse_k[:, :70], lse[:, :70])
        assert torch.equal(lse_k[:, start:start + 130], lse[:, 70:])
        assert (lse_k[:, 70:start] == float("inf")).all() and (delta_k[:, 70:start] == 0).all()
    else:
        assert sq_pad == -(-sq // rows) * rows
        assert torch.equal(lse_k[..., :sq], lse)
        assert (lse_k[..., sq:] == float("inf")).all() and (delta_k[..., sq:] == 0).all()
