"""Correctness suite for whatever device is present: ``python -m flashtile.check``.

Each case draws fresh random inputs, runs flashtile forward and backward with NaN-poisoned
gradient buffers, and compares against a float64 reference using flash-attn's rule:

    |flashtile - ref64|_max  <=  2 * |torch_same_dtype - ref64|_max + eps      (output)
    |flashtile - ref64|_max  <=  3 * |torch_same_dtype - ref64|_max + eps      (dq, dk, dv)

where ``ref64`` and ``torch_same_dtype`` are ``flashtile.reference.torch_ref.reference`` in
float64 and in the input dtype (softmax in float32).  On a GPU it runs the Triton kernels; on
a CPU the torch backend (small shapes).
Feature cases (``--features`` runs only those) cover dropout (the reference applies the keep
mask read back from ``S_dmask``, or regenerated from the call's seed), SDPA attention masks and
learnable biases (``dbias`` checked with the gradient rule), block-sparse attention (the
reference is the dense masked attention of the expanded block mask) and varlen attention on
paged keys/values (``block_table``, pages in random order in a NaN-filled pool; besides the
reference rule, out and gradients must equal those of the same call on contiguous keys/values
on the portable kernels bit for bit, reported as ``paged_vs_contig``).
Exit status 1 if any case fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import sys
import time
import zlib
from unittest import mock

import torch

from .backends import select
from .backends.spec import AttnSpec
from .block_sparse import (block_sparse_attn_func, butterfly_block_mask, expand_block_mask,
                           local_block_mask)
from .interface import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from .reference.torch_ref import reference
from .rng import draw_seed, keep_mask


@dataclasses.dataclass
class Case:
    name: str
    batch: int
    sq: int
    sk: int
    nheads: int
    nheads_k: int
    d: int
    dtype: torch.dtype
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    varlen: bool = False
    sdpa: bool = False
    dropout: float = 0.0
    # SDPA attn_mask: "bool" (B, 1, L, S), "bias" (B, H, L, S) learnable, "bias-bcast"
    # (1, H, 1, S) learnable
    mask: str = ""
    # block-sparse: "butterfly" or "local" over blocks of `block` x `block`
    sparse: str = ""
    block: int = 128
    # varlen with paged k/v of this page size (0: contiguous)
    paged: int = 0

    @property
    def feature(self) -> bool:
        return bool(self.dropout or self.mask or self.sparse or self.paged)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _mask_for(c: Case, device, gen):
    if c.mask == "bool":
        m = torch.rand(c.batch, 1, c.sq, c.sk, device=device, generator=gen) > 0.3
        return m, False
    shape = (c.batch, c.nheads, c.sq, c.sk) if c.mask == "bias" else (1, c.nheads, 1, c.sk)
    return torch.randn(*shape, device=device, generator=gen, dtype=c.dtype), True


def _page_layout(c: Case, device, gen):
    """``(block_table, slots, num_blocks)`` spreading the keys of ``c.batch`` sequences of
    ``c.sk`` keys over pages of ``c.paged`` slots in random order, with spare pages."""
    per_seq = -(-c.sk // c.paged)
    num_blocks = c.batch * per_seq + 3
    perm = torch.randperm(num_blocks, device=device, generator=gen)[:c.batch * per_seq]
    table = perm.reshape(c.batch, per_seq).to(torch.int32)
    j = torch.arange(c.sk, device=device)
    slots = table.long()[:, j // c.paged] * c.paged + j % c.paged  # (batch, sk)
    return table, slots.reshape(-1), num_blocks


def run_case(c: Case, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(c.name.encode()))
    mk = lambda *s: torch.randn(*s, device=device, dtype=c.dtype, generator=gen)  # noqa: E731
    q = mk(c.batch, c.sq, c.nheads, c.d)
    k = mk(c.batch, c.sk, c.nheads_k, c.d)
    v = mk(c.batch, c.sk, c.nheads_k, c.d)
    do = mk(c.batch, c.sq, c.nheads, c.d)
    slopes = (torch.rand(c.batch, c.nheads, device=device, generator=gen) * 0.3) if c.alibi else None
    right = 0 if c.causal else c.window[1]
    spec = AttnSpec(1.0 / math.sqrt(c.d), c.window[0], right, not (c.sdpa or c.mask), c.softcap,
                    c.dropout)
    mask, learn = (None, False)
    if c.mask:
        mask, learn = _mask_for(c, device, gen)
    bmask = None
    if c.sparse:
        build = butterfly_block_mask if c.sparse == "butterfly" else local_block_mask
        bmask = build(c.sq, c.sk, c.block, device=device).expand(c.batch, c.nheads, -1, -1)
    seen = {}
    if c.paged:
        seen["pages"] = _page_layout(c, device, gen)

    def ours(q_, k_, v_, *extra, contiguous=False):
        if c.mask:
            return scaled_dot_product_attention(
                q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2),
                attn_mask=extra[0] if extra else mask, dropout_p=c.dropout,
                enable_gqa=True).transpose(1, 2)
        if c.sparse:
            return block_sparse_attn_func(q_, k_, v_, bmask, (c.block, c.block), c.dropout,
                                          causal=c.causal)
        if c.sdpa:
            return scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2),
                                                v_.transpose(1, 2), is_causal=c.causal,
                                                dropout_p=c.dropout,
                                                enable_gqa=True).transpose(1, 2)
        if c.varlen:
            lens_q = [c.sq] * c.batch
            cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32,
                                device=device)
            cu_k = torch.tensor([0] + list(itertools.accumulate([c.sk] * c.batch)),
                                dtype=torch.int32, device=device)
            kk, vv = k_.reshape(-1, c.nheads_k, c.d), v_.reshape(-1, c.nheads_k, c.d)
            table = None
            if c.paged and not contiguous:
                # differentiable copy into a NaN pool: the gradients flow back to k_ / v_
                table, slots, num_blocks = seen["pages"]
                pool = kk.new_full((num_blocks * c.paged, c.nheads_k, c.d), float("nan"))
                kk, vv = (torch.index_put(pool, (slots,), x).view(num_blocks, c.paged,
                                                                 c.nheads_k, c.d)
                          for x in (kk, vv))
            o = flash_attn_varlen_func(q_.reshape(-1, c.nheads, c.d), kk, vv, cu_q, cu_k, c.sq,
                                       c.sk, dropout_p=c.dropout, causal=c.causal,
                                       window_size=c.window, softcap=c.softcap,
                                       alibi_slopes=slopes, block_table=table)
            return o.reshape(c.batch, c.sq, c.nheads, c.d)
        if c.dropout:
            o, _, s_dmask = flash_attn_func(q_, k_, v_, dropout_p=c.dropout, causal=c.causal,
                                            window_size=c.window, softcap=c.softcap,
                                            alibi_slopes=slopes, return_attn_probs=True)
            seen["keep"] = s_dmask >= 0
            return o
        return flash_attn_func(q_, k_, v_, causal=c.causal, window_size=c.window,
                               softcap=c.softcap, alibi_slopes=slopes)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if learn:
        leaves.append(mask.detach().clone().requires_grad_())
    rng_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    def rewind_rng():  # (the default generator back where the call drew its dropout seed)
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng_state, device)
        else:
            torch.set_rng_state(rng_state)

    out = ours(*leaves)
    keep = seen.get("keep")
    if c.dropout and keep is None:
        # the call drew its seed from the default generator: draw it again from the same state
        rewind_rng()
        keep = keep_mask(int(draw_seed(device)[0]), c.dropout, c.batch, c.nheads, c.sq, c.sk,
                         device=device)
    grads = torch.autograd.grad(out, leaves, do)
    pair = None
    if c.paged:
        # the paged call and the same call on contiguous keys/values, each with the same dropout
        # seed, both on the portable kernels: a paged forward runs those, while its backward
        # (on the gathered keys) and a contiguous forward may take the Hopper ones, whose
        # fused backward sums dQ in no fixed order
        pair = []
        with mock.patch.dict(os.environ, {"FLASHTILE_SM90": "0"}):
            for contiguous in (False, True):
                rewind_rng()
                leaves_p = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                out_p = ours(*leaves_p, contiguous=contiguous)
                pair.append([out_p, *torch.autograd.grad(out_p, leaves_p, do)])
    bias = mask
    if bmask is not None:
        bias = expand_block_mask(bmask, (c.block, c.block), c.sq, c.sk)

    def ref_run(dtype):
        ref_leaves = [x.detach().to(dtype if dtype == torch.float64 else x.dtype).requires_grad_()
                      for x in (q, k, v)]
        b = bias
        if learn:
            b = mask.detach().to(dtype if dtype == torch.float64 else mask.dtype).requires_grad_()
            ref_leaves.append(b)
        r = reference(*ref_leaves[:3], spec, slopes, dtype=dtype, attn_bias=b, keep=keep)
        return r, torch.autograd.grad(r, ref_leaves, do.to(r.dtype))

    ref, ref_grads = ref_run(torch.float64)
    low, low_grads = ref_run(c.dtype)

    eps = 1e-5 if c.dtype == torch.float32 else 1e-4
    result = {"case": c.name, "dtype": str(c.dtype).replace("torch.", ""), "ok": True}
    names = ("dq", "dk", "dv", "dbias")
    for name, got, want, base, factor in [("out", out, ref, low, 2)] + [
            (n, g, r, b, 3) for n, g, r, b in zip(names, grads, ref_grads, low_grads)]:
        err = _max_err(got, want)
        bound = factor * _max_err(base, want) + eps
        finite = bool(torch.isfinite(got).all())
        result[name] = err
        result[name + "_bound"] = bound
        if not (finite and err <= bound):
            result["ok"] = False
    if pair is not None:
        diff = max(_max_err(a, b) for a, b in zip(*pair))
        result["paged_vs_contig"] = diff
        if diff != 0.0:
            result["ok"] = False
    return result


def cases(device: torch.device, quick: bool) -> list[Case]:
    gpu = device.type == "cuda"
    dtypes = [torch.float16, torch.bfloat16] if gpu else [torch.float32, torch.bfloat16]
    dims = [64, 128, 256] if gpu else [32, 64]
    n = 1024 if gpu else 128
    out = []
    for dtype, d, causal in itertools.product(dtypes, dims, (False, True)):
        tag = f"{str(dtype)[6:]}-d{d}-{'causal' if causal else 'full'}"
        out.append(Case(f"{tag}-square", 2, n, n, 4, 4, d, dtype, causal))
        out.append(Case(f"{tag}-gqa-sq<sk-odd", 2, n // 4 + 3, n + 17, 8, 2, d, dtype, causal))
        if not quick:
            out.append(Case(f"{tag}-sq>sk-odd", 1, n + 33, n // 2 - 5, 4, 1, d, dtype, causal))
    for dtype in dtypes:
        t = str(dtype)[6:]
        out += [
            Case(f"{t}-d40-odd-lengths", 2, 177, 301, 6, 3, 40, dtype),
            Case(f"{t}-d96-len1", 3, 1, 1000 if gpu else 100, 4, 2, 96, dtype, True),
            Case(f"{t}-d128-window", 1, n, n, 4, 2, 128 if gpu else 64, dtype, window=(100, 20)),
            Case(f"{t}-d64-softcap-alibi", 2, 300, 300, 4, 4, 64, dtype, True, softcap=30.0,
                 alibi=True),
            Case(f"{t}-d64-varlen", 3, 200, 257, 4, 2, 64, dtype, True, varlen=True),
            Case(f"{t}-d64-sdpa-topleft", 2, 150, 300, 4, 2, 64, dtype, True, sdpa=True),
            Case(f"{t}-d256-odd", 1, 129, 129, 2, 1, 256 if gpu else 80, dtype, True),
            # a head dim the Hopper forward runs at the next width (zeros past the head)
            Case(f"{t}-d192-gqa-odd", 2, 333, 401, 6, 2, 192 if gpu else 48, dtype, True),
            # ... whose backward from 4096 keys runs on the Hopper kernels of that width too
            Case(f"{t}-d96-long-keys", 1, 4096 if gpu else 160, 4096 if gpu else 160, 4, 2,
                 96 if gpu else 40, dtype, True),
        ]
    if gpu:
        out.append(Case("float32-d64", 1, 512, 512, 4, 4, 64, torch.float32, True))
    return out + feature_cases(device, quick)


def feature_cases(device: torch.device, quick: bool) -> list[Case]:
    """Dropout, attention masks / biases, block-sparse attention and paged-varlen keys."""
    gpu = device.type == "cuda"
    dtypes = [torch.float16, torch.bfloat16] if gpu else [torch.float32, torch.bfloat16]
    n = 1024 if gpu else 128
    d = 128 if gpu else 64
    blk = 128 if gpu else 32
    out = []
    for dtype in dtypes:
        t = str(dtype)[6:]
        out += [
            Case(f"{t}-dropout", 2, n, n, 4, 4, d, dtype, dropout=0.17),
            Case(f"{t}-dropout-causal-gqa-odd", 2, n // 2 + 7, n + 5, 8, 2, 64, dtype, True,
                 dropout=0.3),
            Case(f"{t}-dropout-window-softcap-alibi", 1, n, n, 4, 2, 64, dtype, window=(100, 20),
                 softcap=30.0, alibi=True, dropout=0.1),
            Case(f"{t}-mask-bool-dropout", 2, n // 2 + 3, n - 9, 4, 2, 64, dtype, mask="bool",
                 dropout=0.2),
            Case(f"{t}-bias-full-grad", 2, n // 2, n // 2 + 13, 4, 4, d, dtype, mask="bias"),
            Case(f"{t}-bias-bcast-grad", 2, n // 2 + 5, n // 2, 4, 2, 64, dtype,
                 mask="bias-bcast"),
            Case(f"{t}-sparse-butterfly", 2, n, n, 4, 2, d, dtype, sparse="butterfly", block=blk),
            Case(f"{t}-sparse-local-causal-dropout", 1, n + 40, n + 40, 4, 4, 64, dtype, True,
                 sparse="local", block=blk, dropout=0.1),
            # pages smaller than the kernel's key tile (several pages per tile) ...
            Case(f"{t}-paged16-varlen-causal-gqa", 3, n // 4 + 5, n // 2 + 9, 8, 2, d, dtype,
                 True, varlen=True, paged=16),
            # ... and larger ones, with a window, softcap, ALiBi and dropout
            Case(f"{t}-paged256-varlen-window-dropout", 2, n // 2, n + 19, 4, 1, 64, dtype,
                 window=(100, 20), softcap=30.0, alibi=True, varlen=True, dropout=0.1,
                 paged=256 if gpu else 64),
        ]
        if not quick:
            out += [
                Case(f"{t}-dropout-varlen-causal", 3, n // 2, n // 2 + 31, 4, 2, 64, dtype, True,
                     varlen=True, dropout=0.25),
                Case(f"{t}-dropout-sdpa-causal", 2, n // 2, n, 4, 2, 64, dtype, True, sdpa=True,
                     dropout=0.15),
            ]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashtile.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--features", action="store_true",
                        help="only the dropout / mask / bias / block-sparse / paged-varlen cases")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--only", default="", help="run only cases whose name matches this "
                        "regular expression (e.g. ^bfloat16)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes that run the cases at once, each every JOBS-th case "
                        "(on a GPU each compiles its own kernels: the first run on a machine "
                        "is mostly compilation; default 1)")
    parser.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "i/n": --jobs' child
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    t0 = time.time()
    todo = feature_cases(device, args.quick) if args.features else cases(device, args.quick)
    todo = [c for c in todo if re.search(args.only, c.name)]
    if args.shard:
        i, n = map(int, args.shard.split("/"))
        todo = todo[i::n]
    if args.jobs > 1 and not args.shard:
        results = _run_jobs(sys.argv[1:] if argv is None else list(argv), args.jobs, len(todo))
    else:
        results = [run_case(c, device) for c in todo]
    if not results:
        print(f"no case matches --only {args.only!r}")
        return 1
    width = max(len(r["case"]) for r in results)
    print(f"flashtile.check on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f" (backend {select(device)}, torch {torch.__version__})")
    print(f"{'case':<{width}}  {'out err/bound':>19}  {'dq err/bound':>19}  {'dk err/bound':>19}"
          f"  {'dv err/bound':>19}  ok")
    for r in results:
        cols = "  ".join(f"{r[n]:9.2e}/{r[n + '_bound']:9.2e}" for n in ("out", "dq", "dk", "dv"))
        extra = f"  dbias {r['dbias']:9.2e}/{r['dbias_bound']:9.2e}" if "dbias" in r else ""
        if "paged_vs_contig" in r:
            extra += f"  paged_vs_contig {r['paged_vs_contig']:.2e} (must be 0)"
        print(f"{r['case']:<{width}}  {cols}  {'yes' if r['ok'] else 'NO'}{extra}")
    failed = [r["case"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed in {time.time() - t0:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "results": results}, f,
                      indent=1)
    return 1 if failed else 0


def _run_jobs(argv: list, jobs: int, n_cases: int) -> list:
    """Run ``main`` in ``jobs`` child processes, child ``i`` on cases ``i, i + jobs, ...``,
    and return their results in the cases' order."""
    import subprocess
    import tempfile

    jobs = min(jobs, max(n_cases, 1))
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"shard{i}.json") for i in range(jobs)]
        procs = [subprocess.Popen([sys.executable, "-m", "flashtile.check", *argv,
                                   "--shard", f"{i}/{jobs}", "--json", files[i]],
                                  stdout=subprocess.DEVNULL)
                 for i in range(jobs)]
        for proc in procs:
            proc.wait()
        shards = []
        for f in files:
            if not os.path.exists(f):  # a child that died before writing: its cases failed
                raise RuntimeError(f"a check process wrote no results ({f})")
            with open(f) as fh:
                shards.append(json.load(fh)["results"])
    # round robin back into the cases' order
    return [shards[i % jobs][i // jobs] for i in range(n_cases)]


if __name__ == "__main__":
    sys.exit(main())
