"""The IO model (flashtile.reference.io_model) against hand counts and the paper's formulas."""
import pytest

from flashtile.reference import io_model as m

# n=4 queries and keys, d=2, one head, 2-byte elements, 2x2 tiles: one (4, 2) tensor is 16
# bytes, one float32 row statistic (4,) is 16 bytes, one tile of 4 key rows is 16 bytes.
SMALL = m.Problem(n=4, d=2, heads=1, batch=1, dtype_bytes=2)


@pytest.mark.parametrize("causal, kv_tile_bytes", [(False, 2 * 2 * 16), (True, 2 * 16 + 2 * 8)],
                         ids=["dense", "causal"])
def test_forward_counts_match_hand_count(causal, kv_tile_bytes):
    # dense: 2 query tiles each load all 4 rows of K and V; causal: query tile 0 loads key
    # tile 0 (2 rows), query tile 1 both key tiles (4 rows)
    p = m.Problem(n=4, d=2, causal=causal)
    (fwd,) = m.flashtile_forward(p, 2, 2)
    assert fwd.tile_read == 16 + kv_tile_bytes  # Q once + K, V per query tile
    assert fwd.tile_write == 16 + 16  # O, LSE
    assert (fwd.dram_read, fwd.dram_write) == (48, 32)  # Q, K, V once; O, LSE


def test_backward_counts_match_hand_count():
    dq, dkdv = m.flashtile_backward(SMALL, dkdv=(2, 2), dq=(2, 2), fused_delta=True)
    assert dq.kernel == "dq" and dkdv.kernel == "dkdv"
    # dQ: Q, dO, O, LSE once; K and V (16 bytes each) for each of 2 query tiles
    assert dq.tile_read == 4 * 16 + 2 * 2 * 16
    assert dq.tile_write == 16 + 16  # dQ, delta
    assert dq.dram_read == 4 * 16 + 2 * 16
    # dK/dV: K, V once; for each of 2 key tiles all of Q, dO, LSE, delta
    assert dkdv.tile_read == 2 * 16 + 2 * 4 * 16
    assert dkdv.tile_write == 2 * 16
    assert dkdv.dram_read == 6 * 16


def test_compulsory_matches_hand_count():
    assert m.compulsory(SMALL, "fwd") == 3 * 16 + 16 + 16  # read Q K V, write O LSE
    assert m.compulsory(SMALL, "bwd") == 5 * 16 + 16 + 3 * 16  # read Q K V O dO LSE, write dQ dK dV
    assert m.compulsory(SMALL) == 80 + 144


def test_compulsory_of_figure2_shape():
    p = m.figure2_problem()
    t = 64 * 1024 * 16 * 64 * 2  # one bf16 (B, N, H, d) tensor
    lse = 64 * 16 * 1024 * 4
    assert m.compulsory(p) == (4 * t + lse) + (8 * t + lse)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_tile_bytes_fall_as_tiles_grow_and_dram_bytes_do_not(causal):
    p = m.Problem(n=1024, d=64, heads=4, batch=2, causal=causal)
    fwd = [m.flashtile_forward(p, bm, 64)[0] for bm in (16, 32, 64, 128, 256)]
    assert all(a.tile > b.tile for a, b in zip(fwd, fwd[1:]))
    assert len({k.dram for k in fwd}) == 1
    dkdv = [m.flashtile_backward(p, (64, bn), (64, 64))[1] for bn in (16, 32, 64, 128, 256)]
    assert all(a.tile > b.tile for a, b in zip(dkdv, dkdv[1:]))
    dq = [m.flashtile_backward(p, (64, 64), (bm, 64))[0] for bm in (16, 32, 64, 128, 256)]
    assert all(a.tile > b.tile for a, b in zip(dq, dq[1:]))


def test_forward_tile_bytes_are_theorem2_term():
    # dense, tiles dividing n: Q + O + LSE + 2 T_r n d e, T_r = n / B_r
    p = m.Problem(n=2048, d=128, heads=3, batch=2)
    for bm in (32, 64, 128):
        (fwd,) = m.flashtile_forward(p, bm, 64)
        tr = 2048 // bm
        assert fwd.tile == 2 * p.q_bytes() + p.stat_bytes() + 2 * tr * p.kv_bytes()


def test_standard_count_matches_formula():
    for p in (SMALL, m.Problem(n=512, d=64, heads=2, batch=3, n_k=256),
              m.figure2_problem()):
        bh, n, nk, d, e = p.batch * p.heads, p.n, p.nk, p.d, p.dtype_bytes
        for s in (2, 4):
            assert m.standard_forward(p, s) == bh * (2 * n * d * e + 2 * nk * d * e + 4 * n * nk * s)
            # dO three times, O, dQ, Q once (query-sized); V, K, dK, dV once (key-sized);
            # 7 score matrices; D written and read
            assert m.standard_backward(p, s) == bh * (
                6 * n * d * e + 4 * nk * d * e + 7 * n * nk * s + 2 * n * 4)
    assert m.standard(SMALL, "fwd") == 2 * 16 + 2 * 16 + 4 * 32


def test_fused_delta_saves_one_read_of_do_and_the_row_statistics():
    p = m.figure2_problem()
    cfg = dict(dkdv=(64, 64), dq=(128, 64))
    old = m.total(m.flashtile_backward(p, fused_delta=False, **cfg))
    new = m.total(m.flashtile_backward(p, fused_delta=True, **cfg))
    assert old - new == p.q_bytes() + 3 * p.stat_bytes()
    assert [k.kernel for k in m.flashtile_backward(p, fused_delta=False, **cfg)] == ["pre", "dkdv", "dq"]


def test_two_kernel_backward_floor_is_above_1_25x_at_figure2_shape():
    # The dQ kernel re-reads Q, dO, K, V, which the dK/dV kernel also reads: 4 extra tensors.
    p = m.figure2_problem()
    k = m.flashtile_kernels(p, (64, 64), (64, 64), (128, 64))
    ratio = m.total(k["fwd"] + k["bwd"]) / m.compulsory(p)
    # Q, dO, K, V read twice; delta written and read; LSE read by both kernels
    extra = 2 * p.q_bytes() + 2 * p.kv_bytes() + 3 * p.stat_bytes()
    assert m.total(k["fwd"] + k["bwd"]) == m.compulsory(p) + extra
    assert 1.33 < ratio < 1.35


def test_cache_model_falls_back_to_tile_bytes_when_reread_set_does_not_fit():
    p = m.Problem(n=8192, d=128, heads=8, batch=2)  # K and V of one head: 4 MB
    ks = m.flashtile_forward(p, 128, 64)
    assert m.dram_bytes(p, ks, cache_bytes=2**20) == ks[0].tile
    assert m.dram_bytes(p, ks, cache_bytes=10**12) == ks[0].dram


def test_paper_forward_is_theta_n2_d2_over_m():
    assert m.sram_tiles(100 * 1024, 64) == (64, 200)  # B_r = min(ceil(M / 4d), d), B_c
    br, bc = 64, 256
    p1, p2 = m.Problem(n=4096, d=64), m.Problem(n=8192, d=64)
    # doubling N doubles T_c and the rows per pass: 4x, less the Theta(N d) reads of K and V
    assert 3.9 < m.paper_forward(p2, br, bc) / m.paper_forward(p1, br, bc) < 4.0
    costs = [m.paper_forward(p1, br, c) for c in (64, 128, 256, 512)]
    assert all(a > b for a, b in zip(costs, costs[1:]))


# ---- the benchmark's reading of Nsight Compute output (flashtile.bench.io), on CPU

from pathlib import Path  # noqa: E402

from flashtile.bench import io as bench_io  # noqa: E402

SAMPLE = (Path(__file__).parent / "data" / "ncu_sample.csv").read_text()


def test_ncu_csv_parses_every_kernel_in_launch_order_with_units_converted():
    kernels = bench_io.parse_ncu_csv(SAMPLE)
    assert [k.id for k in kernels] == list(range(8))
    assert [bench_io.short_name(k.name) for k in kernels[:7]] == [
        "io_begin_marker_kernel", "attn_fwd_kernel", "io_end_marker_kernel",
        "io_begin_marker_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel",
        "io_end_marker_kernel"]
    # a templated name with commas inside stays one field
    assert kernels[7].name.startswith("void at::native::vectorized_elementwise_kernel<4, ")
    assert bench_io.short_name(kernels[7].name) == "vectorized_elementwise_kernel"
    fwd, dq = kernels[1].metrics, kernels[4].metrics
    assert fwd["dram__bytes_read.sum"] == 402_915_328  # thousands separators dropped
    assert fwd["gpu__time_duration.sum"] == pytest.approx(0.612544)  # ns -> ms
    assert dq["dram__bytes_read.sum"] == pytest.approx(675.41e6)  # Mbyte -> bytes
    assert dq["lts__t_bytes.sum"] == pytest.approx(2.81e9)  # Gbyte -> bytes
    assert dq["gpu__time_duration.sum"] == pytest.approx(0.70218)  # us -> ms


def test_ncu_raw_page_parses_like_the_details_page():
    raw = ('==PROF== Disconnected from process 1\n'
           '"ID","Kernel Name","dram__bytes_read.sum","gpu__time_duration.sum"\n'
           '"","","Mbyte","usecond"\n'
           '"0","attn_fwd_kernel","1.5","250"\n')
    (k,) = bench_io.parse_ncu_csv(raw)
    assert k.metrics == {"dram__bytes_read.sum": 1.5e6, "gpu__time_duration.sum": 0.25}


def test_markers_split_kernels_into_passes_and_drop_the_rest():
    groups = bench_io.split_by_markers(bench_io.parse_ncu_csv(SAMPLE))
    assert [[bench_io.short_name(k.name) for k in g] for g in groups] == [
        ["attn_fwd_kernel"], ["attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"]]


def _sample_records():
    case = bench_io.Case("fig2", "flashtile")
    configs = {"fwd": [64, 64, 4, 3], "dkdv": [64, 64, 4, 3], "dq": [128, 64, 8, 5]}
    entries = [dict(index=0, pass_="fwd", configs=configs),
               dict(index=0, pass_="bwd", configs=configs),
               dict(index=1, error="RuntimeError: no kernel")]
    groups = bench_io.split_by_markers(bench_io.parse_ncu_csv(SAMPLE))
    cases = [case, bench_io.Case("fig2", "cudnn")]
    return bench_io.build_records(cases, entries, groups, {"device": "test"})


def test_records_carry_the_measured_sums_the_model_and_the_compulsory_bytes():
    fwd, bwd, failed = _sample_records()
    p = m.figure2_problem()
    assert (fwd["impl"], fwd["pass"], fwd["n"], fwd["d"], fwd["heads"], fwd["batch"]) == (
        "flashtile", "fwd", 1024, 64, 16, 64)
    assert (fwd["block_m"], fwd["block_n"]) == (64, 64)
    assert fwd["dram_read_bytes"] == 402_915_328 and fwd["dram_write_bytes"] == 138_461_184
    assert fwd["compulsory_bytes"] == m.compulsory(p, "fwd")
    assert fwd["model_dram_bytes"] == m.flashtile_forward(p, 64, 64)[0].dram
    assert bwd["dram_read_bytes"] == pytest.approx(675.41e6 + 545_390_592)
    assert bwd["ms"] == pytest.approx(0.70218 + 1.104864)
    assert [k["name"] for k in bwd["kernels"]] == ["attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"]
    assert bwd["kernels"][1]["model_l2_bytes"] == m.flashtile_backward(p, (64, 64), (128, 64))[1].tile
    assert failed["impl"] == "cudnn" and failed["error"].startswith("RuntimeError")
    for field in ("impl", "pass", "n", "d", "heads", "batch", "block_m", "block_n",
                  "dram_read_bytes", "dram_write_bytes", "l2_bytes", "ms", "compulsory_bytes"):
        assert field in fwd


def test_report_tables_plots_and_doc_section(tmp_path):
    records = _sample_records()
    records.append(dict(sweep="fig3", impl="flashtile", n=1024, batch=16, heads=16, d=64,
                        ms=1.5, peak_extra_bytes=2e8, **{"pass": "fwd_bwd"}))
    md = bench_io.render_markdown(records)
    assert "| flashtile | 2.17 | 1.34 |" in md  # fwd+bwd DRAM GB of the sample, x compulsory
    assert "| flashtile | 1.50 |" in md  # Figure 3 time
    pngs = bench_io.plot(records, tmp_path)
    assert {p.name for p in pngs} == {"fig2_left.png", "fig3.png"}
    assert all(p.stat().st_size > 1000 for p in pngs)
    doc = tmp_path / "io.md"
    doc.write_text(f"intro\n{bench_io.DOC_BEGIN}\nold\n{bench_io.DOC_END}\nend\n")
    bench_io.update_doc(doc, md)
    text = doc.read_text()
    assert "old" not in text and md in text and text.startswith("intro") and text.endswith("end\n")


def test_sweeps_pin_the_tile_they_vary():
    cases = bench_io.build_cases(["blocks"], quick=True)
    for c in cases:
        kernel, tile = c.knob.split(".")
        pinned = getattr(c, kernel)
        assert pinned is not None and len(pinned) == 4
    sizes = [c.fwd[0] for c in cases if c.knob == "fwd.block_m"]
    assert sizes == sorted(sizes) and len(sizes) >= 3
    assert {c.impl for c in bench_io.build_cases(["fig2"], quick=True)} == set(bench_io.IMPLS)


def test_worker_runs_each_pass_between_markers_and_logs_configs(tmp_path, monkeypatch):
    # the worker's flow on CPU (kernels under the interpreter): which passes it logs, in
    # marker order, with the tile configs flashtile used; a failing case is logged, not fatal
    import json

    markers = []
    real = bench_io._markers

    def counting(device):
        begin, end = real(device)
        return (lambda: (markers.append("begin"), begin())), (lambda: (markers.append("end"), end()))

    monkeypatch.setattr(bench_io, "_markers", counting)
    tiny = dict(n=16, d=16, heads=1, batch=1, dtype="float32")
    cases = [bench_io.Case("fig2", "flashtile", **tiny),
             bench_io.Case("fig2", "standard", **tiny),
             bench_io.Case("fig2", "cudnn", **tiny),  # SDPA's cudnn backend: no CPU kernel
             bench_io.Case("blocks", "flashtile", passes=("bwd",), knob="dkdv.block_n",
                           dkdv=(16, 16, 1, 1), dq=(16, 16, 1, 1), **tiny),
             bench_io.Case("sparse", "flashtile_sparse", density=0.5, sparse_block=16,
                           **dict(tiny, n=32))]
    plan, log = tmp_path / "plan.json", tmp_path / "log.jsonl"
    plan.write_text(json.dumps([c.to_json() for c in cases]))
    bench_io.run_worker(str(plan), str(log), device="cpu")
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["index"], e.get("pass_")) for e in entries] == [
        (0, "fwd"), (0, "bwd"), (1, "fwd"), (1, "bwd"), (2, None), (3, "bwd"), (4, "fwd"),
        (4, "bwd")], entries
    assert "error" in entries[4] and not entries[4].get("marked")
    assert entries[5]["configs"]["dkdv"] == [16, 16, 1, 1]
    assert entries[0]["configs"]["fwd"][:2] == [16, 16]  # the interpreter's tiles
    assert entries[2]["configs"] == {}
    assert markers == ["begin", "end"] * 7


FAKE_NCU = '''#!{python}
"""Stands in for ncu: runs the profiled command (on the CPU) and prints the CSV sample."""
import os, subprocess, sys
args = sys.argv[1:]
assert args[:3] == ["--clock-control", "none", "--metrics"], args
cmd = args[args.index({python!r}):]
subprocess.run(cmd + ["--device", "cpu"], check=True, env=dict(os.environ, TRITON_INTERPRET="1"))
sys.stdout.write(open({sample!r}).read())
'''


def test_ncu_run_end_to_end_with_a_stand_in_profiler(tmp_path):
    # the plumbing of run_ncu_sweeps: the ncu command line, the worker subprocess, its log,
    # the CSV on stdout, and the records (the stand-in prints the committed sample)
    import sys

    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable,
                                    sample=str(Path(__file__).parent / "data" / "ncu_sample.csv")))
    fake.chmod(0o755)
    case = bench_io.Case("fig2", "flashtile", n=16, d=16, heads=1, batch=1, dtype="float32")
    records = bench_io.run_ncu_sweeps([case], str(fake), True, tmp_path, timeout=600)
    assert [(r["impl"], r["pass"]) for r in records] == [("flashtile", "fwd"), ("flashtile", "bwd")]
    assert records[1]["dram_write_bytes"] == pytest.approx(138.52e6 + 268_500_992)
    assert records[0]["block_m"] == 16  # the interpreter's tiles, logged by the worker
