"""The end-to-end demo: a realistic paged, block-sparse problem run on every backend and checked.

The problem looks like a serving step: B sequences of different KV lengths, one of them decoding
a single token and the others prefilling chunks, their pages scattered over a physical cache in a
random order with holes (unmapped pages), spare pages and the tail past each ``L_b`` filled with
NaN (R10: never read), built with ``paged_sparse_attn.testing.generate``. Blocks are picked by the
index branch (the query's own "local" block always included). The forward is causal (R9).

Every backend's ``(out, lse)`` is compared with ``dense_reference``
(float64) to a tolerance derived from the dtype (R20). This module needs only numpy; the command
line (``paged-sparse-attn demo``) renders its ``DemoReport``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from . import _api, reference, registry
from ._index import query_positions
from .backends.base import Backend
from .errors import PagedSparseAttnError, SpecError, UnsupportedError
from .testing import generate
from .testing.assertions import tolerance as r20_tolerance

__all__ = [
    "DemoSizes",
    "DemoProblem",
    "BackendResult",
    "DemoReport",
    "tolerance",
    "make_problem",
    "run_demo",
]


@dataclass(frozen=True)
class DemoSizes:
    """Sizes of the demo problem (defaults: a few seconds with the float64 reference).

    Attributes
    ----------
    seqs : int
        B, the number of sequences.
    max_len : int
        The longest KV length; the others are drawn from ``[max_len // 4, max_len]``.
    queries : int
        Tq, the packed queries of all sequences (sequence 0 decodes one token).
    q_heads, kv_heads, head_dim : int
        Hq, Hkv (Hq % Hkv == 0) and D.
    page_size, block_size : int
        S and BS (a multiple of S).
    topk : int
        Blocks selected per query and KV head.
    dtype : str
        ``"float32"`` or ``"float16"`` for q and the caches.
    """

    seqs: int = 3
    max_len: int = 1024
    queries: int = 48
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    block_size: int = 64
    topk: int = 4
    dtype: str = "float32"

    def check(self) -> None:
        """Raise SpecError (with the rule id) for sizes no problem can have."""
        def fail(msg: str, rule: str) -> SpecError:
            return SpecError(f"demo: {msg} [{rule}]", rule)

        for name in ("seqs", "max_len", "q_heads", "kv_heads", "head_dim", "page_size", "block_size"):
            if getattr(self, name) < 1:
                raise fail(f"{name} must be >= 1, got {getattr(self, name)}", "R1" if "head" in name else "R5")
        if self.queries < 0 or self.topk < 0:
            raise fail(f"queries and topk must be >= 0, got {self.queries} and {self.topk}", "R6")
        if self.q_heads % self.kv_heads:
            raise fail(f"q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}", "R1")
        if self.block_size % self.page_size:
            raise fail(f"block_size={self.block_size} must be a multiple of page_size={self.page_size}", "R5")
        if self.dtype not in ("float32", "float16"):
            raise fail(f"dtype must be float32 or float16, got {self.dtype!r}", "R7")


@dataclass(frozen=True, eq=False)
class DemoProblem:
    """A demo problem: the arguments of ``forward()`` plus what it shows."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    block_tables: np.ndarray
    selected: np.ndarray
    cu_seqlens_q: np.ndarray
    used_kv_lens: np.ndarray
    block_size: int
    selection: str  # how the blocks were chosen, in words
    attended: int  # sum over (t, h) of |A(t, h)| (R9)
    visible: int  # sum over (t, h) of the mapped positions causal attention could see
    holes: int  # unmapped pages inside the sequences' lengths
    causal: bool = True

    @property
    def lens(self) -> list[int]:
        """L_b of every sequence."""
        return [int(x) for x in self.used_kv_lens]

    @property
    def queries_per_seq(self) -> list[int]:
        """T_b of every sequence."""
        return [int(x) for x in np.diff(self.cu_seqlens_q)]

    @property
    def density(self) -> float:
        """Attended tokens / causal-visible tokens (what the sparse selection keeps)."""
        return self.attended / self.visible if self.visible else 0.0

    def forward_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``forward`` / ``dense_reference``."""
        return dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache, block_tables=self.block_tables,
                    selected=self.selected, cu_seqlens_q=self.cu_seqlens_q, used_kv_lens=self.used_kv_lens,
                    block_size=self.block_size, causal=self.causal)


@dataclass
class BackendResult:
    """One backend's run: ``status`` is ``"ok"``, ``"mismatch"``, ``"error"`` or ``"unsupported"``."""

    name: str
    status: str
    out_err: float | None = None
    lse_err: float | None = None
    out_tol: float | None = None
    lse_tol: float | None = None
    time_ms: float | None = None  # median of the timed runs (after one warm-up run)
    first_ms: float | None = None  # the first (cold) run: includes pipeline compilation on GPUs
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "error")


@dataclass
class DemoReport:
    """Everything the demo found; ``ok`` is False if any backend disagreed or failed."""

    sizes: DemoSizes
    seed: int
    selection: str
    attended: int
    visible: int
    holes: int
    lens: list[int]
    queries_per_seq: list[int]
    num_pages: int
    reference_s: float
    results: list[BackendResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # unavailable backends -> why

    @property
    def density(self) -> float:
        return self.attended / self.visible if self.visible else 0.0

    @property
    def ok(self) -> bool:
        return bool(self.results) and not any(r.failed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["density"] = self.density
        d["ok"] = self.ok
        return d


def tolerance(dtype: Any) -> float:
    """Relative tolerance against the float64 reference for inputs of ``dtype`` (R20).

    The conformance kit's tolerance (``paged_sparse_attn.testing.tolerance``): a multiple of
    the unit roundoff of the least precise dtype involved, never below float32's. Errors are
    compared with ``tolerance * max(1, max |reference|)``.
    """
    return r20_tolerance(dtype).out


# --------------------------------------------------------------------------------------------
# the problem


def _split_queries(rng: np.random.Generator, total: int, seqs: int) -> list[int]:
    """T_b per sequence: sequence 0 decodes one token, the others share the rest at random."""
    if seqs == 1:
        return [total]
    first = min(1, total)
    cuts = np.sort(rng.integers(0, total - first + 1, size=seqs - 2))
    rest = np.diff(np.concatenate([[0], cuts, [total - first]])).tolist()
    return [first, *[int(x) for x in rest]]


def make_problem(sizes: DemoSizes = DemoSizes(), seed: int = 0,
                 select: Callable[..., tuple[np.ndarray, str]] | None = None) -> DemoProblem:
    """Build a random paged, causal, block-sparse problem.

    Parameters
    ----------
    sizes : DemoSizes
    seed : int
        Seed of ``numpy.random.default_rng``: the same seed gives the same problem.
    select : callable, optional
        ``select(q, k_cache, block_tables, cu_seqlens_q, used_kv_lens, *, block_size, topk, rng)``
        returning ``(selected [Tq, Hkv, topk], description)``; default ``choose_blocks``.

    Returns
    -------
    DemoProblem
    """
    sizes.check()
    rng = np.random.default_rng(seed)
    B, S, BS, D = sizes.seqs, sizes.page_size, sizes.block_size, sizes.head_dim
    Hq, Hkv = sizes.q_heads, sizes.kv_heads
    ppb = BS // S
    msb = -(-sizes.max_len // BS)
    max_pages = msb * ppb

    T = _split_queries(rng, sizes.queries, B)
    lens = [sizes.max_len]
    for b in range(1, B):
        lo = min(sizes.max_len, max(T[b], sizes.max_len // 4, 1))
        lens.append(int(rng.integers(lo, sizes.max_len + 1)))
    used = np.array(lens, dtype=np.int32)
    cu = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)

    # Logical pages inside L_b are mapped except ~1 in 8 (holes: evicted or never written);
    # pages past L_b stay unmapped (-1). Physical ids are a random permutation with spare pages.
    inside = [-(-L // S) for L in lens]
    block_tables, P, holes = generate.page_tables(rng, inside, max_pages, hole_prob=0.125,
                                                  spare_pages=max(2, sum(inside) // 8))

    dt = np.dtype(sizes.dtype)
    k_cache, v_cache = generate.normal_caches(rng, (P, Hkv, S, D), dt)
    q = rng.standard_normal((sizes.queries, Hq, D), dtype=np.float32).astype(dt)
    # Memory that must never be read (R10): spare pages and each sequence's tail past L_b.
    spare = np.setdiff1d(np.arange(P), block_tables[block_tables >= 0])
    k_cache[spare] = np.nan
    v_cache[spare] = np.nan
    for b in range(B):
        last = (lens[b] - 1) // S
        if lens[b] % S and block_tables[b, last] >= 0:
            k_cache[block_tables[b, last], :, lens[b] % S:] = np.nan
            v_cache[block_tables[b, last], :, lens[b] % S:] = np.nan

    select = select or choose_blocks
    selected, how = select(q, k_cache, block_tables, cu, used, block_size=BS, topk=sizes.topk, rng=rng)
    attended, visible = _count_tokens(selected, block_tables, cu, used, block_size=BS, page_size=S)
    return DemoProblem(q, k_cache, v_cache, block_tables, selected, cu, used, BS, how, attended, visible, holes)


def choose_blocks(q, k_cache, block_tables, cu_seqlens_q, used_kv_lens, *, block_size: int, topk: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """Blocks chosen by the index branch (block scores, top-k with the local block forced).

    The demo has no trained index projections: the index query of (t, h) is the mean of the
    queries of KV head h's group and the index keys are the keys. The selection is computed once,
    on the numpy backend, so every backend attends the same blocks.
    """
    from .index_branch import block_scores, select_topk

    Tq, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    index_q = q.astype(np.float32).reshape(Tq, Hkv, Hq // Hkv, D).mean(axis=2).astype(q.dtype)
    scores = block_scores(index_q, k_cache, block_tables, cu_seqlens_q, used_kv_lens, block_size=block_size,
                          causal=True, backend="numpy")
    sel = select_topk(scores, topk, force_local=topk > 0, cu_seqlens_q=cu_seqlens_q, used_kv_lens=used_kv_lens,
                      block_size=block_size, backend="numpy")
    return sel, "chosen by the index branch (block_scores + select_topk, local block forced)"


def _count_tokens(selected, block_tables, cu_seqlens_q, used_kv_lens, *, block_size, page_size) -> tuple[int, int]:
    """(attended, visible): sum over (t, h) of |A(t, h)| and of the mapped causal-visible positions."""
    index = _api.build_kvouter_index(selected, block_tables, cu_seqlens_q, used_kv_lens,
                                     block_size=block_size, page_size=page_size, causal=True)
    B, max_pages = block_tables.shape
    n = max_pages * page_size
    pos = np.arange(n)
    mapped = (np.repeat(block_tables >= 0, page_size, axis=1) & (pos[None, :] < used_kv_lens[:, None]))
    cum = np.zeros((B, n + 1), dtype=np.int64)
    np.cumsum(mapped, axis=1, out=cum[:, 1:])
    b, start = index.edge_seq.astype(np.int64), index.edge_block.astype(np.int64) * block_size
    attended = int((cum[b, start + index.edge_len] - cum[b, start]).sum())
    seq, hi = query_positions(index.cu_seqlens_q, index.used_kv_lens, True)
    visible = int(cum[seq, np.clip(hi, 0, n)].sum()) * selected.shape[1]
    return attended, visible


# --------------------------------------------------------------------------------------------
# the run


def _compare(out, lse, ref_out, ref_lse, tol: float) -> tuple[float, float, float, float]:
    """Max |out - ref| and |lse - ref| (inf on NaN or a -inf mismatch) and their tolerances."""
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        return math.inf, math.inf, 0.0, 0.0
    out_err = float(np.max(np.abs(out - ref_out), initial=0.0))
    if not np.isfinite(out).all():
        out_err = math.inf
    empty = np.isneginf(ref_lse)
    if (np.isneginf(lse) != empty).any() or np.isnan(lse).any():
        lse_err = math.inf
    else:
        lse_err = float(np.max(np.abs(lse[~empty] - ref_lse[~empty]), initial=0.0))
    out_tol = tol * max(1.0, float(np.max(np.abs(ref_out), initial=0.0)))
    lse_tol = tol * max(1.0, float(np.max(np.abs(ref_lse[~empty]), initial=0.0)))
    return out_err, lse_err, out_tol, lse_tol


def _targets(backends: Sequence[str | Backend] | None) -> tuple[list[tuple[str, str | Backend]], dict[str, str]]:
    """(label, backend) pairs to run and the unavailable backends with their reasons.

    None: the default backend and every available registered one. Otherwise exactly those asked
    for (an unavailable one raises BackendUnavailableError, with the reason).
    """
    if backends:
        out = []
        for b in backends:
            be = registry.get_backend(b)  # raises with the reason and how to fix it (R18)
            out.append((b if isinstance(b, str) else be.name, be))
        return out, {}
    default = registry.get_backend(None)
    out: list[tuple[str, str | Backend]] = [(f"{default.name} (default)", default)]
    skipped = {}
    for name, avail in registry.list_backends().items():
        if not avail.ok:
            skipped[name] = avail.reason
            continue
        try:
            be = registry.get_backend(name)
        except PagedSparseAttnError as exc:
            skipped[name] = str(exc)
            continue
        if be is not default:
            out.append((name, be))
    return out, skipped


def run_demo(sizes: DemoSizes = DemoSizes(), *, seed: int = 0, backends: Sequence[str | Backend] | None = None,
             repeat: int = 3) -> DemoReport:
    """Run the demo problem on backends and check each against the float64 reference.

    Parameters
    ----------
    sizes : DemoSizes
    seed : int
    backends : sequence of str or Backend, optional
        Backends to run; default: the default backend and every available one.
    repeat : int
        Timed runs per backend after the first (whose time is reported separately).

    Returns
    -------
    DemoReport
        ``report.ok`` is False if any backend disagreed with the reference or failed.

    Raises
    ------
    SpecError
        Sizes that no problem can have.
    BackendUnavailableError
        A backend asked for by name is unknown or cannot run here.
    """
    sizes.check()  # before any backend starts a device
    targets, skipped = _targets(backends)
    prob = make_problem(sizes, seed)
    kw = prob.forward_kwargs()
    t0 = time.perf_counter()
    ref_out, ref_lse = reference.dense_reference(**kw)
    report = DemoReport(sizes, seed, prob.selection, prob.attended, prob.visible, prob.holes, prob.lens,
                        prob.queries_per_seq, int(prob.k_cache.shape[0]), time.perf_counter() - t0,
                        skipped=skipped)
    tol = tolerance(sizes.dtype)
    explicit = bool(backends)
    for label, be in targets:
        res = BackendResult(label, "ok")
        try:
            t0 = time.perf_counter()
            out, lse = _api.forward(**kw, backend=be, return_lse=True)
            res.first_ms = 1e3 * (time.perf_counter() - t0)
            times = []
            for _ in range(max(0, repeat)):
                t0 = time.perf_counter()
                _api.forward(**kw, backend=be, return_lse=True)
                times.append(1e3 * (time.perf_counter() - t0))
            res.time_ms = statistics.median(times) if times else res.first_ms
        except UnsupportedError as exc:
            # a backend found by discovery may not run this dtype; one asked for by name must
            res.status, res.message = ("error" if explicit else "unsupported"), str(exc)
        except Exception as exc:  # report every backend, then fail
            res.status, res.message = "error", f"{type(exc).__name__}: {exc}"
        else:
            res.out_err, res.lse_err, res.out_tol, res.lse_tol = _compare(out, lse, ref_out, ref_lse, tol)
            if not (res.out_err <= res.out_tol and res.lse_err <= res.lse_tol):
                res.status = "mismatch"
                res.message = (f"max |out - ref| = {res.out_err:.3g} (tol {res.out_tol:.3g}), "
                               f"max |lse - ref| = {res.lse_err:.3g} (tol {res.lse_tol:.3g})")
        report.results.append(res)
    return report
