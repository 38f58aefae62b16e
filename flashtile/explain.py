"""Write (and optionally open) the interactive FlashAttention explainer page.

    python -m flashtile.explain [--out DIR] [--n N [N ...]] [--d D] [--tiles T [T ...]] [--open]

The page is static: ``index.html``, ``explainer.js`` and ``explainer.css`` (shipped in the package,
``flashtile/explainer_assets``) plus ``traces.js``, the traces that
:mod:`flashtile.reference.trace` records for the chosen sequence lengths, head dimension and tile
sizes.  It needs no network and no server: open ``DIR/index.html`` in a browser.  The copy in the
repository's ``docs/explainer`` is this command's output for the defaults.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import webbrowser
from importlib import resources
from pathlib import Path

from .reference import trace

__all__ = ["ASSETS", "asset_dir", "build_parser", "write_page", "main"]

ASSETS = ("index.html", "explainer.js", "explainer.css")
DEFAULT_NS = (8, 16, 32)
DEFAULT_TILES = (2, 4, 8)


def asset_dir():
    """The packaged page assets (a ``Traversable``; a directory in a source checkout or wheel)."""
    return resources.files("flashtile") / "explainer_assets"


def write_page(out, *, ns=DEFAULT_NS, d: int = 4, tiles=DEFAULT_TILES, seed: int = 0,
               elem_bytes: int = 2, max_tiles: int = 8) -> Path:
    """Copy the page assets to ``out`` and write its ``traces.js``; returns ``out/index.html``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = asset_dir()
    for name in ASSETS:
        (out / name).write_bytes((src / name).read_bytes())
    bundle = trace.export_traces(ns=ns, d=d, tiles=tiles, seed=seed, elem_bytes=elem_bytes,
                                 max_tiles=max_tiles)
    (out / "traces.js").write_text(trace.traces_js(bundle), encoding="utf-8")
    return out / "index.html"


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.explain",
        description="Write the interactive FlashAttention explainer (a static page) and "
                    "optionally open it in a browser.")
    p.add_argument("--out", type=Path, default=None,
                   help="directory to write the page to (default: a new temporary directory)")
    p.add_argument("--n", type=_positive, nargs="+", default=list(DEFAULT_NS), metavar="N",
                   help="sequence lengths offered by the page (default: %(default)s)")
    p.add_argument("--d", type=_positive, default=4, metavar="D",
                   help="head dimension (default: %(default)s)")
    p.add_argument("--tiles", type=_positive, nargs="+", default=list(DEFAULT_TILES),
                   metavar="T", help="tile sizes offered for Br and Bc; each must divide the "
                                     "largest (default: %(default)s)")
    p.add_argument("--max-tiles", type=_positive, default=8,
                   help="leave out tile sizes that cut N into more tiles than this "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random Q, K, V")
    p.add_argument("--elem-bytes", type=_positive, default=2,
                   help="bytes per element in the IO counts (default: %(default)s, fp16/bf16)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if max(args.n) > 256 or args.d > 64:
        print("explain: keep N <= 256 and D <= 64 so the page stays readable "
              f"(got N up to {max(args.n)}, D = {args.d})", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="flashtile-explainer-"))
    try:
        index = write_page(out, ns=args.n, d=args.d, tiles=args.tiles, seed=args.seed,
                           elem_bytes=args.elem_bytes, max_tiles=args.max_tiles)
    except ValueError as e:
        print(f"explain: {e}", file=sys.stderr)
        return 2
    print(f"wrote {index}")
    if args.open:
        webbrowser.open(index.resolve().as_uri())
    return 0


if __name__ == "__main__":
    sys.exit(main())
