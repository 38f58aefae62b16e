"""Run flash-attn's own test file, unmodified, against flashtile on a GPU (sampled).

    python tests/gpu/flash_attn_conformance.py --test-file PATH --out DIR [--sample K] [--seed S]
        [--budget-s B]

``PATH`` is flash-attn's ``tests/test_flash_attn.py`` (2.8.x); it is not part of this
repository.  This file is three things at once:

* the command line above, which runs pytest on ``PATH`` in a child process;
* the alias package ``flash_attn`` (:data:`ALIAS`: ``flash_attn``, ``flash_attn.bert_padding``,
  ``flash_attn.flash_attn_interface``, ``flash_attn.layers.rotary``), whose modules re-export
  flashtile.  The command writes it into a temporary directory (:func:`write_alias`) that goes
  first on ``PYTHONPATH``, so the test file's imports get flashtile;
* the pytest plugin of that run (the child loads this module with ``-p flash_attn_conformance``):
  it keeps ``K`` parametrisations of each test function (a seeded random subset: the same seed
  and file give the same items), leaves out the test functions that call flash-attn's compiled
  extension directly, skips what would start after ``--budget-s`` seconds, and writes
  ``DIR/summary.md`` and ``DIR/summary.json`` (counts per test function, each failure with its
  first error line) next to the full pytest log ``DIR/pytest.log``.

The test file needs ``einops`` (and pytest): if they are not installed, pass ``--pydeps DIR``
with a folder that holds them (``pip install --target DIR einops pytest``; a ``pydeps`` folder
next to the test file is used by default).  That folder goes last on ``sys.path``, so installed
packages take precedence.

``S_dmask`` (``return_attn_probs=True`` with dropout): flash-attn's kernels store it as
block-wise unnormalised values and the test file rescales them with its helper
``normalize_flash_attn_S`` before comparing with the reference; flashtile's ``S_dmask``
already holds the normalised probabilities.  ``--s-dmask normalized`` (default) replaces that
helper by the identity in the loaded test module (the file on disk is unchanged), so the
probabilities are still compared with the reference; ``skip`` leaves out the parametrisations
with dropout of those test functions instead; ``as-is`` runs the helper unchanged.

The plugin's settings come from environment variables that the command sets:

``FA_CONFORMANCE_SAMPLE``  items kept per test function (0 = all), a seeded random subset
``FA_CONFORMANCE_SEED``    the seed of that subset (same seed, same file -> same items)
``FA_CONFORMANCE_BUDGET``  seconds; tests that would start later are skipped and counted
``FA_CONFORMANCE_SDMASK``  ``normalized`` | ``skip`` | ``as-is``
``FA_CONFORMANCE_OUT``     folder for ``summary.md`` and ``summary.json``
``FA_CONFORMANCE_FAKE_GPU`` ``1``: stand-in CUDA capability queries, so ``--collect-only``
                           works on a machine without a GPU

The exit status is pytest's (0 when every sampled test passed).  Default settings take about
4-7 minutes on an H100, most of it Triton compiling kernels for the many head dims.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

try:
    import pytest
except ImportError:  # the command line itself runs without pytest; the child needs it
    pytest = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PLUGIN = os.path.splitext(os.path.basename(__file__))[0]


# ----------------------------------------------------------------------------------------------
# The alias package: flash-attn 2.x's module layout, backed by flashtile

ALIAS = {
    "flash_attn/__init__.py": '''\
"""An import alias: flash-attn 2.x's public names, backed by flashtile.

Put the folder that holds this package first on ``PYTHONPATH`` and ``import flash_attn`` gets
flashtile's functions.  It exists to run flash-attn's own test file against flashtile
(``tests/gpu/flash_attn_conformance.py`` writes it into a temporary directory); it is not
installed with flashtile.
"""
import os

# flash-attn raises inside the call (it waits for the check)
os.environ.setdefault("FLASHTILE_KVCACHE_CHECK", "sync")

from flashtile import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

# The flash-attn API level the alias provides (code that checks the version sees 2.x).
__version__ = "2.8.4"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
''',
    "flash_attn/bert_padding.py": '''\
"""``flash_attn.bert_padding`` backed by ``flashtile.padding``."""
from flashtile.padding import (index_first_axis, index_first_axis_residual, index_put_first_axis,
                               pad_input, unpad_input, unpad_input_for_concatenated_sequences)

__all__ = ["index_first_axis", "index_first_axis_residual", "index_put_first_axis",
           "pad_input", "unpad_input", "unpad_input_for_concatenated_sequences"]
''',
    "flash_attn/flash_attn_interface.py": '''\
"""``flash_attn.flash_attn_interface`` backed by flashtile.

The private entry points of flash-attn's compiled extension (``flash_attn_gpu``,
``_flash_attn_forward``, ``_flash_attn_varlen_forward``, ...) have no counterpart: flashtile
has no such extension, and the conformance runner leaves out the tests that call them.
"""
from flashtile import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

# flash-attn's switch for its ROCm Triton build; flashtile's kernels are the same everywhere.
USE_TRITON_ROCM = False


def maybe_contiguous(x):
    """``x`` with a unit-stride last dimension (copied only when it has another stride)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Width of the key blocks in which flash-attn's kernels store ``S_dmask`` unnormalised.

    flashtile's ``S_dmask`` is normalised over the whole row (see ``flash_attn_func``), so
    there is no block structure to undo; one block spans every key of the tests' rows."""
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
    return 1 << 30


__all__ = [
    "USE_TRITON_ROCM",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "maybe_contiguous",
]
''',
    "flash_attn/layers/__init__.py": '''\
"""``flash_attn.layers``: only ``rotary.apply_rotary_emb`` (used by flash-attn's tests)."""
''',
    "flash_attn/layers/rotary.py": '''\
"""``flash_attn.layers.rotary.apply_rotary_emb``: rotary position embeddings (RoPE) in PyTorch.

flash-attn's tests use it to build the reference for ``flash_attn_with_kvcache(rotary_cos=...,
rotary_sin=...)``; this version is written independently of flashtile's own rotary code, so
the comparison checks flashtile against a second implementation.
"""
from __future__ import annotations

import torch


def _positions(batch: int, seqlen: int, seqlen_offsets, device) -> torch.Tensor:
    pos = torch.arange(seqlen, device=device)[None, :]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.int64).reshape(-1, 1)
    return (pos + int(seqlen_offsets)).expand(batch, seqlen)


def _rotate(x, cos, sin, positions, interleaved: bool):
    """``x (..., T, H, D)`` with ``positions (..., T)``: the first ``2 * cos.shape[1]`` channels
    rotated, computed in float32 and returned in ``x``'s dtype."""
    rot = 2 * cos.shape[1]
    c = cos.float()[positions].unsqueeze(-2)  # (..., T, 1, rot / 2)
    s = sin.float()[positions].unsqueeze(-2)
    xf = x[..., :rot].float()
    if interleaved:  # pairs (x[2i], x[2i + 1])
        even, odd = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    else:  # GPT-NeoX halves (x[i], x[i + rot / 2])
        first, second = xf[..., : rot // 2], xf[..., rot // 2:]
        out = torch.cat((first * c - second * s, first * s + second * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` channels of ``x``.

    ``x``: ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` with
    ``cu_seqlens`` int32 ``(batch + 1,)``; ``cos``/``sin``: ``(seqlen_ro, rotary_dim / 2)``;
    ``seqlen_offsets``: an int or an integer ``(batch,)`` tensor added to each token's
    position (its index in its sequence).  Returns the rotated tensor (``x`` itself, written
    in place, with ``inplace=True``).
    """
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = _positions(batch, seqlen, seqlen_offsets, x.device)
        out = _rotate(x, cos, sin, positions, interleaved)
    else:
        cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
        lengths = cu[1:] - cu[:-1]
        seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device),
                                               lengths)
        local = torch.arange(x.shape[0], device=x.device) - cu[:-1][seq_of_token]
        if isinstance(seqlen_offsets, torch.Tensor):
            local = local + seqlen_offsets.to(device=x.device, dtype=torch.int64)[seq_of_token]
        else:
            local = local + int(seqlen_offsets)
        out = _rotate(x.unsqueeze(0), cos, sin, local.unsqueeze(0), interleaved).squeeze(0)
    if inplace:
        x.copy_(out)
        return x
    return out
''',
}


def write_alias(root) -> Path:
    """Write the package ``flash_attn`` (:data:`ALIAS`) under ``root``; returns ``root``, the
    folder to put first on ``PYTHONPATH``."""
    root = Path(root)
    for rel, source in ALIAS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


# ----------------------------------------------------------------------------------------------
# The pytest plugin (loaded in the child process with ``-p flash_attn_conformance``)

_hookwrapper = (pytest.hookimpl(hookwrapper=True) if pytest is not None
                else lambda fn: fn)

EXTENSION_CALLS = re.compile(r"\bflash_attn_gpu\b|\b_flash_attn_(varlen_)?(forward|backward)\b")
BUDGET_REASON = "time budget of the sampled run used up"

_state = {
    "start": time.time(),
    "functions": {},  # name -> {"collected", "excluded", "excluded_reason", "sampled"}
    "results": {},  # nodeid -> (function, outcome, first error line)
    "notes": [],
}


def _env(name, default):
    return os.environ.get(f"FA_CONFORMANCE_{name}", default)


def _fake_cuda_queries():
    """Stand-ins for the capability queries the test module runs at import (collect-only on
    a machine without a GPU)."""
    import torch

    class _Props:
        total_memory = 80 * 2**30
        name = "collect-only stand-in"

    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: _Props()


def pytest_configure(config):
    if _env("FAKE_GPU", "0") == "1":
        _fake_cuda_queries()
        _state["notes"].append("CUDA capability queries stubbed (collect-only without a GPU)")


def _identity_normalize(attn_unnorm, q, k, v, query_padding_mask=None, key_padding_mask=None,
                        attn_bias=None, is_dropout=False, causal=False, window_size=(-1, -1)):
    """``normalize_flash_attn_S`` for an ``S_dmask`` that already holds normalised
    probabilities: only the padded query rows are zeroed, as the original helper does."""
    from einops import rearrange
    if query_padding_mask is not None:
        attn_unnorm = attn_unnorm.masked_fill(rearrange(~query_padding_mask, "b s -> b 1 s 1"),
                                              0.0)
    return attn_unnorm


def _source(item) -> str:
    try:
        return inspect.getsource(item.function)
    except (OSError, TypeError):
        return ""


def _function_info(name: str) -> dict:
    return _state["functions"].setdefault(
        name, {"collected": 0, "excluded": 0, "excluded_reason": "", "sampled": 0})


def _value_id(argname: str, value, index: int) -> str:
    """pytest's default id of one parameter value."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return f"{argname}{index}"


def _plain(calls) -> bool:
    """True when every recorded ``parametrize`` call is a plain decorator (no ids, indirect,
    scope, or ``pytest.param`` values), which the sampler rebuilds as one call."""
    from _pytest.mark.structures import ParameterSet
    return all(not args and set(kw) <= {"_param_mark"}
               and not any(isinstance(v, ParameterSet) for v in values)
               for _, values, args, kw in calls)


@_hookwrapper
def pytest_generate_tests(metafunc):
    """Sample the combinations of the ``parametrize`` decorators before pytest builds them:
    the file has ~500,000 of them, and building them all takes minutes.  The decorators'
    calls are recorded, ``K`` combinations are drawn by index (seeded), and only those are
    passed to ``parametrize`` (one call, with the ids pytest would have given them)."""
    recorded = []
    metafunc.parametrize = lambda argnames, argvalues, *args, **kw: recorded.append(
        (argnames, list(argvalues), args, kw))
    try:
        outcome = yield
    finally:
        del metafunc.parametrize
    outcome.get_result()  # re-raises a failure of the parametrisation itself
    name = metafunc.function.__name__
    info = _function_info(name)
    if not recorded:
        info["collected"] = 1
        return
    if not _plain(recorded):  # replay unchanged; no sampling for such a function
        for argnames, values, args, kw in recorded:
            metafunc.parametrize(argnames, values, *args, **kw)
        info["collected"] = len(metafunc._calls)
        return
    names, axes = [], []  # one axis per decorator: (argnames, [(values_tuple, id)])
    for argnames, values, _, _ in recorded:
        group = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) \
            else list(argnames)
        entries = []
        for i, v in enumerate(values):
            vals = tuple(v) if len(group) > 1 else (v,)
            entries.append((vals, "-".join(_value_id(n, x, i) for n, x in zip(group, vals))))
        names += group
        axes.append((group, entries))
    src = inspect.getsource(metafunc.function)
    total = math.prod(len(entries) for _, entries in axes)
    info["collected"] = total
    if "normalize_flash_attn_S" in src and _env("SDMASK", "normalized") == "skip":
        for group, entries in axes:
            if group == ["dropout_p"]:
                entries[:] = [e for e in entries if float(e[0][0]) == 0.0] or entries[:1]
        info["excluded"] = total - math.prod(len(entries) for _, entries in axes)
        info["excluded_reason"] = "S_dmask scaling check (dropout_p > 0)"
    count = math.prod(len(entries) for _, entries in axes)
    sample = int(_env("SAMPLE", "16"))
    if 0 < sample < count and not EXTENSION_CALLS.search(src):
        rng = random.Random(f"{_env('SEED', '0')}/{name}")
        chosen = sorted(rng.sample(range(count), sample))
    else:
        chosen = range(count)
    combos, ids = [], []
    for flat in chosen:
        vals, parts = (), []
        for _, entries in reversed(axes):  # mixed radix, first decorator varies slowest
            flat, r = divmod(flat, len(entries))
            vals = entries[r][0] + vals
            parts.insert(0, entries[r][1])
        combos.append(vals)
        ids.append("-".join(parts))
    metafunc.parametrize(names, combos, ids=ids)


def pytest_collection_modifyitems(session, config, items):
    patched = set()
    keep, drop = [], []
    for item in items:
        name = getattr(item, "originalname", item.name)
        info = _function_info(name)
        if EXTENSION_CALLS.search(_source(item)):
            info["excluded"] += 1
            info["excluded_reason"] = "calls flash-attn's compiled extension"
            drop.append(item)
            continue
        module = item.module
        if (_env("SDMASK", "normalized") == "normalized" and module.__name__ not in patched
                and hasattr(module, "normalize_flash_attn_S")):
            module.normalize_flash_attn_S = _identity_normalize
            patched.add(module.__name__)
        info["sampled"] += 1
        keep.append(item)
    if patched:
        _state["notes"].append(
            "normalize_flash_attn_S replaced by the identity (S_dmask already holds normalised "
            "probabilities): the S_dmask check compares them with the reference's")
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_setup(item):
    budget = float(_env("BUDGET", "0"))
    if budget > 0 and time.time() - _state["start"] > budget:
        pytest.skip(BUDGET_REASON)


def _first_error_line(report) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1].split("[")[0]
    results = _state["results"]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            outcome = "not run (budget)" if BUDGET_REASON in reason else "skipped"
            results[report.nodeid] = (name, outcome, reason[:200])
        elif report.failed:
            results[report.nodeid] = (name, "failed", _first_error_line(report))
        else:
            results[report.nodeid] = (name, "passed", "")
    elif report.when == "teardown" and report.failed and report.nodeid in results:
        results[report.nodeid] = (name, "failed", "teardown: " + _first_error_line(report))


def pytest_collectreport(report):
    if report.failed:
        _state["notes"].append(f"collection error in {report.nodeid}: "
                               f"{_first_error_line(report)}")


def _environment() -> dict:
    env = {}
    try:
        import torch
        env["torch"] = torch.__version__
        if torch.cuda.is_available() and _env("FAKE_GPU", "0") != "1":
            env["device"] = torch.cuda.get_device_name()
    except Exception as exc:  # the summary is still written
        env["torch"] = f"unavailable ({exc})"
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = "unavailable"
    return env


def pytest_sessionfinish(session, exitstatus):
    out = _env("OUT", "")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    counts = {name: dict(info, passed=0, failed=0, skipped=0, not_run=0)
              for name, info in _state["functions"].items()}
    failures = []
    for nodeid, (name, outcome, detail) in sorted(_state["results"].items()):
        row = counts.setdefault(name, {"collected": 0, "excluded": 0, "excluded_reason": "",
                                       "sampled": 0, "passed": 0, "failed": 0, "skipped": 0,
                                       "not_run": 0})
        key = {"passed": "passed", "failed": "failed", "skipped": "skipped"}.get(outcome,
                                                                                 "not_run")
        row[key] += 1
        if outcome == "failed":
            failures.append({"test": nodeid.split("::")[-1], "error": detail})
    summary = {
        "test_file": os.environ.get("FA_CONFORMANCE_TEST_FILE", ""),
        "test_file_sha256": os.environ.get("FA_CONFORMANCE_TEST_SHA256", ""),
        "flashtile_commit": os.environ.get("FA_CONFORMANCE_COMMIT", ""),
        "sample_per_function": int(_env("SAMPLE", "16")),
        "seed": _env("SEED", "0"),
        "s_dmask_mode": _env("SDMASK", "normalized"),
        "wall_s": round(time.time() - _state["start"], 1),
        "environment": _environment(),
        "notes": _state["notes"],
        "functions": counts,
        "failures": failures,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(_markdown(summary))


def _markdown(s: dict) -> str:
    total = defaultdict(int)
    lines = [
        "# flash-attn test file against flashtile (sampled)",
        "",
        f"- test file: `{s['test_file']}` (sha256 `{s['test_file_sha256'][:16]}`)",
        f"- flashtile commit: `{s['flashtile_commit']}`",
        f"- environment: {', '.join(f'{k} {v}' for k, v in s['environment'].items())}",
        f"- sample: {s['sample_per_function']} per test function (seed {s['seed']}); "
        f"S_dmask mode: {s['s_dmask_mode']}; wall time {s['wall_s']} s"
        + (f" ({s['jobs']} pytest processes at once)" if s.get("jobs", 1) > 1 else ""),
    ]
    lines += [f"- {note}" for note in s["notes"]]
    lines += ["", "| test function | collected | excluded | sampled | passed | failed | skipped "
              "| not run (budget) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in s["functions"].items():
        excluded = f"{r['excluded']}" + (f" ({r['excluded_reason']})" if r["excluded"] else "")
        lines.append(f"| `{name}` | {r['collected']} | {excluded} | {r['sampled']} | "
                     f"{r['passed']} | {r['failed']} | {r['skipped']} | {r['not_run']} |")
        for key in ("collected", "excluded", "sampled", "passed", "failed", "skipped",
                    "not_run"):
            total[key] += r[key]
    lines.append(f"| **total** | {total['collected']} | {total['excluded']} | "
                 f"{total['sampled']} | {total['passed']} | {total['failed']} | "
                 f"{total['skipped']} | {total['not_run']} |")
    lines += ["", f"## Failures ({len(s['failures'])})", ""]
    lines += [f"- `{f['test']}`: {f['error']}" for f in s["failures"]] or ["none"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flash_attn_conformance.py", description="Run flash-attn's tests/test_flash_attn.py against flashtile "
        "through the flash_attn alias package, sampled, and write a summary.")
    p.add_argument("--test-file", required=True, help="flash-attn's tests/test_flash_attn.py")
    p.add_argument("--out", required=True, help="folder for summary.md, summary.json, pytest.log")
    p.add_argument("--sample", type=int, default=16,
                   help="parametrisations kept per test function, 0 = all (default 16)")
    p.add_argument("--seed", default="0", help="seed of the sampled subset (default 0)")
    p.add_argument("--budget-s", type=float, default=390.0,
                   help="skip tests that would start after this many seconds (default 390; "
                   "0 = no limit)")
    p.add_argument("--s-dmask", choices=("normalized", "skip", "as-is"), default="normalized",
                   help="how to treat the test file's S_dmask rescaling (see the module doc)")
    p.add_argument("--pydeps", default=None,
                   help="extra folder for PYTHONPATH holding einops (default: pydeps/ next to "
                   "the test file, if present)")
    p.add_argument("--collect-only", action="store_true",
                   help="only collect and sample (works without a GPU: the test module's "
                   "capability queries get stand-ins)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--functions", default=None, help=argparse.SUPPRESS)  # --jobs' children
    p.add_argument("--jobs", type=int, default=1,
                   help="pytest processes run at once, each on its share of the test functions "
                   "(round robin, in file order); their summaries are merged into --out "
                   "(default 1). Each process compiles its own kernels: on a 16-core host, "
                   "8 jobs reach about 6x the tests of one in the same time")
    return p


# pytest's entry point with the --pydeps folder appended to sys.path
_BOOT = ("import os, sys; d = os.environ.get('FA_CONFORMANCE_PYDEPS'); "
         "d and sys.path.append(d); import pytest; sys.exit(pytest.main(sys.argv[1:]))")


def _commit() -> str:
    """HEAD's short hash, marked when tracked files differ from it (a copied tree whose git
    metadata is older than its files reads as that older commit plus changes)."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                  "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} + uncommitted changes" if changed else head


def _test_functions(test_file: str) -> list[str]:
    """The test functions of ``test_file``, in file order (module level ``def test_*``)."""
    with open(test_file) as f:
        return re.findall(r"^def (test_\w+)\(", f.read(), flags=re.M)


def merge_summaries(parts: list[dict]) -> dict:
    """One summary from those of processes that ran disjoint test functions of one file: the
    per-function rows side by side, failures and notes joined, the longest wall time."""
    merged = dict(parts[0], functions={}, failures=[], notes=[])
    merged["wall_s"] = max(p["wall_s"] for p in parts)
    def weight(row):  # the process that selected a function has its counts
        return sum(row.get(k, 0) for k in ("sampled", "excluded", "passed", "failed", "skipped",
                                             "not_run"))

    for part in parts:
        for name, row in part["functions"].items():
            if name not in merged["functions"] or weight(row) > weight(merged["functions"][name]):
                merged["functions"][name] = row
        merged["failures"] += part["failures"]
        merged["notes"] += [n for n in part["notes"] if n not in merged["notes"]]
    merged["jobs"] = len(parts)
    return merged


def _run_jobs(args, argv) -> int:
    """Run ``--jobs`` copies of this command at once, each on its share of the test functions
    (as ``FILE::function`` node ids), and merge their summaries into ``--out``."""
    names = _test_functions(os.path.abspath(args.test_file))
    groups = [names[i::args.jobs] for i in range(args.jobs)]
    out = os.path.abspath(args.out)
    procs = []
    for i, group in enumerate(g for g in groups if g):
        sub = os.path.join(out, f"job{i}")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--jobs", "1", "--out", sub,
               "--functions", ",".join(group)]
        procs.append((sub, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.STDOUT)))
    status = 0
    parts = []
    for sub, proc in procs:
        status = max(status, proc.wait())
        path = os.path.join(sub, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(json.load(f))
        else:
            status = max(status, 1)
            print(f"no summary from {sub} (see {sub}/pytest.log)", file=sys.stderr)
    if not parts:
        return status or 1
    merged = merge_summaries(parts)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(merged, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(_markdown(merged))
    print(_markdown(merged))
    print(f"{len(parts)} pytest processes, worst exit status {status}; logs: {out}/job*/pytest.log")
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    test_file = os.path.abspath(args.test_file)
    if not os.path.isfile(test_file):
        print(f"flash_attn_conformance.py: --test-file {test_file} does not exist", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if args.jobs > 1:
        # the children get --jobs 1 and their own --out (later flags win in argparse)
        return _run_jobs(args, argv)
    pydeps = args.pydeps or os.path.join(os.path.dirname(test_file), "pydeps")
    tmp = tempfile.TemporaryDirectory(prefix="flash_attn_alias-")
    paths = [str(write_alias(tmp.name)), HERE, REPO]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    # pydeps goes last on sys.path (after site-packages): it only fills in what is missing
    env["FA_CONFORMANCE_PYDEPS"] = os.path.abspath(pydeps) if os.path.isdir(pydeps) else ""
    with open(test_file, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    fake_gpu = args.collect_only and not _cuda_available()
    env.update({
        "FA_CONFORMANCE_SAMPLE": str(args.sample),
        "FA_CONFORMANCE_SEED": str(args.seed),
        "FA_CONFORMANCE_BUDGET": str(args.budget_s),
        "FA_CONFORMANCE_SDMASK": args.s_dmask,
        "FA_CONFORMANCE_OUT": out,
        "FA_CONFORMANCE_FAKE_GPU": "1" if fake_gpu else "0",
        "FA_CONFORMANCE_TEST_FILE": test_file,
        "FA_CONFORMANCE_TEST_SHA256": sha,
        # a copy of the tree without its git history (a remote machine) passes its commit in
        "FA_CONFORMANCE_COMMIT": os.environ.get("FA_CONFORMANCE_COMMIT") or _commit(),
    })
    ini = os.path.join(out, "pytest.ini")  # an empty config: no addopts/conftest of the repo
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    targets = ([f"{test_file}::{name}" for name in args.functions.split(",")]
               if args.functions else [test_file])
    cmd = [sys.executable, "-c", _BOOT, *targets, "-c", ini,
           "--rootdir", os.path.dirname(test_file), "-p", PLUGIN,
           "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short",
           "-W", "ignore::DeprecationWarning"]
    if args.collect_only:
        cmd.append("--collect-only")
    if args.keyword:
        cmd += ["-k", args.keyword]
    log_path = os.path.join(out, "pytest.log")
    with tmp, open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT)
    summary = os.path.join(out, "summary.md")
    if os.path.exists(summary):
        with open(summary) as f:
            print(f.read())
    print(f"pytest exit status {proc.returncode}; log: {log_path}")
    return proc.returncode


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
