"""Run flash-attn's own test file, unmodified, against flashtile on a GPU (sampled).

    python tests/gpu/flash_attn_conformance/run.py --test-file PATH --out DIR [--sample K]

``PATH`` is flash-attn's ``tests/test_flash_attn.py`` (2.8.x); it is not part of this
repository.  The folder ``alias/`` holds a package named ``flash_attn`` whose modules
(``flash_attn``, ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``,
``flash_attn.layers.rotary``) re-export flashtile; it goes first on ``PYTHONPATH``, so the
test file's imports get flashtile.  The test file needs ``einops`` (and pytest): if they are not
installed, pass ``--pydeps DIR`` with a folder that holds them (``pip install --target DIR
einops pytest``; a ``pydeps`` folder next to the test file is used by default).  That folder
goes last on ``sys.path``, so installed packages take precedence.

pytest runs with ``fa_conformance_plugin.py``, which keeps ``K`` parametrisations of each
test function (a seeded random subset: the same seed and file give the same items), leaves
out the test functions that call flash-attn's compiled extension directly, skips what would
start after ``--budget-s`` seconds, and writes ``DIR/summary.md`` and ``DIR/summary.json``
(counts per test function, each failure with its first error line) plus the full pytest
log ``DIR/pytest.log``.

``S_dmask`` (``return_attn_probs=True`` with dropout): flash-attn's kernels store it as
block-wise unnormalised values and the test file rescales them with its helper
``normalize_flash_attn_S`` before comparing with the reference; flashtile's ``S_dmask``
already holds the normalised probabilities.  ``--s-dmask normalized`` (default) replaces that
helper by the identity in the loaded test module (the file on disk is unchanged), so the
probabilities are still compared with the reference; ``skip`` leaves out the parametrisations
with dropout of those test functions instead; ``as-is`` runs the helper unchanged.

The exit status is pytest's (0 when every sampled test passed).  Default settings take about
4-7 minutes on an H100, most of it Triton compiling kernels for the many head dims.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py", description="Run flash-attn's tests/test_flash_attn.py against flashtile "
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
    return p


# pytest's entry point with the --pydeps folder appended to sys.path
_BOOT = ("import os, sys; d = os.environ.get('FA_CONFORMANCE_PYDEPS'); "
         "d and sys.path.append(d); import pytest; sys.exit(pytest.main(sys.argv[1:]))")


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    test_file = os.path.abspath(args.test_file)
    if not os.path.isfile(test_file):
        print(f"run.py: --test-file {test_file} does not exist", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    pydeps = args.pydeps or os.path.join(os.path.dirname(test_file), "pydeps")
    paths = [os.path.join(HERE, "alias"), HERE, REPO]
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
        "FA_CONFORMANCE_COMMIT": _commit(),
    })
    ini = os.path.join(out, "pytest.ini")  # an empty config: no addopts/conftest of the repo
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    cmd = [sys.executable, "-c", _BOOT, test_file, "-c", ini,
           "--rootdir", os.path.dirname(test_file), "-p", "fa_conformance_plugin",
           "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short",
           "-W", "ignore::DeprecationWarning"]
    if args.collect_only:
        cmd.append("--collect-only")
    if args.keyword:
        cmd += ["-k", args.keyword]
    log_path = os.path.join(out, "pytest.log")
    with open(log_path, "w") as log:
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
