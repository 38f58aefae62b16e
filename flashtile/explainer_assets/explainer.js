// The flashtile explainer: displays traces exported by flashtile.reference.trace.
// Nothing here computes attention: every number shown is read from window.FLASHTILE_TRACES.
// The page state at step t is the trace's steps 0..t-1 applied in order (values assigned,
// never recomputed).
(function () {
  "use strict";

  var B = window.FLASHTILE_TRACES;
  var $ = function (id) { return document.getElementById(id); };

  var sel = { view: "fa1", n: null, br: null, bc: null, causal: false };
  var tr = null;      // the trace on display
  var t = 0;          // steps applied (0 = before the first step)
  var timer = null;
  var SHORT = { fa1: "Forward, FA1 order", fa2: "Forward, FA2 order", backward: "Backward (recompute)",
                sparse: "Block-sparse", decode: "Decode, split-KV" };

  // ---------- formatting ----------
  function fmt(x) {
    if (x === null || x === undefined) return "\u2212\u221e";
    var a = Math.abs(x);
    if (a !== 0 && (a >= 1e4 || a < 1e-3)) return x.toExponential(3).replace("-", "\u2212");
    return x.toFixed(4).replace("-", "\u2212");
  }
  function raw(x) { return (x === null || x === undefined) ? "-inf" : String(x); }
  function fmtBytes(b) {
    var s = String(Math.round(b)).replace(/\B(?=(\d{3})+(?!\d))/g, "\u2009");
    if (b >= 1024 * 1024) return s + " B (" + (b / 1048576).toFixed(1) + " MiB)";
    if (b >= 1024) return s + " B (" + (b / 1024).toFixed(1) + " KiB)";
    return s + " B";
  }
  function setNum(el, x) {
    el.textContent = fmt(x);
    el.setAttribute("data-value", raw(x));
    el.classList.toggle("neg-inf", x === null || x === undefined);
  }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); return e; }
  function range(a, b) { var r = []; for (var i = a; i < b; i++) r.push(i); return r; }

  // ---------- trace selection ----------
  function key(s) {
    return [s.view, s.n, s.view === "decode" ? 1 : s.br, s.bc, s.view === "decode" ? 0 : (s.causal ? 1 : 0)].join("|");
  }
  function tilesFor(n, view, which) {
    if (view === "decode" && which === "br") return [1];
    return B.tiles.filter(function (x) {
      var s = { view: view, n: n, br: which === "br" ? x : sel.br, bc: which === "bc" ? x : sel.bc, causal: sel.causal };
      // a tile size is offered when some trace with it exists for this N
      return Object.keys(B.traces).some(function (k) {
        var p = k.split("|");
        return p[0] === view && +p[1] === n && +(which === "br" ? p[2] : p[3]) === x;
      });
    });
  }
  function closest(list, x) {
    var best = list[0];
    list.forEach(function (v) { if (Math.abs(v - x) < Math.abs(best - x)) best = v; });
    return best;
  }
  function fillSelect(s, values, current, label) {
    clear(s);
    values.forEach(function (v) {
      var o = el("option", { value: String(v) }, label ? label(v) : String(v));
      if (String(v) === String(current)) o.selected = true;
      s.appendChild(o);
    });
  }

  function choose(keepFraction) {
    var frac = tr ? (t >= tr.steps.length ? 1 : t / Math.max(1, tr.steps.length)) : 0;
    if (B.ns.indexOf(sel.n) < 0) sel.n = B.ns[Math.min(1, B.ns.length - 1)];
    var brs = tilesFor(sel.n, sel.view, "br"), bcs = tilesFor(sel.n, sel.view, "bc");
    if (sel.view !== "decode") sel.br = brs.indexOf(sel.br) >= 0 ? sel.br : closest(brs, sel.br || 4);
    sel.bc = bcs.indexOf(sel.bc) >= 0 ? sel.bc : closest(bcs, sel.bc || 4);
    fillSelect($("view"), B.views, sel.view, function (v) { return SHORT[v] || v; });
    fillSelect($("seq-len"), B.ns, sel.n);
    fillSelect($("block-r"), sel.view === "decode" ? [1] : brs, sel.view === "decode" ? 1 : sel.br);
    fillSelect($("block-c"), bcs, sel.bc);
    $("block-r").disabled = sel.view === "decode";
    $("causal").disabled = sel.view === "decode";
    $("causal").checked = sel.causal && sel.view !== "decode";
    tr = B.traces[key(sel)];
    if (!tr) throw new Error("no trace for " + key(sel));
    buildStatic();
    var target = keepFraction ? Math.round(frac * tr.steps.length) : 0;
    go(target);
  }

  // ---------- static parts of a trace ----------
  function matTable(table, rows, cols, idPrefix, values, withNumbers) {
    clear(table);
    var cells = [];
    var head = el("tr");
    head.appendChild(el("th", { scope: "col" }, ""));
    range(0, cols).forEach(function (c) { head.appendChild(el("th", { scope: "col" }, String(c))); });
    table.appendChild(head);
    range(0, rows).forEach(function (r) {
      var row = el("tr");
      row.appendChild(el("th", { scope: "row" }, String(r)));
      cells.push([]);
      range(0, cols).forEach(function (c) {
        var td = el("td", { id: idPrefix + "-" + r + "-" + c });
        if (values) {
          var x = values[r][c];
          if (withNumbers) setNum(td, x);
          else { td.setAttribute("data-value", raw(x)); td.title = idPrefix + "[" + r + "," + c + "] = " + fmt(x); }
        }
        row.appendChild(td);
        cells[r].push(td);
      });
      table.appendChild(row);
    });
    return cells;
  }
  function transpose(a) { return a.length ? a[0].map(function (_, c) { return a.map(function (r) { return r[c]; }); }) : []; }

  var cellsQ, cellsKt, cellsV, tileCells, rowCells;

  function buildStatic() {
    var M = tr.meta;
    $("view-title").textContent = M.title + (M.causal ? ", causal" : "") + ": N = " + M.n + ", d = " + M.d +
      (M.view === "decode" ? ", one new query token, " + M.num_splits + " KV splits" : ", Br = " + M.br) +
      ", Bc = " + M.bc + " (" + M.tiles_visited + " tiles computed, " + M.tiles_skipped + " skipped).";
    $("q-dim").textContent = "(" + M.sq + "\u00d7" + M.d + ")";
    $("k-dim").textContent = "(" + M.d + "\u00d7" + M.sk + ")";
    $("v-dim").textContent = "(" + M.sk + "\u00d7" + M.d + ")";
    cellsQ = matTable($("mat-q"), M.sq, M.d, "q", tr.inputs.q, false);
    cellsKt = matTable($("mat-kt"), M.d, M.sk, "kt", transpose(tr.inputs.k), false);
    cellsV = matTable($("mat-v"), M.sk, M.d, "v", tr.inputs.v, false);

    // tile map
    var tm = clear($("tilemap"));
    var head = el("tr");
    head.appendChild(el("th", { scope: "col" }, "i\\j"));
    range(0, M.tc).forEach(function (j) { head.appendChild(el("th", { scope: "col" }, String(j))); });
    tm.appendChild(head);
    tileCells = [];
    range(0, M.tr).forEach(function (i) {
      var row = el("tr");
      row.appendChild(el("th", { scope: "row" }, String(i)));
      tileCells.push([]);
      range(0, M.tc).forEach(function (j) {
        var td = el("td", { id: "tile-" + i + "-" + j });
        row.appendChild(td);
        tileCells[i].push(td);
      });
      tm.appendChild(row);
    });

    // per-row table
    var rows = clear($("rows"));
    var h = el("tr");
    ["row", "m", "\u2113"].concat(range(0, M.d).map(function (c) { return "O[\u00b7," + c + "]"; }))
      .forEach(function (x) { h.appendChild(el("th", { scope: "col" }, x)); });
    rows.appendChild(h);
    rowCells = [];
    range(0, M.sq).forEach(function (r) {
      var tr_ = el("tr", { id: "row-" + r });
      tr_.appendChild(el("th", { scope: "row" }, String(r)));
      var c = { m: el("td", { id: "m-" + r, "class": "num" }), l: el("td", { id: "l-" + r, "class": "num" }), o: [] };
      tr_.appendChild(c.m); tr_.appendChild(c.l);
      range(0, M.d).forEach(function (k) { var td = el("td", { id: "o-" + r + "-" + k, "class": "num" }); c.o.push(td); tr_.appendChild(td); });
      rowCells.push(c);
      rows.appendChild(tr_);
    });
    var notes = {
      fa1: "m, \u2113 and O live in HBM and are rewritten after every tile (O stays normalised).",
      sparse: "m, \u2113 and O live in HBM and are rewritten after every computed tile.",
      fa2: "Rows of the current query tile show the on-chip m and \u2113 (marked \u2022); O and lse reach HBM once the row's last tile is done.",
      backward: "m, \u2113 and O were saved by the forward pass; the backward reads them to recompute P = exp(S \u2212 m)/\u2113 tile by tile.",
      decode: "Each split keeps its own m, \u2113 and accumulator; the merge combines them into the row below."
    };
    $("rows-note").textContent = notes[M.view];

    // gradients (backward)
    var g = clear($("grads"));
    if (M.view === "backward") {
      [["dq", "dQ (HBM, accumulated across key tiles)", M.sq], ["dk", "dK (written once per key tile)", M.sk], ["dv", "dV (written once per key tile)", M.sk]]
        .forEach(function (x) {
          var f = el("figure");
          f.appendChild(el("figcaption", null, x[1]));
          var wrap = el("div", { "class": "scroll" });
          var tb = el("table", { "class": "mat vals", id: "mat-" + x[0] });
          wrap.appendChild(tb); f.appendChild(wrap); g.appendChild(f);
          matTable(tb, x[2], M.d, x[0], null, false);
        });
    }

    // check section and byte totals
    var fo = M.view === "backward" ? tr.final.o : tr.final.o;
    matTable($("final-o"), M.sq, M.d, "final-o", fo, true);
    matTable($("naive-o"), M.sq, M.d, "naive-o", tr.naive.o, true);
    var md = $("max-diff");
    md.textContent = tr.max_abs_diff.toExponential(2) + (M.view === "backward" ? " (output and gradients)" : "");
    md.setAttribute("data-value", String(tr.max_abs_diff));
    $("elem-bytes").textContent = String(M.elem_bytes);
    [["bytes-flash-hbm-total", tr.bytes.flash_hbm], ["bytes-flash-sram-total", tr.bytes.flash_sram],
     ["bytes-std-hbm", tr.bytes.standard_hbm], ["bytes-std-sram", tr.bytes.standard_sram]].forEach(function (x) {
      $(x[0]).textContent = fmtBytes(x[1]);
      $(x[0]).setAttribute("data-value", String(x[1]));
    });
    var sc = B.at_scale, sv = sc.views[M.view];
    var ratio = sv.standard / sv.flash;
    $("scale-note").textContent = M.view === "decode"
      ? "Decoding reads the whole KV cache once with or without splits, and never writes a score row: at N = " + sc.n +
        ", d = " + sc.d + " the same formulas give " + fmtBytes(sv.flash) + " of HBM traffic against " + fmtBytes(sv.standard) +
        " for standard attention. What splitting buys is parallel work across the cache, merged exactly by log-sum-exp."
      : "These toy tiles hold a few rows, so FlashAttention re-reads Q and O many times" +
      " and can move more than standard attention. The saving needs tiles as large as SRAM allows (Bc \u2248 M/4d): at N = " +
      sc.n + ", d = " + sc.d + " with " + sc.br + "\u00d7" + sc.bc + " tiles the same formulas give " + fmtBytes(sv.flash) +
      " of HBM traffic for FlashAttention against " + fmtBytes(sv.standard) + " for standard attention (" +
      (ratio >= 1 ? ratio.toFixed(1) + "\u00d7 less" : (1 / ratio).toFixed(1) + "\u00d7 more") + ").";
    $("data-desc").textContent = "seed " + M.seed + ", N = " + M.n + ", d = " + M.d + ", " + B.ns.length +
      " lengths, tile sizes " + B.tiles.join("/") + ", float64, " + M.digits + " significant digits";

    $("step-slider").max = String(tr.steps.length);
    $("step-count").textContent = String(tr.steps.length);
  }

  // ---------- state at step t ----------
  function replay(n) {
    var M = tr.meta, i, r, a;
    var S = {
      m: [], l: [], onchip: [], o: [], status: [], dq: [], dk: [], dv: [], splits: [], merged: null
    };
    for (r = 0; r < M.sq; r++) {
      S.m.push(null); S.l.push(0); S.onchip.push(false);
      S.o.push(range(0, M.d).map(function () { return 0; }));
      S.dq.push(range(0, M.d).map(function () { return 0; }));
    }
    for (r = 0; r < M.sk; r++) {
      S.dk.push(range(0, M.d).map(function () { return 0; }));
      S.dv.push(range(0, M.d).map(function () { return 0; }));
    }
    for (i = 0; i < M.tr; i++) S.status.push(range(0, M.tc).map(function () { return "todo"; }));
    if (M.view === "backward") {
      S.m = tr.final.m.slice(); S.l = tr.final.l.slice(); S.o = tr.final.o.map(function (x) { return x.slice(); });
    }
    for (var k = 0; k < n; k++) {
      var st = tr.steps[k];
      if (st.k === "tile") {
        S.status[st.i][st.j] = "done";
        var r0 = st.r[0];
        if (M.view === "backward") {
          for (a = 0; a < st.dq.length; a++) S.dq[r0 + a] = st.dq[a];
        } else if (M.view === "decode") {
          S.splits[st.split] = S.splits[st.split] || {};
          S.splits[st.split].m = st.m_new[0]; S.splits[st.split].l = st.l_new[0];
          S.splits[st.split].c = S.splits[st.split].c || [st.c[0], st.c[1]];
          S.splits[st.split].c[1] = st.c[1];
        } else {
          for (a = 0; a < st.m_new.length; a++) {
            S.m[r0 + a] = st.m_new[a]; S.l[r0 + a] = st.l_new[a];
            if (M.view === "fa2") S.onchip[r0 + a] = true; else S.o[r0 + a] = st.o[a];
          }
        }
      } else if (st.k === "skip") {
        S.status[st.i][st.j] = st.why === "causal" ? "skip-causal" : "skip-sparse";
      } else if (st.k === "store") {
        if (M.view === "fa2") {
          for (a = 0; a < st.o.length; a++) {
            S.o[st.r[0] + a] = st.o[a]; S.m[st.r[0] + a] = st.m[a]; S.l[st.r[0] + a] = st.l[a]; S.onchip[st.r[0] + a] = false;
          }
        } else if (M.view === "backward") {
          for (a = 0; a < st.dk.length; a++) { S.dk[st.c[0] + a] = st.dk[a]; S.dv[st.c[0] + a] = st.dv[a]; }
        } else if (M.view === "decode") {
          S.splits[st.split] = S.splits[st.split] || {};
          S.splits[st.split].lse = st.lse[0]; S.splits[st.split].stored = true;
        }
      } else if (st.k === "merge") {
        S.merged = st;
        S.o = st.o.map(function (x) { return x.slice(); });
        S.m = tr.final.m.slice(); S.l = tr.final.l.slice();
      }
    }
    return S;
  }

  // ---------- dynamic parts ----------
  function mark(cells, rows, cols, cls) {
    rows.forEach(function (r) { cols.forEach(function (c) { if (cells[r] && cells[r][c]) cells[r][c].classList.add(cls); }); });
  }
  function unmarkAll(cells) {
    cells.forEach(function (row) { row.forEach(function (c) { c.classList.remove("cur", "skip"); }); });
  }
  function smallTable(title, id, values, colLabel, rowLabel) {
    var f = el("figure");
    f.appendChild(el("figcaption", null, title));
    var wrap = el("div", { "class": "scroll" });
    var tb = el("table", { "class": "mat vals", id: "tbl-" + id });
    var h = el("tr");
    h.appendChild(el("th", { scope: "col" }, ""));
    (values[0] || []).forEach(function (_, c) { h.appendChild(el("th", { scope: "col" }, colLabel ? colLabel(c) : String(c))); });
    tb.appendChild(h);
    values.forEach(function (row, r) {
      var tr_ = el("tr");
      tr_.appendChild(el("th", { scope: "row" }, String(rowLabel ? rowLabel(r) : r)));
      row.forEach(function (x, c) {
        var td = el("td", { id: id + "-" + r + "-" + c, "class": "num" });
        setNum(td, x);
        if (x === null) { td.classList.add("masked"); td.textContent = "masked"; td.setAttribute("aria-label", "masked, minus infinity"); }
        tr_.appendChild(td);
      });
      tb.appendChild(tr_);
    });
    wrap.appendChild(tb); f.appendChild(wrap);
    return f;
  }
  function statTable(cols, n, rowLabel) {
    var tb = clear($("tile-stats"));
    var h = el("tr");
    h.appendChild(el("th", { scope: "col" }, "row"));
    cols.forEach(function (c) { h.appendChild(el("th", { scope: "col" }, c[0])); });
    tb.appendChild(h);
    for (var a = 0; a < n; a++) {
      var r = el("tr");
      r.appendChild(el("th", { scope: "row" }, String(rowLabel(a))));
      cols.forEach(function (c) {
        var td = el("td", { id: c[1] + "-" + a, "class": "num" });
        setNum(td, c[2][a]);
        r.appendChild(td);
      });
      tb.appendChild(r);
    }
  }
  function names(list, i, j) {
    return list.map(function (x) {
      if (/^(K|V|dK|dV)$/.test(x)) return x + "_" + j;
      if (/^(Q|O|l|m|dO|dQ|lse)$/.test(x)) return (x === "l" ? "\u2113" : x) + "_" + i;
      return x;
    }).join(", ");
  }

  function render() {
    var M = tr.meta, S = replay(t), st = t > 0 ? tr.steps[t - 1] : null;
    $("step-index").textContent = String(t);
    $("step-slider").value = String(t);
    $("step-slider").setAttribute("aria-valuetext", "step " + t + " of " + tr.steps.length);

    // tile map
    for (var i = 0; i < M.tr; i++) for (var j = 0; j < M.tc; j++) {
      var s = S.status[i][j], td = tileCells[i][j];
      if (st && (st.k === "tile" || st.k === "skip") && st.i === i && st.j === j) s = st.k === "tile" ? "cur" : s + " cur";
      td.className = s;
      var sym = { todo: "\u00b7", done: "\u2713", cur: "\u25b6", "skip-causal": "\u2715", "skip-sparse": "\u2205" };
      var base = s.split(" ")[0];
      td.textContent = s.indexOf("cur") >= 0 && base !== "cur" ? "\u25b6" + sym[base] : sym[base];
      td.setAttribute("aria-label", "tile " + i + "," + j + ": " + s.replace("skip-", "skipped, ").replace("cur", "now"));
      td.setAttribute("data-status", s);
    }

    // Q, K^T, V highlight
    [cellsQ, cellsKt, cellsV].forEach(unmarkAll);
    if (st && st.r && st.c) {
      var cls = st.k === "skip" ? "skip" : "cur";
      var rr = range(st.r[0], st.r[1]), cc = range(st.c[0], st.c[1]), dd = range(0, M.d);
      mark(cellsQ, rr, dd, cls); mark(cellsKt, dd, cc, cls); mark(cellsV, cc, dd, cls);
    } else if (st && st.r) {
      mark(cellsQ, range(st.r[0], st.r[1]), range(0, M.d), "cur");
    } else if (st && st.c) {
      mark(cellsV, range(st.c[0], st.c[1]), range(0, M.d), "cur");
      mark(cellsKt, range(0, M.d), range(st.c[0], st.c[1]), "cur");
    }

    // rows
    for (var r = 0; r < M.sq; r++) {
      var c = rowCells[r];
      setNum(c.m, S.m[r]); setNum(c.l, S.l[r]);
      if (S.onchip[r]) { c.m.textContent += " \u2022"; c.l.textContent += " \u2022"; }
      c.m.parentNode.classList.toggle("cur", !!(st && st.r && r >= st.r[0] && r < st.r[1]));
      for (var k = 0; k < M.d; k++) setNum(c.o[k], S.o[r][k]);
    }
    if (M.view === "backward") {
      [["dq", S.dq, M.sq], ["dk", S.dk, M.sk], ["dv", S.dv, M.sk]].forEach(function (x) {
        for (var r2 = 0; r2 < x[2]; r2++) for (var k2 = 0; k2 < M.d; k2++) setNum($(x[0] + "-" + r2 + "-" + k2), x[1][r2][k2]);
      });
    }

    // SRAM panel
    var tv = clear($("tile-views")), extra = clear($("tile-extra"));
    clear($("tile-stats"));
    var label = "", text = "";
    if (!st) {
      label = "Nothing on chip yet.";
      text = "Press Play or Step (\u2192) to start. " + M.title + ".";
    } else if (st.k === "init") {
      label = "No tile yet.";
      text = st.text + " (the paper's algorithms start by writing these).";
    } else if (st.k === "skip") {
      label = "Tile pair (i, j) = (" + st.i + ", " + st.j + "): query rows " + st.r[0] + "\u2013" + (st.r[1] - 1) + ", keys " + st.c[0] + "\u2013" + (st.c[1] - 1) + ".";
      text = (st.why === "causal"
        ? "Skipped: every key of this tile comes after every query of it, so the causal mask hides the whole tile."
        : "Skipped: the block-sparsity layout switches this tile off.") +
        (st.loads.length ? " (" + names(st.loads, st.i, st.j) + " were loaded as this key tile's loop began.) Nothing else is loaded or computed for this tile."
                         : " Nothing is loaded or computed for it.");
      tv.appendChild(el("p", { "class": "skipped-note" }, "\u2715 Tile skipped: no S tile, no update."));
    } else if (st.k === "tile") {
      label = "Tile pair (i, j) = (" + st.i + ", " + st.j + "): query rows " + st.r[0] + "\u2013" + (st.r[1] - 1) +
        ", keys " + st.c[0] + "\u2013" + (st.c[1] - 1) + (st.split !== undefined ? ", split " + st.split : "") + ".";
      var colLab = function (c) { return String(st.c[0] + c); };
      var rl = function (a) { return st.r[0] + a; };
      var kl = function (a) { return st.c[0] + a; };
      tv.appendChild(smallTable("S = \u03c4 Q\u1d62 K\u2c7c\u1d40 (" + st.s.length + "\u00d7" + st.s[0].length + ", never written to HBM)", "s", st.s, colLab, rl));
      if (M.view === "backward") {
        tv.appendChild(smallTable("P = exp(S \u2212 m) / \u2113, recomputed", "p", st.p, colLab, rl));
        tv.appendChild(smallTable("dS = P \u2218 (dP \u2212 D)", "ds", st.ds, colLab, rl));
        statTable([["m (saved)", "tile-m", st.r ? S.m.slice(st.r[0], st.r[1]) : []],
                   ["\u2113 (saved)", "tile-l", S.l.slice(st.r[0], st.r[1])]], st.r[1] - st.r[0], rl);
        extra.appendChild(smallTable("dK\u2c7c so far (on chip)", "tile-dk", st.dk, null, kl));
        extra.appendChild(smallTable("dV\u2c7c so far (on chip)", "tile-dv", st.dv, null, kl));
        extra.appendChild(smallTable("dQ\u1d62 after this tile (written to HBM)", "tile-dq", st.dq, null, rl));
        text = "Load " + names(st.loads, st.i, st.j) + ". Recompute S and P from the saved statistics instead of reading an N\u00d7N P from HBM, then dV\u2c7c += P\u1d40dO\u1d62, dS, dK\u2c7c += \u03c4 dS\u1d40Q\u1d62, and write dQ\u1d62 += \u03c4 dS K\u2c7c back.";
      } else {
        statTable([["m old", "tile-mold", st.m_old], ["m new", "tile-mnew", st.m_new],
                   ["\u03b1 = exp(m old \u2212 m new)", "tile-alpha", st.alpha],
                   ["\u2113 old", "tile-lold", st.l_old], ["\u2113 new", "tile-lnew", st.l_new]],
                  st.m_new.length, M.view === "decode" ? function () { return 0; } : rl);
        if (st.o) {
          extra.appendChild(smallTable("O\u1d62 = (\u03b1\u00b7\u2113 old\u00b7O\u1d62 + e^(m\u0303\u2212m new) P\u0303V\u2c7c) / \u2113 new, written back", "tile-o", st.o, null, rl));
          text = "Load " + names(st.loads, st.i, st.j) + ". Compute the " + st.s.length + "\u00d7" + st.s[0].length +
            " score tile in SRAM, raise the running max where the tile's max is larger, rescale the old \u2113 and O\u1d62 by \u03b1, add this tile's share, and write O\u1d62, \u2113\u1d62, m\u1d62 back to HBM.";
        } else {
          extra.appendChild(smallTable("accumulator = \u03b1\u00b7acc + exp(S \u2212 m new) V\u2c7c (unnormalised, on chip)", "tile-acc", st.acc, null, rl));
          text = "Load " + names(st.loads, st.i, st.j) + ". Compute the score tile, update m and \u2113, rescale the on-chip accumulator by \u03b1 and add exp(S \u2212 m new)V\u2c7c. Nothing is written to HBM until this query tile is finished.";
        }
      }
    } else if (st.k === "store") {
      if (M.view === "backward") {
        label = "Key tile j = " + st.j + " finished.";
        var kl2 = function (a) { return st.c[0] + a; };
        extra.appendChild(smallTable("dK\u2c7c written to HBM", "tile-dk", st.dk, null, kl2));
        extra.appendChild(smallTable("dV\u2c7c written to HBM", "tile-dv", st.dv, null, kl2));
        text = "All query tiles have passed key tile " + st.j + ": write dK\u2c7c and dV\u2c7c to HBM once.";
      } else {
        label = (M.view === "decode" ? "Split " + st.split + " finished." : "Query tile i = " + st.i + " finished.");
        statTable([["m", "tile-m", st.m], ["\u2113", "tile-l", st.l], ["lse = m + log \u2113", "tile-lse", st.lse]],
                  st.m.length, function (a) { return st.r[0] + a; });
        extra.appendChild(smallTable("O = acc / \u2113, written to HBM", "tile-o", st.o, null, function (a) { return st.r[0] + a; }));
        text = M.view === "decode"
          ? "Split " + st.split + " divides its accumulator by \u2113 and writes its partial output and lse (one number per query) to HBM."
          : "Divide the accumulator by \u2113 once, and write O\u1d62 and lse\u1d62 = m + log \u2113 to HBM (the backward pass needs only lse).";
      }
    } else if (st.k === "merge") {
      label = "Merge of " + st.lses.length + " splits.";
      extra.appendChild(smallTable("merged output O = \u03a3 w\u209b O\u209b", "tile-o", st.o));
      text = "Read every split's partial output and lse; lse = log \u03a3 exp(lse\u209b), weight w\u209b = exp(lse\u209b \u2212 lse); O = \u03a3 w\u209b O\u209b. The result equals attention over the whole cache.";
    }
    $("tile-stats-h").hidden = !$("tile-stats").firstChild;
    $("tile-label").textContent = label;
    $("tile-label").setAttribute("data-kind", st ? st.k : "none");
    $("tile-label").setAttribute("data-i", st && st.i !== undefined ? String(st.i) : "");
    $("tile-label").setAttribute("data-j", st && st.j !== undefined ? String(st.j) : "");
    $("step-text").textContent = (st ? "Step " + t + ": " : "") + text;

    // decode: the splits table
    if (M.view === "decode") {
      var f = el("figure");
      f.appendChild(el("figcaption", null, "KV splits (run in parallel on a GPU)"));
      var wrap = el("div", { "class": "scroll" });
      var tb = el("table", { "class": "rows", id: "splits" });
      var h = el("tr");
      ["split", "keys", "m", "\u2113", "lse", "weight"].forEach(function (x) { h.appendChild(el("th", { scope: "col" }, x)); });
      tb.appendChild(h);
      var nsp = M.num_splits;
      for (var s2 = 0; s2 < nsp; s2++) {
        var sp = S.splits[s2] || {};
        var row = el("tr", { id: "split-" + s2 });
        row.appendChild(el("th", { scope: "row" }, String(s2)));
        row.appendChild(el("td", null, sp.c ? sp.c[0] + "\u2013" + (sp.c[1] - 1) : "\u2014"));
        [["split-m-", sp.m], ["split-l-", sp.l], ["split-lse-", sp.lse],
         ["split-w-", S.merged ? S.merged.weights[s2][0] : undefined]].forEach(function (x) {
          var td = el("td", { id: x[0] + s2, "class": "num" });
          if (x[1] === undefined) td.textContent = "\u2014"; else setNum(td, x[1]);
          row.appendChild(td);
        });
        tb.appendChild(row);
      }
      wrap.appendChild(tb); f.appendChild(wrap); extra.appendChild(f);
    }

    // bytes
    var hb = st ? st.hbm : 0, sb = st ? st.sram : 0;
    $("bytes-flash-hbm").textContent = fmtBytes(hb); $("bytes-flash-hbm").setAttribute("data-value", String(hb));
    $("bytes-flash-sram").textContent = fmtBytes(sb); $("bytes-flash-sram").setAttribute("data-value", String(sb));
    var mx = Math.max(tr.bytes.flash_hbm, tr.bytes.standard_hbm, tr.bytes.flash_sram, tr.bytes.standard_sram, 1);
    [["bar-flash-hbm", hb], ["bar-flash-sram", sb], ["bar-std-hbm", tr.bytes.standard_hbm], ["bar-std-sram", tr.bytes.standard_sram]]
      .forEach(function (x) { $(x[0]).style.width = (100 * x[1] / mx).toFixed(1) + "%"; });

    $("btn-back").disabled = t === 0; $("btn-first").disabled = t === 0;
    $("btn-forward").disabled = t >= tr.steps.length; $("btn-last").disabled = t >= tr.steps.length;
  }

  function go(n) {
    t = Math.max(0, Math.min(tr.steps.length, n));
    render();
    if (t >= tr.steps.length) pause();
  }

  // ---------- playback ----------
  function speed() { return +$("speed").value; }
  function play() {
    if (timer) return;
    if (t >= tr.steps.length) go(0);
    $("btn-play").textContent = "\u275a\u275a Pause";
    $("btn-play").setAttribute("aria-pressed", "true");
    timer = setInterval(function () { go(t + 1); }, 1000 / speed());
  }
  function pause() {
    if (timer) { clearInterval(timer); timer = null; }
    $("btn-play").textContent = "\u25b6 Play";
    $("btn-play").setAttribute("aria-pressed", "false");
  }
  function toggle() { if (timer) pause(); else play(); }
  function setSpeed(v) {
    $("speed").value = String(Math.max(1, Math.min(20, v)));
    $("speed-value").textContent = $("speed").value;
    if (timer) { pause(); play(); }
  }
  function cycle(list, x) { var i = list.indexOf(x); return list[(i + 1) % list.length]; }

  // ---------- wiring ----------
  $("view").addEventListener("change", function () { pause(); sel.view = this.value; choose(false); });
  $("seq-len").addEventListener("change", function () { pause(); sel.n = +this.value; choose(false); });
  $("block-r").addEventListener("change", function () { sel.br = +this.value; choose(true); });
  $("block-c").addEventListener("change", function () { sel.bc = +this.value; choose(true); });
  $("causal").addEventListener("change", function () { sel.causal = this.checked; choose(true); });
  $("btn-play").addEventListener("click", toggle);
  $("btn-forward").addEventListener("click", function () { pause(); go(t + 1); });
  $("btn-back").addEventListener("click", function () { pause(); go(t - 1); });
  $("btn-first").addEventListener("click", function () { pause(); go(0); });
  $("btn-last").addEventListener("click", function () { pause(); go(tr.steps.length); });
  $("speed").addEventListener("input", function () { setSpeed(+this.value); });
  $("step-slider").addEventListener("input", function () { pause(); go(+this.value); });

  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    var tag = e.target && e.target.tagName;
    var inControl = tag === "SELECT" || tag === "INPUT" || tag === "TEXTAREA";
    var k = e.key;
    if (inControl && (k.indexOf("Arrow") === 0 || k === "Home" || k === "End" || k === " ")) return;
    if (tag === "BUTTON" && (k === " " || k === "Enter")) return;  // the button itself acts
    var handled = true;
    switch (k) {
      case " ": case "p": case "P": toggle(); break;
      case "ArrowRight": pause(); go(t + 1); break;
      case "ArrowLeft": pause(); go(t - 1); break;
      case "Home": pause(); go(0); break;
      case "End": pause(); go(tr.steps.length); break;
      case "+": case "=": setSpeed(speed() + 1); break;
      case "-": case "_": setSpeed(speed() - 1); break;
      case "v": case "V": pause(); sel.view = cycle(B.views, sel.view); choose(false); break;
      case "n": case "N": pause(); sel.n = cycle(B.ns, sel.n); choose(false); break;
      case "r": case "R": if (sel.view !== "decode") { sel.br = cycle(tilesFor(sel.n, sel.view, "br"), sel.br); choose(true); } break;
      case "c": case "C": sel.bc = cycle(tilesFor(sel.n, sel.view, "bc"), sel.bc); choose(true); break;
      case "m": case "M": if (sel.view !== "decode") { sel.causal = !sel.causal; choose(true); } break;
      default: handled = false;
    }
    if (handled) e.preventDefault();
  });

  // initial selection: from the URL hash (#view=fa2&n=16&br=4&bc=4&causal=1) or defaults
  var params = {};
  (window.location.hash || "").replace(/^#/, "").split("&").forEach(function (p) {
    var kv = p.split("="); if (kv[0]) params[kv[0]] = decodeURIComponent(kv[1] || "");
  });
  if (B.views.indexOf(params.view) >= 0) sel.view = params.view;
  sel.n = params.n ? +params.n : B.ns[Math.min(1, B.ns.length - 1)];
  sel.br = params.br ? +params.br : 4;
  sel.bc = params.bc ? +params.bc : 4;
  sel.causal = params.causal === "1";
  choose(false);
  if (params.step) go(+params.step);

  // a small handle for scripted use (tests, bookmarks): read-only views of the state
  window.flashtileExplainer = {
    key: function () { return key(sel); },
    step: function () { return t; },
    steps: function () { return tr.steps.length; },
    go: function (n) { pause(); go(n); }
  };
})();
