"""The Hopper forward kernel (Gluon) compiled for sm_90a on this CPU-only machine: Triton's own
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

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

SMEM_LIMIT = 227 * 1024  # per block on sm_90

# Prints one JSON line per variant: what the compiled kernel is made of.
_COMPILE = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from flashtile.backends.triton import launch_sm90
from flashtile.backends.triton.kernels.attn_fwd_sm90 import attn_fwd_sm90_kernel as kernel

INT_ARGS = ("stride_ob", "stride_om", "stride_oh", "stride_lb", "stride_lh", "batch", "sq", "sk",
            "nheads", "group", "lpt")
names = kernel.arg_names
for dtype in (torch.bfloat16, torch.float16):
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            # as the launcher specialises a call with no integer argument equal to 1
            q_layout, kv_layout = launch_sm90._layouts(head_dim, dtype)
            ty = "bf16" if dtype == torch.bfloat16 else "fp16"
            bq, bn = launch_sm90.BLOCK_M // 2, launch_sm90.block_n(head_dim)
            types = {"desc_q": f"tensordesc<{ty}[{bq}, {head_dim}],{q_layout!r}>",
                     "desc_k": f"tensordesc<{ty}[{bn}, {head_dim}],{kv_layout!r}>",
                     "desc_v": f"tensordesc<{ty}[{bn}, {head_dim}],{kv_layout!r}>",
                     "Out": f"*{ty}", "Lse": "*fp32", "qk_scale": "fp32", "CAUSAL": "constexpr",
                     "STAGES": "constexpr", "num_warps": "constexpr"}
            types.update({name: "i32" for name in INT_ARGS})
            assert set(types) == set(names), sorted(set(types) ^ set(names))
            constexprs = {(names.index("CAUSAL"),): causal,
                          (names.index("STAGES"),): launch_sm90.STAGES,
                          (names.index("num_warps"),): launch_sm90.NUM_WARPS}
            src = GluonASTSource(kernel, {n: types[n] for n in names}, constexprs)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": launch_sm90.NUM_WARPS})
            ptx = k.asm["ptx"]
            print(json.dumps(dict(
                variant=f"{ty}-d{head_dim}-{'causal' if causal else 'full'}",
                head_dim=head_dim, shared=k.metadata.shared, num_warps=k.metadata.num_warps,
                cubin_bytes=len(k.asm["cubin"]),
                ops={op: op in ptx for op in ("wgmma.mma_async", "cp.async.bulk.tensor",
                                              "setmaxnreg", "mbarrier.try_wait")})))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {row["variant"]: row for row in rows}


VARIANTS = [f"{ty}-d{d}-{mode}" for ty in ("bf16", "fp16") for d in (64, 128, 256)
            for mode in ("full", "causal")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sm90_forward_compiles_for_hopper_with_its_structure(compiled, variant):
    from flashtile.backends.triton import launch_sm90

    row = compiled[variant]
    assert row["cubin_bytes"] > 0, "ptxas produced no binary"
    # Q (two 64-row halves) + STAGES K and V tiles (+ barriers), within the per-block limit
    rows = launch_sm90.BLOCK_M + 2 * launch_sm90.STAGES * launch_sm90.block_n(row["head_dim"])
    tiles = rows * row["head_dim"] * 2
    assert tiles <= row["shared"] <= SMEM_LIMIT
    # 4 warps per consumer warpgroup, 2 consumers, 1 producer warp padded to a warpgroup
    assert row["num_warps"] == 12
    # asynchronous warpgroup matrix products, TMA loads, per-partition register budgets and the
    # producer/consumer handshakes are all in the code
    assert all(row["ops"].values()), row["ops"]
