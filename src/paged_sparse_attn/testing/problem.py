"""Plain records for generated problems: one valid forward problem, one invalid call.

No hypothesis here: these records are what the strategies return and what the property tests,
the conformance kit and hand-written tests pass around.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["AttentionProblem", "InvalidCall", "FORWARD_ARGS", "to_layout"]

# The arguments of psa.forward / psa.dense_reference, in order (all may be passed by keyword).
FORWARD_ARGS = ("q", "k_cache", "v_cache", "block_tables", "selected", "cu_seqlens_q",
                "used_kv_lens", "block_size", "softmax_scale", "causal", "kv_layout")


def to_layout(cache: Any, kv_layout: str) -> Any:
    """A logical ``[P, Hkv, S, D]`` cache as the array a caller holds in ``kv_layout`` (R34):
    itself for ``"HND"``, its ``[P, S, Hkv, D]`` transpose (C-contiguous) for ``"NHD"``."""
    if kv_layout != "NHD" or not isinstance(cache, np.ndarray) or cache.ndim != 4:
        return cache
    return np.ascontiguousarray(cache.transpose(0, 2, 1, 3))


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """A complete, valid forward problem (R1-R8): the arguments of ``forward()``.

    Attributes
    ----------
    q : ndarray [Tq, Hq, D]
    k_cache, v_cache : ndarray [P, Hkv, S, D]
        The logical caches, ``[P, Hkv, S, D]`` whatever ``kv_layout`` (so tests index them one
        way); the calls (``kwargs``, ``forward``, ``reference``) pass them in ``kv_layout``.
    block_tables : ndarray int32 [B, max_pages]
    selected : ndarray int32 [Tq, Hkv, topk]
    cu_seqlens_q : ndarray int32 [B + 1]
    used_kv_lens : ndarray int32 [B] or None
        None means the R4 default ``msb * block_size``.
    block_size : int
    softmax_scale : float or None
    causal : bool
    values : str
        How the float data were made (e.g. ``"normal(seed=3)"``): with the index arrays shown by
        ``repr`` it is enough to rebuild the problem from a failure report.
    poisoned_cells : int
        Cache cells no query attends that hold NaN / +Inf / -Inf (R10), 0 for none
        (``generate.poison_unattended``).
    kv_layout : str
        The page layout the calls pass the caches in (R34): ``"HND"`` or ``"NHD"``.
    """

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    block_tables: np.ndarray
    selected: np.ndarray
    cu_seqlens_q: np.ndarray
    used_kv_lens: np.ndarray | None
    block_size: int
    softmax_scale: float | None = None
    causal: bool = False
    values: str = field(default="", compare=False)
    poisoned_cells: int = field(default=0, compare=False)
    kv_layout: str = "HND"

    # --- sizes -------------------------------------------------------------------------------
    @property
    def num_queries(self) -> int:
        return int(self.q.shape[0])

    @property
    def num_q_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[2])

    @property
    def num_pages(self) -> int:
        return int(self.k_cache.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_cache.shape[1])

    @property
    def page_size(self) -> int:
        return int(self.k_cache.shape[2])

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def pages_per_block(self) -> int:
        return self.block_size // self.page_size

    @property
    def msb(self) -> int:
        return int(self.block_tables.shape[1]) // self.pages_per_block

    @property
    def topk(self) -> int:
        return int(self.selected.shape[2])

    @property
    def kv_lens(self) -> np.ndarray:
        """``used_kv_lens`` with the R4 default filled in, int64 [B]."""
        if self.used_kv_lens is None:
            return np.full(self.num_seqs, self.msb * self.block_size, dtype=np.int64)
        return np.asarray(self.used_kv_lens, dtype=np.int64)

    @property
    def scale(self) -> float:
        """The effective softmax scale (R8 default ``1 / sqrt(D)``)."""
        if self.softmax_scale is None:
            return 1.0 / float(np.sqrt(self.head_dim))
        return float(self.softmax_scale)

    @property
    def dtypes(self) -> tuple[np.dtype, np.dtype]:
        """``(q.dtype, cache dtype)``: what tolerances are derived from (R20)."""
        return (np.dtype(self.q.dtype), np.dtype(self.k_cache.dtype))

    @property
    def seq_of_query(self) -> np.ndarray:
        """Sequence b of every packed query, int64 [Tq]."""
        counts = np.diff(np.asarray(self.cu_seqlens_q, dtype=np.int64))
        return np.repeat(np.arange(self.num_seqs, dtype=np.int64), counts)

    # --- calls -------------------------------------------------------------------------------
    def kwargs(self) -> dict[str, Any]:
        """Every argument of ``forward`` / ``dense_reference`` by keyword, the caches in
        ``kv_layout`` (R34)."""
        kw = {name: getattr(self, name) for name in FORWARD_ARGS}
        kw["k_cache"], kw["v_cache"] = to_layout(self.k_cache, self.kv_layout), to_layout(self.v_cache, self.kv_layout)
        return kw

    @property
    def args(self) -> tuple:
        """The positional arguments of ``forward``: ``(q, k_cache, v_cache, block_tables,
        selected, cu_seqlens_q)``."""
        return tuple(getattr(self, name) for name in FORWARD_ARGS[:6])

    @property
    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``forward`` after ``args``: ``used_kv_lens``, ``block_size``,
        ``softmax_scale``, ``causal``."""
        return {name: getattr(self, name) for name in FORWARD_ARGS[6:]}

    def replace(self, **changes: Any) -> AttentionProblem:
        """A copy with some fields replaced (arrays are not copied)."""
        return dataclasses.replace(self, **changes)

    def copy(self) -> AttentionProblem:
        """A deep copy (writable arrays), e.g. to poison a cache."""
        return self.replace(**{n: np.array(getattr(self, n)) for n in
                               ("q", "k_cache", "v_cache", "block_tables", "selected", "cu_seqlens_q")},
                            used_kv_lens=None if self.used_kv_lens is None else np.array(self.used_kv_lens))

    def forward(self, backend: Any = None, **changes: Any) -> tuple[np.ndarray, np.ndarray]:
        """``psa.forward(..., return_lse=True)`` on ``backend``; ``changes`` replace fields first."""
        import paged_sparse_attn as psa

        p = self.replace(**changes) if changes else self
        return psa.forward(**p.kwargs(), backend=backend, return_lse=True)

    def reference(self, **changes: Any) -> tuple[np.ndarray, np.ndarray]:
        """``psa.dense_reference(...)`` (float64 oracle); ``changes`` replace fields first."""
        import paged_sparse_attn as psa

        p = self.replace(**changes) if changes else self
        return psa.dense_reference(**p.kwargs())

    def tolerance(self, **changes: Any):
        """The derived R20 tolerance of this problem (``assertions.problem_tolerance``)."""
        from .assertions import problem_tolerance

        p = self.replace(**changes) if changes else self
        return problem_tolerance(**p.kwargs())

    def build_index(self):
        """``psa.build_kvouter_index`` for this problem (R13)."""
        import paged_sparse_attn as psa

        return psa.build_kvouter_index(self.selected, self.block_tables, self.cu_seqlens_q,
                                       self.used_kv_lens, block_size=self.block_size,
                                       page_size=self.page_size, causal=self.causal)

    def __repr__(self) -> str:
        def arr(a: Any) -> str:
            return "None" if a is None else repr(np.asarray(a).tolist())

        return (
            f"AttentionProblem(Tq={self.num_queries}, Hq={self.num_q_heads}, Hkv={self.num_kv_heads}, "
            f"D={self.head_dim}, P={self.num_pages}, S={self.page_size}, block_size={self.block_size}, "
            f"msb={self.msb}, topk={self.topk}, q={np.dtype(self.q.dtype).name}, "
            f"cache={np.dtype(self.k_cache.dtype).name}, causal={self.causal}, "
            f"softmax_scale={self.softmax_scale!r}, values={self.values!r}, kv_layout={self.kv_layout!r},\n"
            f"    cu_seqlens_q={arr(self.cu_seqlens_q)}, used_kv_lens={arr(self.used_kv_lens)},\n"
            f"    block_tables={arr(self.block_tables)},\n"
            f"    selected={arr(self.selected)})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis' failure report
        printer.text(repr(self))


@dataclass(frozen=True, eq=False)
class InvalidCall:
    """The arguments of a ``forward`` call that break exactly one rule (R17).

    Attributes
    ----------
    kwargs : dict
        Every argument of ``forward`` / ``dense_reference`` by keyword (some may not even be
        arrays: a list, a string, a NaN scale).
    rule : str
        The rule id the call violates, e.g. ``"R6"``; the SpecError must carry it.
    what : str
        The violation in words, e.g. ``"selected[2, 0, 1] = 4 >= msb=4"``.
    base : AttentionProblem, optional
        The valid problem the violation was made from.
    """

    kwargs: dict[str, Any]
    rule: str
    what: str
    base: AttentionProblem | None = None

    def __repr__(self) -> str:
        return f"InvalidCall(rule={self.rule!r}, what={self.what!r}, base={self.base!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis' failure report
        printer.text(repr(self))
