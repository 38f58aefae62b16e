"""Launch side of the decode kernels: block shapes, the split heuristic, workspaces, grids, and
the error records of the device-side index check.

Nothing here reads a tensor's values on the host: every size comes from static shapes, so a
whole decode step (append + split-KV + combine) can be captured in a CUDA graph.  The host
work of an eager call is kept small: the block shapes and split count are memoised per shape
(:func:`_plan`), each kernel's ``triton.heuristics`` constexprs are evaluated once per launch
from a single argument mapping (:func:`fastlaunch.launch`), and a call can be recorded as a
:class:`Plan` that later calls of the same signature replay (:func:`record_plan`).  Arguments
arrive validated and normalised by :func:`flashtile._validate.kvcache` (int32
``cache_seqlens`` tensor, bool tree mask, last dimension contiguous).

Index values (``FLASHTILE_KVCACHE_CHECK``, :func:`check_mode`).  The kernels check them on the
device inside launches the call makes anyway (see ``kernels/decode.py``): a call with a bad
index writes nothing into the caches and its output is NaN where the index was used.  The
verdict goes to an error record in a ring of pinned host memory (:class:`_Ring`), written by
the kernel itself, and the host reads it without waiting:

* ``async`` (default): the record of a call is read at a later call on the same device (the
  first one that finds it written, oldest first), which raises
  :class:`flashtile.FlashtileInputError` naming the earlier call's bad argument, row and value
  before it launches anything, or by :func:`check_errors` (``flashtile.check_kvcache_errors``),
  which waits.  At most ``_Ring.SLOTS`` records are outstanding: a call that finds the ring full
  waits for the oldest one;
* ``sync``: the call waits for its own record (spinning on it, not on the attention kernels)
  and raises before returning, as flash-attn does;
* ``off`` (or ``FLASHTILE_CHECK_INDICES=0``): no check, no record; the kernels' guards still
  keep every access inside the cache.

Inside CUDA-graph capture the call gets a record slot of its own (none is read while
capturing): a replay that finds a bad index writes it, and :func:`check_errors` reports it.
"""
from __future__ import annotations

import functools
import math
import threading
import time

import torch
from .. import env_reader
from .. import interpreting
from ..._validate import MAX_SPLITS, FlashtileInputError, kvcache_error_message
from .kernels.decode import (RECORD_DONE, _check_kernel, _combine_kernel, _rotary_append_kernel,
                             _split_kv_kernel)
from . import fastlaunch
from .fastlaunch import empty as _alloc
from .fastlaunch import launch as _launch

__all__ = ["decode", "decode_forward", "record_decode", "merge_states", "combine",
           "choose_num_splits", "default_num_splits", "num_sms", "attn_config", "check_mode",
           "check_errors", "MAX_SPLITS"]

# a split should stream at least this many keys, or its fixed cost (q load, partial store,
# combine read) outweighs the parallelism it buys
MIN_KEYS_PER_SPLIT = 256
# the default of choose_num_splits: 256 keys in tiles of 64
MIN_TILES_PER_SPLIT = 4

# Bytes of K and V tiles one pipeline stage holds (three stages in flight).  A program alone on
# its SM keeps 192 KB of keys and values in flight; where two programs share an SM each keeps
# half.  Decode only streams K and V, so the bytes in flight set its speed: on the H200 (4.8
# TB/s) 32 KB a stage for a lone program (64-key tiles at d = 128) reached 0.88-1.00x cuDNN's
# speed, 64 KB (128-key tiles) 0.997-1.04x (docs/dev/tuning-log.md, step 142).
STAGE_BYTES_ALONE = 64 * 1024
STAGE_BYTES_SHARED = 32 * 1024
# shared memory the pipelined K/V tiles and the query tile may take (an H100 / H200 block can
# have 227 KB)
SMEM_BUDGET = 208 * 1024
# pipeline depth where pages cut the tiles short (more stages of smaller tiles)
MAX_STAGES = 6
# how full the last wave of an unsplit grid must be (programs over the slots its SMs hold) for
# it to run unsplit where the 16-programs-an-SM rule would cut it: H200, d = 128 bf16, batch 48
# at 4K keys (384 programs, 396 slots) 1.03x cuDNN unsplit against 0.97x in 5 splits, batch 96
# (1.94 waves) 0.995x against 0.97x; unsplit grids of 1.13-1.62 or 2.26-2.59 waves ran
# 0.83-0.97x, slower than split (docs/dev/tuning-log.md, step 147)
FULL_WAVE = 0.9
# d = 64 in 16-bit types: the 256-key tiles of a program alone on its SM only where the
# programs before splitting fill at most 1/NARROW_ALONE of the SMs (batch 1 at 8 KV heads);
# more programs take 128-key tiles, about two an SM after splitting: H200, batch 2 / 4 / 16 at
# 4K-16K 0.93-1.11x cuDNN against 0.85-1.01x, batch 8 level (docs/dev/tuning-log.md, step 149)
NARROW_ALONE = 16


def _on_gpu(x: torch.Tensor) -> bool:
    """Compiled kernels (True) or the interpreter (False) run for tensors like ``x``."""
    return x.device.type == "cuda"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_props(index: int) -> tuple:
    """``(SMs, shared memory of one SM in bytes)`` of CUDA device ``index`` (0 bytes where
    PyTorch does not say)."""
    props = torch.cuda.get_device_properties(index)
    return (props.multi_processor_count,
            int(getattr(props, "shared_memory_per_multiprocessor", 0)))


def _device_sms(device: torch.device):
    """:func:`_sm_props` of ``device``, or None where it is not a CUDA device."""
    if device.type != "cuda":
        return None
    return _sm_props(device.index if device.index is not None else torch.cuda.current_device())


def sm_shared_bytes(device: torch.device) -> int:
    """Shared memory of one SM of ``device`` in bytes; 0 for anything that is not a CUDA
    device (or where PyTorch does not say)."""
    props = _device_sms(device)
    return 0 if props is None else props[1]


def resident_programs(block_m: int, block_n: int, block_d: int, stages: int, elt: int,
                      sm_bytes: int) -> int:
    """How many split-KV programs of a contiguous cache one SM of ``sm_bytes`` shared memory
    holds at once (0 where ``sm_bytes`` is unknown): Triton's pipeline keeps ``stages - 1``
    K and V tiles in shared memory, beside the query tile and the probabilities' tile on its
    way to ``P @ V`` (``block_m x block_n``), and the driver reserves 1 KB a block.  The
    compiled kernels take exactly that much (H200, every tile of d = 64 / 128 / 256; a GPU test
    compares them) and fewer than 128 registers a thread, so shared memory is what limits."""
    if not sm_bytes:
        return 0
    per = ((stages - 1) * 2 * block_n * block_d + block_m * block_d + block_m * block_n) * elt
    return sm_bytes // (per + 1024)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 1 for anything that is not a CUDA device."""
    props = _device_sms(device)
    return 1 if props is None else props[0]


def attn_config(on_gpu: bool, head_dim: int, rows: int, dtype: torch.dtype, page_size: int = 0,
                alone: bool = False) -> dict:
    """Block shapes of the split-KV kernel.

    ``rows = seqlen_q * (nheads // nheads_k)`` query rows share each K/V tile; up to 64 of
    them go into one program (``BLOCK_M``, at least 16 for ``tl.dot``).  ``BLOCK_N`` keys per
    tile: as many as make one stage's K and V tiles ``STAGE_BYTES_ALONE`` (``alone``: each
    program has an SM to itself) or ``STAGE_BYTES_SHARED``, three stages deep, within
    ``SMEM_BUDGET``.  Through a block table (``page_size`` slots a page) a tile inside one
    page looks its page up once, any other tile per key: a page smaller than the tile cuts
    ``BLOCK_N`` to the largest power of two dividing it where that is 64 or more, with up to
    ``MAX_STAGES`` stages keeping the bytes in flight; smaller pages (16 or 32 slots) get
    64-key tiles (32 at d = 256) whose pages are looked up per key.
    """
    block_m, block_n, block_d, warps, stages = _attn_config(bool(on_gpu), int(head_dim),
                                                            int(rows), dtype, int(page_size),
                                                            bool(alone))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps,
                num_stages=stages)


def _block_m(rows: int) -> int:
    """Query rows of a program: all ``rows`` of a K/V head up to 64, at least 16."""
    return min(64, max(16, _next_pow2(rows)))


def _tile_keys(stage_bytes: int, block_d: int, elt: int) -> int:
    """Keys of a K (and a V) tile of ``block_d``-wide rows that together take ``stage_bytes``:
    a power of two in [16, 256]."""
    return max(16, min(256, stage_bytes // (2 * block_d * elt)))


@functools.lru_cache(maxsize=1024)
def _attn_config(on_gpu: bool, head_dim: int, rows: int, dtype: torch.dtype, page_size: int = 0,
                 alone: bool = False) -> tuple:
    """``(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages)``; see :func:`attn_config`."""
    block_d = max(16, _next_pow2(head_dim))
    block_m = _block_m(rows)
    if not on_gpu:
        # the interpreter runs every program in numpy: small tiles keep splits meaningful on
        # short test caches
        return block_m, 16, block_d, 1, 1
    elt = dtype.itemsize
    shared = _tile_keys(STAGE_BYTES_SHARED, block_d, elt)
    block_n = _tile_keys(STAGE_BYTES_ALONE if alone else STAGE_BYTES_SHARED, block_d, elt)
    stages = 3
    if page_size and page_size % block_n:
        # a tile inside one page looks it up once: the largest power of two dividing the page,
        # with more stages keeping the bytes in flight (64-slot pages at d = 128: 6 stages of
        # 64 keys 0.92-0.98x cuDNN, 3 stages 0.83-0.86x); for pages of 16 or 32 slots,
        # per-key lookups of 64-key tiles (32 at d = 256) cost less than tiles that small
        fits = page_size & -page_size
        if fits >= 64:
            stages = min(MAX_STAGES, 3 * block_n // fits)
            block_n = fits
        else:
            block_n = min(shared, 64)
    q_bytes = block_m * block_d * elt

    def smem(n, st):
        return st * 2 * n * block_d * elt + q_bytes

    # a query tile of 64 rows (a chunk of queries, or a large group) leaves less room
    while stages > 3 and smem(block_n, stages) > SMEM_BUDGET:
        stages -= 1
    while block_n > 16 and smem(block_n, stages) > SMEM_BUDGET:
        block_n //= 2
    warps = 8 if block_m * block_d >= 64 * 256 else 4
    return block_m, block_n, block_d, warps, stages


@functools.lru_cache(maxsize=4096)
def choose_num_splits(n_programs: int, n_sms: int, n_tiles: int, max_splits: int = MAX_SPLITS,
                      paged: bool = False, per_key_pages: bool = False,
                      min_tiles: int = MIN_TILES_PER_SPLIT, resident: int = 0,
                      two_per_sm: bool = False) -> int:
    """How many slices to cut each row's keys into so that the grid fills the GPU.

    ``n_programs``: programs without splitting (batch * kv heads * query blocks);
    ``n_tiles``: key tiles of a full cache row; ``paged``: the keys are read through a block
    table; ``per_key_pages``: pages are smaller than a key tile, so the kernel looks the page up
    for every key (``PAGE_SIZE % BLOCK_N != 0``).  Rules (measured on the H100, d=128 bf16,
    with 64-key tiles, and kept on the H200 with the tiles of step 142; docs/dev/tuning-log.md),
    always keeping ``min_tiles`` tiles per split (the launcher passes the tiles of
    ``MIN_KEYS_PER_SPLIT`` keys):

    * fewer programs than ``per_sm`` waves of SMs (``per_sm = 1``, or 2 for a paged cache and
      with ``two_per_sm``; batch 1-2 at 8 KV heads): the most splits that still fit,
      ``n_programs * splits <= per_sm * n_sms``.  For a contiguous cache at d = 128 one program
      per SM streaming a long slice beat two per SM (batch 1, 16K: 16 splits 5% faster than
      33); a paged cache needs the second program per SM to hide the page-table lookups
      (batch 8, 16K: 2 splits 25% slower than 4), and so do the 128-key tiles of d = 64
      (``two_per_sm``; :data:`NARROW_ALONE`);
    * up to two programs per SM (batch 16-32): no split, the grid already fills every SM once
      and the combine would only add work;
    * more (batch 64): programs that each stream a whole row run in uneven waves, and the last
      one leaves SMs idle; about 16 programs per SM even that out (batch 64: 4 splits, 8%
      faster than none).  Not for pages smaller than a tile: there the per-key page lookups
      of the extra programs cost more than the waves (batch 64, 16-slot pages: no split 5%
      faster than 4 at 16K and 64K).  Nor where the unsplit grid's last wave fills at least
      ``FULL_WAVE`` of the program slots (``resident`` programs an SM, contiguous caches; 0:
      unknown): there the waves are already even (batch 48 and 96 at 8 KV heads on 132 SMs
      of three slots, H200: 5-7% faster unsplit at 4K keys, within 2% at 16K).

    Memoised: a decode loop asks for the same shapes every step.
    """
    if n_sms <= 1:
        return 1
    cap = min(max_splits, max(1, n_tiles // max(1, min_tiles)))
    per_sm = 2 if paged or two_per_sm else 1
    if n_programs < 0.8 * per_sm * n_sms:
        return max(1, min(cap, per_sm * n_sms // n_programs))
    if n_programs <= 2 * n_sms or per_key_pages:
        return 1
    if resident and not paged:
        waves = n_programs / (resident * n_sms)
        if math.ceil(waves) - waves <= 1 - FULL_WAVE:
            return 1
    return max(1, min(cap, (16 * n_sms) // n_programs))


def default_num_splits(q: torch.Tensor, nheads_k: int, capacity: int, page_size: int = 0) -> int:
    """The split count ``num_splits=0`` resolves to for query ``q (B, Sq, H, D)`` against a
    cache of ``nheads_k`` heads and ``capacity`` key slots per row (read through a block table
    of ``page_size``-slot pages; 0: a contiguous cache)."""
    b, sq, h, d = q.shape
    return _plan(_on_gpu(q), d, sq, h // nheads_k, q.dtype, b, nheads_k, capacity,
                 num_sms(q.device), 0, page_size, sm_shared_bytes(q.device))[-1]


@functools.lru_cache(maxsize=4096)
def _plan(on_gpu: bool, head_dim: int, seqlen_q: int, group: int, dtype: torch.dtype, batch: int,
          nheads_k: int, capacity: int, n_sms: int, num_splits: int, page_size: int = 0,
          sm_bytes: int = 0) -> tuple:
    """Launch shape of the split-KV kernel for one call signature (memoised):
    ``(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages, m_blocks, num_splits)``, with
    ``num_splits <= 0`` resolved by :func:`choose_num_splits` (``page_size`` 0: a contiguous
    cache).  Where the programs before splitting fit on the SMs one each (batch x KV heads x
    query blocks <= SMs; at d = 64 in 16-bit types on a contiguous cache, a
    ``NARROW_ALONE``-th of the SMs) the tiles are those of a program alone on its SM
    (:func:`attn_config`), whatever the split count.  ``sm_bytes``: an SM's shared memory
    (:func:`sm_shared_bytes`; 0 unknown), for the programs an SM holds
    (:func:`resident_programs`)."""
    rows = seqlen_q * group
    m_blocks = _cdiv(rows, _block_m(rows))
    programs = batch * nheads_k * m_blocks
    # d = 64 in 16-bit types on a contiguous cache: alone only for the fewest programs
    narrow = (on_gpu and not page_size and dtype.itemsize == 2
              and max(16, _next_pow2(head_dim)) == 64)
    alone = on_gpu and programs * (NARROW_ALONE if narrow else 1) <= n_sms
    block_m, block_n, block_d, warps, stages = _attn_config(on_gpu, head_dim, rows, dtype,
                                                            page_size, alone)
    if num_splits <= 0:
        num_splits = choose_num_splits(programs, n_sms, _cdiv(capacity, block_n),
                                       paged=page_size > 0,
                                       per_key_pages=page_size > 0 and page_size % block_n != 0,
                                       min_tiles=max(1, MIN_KEYS_PER_SPLIT // block_n),
                                       resident=resident_programs(block_m, block_n, block_d,
                                                                  stages, dtype.itemsize,
                                                                  sm_bytes),
                                       two_per_sm=narrow and not alone)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    return block_m, block_n, block_d, warps, stages, m_blocks, num_splits


# --------------------------------------------------------------------------------------------
# Index checks: the mode, and the error records
# --------------------------------------------------------------------------------------------
CHECK_MODES = ("async", "sync", "off")


_check_env = env_reader("FLASHTILE_KVCACHE_CHECK")
_check_indices_env = env_reader("FLASHTILE_CHECK_INDICES")


def check_mode() -> str:
    """``FLASHTILE_KVCACHE_CHECK``: ``async`` (default), ``sync`` or ``off``; unset, the older
    ``FLASHTILE_CHECK_INDICES=0`` means ``off``."""
    mode = _check_env()
    if not mode:
        return "off" if _check_indices_env() == "0" else "async"
    if mode in CHECK_MODES:
        return mode
    raise ValueError(f"FLASHTILE_KVCACHE_CHECK={mode!r}: expected one of {', '.join(CHECK_MODES)}")


_DONE = RECORD_DONE.value  # status word of a written record: _DONE + error code


class _Ring:
    """The error records of one device: ``SLOTS`` slots reused in turn by eager calls, then
    ``GRAPH_SLOTS`` slots given for good to calls captured in CUDA graphs.

    A slot is four int32 ``(status, index, value, -)`` in pinned host memory (plain memory for
    the interpreter's CPU tensors), which the kernels write directly.  ``status`` is 0 until
    the check has run, then ``_DONE + code``.  Eager call ``seq`` uses slot ``seq % SLOTS``: it
    clears the status, launches, and its record is pending until a later call finds it
    written.  The pending records are the calls ``oldest .. seq - 1``: retiring one is a counter
    increment, and a record the host has settled (reported by a ``sync`` call, or of a call
    whose launches failed) is marked written-without-error (``_DONE``) so the others never
    wait for it."""

    SLOTS = 256
    GRAPH_SLOTS = 4096  # a model captures one call per layer; slots are not given back

    def __init__(self, device: torch.device):
        self.device = device
        total = self.SLOTS + self.GRAPH_SLOTS
        self.buf = torch.zeros((total, 4), dtype=torch.int32, pin_memory=device.type == "cuda")
        self.words = self.buf.numpy()
        # the status word of slot s is status[4 * s]: a flat view that reads and writes single
        # words at Python-int speed (the per-call path)
        self.status = memoryview(self.words).cast("B").cast("i")
        self.views = [self.buf[i] for i in range(total)]
        # each slot's address, which is also its device address (unified addressing): launch
        # plans pass it as is, sparing the launcher a pointer query
        self.addrs = [self.buf.data_ptr() + self.buf.stride(0) * 4 * i for i in range(total)]
        self.infos: list = [None] * self.SLOTS  # the message facts of each eager slot's call
        self.seq = self.oldest = 0  # the next call; the oldest call whose record is pending
        self.graphs: list = []  # (slot, info) of captured calls
        self.lock = threading.Lock()
        # the interpreter runs every kernel before the launch returns: a record still unwritten
        # at the next call was never launched
        self.synchronous = device.type != "cuda"

    # ---- eager calls
    def begin(self, info) -> tuple:
        """Raise the errors of earlier calls that are already recorded; then a cleared slot for
        a new call, ``(seq, slot)``, pending (waiting for the oldest record when the ring is
        full)."""
        with self.lock:
            status, slots, seq, oldest = self.status, self.SLOTS, self.seq, self.oldest
            # retire the written records (usually the previous call's), inline: this runs on
            # every eager decode call, where the host is the bottleneck at batch 1
            while oldest < seq:
                word = status[4 * (oldest % slots)]
                if word == _DONE or (word == 0 and self.synchronous):
                    oldest += 1
                elif word == 0:
                    break
                else:
                    self.oldest = oldest
                    self._raise_written()  # an error: retire in order and raise
            self.oldest = oldest
            while seq - self.oldest >= slots:  # full: wait for the oldest record
                first = self.oldest % slots
                if not self._wait(first):
                    status[4 * first] = _DONE  # never written: its launch did not happen
                self._raise_written()
            slot = seq % slots
            status[4 * slot] = 0
            self.infos[slot] = info
            self.seq = seq + 1
            return seq, slot

    def pending(self) -> list:
        """The calls whose records are pending, oldest first."""
        return list(range(self.oldest, self.seq))

    def _settle(self, seq: int) -> None:
        """Mark call ``seq``'s record written without error, if it is still pending."""
        if self.oldest <= seq < self.seq:
            self.status[4 * (seq % self.SLOTS)] = _DONE

    def drop(self, seq: int) -> None:
        """Forget the record of a call whose launches failed."""
        with self.lock:
            self._settle(seq)

    def finish_sync(self, seq: int, slot: int, info) -> None:
        """Wait for the record of call ``seq`` (``sync`` mode) and raise its error."""
        with self.lock:
            written = self._wait(slot)
            word = self.status[4 * slot] if written else 0
            error = None
            if word not in (0, _DONE):
                error = self._error([(slot, word - _DONE, info)], "")
            self._settle(seq)  # reported here: a later call does not report it again
            if error is not None:
                raise error

    def _wait(self, slot: int) -> bool:
        """Until the record in ``slot`` is written (True), spinning on its status word and
        letting other threads run; after 0.1 s the device is synchronised instead, and a record
        still unwritten then was never launched (False)."""
        status, i = self.status, 4 * slot
        if status[i] != 0:
            return True
        if self.synchronous:
            return False
        deadline = time.perf_counter() + 0.1
        while status[i] == 0:
            if time.perf_counter() > deadline:
                torch.cuda.synchronize(self.device)
                return status[i] != 0
            time.sleep(0)
        return True

    def _raise_written(self) -> None:
        """Retire the pending records that are written, oldest first, up to the first one that
        is not; raise the first error among them."""
        errors = []
        status, slots = self.status, self.SLOTS
        while self.oldest < self.seq:
            slot = self.oldest % slots
            word = status[4 * slot]
            if word == 0 and not self.synchronous:
                break
            self.oldest += 1
            if word not in (0, _DONE):
                errors.append((slot, word - _DONE, self.infos[slot]))
        if errors:
            raise self._error(errors, "earlier")

    # ---- captured calls
    def begin_graph(self, info):
        """A slot of its own for a call being captured (None once they are used up)."""
        with self.lock:
            if len(self.graphs) >= self.GRAPH_SLOTS:
                return None
            slot = self.SLOTS + len(self.graphs)
            self.words[slot, 0] = 0
            self.graphs.append((slot, info))
            return slot

    # ---- everything
    def check(self) -> None:
        """Wait for the device, retire every pending record and collect the captured calls'
        errors; raise the first error found."""
        with self.lock:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            errors = []
            while self.oldest < self.seq:
                slot = self.oldest % self.SLOTS
                self.oldest += 1
                word = self.status[4 * slot]
                if word not in (0, _DONE):
                    errors.append((slot, word - _DONE, self.infos[slot]))
            graph_errors = []
            if self.graphs:
                written = self.words[self.SLOTS:self.SLOTS + len(self.graphs), 0]
                for i in written.nonzero()[0].tolist():
                    slot, info = self.graphs[i]
                    graph_errors.append((slot, int(written[i]) - _DONE, info))
            if errors:
                raise self._error(errors + graph_errors, "checked")
            if graph_errors:
                raise self._error(graph_errors, "graph")

    def _error(self, errors: list, when: str) -> FlashtileInputError:
        """The exception for ``errors`` ``[(slot, code, info), ...]`` (the first is described);
        clears the slots of captured calls so that a later replay can report again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # index and value are written before status
        slot, code, info = errors[0]
        msg = kvcache_error_message(code, int(self.words[slot, 1]), int(self.words[slot, 2]),
                                    *info)
        for s, _, _ in errors:
            if s >= self.SLOTS:
                self.words[s, 0] = 0
        if when == "":
            return FlashtileInputError(msg)
        what = ("a replay of a flash_attn_with_kvcache call captured in a CUDA graph"
                if slot >= self.SLOTS else "an earlier flash_attn_with_kvcache call")
        text = (f"{what} on {self.device} had an invalid index: {msg}.  That call wrote nothing "
                "into the caches and its output holds NaN where the index was used")
        if len(errors) > 1:
            text += f" ({len(errors) - 1} more call(s) had invalid indices too)"
        if when == "earlier":
            text += "; this call did not run"
        return FlashtileInputError(text)


_RINGS: dict = {}
_RINGS_LOCK = threading.Lock()


def _ring(device: torch.device) -> _Ring:
    ring = _RINGS.get(device)
    if ring is None:
        with _RINGS_LOCK:
            ring = _RINGS.get(device)
            if ring is None:
                ring = _RINGS[device] = _Ring(device)
    return ring


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _begin(device: torch.device, mode: str, info: tuple):
    """The record of a new call: ``(ring, slot, rec_sticky, handle)``, ``slot`` None when there
    is none (checks off, or no slot left for a captured call).  Raises the errors that earlier
    calls on ``device`` recorded."""
    if mode == "off":
        return None, None, 0, None
    if _capturing(device):
        # nothing can be read while capturing; pinned memory is not allocated then either
        ring = _RINGS.get(device)
        slot = ring.begin_graph(info) if ring is not None else None
        return ring, slot, 1, None
    ring = _ring(device)
    seq, slot = ring.begin(info)
    return ring, slot, 0, (ring, seq, slot, mode == "sync", info)


def _end(handle) -> None:
    if handle is not None and handle[3]:
        handle[0].finish_sync(handle[1], handle[2], handle[4])


def _abandon(handle) -> None:
    if handle is not None:
        handle[0].drop(handle[1])


def check_errors(device: torch.device | None = None) -> None:
    """Wait for the decode calls issued so far on ``device`` (every device with records when
    None) and raise the first index error they recorded, including those of CUDA-graph
    replays (see ``flashtile.check_kvcache_errors``)."""
    rings = list(_RINGS.values()) if device is None else [r for d, r in list(_RINGS.items())
                                                          if d == device]
    for ring in rings:
        ring.check()


# --------------------------------------------------------------------------------------------
# Launch plans of eager calls
# --------------------------------------------------------------------------------------------
# An eager decode step cost ~100-140 us of host time on the H100 machine against ~30 us of GPU
# time at batch 1 (docs/dev/tuning-log.md): validation, the heuristics, ~50 kernel
# arguments per launch rebuilt from the same shapes.  A call runs once inside
# ``fastlaunch.recording`` (the recorder the forward and the backward use: every allocation and
# every direct launch is noted); :func:`record_plan` turns that into a :class:`Plan` that
# replays the call for new tensors of the same signature (see ``flashtile.kvcache``): allocate
# the outputs, put the caller's tensors, the outputs, scratch addresses and a new error record
# in their argument slots, launch the same compiled kernels.  Decode keeps its own replay
# (``fastlaunch.Plan`` has no place for the per-call error record).
def _go(kernel, grid, **kwargs) -> None:
    """``kernel[grid](**kwargs)`` (every argument and launch option by name), noted by the
    call's ``fastlaunch.recording``."""
    _launch(kernel, grid, **kwargs)


# A replay's buffers that it does not return (the split-KV partials, the append's verdict, a
# rotated q) are used only between the call's own launches, in stream order.  One region per
# (device, stream, thread), shared by every plan and reused by every replay of that thread on
# that stream, holds them: the next replay's first write comes after this one's last read.  (Per
# thread: two threads replaying on one stream could interleave their launches.)  It saves their
# allocations (a torch.empty costs ~5 us of host time on the H100 machine; a batch-1 step made
# four).  A call needing more than SCRATCH_LIMIT bytes allocates its own region.
SCRATCH_LIMIT = 64 << 20
SCRATCH_ALIGN = 256  # every buffer's offset: the 16-byte alignment its kernels were compiled for
SCRATCH_REGIONS = 64  # regions kept (a region is only ever replaced by its own thread); past
# that, replays of new (device, stream, thread) keys allocate their own
_SCRATCH: dict = {}  # (device index, raw stream, thread) -> (uint8 tensor, its address)


def _scratch(device: torch.device, index, stream, nbytes: int) -> tuple:
    """``(address, tensor to keep alive until the launches are queued)`` of ``nbytes`` of
    scratch for a replay on ``stream`` by this thread."""
    if nbytes > SCRATCH_LIMIT:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf.data_ptr(), buf
    key = (index, stream, threading.get_ident())
    held = _SCRATCH.get(key)
    if held is None or held[0].numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if held is None and len(_SCRATCH) >= SCRATCH_REGIONS:
            return buf.data_ptr(), buf
        # a region replaced returns to the allocator on its stream: stream order keeps its
        # pending reads before any later use
        held = _SCRATCH[key] = (buf, buf.data_ptr())
    return held[1], None


class Plan:
    """A recorded eager call: the outputs to allocate, then launches whose arguments are the
    addresses of the call's inputs (by position), of those outputs, in the stream's scratch
    region (:func:`_scratch`) and of the call's error record (``fastlaunch.addresses``).

    ``allocs``: per buffer of the call, ``(shape, dtype, None)`` for ``out`` and ``lse`` (fresh
    tensors) or ``(None, None, offset)`` for a scratch buffer; ``launches``: ``(function,
    argument template, [(position, pool, index)])`` (``fastlaunch.bind``)."""

    __slots__ = ("allocs", "launches", "out", "lse", "device", "stream_device", "mode", "info",
                 "ring", "scratch_bytes")

    def __init__(self, allocs, launches, out, lse, device, mode, info, scratch_bytes):
        self.allocs, self.launches, self.out, self.lse = allocs, launches, out, lse
        self.device = device
        self.mode, self.info = mode, info  # the check mode and the record's message facts
        self.scratch_bytes = scratch_bytes
        # launches go to the current device's stream, as the direct launches they replay did
        # (the plan key holds the current device)
        self.stream_device = torch.cuda.current_device() if device.type == "cuda" else None
        # the device's error records (replays are never captured: see run)
        self.ring = _ring(device) if mode != "off" else None

    def run(self, inputs: tuple):
        """``(out, lse)`` for ``inputs`` (same signature as the recorded call, outside CUDA-graph
        capture), or None when a profiler hook asks for Triton's own launch path (nothing is
        launched then)."""
        if fastlaunch.launch_hooks_set():
            return None
        ring, seq, slot = self.ring, None, None
        if ring is not None:  # _begin's eager branch, without its lookups
            seq, slot = ring.begin(self.info)
        dev = self.stream_device
        stream = fastlaunch.raw_stream(dev) if dev is not None else None
        base = held = None
        if self.scratch_bytes:
            base, held = _scratch(self.device, dev, stream, self.scratch_bytes)
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) if off is None else base + off
                for shape, dtype, off in self.allocs]
        out, lse = bufs[self.out], bufs[self.lse]
        pools = (fastlaunch.addresses(inputs), fastlaunch.addresses(bufs),
                 (ring.addrs[slot] if slot is not None else None,))
        try:
            for function, template, slots in self.launches:
                args = template.copy()
                args[fastlaunch.STREAM_ARG] = stream
                for pos, kind, j in slots:
                    args[pos] = pools[kind][j]
                function(*args)
        except BaseException:
            if ring is not None:
                ring.drop(seq)
            raise
        del held  # queued: the allocator keeps a region freed now for this stream's later use
        if ring is not None and self.mode == "sync":
            ring.finish_sync(seq, slot, self.info)
        return out, lse


def record_plan(inputs: tuple, call):
    """Run ``call()`` (a :func:`decode_forward` on ``inputs``) while recording; returns
    ``(its result, a Plan or None)``.  No plan when a launch was not direct, when a kernel got a
    tensor that is neither one of ``inputs``, a buffer of the call nor its error record (a
    converted copy), or when one tensor is passed as two inputs (a later call of the same
    signature may pass two)."""
    with fastlaunch.recording() as rec:
        out, lse = call()
    note = rec.note or {}
    slots = {id(t): (0, i) for i, t in enumerate(inputs) if t is not None}
    if len(slots) != sum(t is not None for t in inputs):
        return (out, lse), None
    slots.update({id(t): (1, j) for j, t in enumerate(rec.allocs)})
    if note.get("slot") is not None:
        slots[id(note["slot"])] = (2, 0)
    launches = []
    for _, grid, launched in rec.launches:
        if launched is None or len(launched) != 2:  # (a Gluon launch: descriptors)
            return (out, lse), None
        compiled, values = launched
        template, where = list(values), []
        for pos, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                slot = slots.get(id(v))
                if slot is None:
                    return (out, lse), None
                template[pos] = None
                where.append((pos, *slot))
        launches.append(fastlaunch.bind_slots(compiled, grid, template, where))
    if not launches or slots.get(id(out), (0,))[0] != 1 or slots.get(id(lse), (0,))[0] != 1:
        return (out, lse), None
    allocs, offset = [], 0
    for t in rec.allocs:
        if t is out or t is lse:
            allocs.append((tuple(t.shape), t.dtype, None))
        else:
            allocs.append((None, None, offset))
            offset += -(-t.numel() * t.element_size() // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return (out, lse), Plan(allocs, launches, slots[id(out)][1], slots[id(lse)][1], out.device,
                            note.get("mode", "off"), note.get("info"), offset)


# --------------------------------------------------------------------------------------------
# launches
# --------------------------------------------------------------------------------------------
def _check_runnable(x: torch.Tensor) -> None:
    if not _on_gpu(x) and not interpreting():
        raise RuntimeError(
            f"the triton decode kernels cannot run on {x.device.type} tensors; set "
            "TRITON_INTERPRET=1 (before triton kernels are imported) to emulate them, or use "
            "FLASHTILE_BACKEND=torch")


# The append decides the call's verdict in every one of its programs (no launch of its own)
# while programs x batch x (block-table columns + 4) index reads stay under this budget (a
# decode step up to batch ~16 with 16K-key caches of 16-slot pages); larger appends (long
# chunks, large batches) run the one-program check kernel first.
FUSED_CHECK_BUDGET = 1 << 18


@functools.lru_cache(maxsize=1024)
def _scan_blocks(batch: int, n_cols: int) -> tuple[int, int]:
    """``(BLOCK_B, BLOCK_C)``: rows and block-table columns the index check reads at once."""
    block_b = min(64, _next_pow2(max(batch, 1)))
    block_c = max(16, min(_next_pow2(max(n_cols, 1)), 4096 // block_b))
    return block_b, block_c


def _index_args(seqlens, leftpad, batch_idx, block_table, *, batch, n_cols, capacity, cache_rows,
                page_size) -> dict:
    """The index tensors and the facts every checking kernel takes, by name."""
    block_b, block_c = _scan_blocks(batch, n_cols)
    return dict(SEQLENS=seqlens, LEFTPAD=leftpad, BATCH_IDX=batch_idx, BLOCK_TABLE=block_table,
                batch=batch, stride_btb=block_table.stride(0) if block_table is not None else 0,
                n_cols=n_cols, capacity=capacity, cache_rows=cache_rows, PAGE_SIZE=page_size,
                BLOCK_B=block_b, BLOCK_C=block_c)


def _check(err, slot, sticky, index_args: dict, *, seqlen_new, rotary_need):
    """The check kernel (one program): ``err[0]`` and the record ``slot``."""
    _go(_check_kernel, (1,), ERR=err, REC=slot, rec_sticky=sticky, seqlen_new=seqlen_new,
        rotary_need=rotary_need, num_warps=4 if _on_gpu(index_args["SEQLENS"]) else 1,
        **index_args)


def _rotary_append(x, y, xo, yo, cos, sin, index_args: dict, *, err, slot, sticky, check,
                   rotary_dim, interleaved, per_token, to_cache, seqlen_new, rotary_need):
    """Rotate ``x`` (with rotary tables) and write it with ``y`` to ``xo``/``yo``: the cache
    (``to_cache``; ``check``: every program decides the call's verdict, program 0 publishes it
    to ``err`` and ``slot``) or a fresh buffer."""
    b, t, h, d = x.shape
    block_d = max(16, _next_pow2(d))
    block_h = min(_next_pow2(h), max(1, 4096 // block_d))
    args = dict(index_args)
    if not to_cache:
        args.update(LEFTPAD=None, BATCH_IDX=None, BLOCK_TABLE=None, stride_btb=0, n_cols=0,
                    PAGE_SIZE=1)
    sx = x.stride()
    sy = y.stride() if y is not None else (0, 0, 0, 0)
    sxo = xo.stride()
    syo = yo.stride() if yo is not None else (0, 0, 0, 0)
    _go(_rotary_append_kernel, (t, b, _cdiv(h, block_h)),
        X=x, Y=y, XO=xo, YO=yo, COS=cos, SIN=sin, ERR=err, REC=slot,
        stride_xb=sx[0], stride_xs=sx[1], stride_xh=sx[2],
        stride_yb=sy[0], stride_ys=sy[1], stride_yh=sy[2],
        stride_xob=sxo[0], stride_xos=sxo[1], stride_xoh=sxo[2],
        stride_yob=syo[0], stride_yos=syo[1], stride_yoh=syo[2],
        stride_cos=cos.stride(0) if cos is not None else 0,
        stride_sin=sin.stride(0) if sin is not None else 0,
        nheads=h, head_dim=d, seqlen_ro=int(cos.shape[0]) if cos is not None else 0,
        seqlen_new=seqlen_new, rotary_need=rotary_need, rec_sticky=sticky,
        ROTARY_DIM=rotary_dim, INTERLEAVED=bool(interleaved), PER_TOKEN=bool(per_token),
        TO_CACHE=bool(to_cache), CHECK=bool(check), BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if _on_gpu(x) else 1, **args)


def merge_states(out_a, lse_a, out_b, lse_b):
    """``flashtile.merge_attention_states`` on validated inputs (the backend protocol's
    ``merge_states``): the combine kernel over the two stacked partial results."""
    b, s, h, d = out_a.shape
    o_part = torch.stack([out_a, out_b]).contiguous()
    l_part = torch.stack([lse_a.float(), lse_b.float()]).contiguous()
    out = torch.empty((b, s, h, d), dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=out_a.device)
    combine(o_part, l_part, out, lse)
    return out, lse


def _decode_call(a, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes, rotary_interleaved):
    return decode_forward(
        a.q, k_cache, v_cache, a.k, a.v, rotary_cos, rotary_sin, a.cache_seqlens,
        a.cache_batch_idx, a.cache_leftpad, a.block_table, softmax_scale=a.softmax_scale,
        window_left=a.window_left, window_right=a.window_right, softcap=a.softcap,
        rotary_interleaved=rotary_interleaved, rotary_q_per_token=a.rotary_q_per_token,
        alibi_slopes=alibi_slopes, num_splits=a.num_splits, tree_mask=a.tree_mask)


def decode(a, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes, rotary_interleaved: bool):
    """``flash_attn_with_kvcache`` on a validated call (``flashtile.backends.spec.KVCacheSpec``):
    the backend protocol's ``decode``.  Returns ``(out, lse)``; raises ``FlashtileInputError``
    for a bad index value of this call (``sync`` mode) or of an earlier one (``async``)."""
    return _decode_call(a, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes,
                        rotary_interleaved)


def record_decode(inputs: tuple, a, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes,
                  rotary_interleaved: bool):
    """:func:`decode`, recorded: ``((out, lse), Plan or None)`` (see :func:`record_plan`;
    ``inputs`` are the caller's tensors, in the order a later :meth:`Plan.run` gets them)."""
    return record_plan(inputs, lambda: _decode_call(a, k_cache, v_cache, rotary_cos, rotary_sin,
                                                    alibi_slopes, rotary_interleaved))


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor) -> None:
    """LSE-combine ``n`` partial results into ``out``/``lse`` (written in place).

    ``o_part``: ``(n, B, Sq, H, D)`` (any float dtype, last dim contiguous); ``lse_part``:
    ``(n, B, H, Sq)`` float32 with contiguous last dim; ``out``: ``(B, Sq, H, D)``;
    ``lse``: ``(B, H, Sq)`` float32 with contiguous last dim.  A NaN partial lse makes its row
    NaN.
    """
    _check_runnable(out)
    if any(x.stride(-1) != 1 for x in (lse_part, lse, o_part, out)):
        raise ValueError("combine: the last dimension of every tensor must be contiguous")
    _merge(o_part, lse_part, out, lse)


def _merge(o_part, lse_part, out, lse) -> None:
    """The combine launch of :func:`combine`, for arguments already known to be valid."""
    n, b, sq, h, d = o_part.shape
    if b * sq * h == 0:
        return
    block_s = max(2, _next_pow2(n))
    block_d = max(16, _next_pow2(d))
    warps = 4 if block_s * block_d <= 8192 else 8
    sop, slp, sout, slse = o_part.stride(), lse_part.stride(), out.stride(), lse.stride()
    _go(_combine_kernel, (b * sq * h,),
        O_PART=o_part, LSE_PART=lse_part, O=out, LSE=lse,
        stride_ops=sop[0], stride_opb=sop[1], stride_opm=sop[2], stride_oph=sop[3],
        stride_lps=slp[0], stride_lpb=slp[1], stride_lph=slp[2],
        stride_ob=sout[0], stride_om=sout[1], stride_oh=sout[2],
        stride_lb=slse[0], stride_lh=slse[1],
        seqlen_q=sq, nheads=h, n_splits=n, head_dim=d,
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps if _on_gpu(out) else 1)


def decode_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None,
    *,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    rotary_q_per_token: bool,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
    tree_mask: torch.Tensor | None,
):
    """Append (with rotary), attend and combine.  Returns ``(out (B, Sq, H, D), lse (B, H, Sq))``.

    ``cache_seqlens``: int32 ``(B,)`` lengths before the append; ``tree_mask``: bool
    ``(B | 1, Sq, Sq)``; ``num_splits = 0`` picks the count with :func:`choose_num_splits`.
    Launches: the append (only with new k/v; it checks the index values), the q rotation (only
    with rotary tables), the split-KV kernel (it checks them when nothing is appended), and the
    combine (only when there is more than one split); the check kernel only before an append
    too large to check them itself (:data:`FUSED_CHECK_BUDGET`).  Raises
    ``FlashtileInputError`` for an earlier call's bad index (``async`` mode, before launching)
    or this call's (``sync``, after).
    """
    on_gpu = _on_gpu(q)
    if not on_gpu:
        _check_runnable(q)
    b, sq, h, d = q.shape
    hk = k_cache.shape[2]
    paged = block_table is not None
    page_size = int(k_cache.shape[1]) if paged else 1
    capacity = int(block_table.shape[1]) * int(k_cache.shape[1]) if paged else int(k_cache.shape[1])
    seqlen_new = 0 if k is None else int(k.shape[1])
    cache_rows = int(k_cache.shape[0])  # cache rows, or pages of a paged cache
    n_cols = int(block_table.shape[1]) if paged else 0
    seqlen_ro = int(rotary_cos.shape[0]) if rotary_cos is not None else 0
    span = max(seqlen_new, sq if rotary_q_per_token else 1)
    info = (paged, seqlen_new, capacity, n_cols, page_size, cache_rows, seqlen_ro, span)
    mode = check_mode() if b > 0 else "off"  # no rows: nothing is read or written
    ring, slot, sticky, handle = _begin(q.device, mode, info)
    slot = ring.views[slot] if slot is not None else None
    rec = fastlaunch.recorder()
    if rec is not None:
        rec.note = dict(slot=slot, mode=mode, info=info)
    try:
        res = _launch_all(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, slot, sticky, checking=mode != "off", on_gpu=on_gpu,
            hk=hk, paged=paged, page_size=page_size, capacity=capacity, seqlen_new=seqlen_new,
            cache_rows=cache_rows, n_cols=n_cols,
            rotary_need=seqlen_ro - span if rotary_cos is not None else 1 << 30,
            softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
            softcap=softcap, rotary_interleaved=rotary_interleaved,
            rotary_q_per_token=rotary_q_per_token, alibi_slopes=alibi_slopes,
            num_splits=num_splits, tree_mask=tree_mask)
    except BaseException:
        _abandon(handle)
        raise
    _end(handle)
    return res


def _launch_all(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, slot, sticky, *, checking, on_gpu,
                hk, paged, page_size, capacity, seqlen_new, cache_rows, n_cols, rotary_need,
                softmax_scale, window_left, window_right, softcap, rotary_interleaved,
                rotary_q_per_token, alibi_slopes, num_splits, tree_mask):
    """The launches of :func:`decode_forward`; with ``checking``, one of them writes the record
    ``slot`` (eager: always; captured, ``sticky``: on an error)."""
    b, sq, h, d = q.shape
    group = h // hk
    device = q.device
    index = _index_args(cache_seqlens, cache_leftpad, cache_batch_idx, block_table, batch=b,
                        n_cols=n_cols, capacity=capacity, cache_rows=cache_rows,
                        page_size=page_size)

    err = None  # the verdict of an appending call, for its later kernels
    if seqlen_new > 0:
        rot_dim = int(rotary_cos.shape[1]) * 2 if rotary_cos is not None else 0
        fused = False
        if checking:
            err = _alloc((1,), torch.int32, device)
            block_h = min(_next_pow2(hk), max(1, 4096 // max(16, _next_pow2(d))))
            programs = seqlen_new * b * _cdiv(hk, block_h)
            fused = programs * b * (n_cols + 4) <= FUSED_CHECK_BUDGET
            if not fused:
                _check(err, slot, sticky, index, seqlen_new=seqlen_new, rotary_need=rotary_need)
        _rotary_append(k, v, k_cache, v_cache, rotary_cos, rotary_sin, index, err=err,
                       slot=slot if fused else None, sticky=sticky, check=fused,
                       rotary_dim=rot_dim, interleaved=rotary_interleaved, per_token=True,
                       to_cache=True, seqlen_new=seqlen_new, rotary_need=rotary_need)
    if rotary_cos is not None:
        q_rot = _alloc(q.shape, q.dtype, device)
        _rotary_append(q, None, q_rot, None, rotary_cos, rotary_sin, index, err=None, slot=None,
                       sticky=0, check=False, rotary_dim=int(rotary_cos.shape[1]) * 2,
                       interleaved=rotary_interleaved, per_token=rotary_q_per_token,
                       to_cache=False, seqlen_new=seqlen_new, rotary_need=rotary_need)
        q = q_rot

    # NaN-filled under fastlaunch.poison_outputs, so tests see any element left unwritten
    out = _alloc((b, sq, h, d), q.dtype, device)
    lse = _alloc((b, h, sq), torch.float32, device)
    # without an append, the split-KV kernel checks the index values (and writes the record)
    split_check = checking and seqlen_new == 0
    if b * sq * h == 0:
        if split_check:  # nothing attends: the record still has to be written
            _check(None, slot, sticky, index, seqlen_new=0, rotary_need=rotary_need)
        return out, lse

    block_m, block_n, block_d, warps, stages, m_blocks, num_splits = _plan(
        on_gpu, d, sq, group, q.dtype, b, hk, capacity, num_sms(device), int(num_splits),
        page_size if paged else 0, sm_shared_bytes(device))

    if num_splits == 1:
        o_part, lse_part = out, lse
        s_out, s_lse = out.stride(), lse.stride()
        so = (0, s_out[0], s_out[1], s_out[2])
        sl = (0, s_lse[0], s_lse[1])
    else:
        o_part = _alloc((num_splits, b, sq, h, d), torch.float32, device)
        lse_part = _alloc((num_splits, b, h, sq), torch.float32, device)
        so = o_part.stride()
        sl = lse_part.stride()

    tree_u8 = None
    stb = stq = 0
    if tree_mask is not None:
        tree_u8 = (tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool
                   else tree_mask.to(torch.uint8))
        if tree_u8.stride(2) != 1:
            tree_u8 = tree_u8.contiguous()
        stb = tree_u8.stride(0) if tree_u8.shape[0] > 1 else 0
        stq = tree_u8.stride(1)
    stride_ab = 0
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        stride_ab = alibi_slopes.stride(0)

    split_slot = slot if split_check else None
    # with a record to write, one extra program checks the call alongside the attention
    grid = (b * hk * num_splits * m_blocks + (1 if split_slot is not None else 0),)
    s_q, s_k, s_v = q.stride(), k_cache.stride(), v_cache.stride()
    _go(_split_kv_kernel, grid,
        Q=q, K=k_cache, V=v_cache, O=o_part, LSE=lse_part, ALIBI=alibi_slopes, TREE=tree_u8,
        ERR=err, REC=split_slot,
        stride_qb=s_q[0], stride_qs=s_q[1], stride_qh=s_q[2],
        stride_kb=s_k[0], stride_ks=s_k[1], stride_kh=s_k[2],
        stride_vb=s_v[0], stride_vs=s_v[1], stride_vh=s_v[2],
        stride_osplit=so[0], stride_ob=so[1], stride_os=so[2], stride_oh=so[3],
        stride_lsplit=sl[0], stride_lb=sl[1], stride_lh=sl[2],
        stride_ab=stride_ab, stride_tb=stb, stride_tq=stq,
        seqlen_q=sq, seqlen_new=seqlen_new, nheads_k=hk, head_dim=d, rec_sticky=sticky,
        softmax_scale=float(softmax_scale), softcap=float(softcap),
        window_left=int(window_left), window_right=int(window_right), n_splits=num_splits,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", CHECK=split_check,
        num_warps=warps, num_stages=stages, **index)
    if num_splits > 1:
        _merge(o_part, lse_part, out, lse)
    return out, lse
