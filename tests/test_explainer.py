"""The explainer: traces of the reference algorithms, and the page in a real headless Chromium.

Trace tests compare ``flashtile.explain``'s traces with the algorithms they instrument, with naive
attention and with the paper's IO formulas.  Browser tests load ``docs/explainer/index.html``
from disk in Debian's Chromium (driven by Selenium through ``/usr/bin/chromedriver``; nothing is
downloaded), step through traces and compare the numbers the page displays with the reference
computed here.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from flashtile import explain
from flashtile.reference import algorithms as alg
from flashtile.reference import naive

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "explainer"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

VIEW_CAUSAL = [(v, c) for v in explain.VIEWS for c in ((False,) if v == "decode" else (False, True))]


def _ids(vc):
    return f"{vc[0]}-{'causal' if vc[1] else 'full'}"


def _f(x):
    """A trace number (``None`` stands for -inf) as a float."""
    return -np.inf if x is None else float(x)


def _fa(a):
    return np.vectorize(_f, otypes=[float])(np.array(a, dtype=object))


def _naive_out(q, k, v, causal, token_mask=None):
    bias = None if token_mask is None else np.where(token_mask, 0.0, -np.inf)[None, None]
    out, lse = naive.attention(q[None, :, None], k[None, :, None], v[None, :, None],
                               window_right=0 if causal else -1, attn_bias=bias)
    return out[0, :, 0], lse[0, 0]


def _inputs_of(tr):
    return tuple(np.array(tr["inputs"][name], dtype=np.float64) for name in ("q", "k", "v"))


# ----------------------------------------------------------------------------------------------
# explain.py


@pytest.mark.parametrize("view_causal", VIEW_CAUSAL, ids=_ids)
def test_trace_final_state_equals_algorithm_and_naive(view_causal):
    view, causal = view_causal
    seed = int(np.random.default_rng().integers(1 << 30))
    tr = explain.export_trace(view, n=12, d=3, br=4, bc=4, causal=causal, seed=seed, digits=17)
    q, k, v = _inputs_of(tr)
    mask = explain.sparse_layout(12, 12, 4) if view == "sparse" else None
    want_o, want_lse = _naive_out(q, k, v, causal, mask)
    np.testing.assert_allclose(_fa(tr["final"]["o"]), want_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(_fa(tr["naive"]["o"]), want_o, rtol=0, atol=1e-15)
    np.testing.assert_allclose(_fa(tr["final"]["lse"]), want_lse, rtol=0, atol=1e-12)
    assert tr["max_abs_diff"] < 1e-12
    if view == "sparse":
        assert tr["meta"]["tiles_skipped"] > 0 and not mask.all()
    # m is the row max of the visible scores and l the sum of exp(s - m), for every view
    s = q @ k.T / np.sqrt(3)
    visible = naive.visibility_mask(q.shape[0], 12, window_right=0 if causal else -1)
    if mask is not None:
        visible &= mask
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=1)
    np.testing.assert_allclose(_fa(tr["final"]["m"]), m, rtol=0, atol=1e-12)
    np.testing.assert_allclose(_fa(tr["final"]["l"]), np.exp(s - m[:, None]).sum(axis=1),
                               rtol=1e-12)
    if view == "backward":
        do = np.array(tr["inputs"]["do"])
        dq, dk, dv = naive.attention_backward(do[None, :, None], q[None, :, None],
                                              k[None, :, None], v[None, :, None],
                                              window_right=0 if causal else -1)
        for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
            np.testing.assert_allclose(_fa(tr["final"][name]), want[0, :, 0], rtol=0, atol=1e-12)


def test_trace_steps_equal_fa1_reference_events():
    """Each fa1 step carries exactly the tile values Algorithm 1 produced, in loop order."""
    seed = int(np.random.default_rng().integers(1 << 30))
    tr = explain.export_trace("fa1", n=10, d=3, br=4, bc=3, causal=True, seed=seed, digits=17)
    q, k, v = _inputs_of(tr)
    events = []
    alg.flash_attention_forward_v1(q, k, v, block_r=4, block_c=3, causal=True,
                                   trace=lambda ev, **f: events.append((ev, f)))
    events = [(ev, f) for ev, f in events if ev in ("tile", "skip")]
    steps = [s for s in tr["steps"] if s["k"] in ("tile", "skip")]
    assert len(steps) == len(events) and any(ev == "skip" for ev, _ in events)
    for st, (ev, f) in zip(steps, events):
        assert st["k"] == ev and st["r"] == [f["r0"], f["r1"]] and st["c"] == [f["c0"], f["c1"]]
        if ev == "tile":
            for name in ("s", "m_old", "m_new", "l_old", "l_new", "alpha", "o"):
                np.testing.assert_array_equal(_fa(st[name]), f[name], err_msg=name)
            np.testing.assert_allclose(st["alpha"], np.exp(_fa(st["m_old"]) - _fa(st["m_new"])),
                                       rtol=1e-15)


@pytest.mark.parametrize("view", explain.VIEWS)
def test_trace_bytes_equal_io_formulas(view):
    sq_n, d, br, bc, eb = 24, 4, 8, 4, 2
    tr = explain.export_trace(view, n=sq_n, d=d, br=br, bc=bc, elem_bytes=eb, sparse_group=8)
    sq = tr["meta"]["sq"]
    br_eff = tr["meta"]["br"]
    want = explain.io_formula(view, sq, sq_n, d, br_eff, bc)
    if view == "sparse":  # Algorithm 1's count over the visited tiles only
        tc = -(-sq_n // bc)
        visited = int(np.sum(tr["meta"]["block_mask"]))
        want["flash"] = sq * d + 2 * sq + 2 * sq_n * d + visited * (3 * br * d + 4 * br)
        assert tr["meta"]["tiles_visited"] == visited < tc * -(-sq // br)
    assert tr["bytes"]["flash_hbm"] == want["flash"] * eb
    assert tr["bytes"]["standard_hbm"] == want["standard"] * eb
    assert tr["steps"][-1]["hbm"] == tr["bytes"]["flash_hbm"]
    # on chip: every element written once and read once: what crosses to or from HBM, and
    # the Br x Bc tiles that stay on chip (S, P; the backward also dP, dS)
    tiles_per_visit = 4 if view == "backward" else 2
    chip = tiles_per_visit * sum((s["r"][1] - s["r"][0]) * (s["c"][1] - s["c"][0])
                                 for s in tr["steps"] if s["k"] == "tile")
    assert tr["bytes"]["flash_sram"] == 2 * (want["flash"] + chip) * eb
    assert tr["bytes"]["standard_sram"] == 2 * want["standard"] * eb
    hbm = [s["hbm"] for s in tr["steps"]]
    assert hbm == sorted(hbm)  # cumulative


def test_io_formula_orders():
    """The paper's Theta: standard ~ N^2, FlashAttention ~ N^2 d^2 / M with Bc ~ M / 4d."""
    n, d = 4096, 64
    for view in ("fa1", "fa2", "backward"):
        f = explain.io_formula(view, n, n, d, 128, 128)
        assert f["flash"] < f["standard"] / 2
        f2 = explain.io_formula(view, 2 * n, 2 * n, d, 128, 128)
        assert 3.5 < f2["flash"] / f["flash"] < 4.1 and 3.9 < f2["standard"] / f["standard"] < 4.1
    # doubling the tile (the SRAM) halves FlashAttention's dominant term
    a = explain.io_formula("fa1", n, n, d, 64, 64)["flash"]
    b = explain.io_formula("fa1", n, n, d, 64, 128)["flash"]
    assert 1.8 < a / b < 2.0


@pytest.mark.parametrize("view_causal", VIEW_CAUSAL, ids=_ids)
def test_every_tile_size_gives_the_same_output(view_causal):
    view, causal = view_causal
    sizes = (1, 2, 4) if view == "sparse" else (1, 2, 3, 5, 8, 16)  # sparse: divide the group
    seed = int(np.random.default_rng().integers(1 << 30))
    outs = []
    for br, bc in itertools.product(sizes, sizes):
        tr = explain.export_trace(view, n=16, d=3, br=br, bc=bc, causal=causal, seed=seed,
                                digits=17)
        outs.append(_fa(tr["final"]["o"]))
        naive_o = _fa(tr["naive"]["o"])
        np.testing.assert_allclose(outs[-1], naive_o, rtol=0, atol=1e-12,
                                   err_msg=f"Br={br} Bc={bc}")
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=0, atol=1e-12)


def test_split_kv_decode_merge_equals_naive():
    rng = np.random.default_rng()
    q, k, v = rng.standard_normal((3, 5)), rng.standard_normal((37, 5)), rng.standard_normal((37, 5))
    want_o, want_lse = _naive_out(q, k, v, causal=False)
    for splits, block in ((1, 8), (2, 8), (3, 4), (5, 16)):
        o, lse = alg.split_kv_decode(q, k, v, num_splits=splits, block_n=block)
        np.testing.assert_allclose(o, want_o, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-12)


def test_trace_rejects_bad_arguments():
    with pytest.raises(ValueError, match="view"):
        explain.export_trace("fa3")
    with pytest.raises(ValueError, match="br"):
        explain.export_trace("fa1", br=0)
    with pytest.raises(ValueError, match="divide"):
        explain.export_trace("sparse", n=16, br=3, bc=4)
    with pytest.raises(ValueError, match="divide"):
        explain.export_traces(ns=(8,), tiles=(3, 4))


# ----------------------------------------------------------------------------------------------
# explain.py and the committed copy


def _inlined_bundle(html):
    """The traces bundle a page carries inline (``window.FLASHTILE_TRACES = {...};``)."""
    start = html.index("window.FLASHTILE_TRACES =") + len("window.FLASHTILE_TRACES =")
    return json.loads(html[start:html.index(";\n", start)].replace("<\\/", "</"))


def test_explain_main_writes_a_page(tmp_path):
    assert explain.main(["--out", str(tmp_path), "--n", "6", "--d", "2", "--tiles", "2", "4"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html"]  # one self-contained file
    html = (tmp_path / "index.html").read_text()
    assert "<script src=" not in html and "<link rel=\"stylesheet\"" not in html
    bundle = _inlined_bundle(html)
    assert bundle["ns"] == [6] and bundle["d"] == 2 and bundle["tiles"] == [2, 4]
    assert "fa1|6|4|2|1" in bundle["traces"] and "decode|6|1|4|0" in bundle["traces"]
    assert explain.main(["--out", str(tmp_path), "--n", "8", "--tiles", "3", "4"]) == 2
    with pytest.raises(SystemExit):
        explain.main(["--n", "0"])


def test_docs_copy_is_the_exporters_output():
    """docs/explainer/index.html is exactly what `python -m flashtile explain --out docs/explainer`
    writes: the packaged template with the default traces inlined."""
    bundle = explain.export_traces(ns=explain.DEFAULT_NS, tiles=explain.DEFAULT_TILES)
    assert (DOCS / "index.html").read_text(encoding="utf-8") == explain.page_html(bundle)
    assert _inlined_bundle(explain.page_html(bundle)) == json.loads(
        json.dumps(bundle, allow_nan=False))


# ----------------------------------------------------------------------------------------------
# the page in a headless browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail(f"the explainer tests need Debian's chromium and chromium-driver "
                    f"({CHROMIUM}, {CHROMEDRIVER}): apt-get install -y chromium chromium-driver")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a browser online
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars"):
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_window_size(1280, 1800)
    yield driver
    driver.quit()


def _open(driver, fragment):
    driver.get("about:blank")  # a new fragment alone would not reload the page
    driver.get_log("browser")  # empty the console log: what follows is this page's
    driver.get((DOCS / "index.html").as_uri() + "#" + fragment)


def _keys(driver, *keys):
    from selenium.webdriver.common.by import By
    body = driver.find_element(By.TAG_NAME, "body")
    for key in keys:
        body.send_keys(key)


def _values(driver, selector_prefix, rows, cols=None):
    """data-value of elements ``{prefix}-{r}`` or ``{prefix}-{r}-{c}`` as a float array."""
    ids = ([f"{selector_prefix}-{r}" for r in range(rows)] if cols is None else
           [f"{selector_prefix}-{r}-{c}" for r in range(rows) for c in range(cols)])
    raw = driver.execute_script(
        "return arguments[0].map(function (id) { var e = document.getElementById(id);"
        " return e ? e.getAttribute('data-value') : null; });", ids)
    assert None not in raw, f"missing element among {ids}"
    vals = np.array([-np.inf if x == "-inf" else float(x) for x in raw])
    return vals if cols is None else vals.reshape(rows, cols)


def _page_inputs(driver, sq, sk, d):
    return (_values(driver, "q", sq, d), _values(driver, "kt", d, sk).T, _values(driver, "v", sk, d))


def _console_errors(driver):
    return [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]


def _state(driver):
    return driver.execute_script("return [window.flashtileExplainer.key(),"
                                 " window.flashtileExplainer.step(), window.flashtileExplainer.steps()]")


# digits=9 in the committed traces: values agree with float64 to ~1e-9 relative
RTOL, ATOL = 1e-7, 1e-8


def test_page_fa1_steps_match_reference(browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    n, d, br, bc = 16, 4, 4, 4
    _open(browser, f"view=fa1&n={n}&br={br}&bc={bc}&causal=0")
    assert _state(browser)[:2] == [f"fa1|{n}|{br}|{bc}|0", 0]
    q, k, v = _page_inputs(browser, n, n, d)

    # the reference, run here on the inputs the page shows, with its per-tile events
    events = []
    o_ref, l_ref, m_ref = alg.flash_attention_forward_v1(
        q, k, v, block_r=br, block_c=bc, trace=lambda ev, **f: events.append((ev, f)))
    tiles = [f for ev, f in events if ev == "tile"]

    _keys(browser, *[Keys.ARROW_RIGHT] * 8)  # init + 7 tiles
    assert _state(browser)[1] == 8
    label = browser.find_element("id", "tile-label")
    i, j = int(label.get_attribute("data-i")), int(label.get_attribute("data-j"))
    f = next(f for f in tiles if f["r0"] == i * br and f["c0"] == j * bc)
    np.testing.assert_allclose(_values(browser, "tile-mnew", br), f["m_new"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "tile-lnew", br), f["l_new"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "tile-mold", br), f["m_old"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "tile-alpha", br), f["alpha"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "s", br, bc), f["s"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "tile-o", br, d), f["o"], rtol=RTOL, atol=ATOL)
    # HBM state after the first 7 tiles: replay their writes
    m_mid, l_mid, o_mid = np.full(n, -np.inf), np.zeros(n), np.zeros((n, d))
    for f in tiles[:7]:
        m_mid[f["r0"]:f["r1"]], l_mid[f["r0"]:f["r1"]], o_mid[f["r0"]:f["r1"]] = \
            f["m_new"], f["l_new"], f["o"]
    np.testing.assert_allclose(_values(browser, "m", n), m_mid, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "l", n), l_mid, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "o", n, d), o_mid, rtol=RTOL, atol=ATOL)
    shot = tmp_path / "explainer-fa1-mid-run.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    artifacts = os.environ.get("FLASHTILE_TEST_ARTIFACTS")
    if artifacts:  # CI can collect the screenshot from here
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / shot.name)

    # one step back and forward again lands on the same numbers
    _keys(browser, Keys.ARROW_LEFT)
    assert _state(browser)[1] == 7
    _keys(browser, Keys.ARROW_RIGHT)
    np.testing.assert_allclose(_values(browser, "tile-lnew", br), f["l_new"], rtol=RTOL, atol=ATOL)

    _keys(browser, Keys.END)
    assert _state(browser)[1] == _state(browser)[2]
    np.testing.assert_allclose(_values(browser, "m", n), m_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "l", n), l_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "o", n, d), o_ref, rtol=RTOL, atol=ATOL)
    want, _ = _naive_out(q, k, v, causal=False)
    np.testing.assert_allclose(_values(browser, "final-o", n, d), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "naive-o", n, d), want, rtol=RTOL, atol=ATOL)
    assert _console_errors(browser) == []


def test_page_tile_size_control_leaves_output_unchanged(browser):
    from selenium.webdriver.support.ui import Select

    n, d = 16, 4
    _open(browser, f"view=fa2&n={n}&br=4&bc=4&causal=1")
    q, k, v = _page_inputs(browser, n, n, d)
    want, _ = _naive_out(q, k, v, causal=True)
    browser.execute_script("window.flashtileExplainer.go(window.flashtileExplainer.steps())")
    seen = []
    for br, bc in ((4, 4), (2, 8), (8, 2), (8, 8), (2, 2)):
        Select(browser.find_element("id", "block-r")).select_by_value(str(br))
        Select(browser.find_element("id", "block-c")).select_by_value(str(bc))
        key, step, steps = _state(browser)
        assert key == f"fa2|{n}|{br}|{bc}|1" and step == steps  # still at the end
        shown = _values(browser, "o", n, d)
        np.testing.assert_allclose(shown, want, rtol=RTOL, atol=ATOL, err_msg=key)
        np.testing.assert_allclose(_values(browser, "final-o", n, d), want, rtol=RTOL, atol=ATOL)
        seen.append(shown)
    for shown in seen[1:]:
        np.testing.assert_allclose(shown, seen[0], rtol=RTOL, atol=ATOL)
    # the keyboard shortcut for the query tile size does the same
    _keys(browser, "r")
    assert _state(browser)[0] != f"fa2|{n}|2|2|1"
    np.testing.assert_allclose(_values(browser, "o", n, d), want, rtol=RTOL, atol=ATOL)
    assert _console_errors(browser) == []


@pytest.mark.parametrize("view", ["backward", "sparse", "decode"])
def test_page_other_views_end_at_the_reference(browser, view):
    n, d = 16, 4
    causal = view == "backward"
    _open(browser, f"view={view}&n={n}&br=4&bc=4&causal={int(causal)}")
    assert _state(browser)[0].startswith(f"{view}|{n}|")
    sq = 1 if view == "decode" else n
    q, k, v = _page_inputs(browser, sq, n, d)
    browser.execute_script("window.flashtileExplainer.go(window.flashtileExplainer.steps())")
    mask = None
    if view == "sparse":
        group = browser.execute_script("return window.FLASHTILE_TRACES.traces["
                                       "window.flashtileExplainer.key()].meta.sparse_group")
        mask = explain.sparse_layout(n, n, group)
        assert not mask.all()
    want, lse = _naive_out(q, k, v, causal, mask)
    np.testing.assert_allclose(_values(browser, "o", sq, d), want, rtol=RTOL, atol=ATOL)
    s = q @ k.T / np.sqrt(d)
    visible = naive.visibility_mask(sq, n, window_right=0 if causal else -1)
    if mask is not None:
        visible &= mask
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=1)
    np.testing.assert_allclose(_values(browser, "m", sq), m, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(_values(browser, "l", sq), np.exp(s - m[:, None]).sum(axis=1),
                               rtol=RTOL, atol=ATOL)
    if view == "backward":
        do = np.array(json.loads(browser.execute_script(
            "return JSON.stringify(window.FLASHTILE_TRACES.traces[window.flashtileExplainer.key()]"
            ".inputs.do)")))
        grads = naive.attention_backward(do[None, :, None], q[None, :, None], k[None, :, None],
                                         v[None, :, None], window_right=0)
        for name, g in zip(("dq", "dk", "dv"), grads):
            np.testing.assert_allclose(_values(browser, name, n, d), g[0, :, 0], rtol=RTOL,
                                       atol=ATOL, err_msg=name)
    if view == "decode":  # the LSE merge's weights sum to one
        w = _values(browser, "split-w", 2)
        np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-8)
    assert _console_errors(browser) == []


def test_page_keyboard_play_pause_and_views(browser):
    import time

    from selenium.webdriver.common.keys import Keys

    _open(browser, "view=fa1&n=16&br=2&bc=2")  # 65 steps: playing does not reach the end here
    _keys(browser, "+", "+", "-")  # 3 -> 5 -> 4 steps/s
    assert browser.find_element("id", "speed").get_attribute("value") == "4"
    _keys(browser, " ")
    deadline = time.time() + 10
    while _state(browser)[1] < 2 and time.time() < deadline:
        time.sleep(0.05)
    _keys(browser, " ")
    paused_at, steps = _state(browser)[1:]
    assert 2 <= paused_at < steps
    time.sleep(0.6)
    assert _state(browser)[1] == paused_at
    _keys(browser, Keys.HOME)
    assert _state(browser)[1] == 0
    _keys(browser, "v")
    assert _state(browser)[0].startswith("fa2|16|")
    _keys(browser, "m")
    assert _state(browser)[0].endswith("|1")
    _keys(browser, "n")
    assert _state(browser)[0].startswith("fa2|32|")
    assert "Space" in browser.find_element("id", "keys").text
    assert _console_errors(browser) == []


def test_page_fits_a_phone_screen(browser, tmp_path):
    from selenium.webdriver.common.keys import Keys

    browser.set_window_size(390, 1600)
    try:
        _open(browser, "view=backward&n=16&br=4&bc=4&causal=1")
        _keys(browser, *[Keys.ARROW_RIGHT] * 6)
        width, inner = browser.execute_script(
            "return [document.documentElement.scrollWidth, window.innerWidth]")
        assert width <= inner, "the page scrolls sideways at phone width"
        assert browser.save_screenshot(str(tmp_path / "explainer-phone.png"))
        assert _console_errors(browser) == []
    finally:
        browser.set_window_size(1280, 1800)
