"""``python -m flashtile.check`` on the CPU (its torch backend, small shapes): the suite a user
runs on their own machine passes, every case within flash-attn's error rule of float64."""
import json

import flashtile
from flashtile import check


def test_check_quick_suite_passes_on_cpu(tmp_path):
    """``--quick`` on the CPU: exit status 0, every case (the dense grid, odd head dims, the
    padded-width cases, windows, softcap with ALiBi, varlen, the SDPA drop-in, dropout, masks,
    biases, block-sparse and paged varlen) recorded as passed in the JSON report, with its
    errors within their bounds (the torch backend, as a CPU-only install runs it: this test
    session interprets the Triton kernels, which would take the CPU otherwise)."""
    report = tmp_path / "check.json"
    with flashtile.use_backend("torch"):
        assert check.main(["--device", "cpu", "--quick", "--json", str(report)]) == 0
    results = json.loads(report.read_text())["results"]
    names = {r["case"] for r in results}
    assert len(results) == len(check.cases(check.torch.device("cpu"), True))
    assert {"float32-d96-long-keys", "bfloat16-d192-gqa-odd"} <= names
    for r in results:
        assert r["ok"], r["case"]
        for n in ("out", "dq", "dk", "dv"):
            assert r[n] <= r[n + "_bound"], (r["case"], n)


def test_check_jobs_split_the_cases_and_merge_them_in_order(tmp_path, monkeypatch):
    """``--jobs 3``: three child processes, each running every third case, and one report of
    all of them in the cases' order, as one process gives (the children read the backend
    from ``FLASHTILE_BACKEND``)."""
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    argv = ["--device", "cpu", "--quick", "--only", "d96|d192|d40"]
    report = tmp_path / "jobs.json"
    assert check.main([*argv, "--jobs", "3", "--json", str(report)]) == 0
    results = json.loads(report.read_text())["results"]
    want = [c.name for c in check.cases(check.torch.device("cpu"), True)
            if check.re.search("d96|d192|d40", c.name)]
    assert [r["case"] for r in results] == want and len(want) == 8
    assert all(r["ok"] for r in results)
