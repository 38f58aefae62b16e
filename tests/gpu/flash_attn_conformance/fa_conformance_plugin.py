"""pytest plugin of the flash-attn conformance run (``run.py`` loads it with ``-p``).

Settings come from environment variables that ``run.py`` sets:

``FA_CONFORMANCE_SAMPLE``  items kept per test function (0 = all), a seeded random subset
``FA_CONFORMANCE_SEED``    the seed of that subset (same seed, same file -> same items)
``FA_CONFORMANCE_BUDGET``  seconds; tests that would start later are skipped and counted
``FA_CONFORMANCE_SDMASK``  ``normalized`` | ``skip`` | ``as-is`` (see ``run.py``)
``FA_CONFORMANCE_OUT``     folder for ``summary.md`` and ``summary.json``
``FA_CONFORMANCE_FAKE_GPU`` ``1``: stand-in CUDA capability queries, so ``--collect-only``
                           works on a machine without a GPU

The test file itself is never modified.  Test functions whose source calls flash-attn's
compiled extension (``flash_attn_gpu``, ``_flash_attn_forward`` / ``_varlen_forward`` /
``_backward``) are left out, as is, depending on ``FA_CONFORMANCE_SDMASK``, the rescaling of
``S_dmask`` by the test file's ``normalize_flash_attn_S`` helper.
"""
from __future__ import annotations

import inspect
import json
import math
import os
import random
import re
import time
from collections import defaultdict

import pytest

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


@pytest.hookimpl(hookwrapper=True)
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
        f"S_dmask mode: {s['s_dmask_mode']}; wall time {s['wall_s']} s",
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
