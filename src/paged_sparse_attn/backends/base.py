"""The Backend interface every backend implements.

A backend receives problems that are already validated (R1-R8, R17) and an index already built
(R13); it never re-defines semantics, it only computes them. The API layer checks the backend's
``Capabilities`` before calling it (R18).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from .._types import AttentionInputs, Availability, Capabilities, KVOuterIndex, Partials
from ..errors import UnsupportedError

if TYPE_CHECKING:  # for annotations only: index_branch imports this module
    from .._types import IndexProblem, TopkProblem

__all__ = ["Backend"]


class Backend(ABC):
    """Abstract backend.

    Subclasses set [`name`][paged_sparse_attn.Backend.name], implement
    [`probe`][paged_sparse_attn.Backend.probe], [`capabilities`][paged_sparse_attn.Backend.capabilities]
    and [`forward_partials`][paged_sparse_attn.Backend.forward_partials]; they may override
    [`forward`][paged_sparse_attn.Backend.forward] (e.g. to keep partials on the device) and
    [`combine_partials`][paged_sparse_attn.Backend.combine_partials]. A backend that runs the
    index branch (R21-R25) overrides [`block_scores`][paged_sparse_attn.Backend.block_scores] and
    [`select_topk`][paged_sparse_attn.Backend.select_topk].
    Everything a backend returns is checked by the API for shape and dtype before use
    (``paged_sparse_attn._outputs``).
    """

    name: ClassVar[str] = "abstract"
    """The name the backend is registered and chosen by (``backend="numpy"``)."""
    description: ClassVar[str] = ""
    """Plugin metadata: one line saying what the backend is and runs on."""
    url: ClassVar[str] = ""
    """Plugin metadata: where its documentation lives."""

    @classmethod
    def probe(cls) -> Availability:
        """Report whether this backend can run here. Must never raise."""
        return Availability(True, "ok")

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend instance can run (dtypes, limits, features)."""

    @abstractmethod
    def forward_partials(self, problem: AttentionInputs, index: KVOuterIndex) -> Partials:
        """Compute the R14 partials of every (edge, query head in group).

        Parameters
        ----------
        problem : AttentionInputs
            Validated ``q``, caches and ``softmax_scale`` (a ``Problem`` from ``forward``, whose
            selection the backend does not need: the edges are the index's).
        index : KVOuterIndex
            The R13 index; ``index.layout is problem.layout``.

        Returns
        -------
        Partials
            ``o`` [E, G, D], ``m`` [E, G], ``l`` [E, G], float32, in index edge order.
        """

    def combine_partials(self, partials: Partials, index: KVOuterIndex) -> tuple[np.ndarray, np.ndarray]:
        """Merge partials into ``out`` [Tq, Hq, D] and ``lse`` [Tq, Hq] (R15). Default: numpy."""
        from .._combine import combine_partials_numpy

        return combine_partials_numpy(partials, index)

    def forward(self, problem: AttentionInputs, index: KVOuterIndex) -> tuple[np.ndarray, np.ndarray]:
        """Full forward: partials then combine. Returns ``(out, lse)``, float32.

        ``problem`` is the ``Problem`` of ``forward()`` or ``sparse_attention()``; ``index`` its R13
        index (``index.layout is problem.layout``).
        """
        from .._outputs import checked_partials

        # the partials never reach the API here: checked before the combine reads them
        parts = checked_partials(self, "forward", self.forward_partials(problem, index), index.num_edges,
                                 problem.group_size, problem.head_dim)
        return self.combine_partials(parts, index)

    # Index branch (R21-R25). Backends that declare ``index_branch`` override these; the API
    # never calls them on a backend that does not (R18).
    def block_scores(self, problem: IndexProblem) -> np.ndarray:
        """Score every block for every (query, KV head) (R22).

        Parameters
        ----------
        problem : IndexProblem
            Validated inputs of [`block_scores`][paged_sparse_attn.index_branch.block_scores]
            (R21).

        Returns
        -------
        ndarray float32 [Tq, Hkv, msb]
            Max over each block's visible positions of ``softmax_scale * index_q . index_k``;
            ``-inf`` where no position is visible; NaN where a visible product is NaN. The API
            layer checks the shape and dtype before returning it.

        Raises
        ------
        UnsupportedError
            The default: this backend does not implement the index branch (R18).
        """
        raise UnsupportedError(f"backend {self.name!r} does not implement block_scores [R18]")

    def select_topk(self, problem: TopkProblem) -> np.ndarray:
        """Exp-free top-k of every (query, KV head) row of block scores (R24).

        Parameters
        ----------
        problem : TopkProblem
            Validated inputs of [`select_topk`][paged_sparse_attn.index_branch.select_topk] (R23).

        Returns
        -------
        ndarray int32 [Tq, Hkv, topk]
            Per row: the forced local block first (with ``force_local``), then the other blocks
            by descending score, ties to the lower block id; ``-1`` padding at the end. NaN and
            ``-inf`` scores are never selected (the forced local block excepted). The API layer
            checks the result before returning it.

        Raises
        ------
        UnsupportedError
            The default: this backend does not implement the index branch (R18).
        """
        raise UnsupportedError(f"backend {self.name!r} does not implement select_topk [R18]")

    def plans_forward(self, problem: AttentionInputs) -> bool:
        """Whether ``forward()`` runs ``problem`` through a cached plan of this backend (R32).

        ``problem`` is a ``Problem``, or the ``AttentionInputs`` of ``sparse_attention()`` before
        its selection exists: the answer must not depend on the selection.
        Default False: ``forward()`` builds the index and calls ``forward``.
        """
        return False

    def make_runtime(self, layout):
        """What this backend prepares for a planned batch layout (R32), or None.

        None (the default): the plan runs each layer through ``forward`` (the R13 index built on
        the host). A backend with device work to set up once (buffers, pipelines) returns a
        runtime with ``run``, ``run_sparse``, ``kvouter_index``, ``update`` and ``close``; its
        ``run`` / ``run_sparse`` may return ``NotImplemented`` for a call it leaves to that plain
        path (the plan then takes it).
        """
        return None

    def synchronize(self) -> None:
        """Wait until every call this backend has accepted has finished on its device (R35).

        Copies nothing to the host and raises no R31 error (a device-resident selection's
        violation is raised by the first readback of its results). The default, for backends
        that compute on the host before they return: nothing to wait for.
        """

    def close(self) -> None:
        """Release device resources. The default has none."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
