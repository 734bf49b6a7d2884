"""The Backend interface every backend implements.

A backend receives problems that are already validated (R1-R8, R17) and an index already built
(R13); it never re-defines semantics, it only computes them. The API layer checks the backend's
:class:`~paged_sparse_attn.Capabilities` before calling it (R18).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from .._types import Availability, Capabilities, KVOuterIndex, Partials, Problem
from ..errors import UnsupportedError

__all__ = ["Backend"]


class Backend(ABC):
    """Abstract backend.

    Subclasses set :attr:`name` (and the metadata :attr:`description`, :attr:`url`), implement
    :meth:`probe`, :attr:`capabilities` and :meth:`forward_partials`; they may override
    :meth:`forward` (e.g. to keep partials on the device) and :meth:`combine_partials`, and
    implement the index branch (:meth:`block_scores`, :meth:`select_topk`) when their
    capabilities declare ``index_branch``. Everything they return is checked by the API for
    shape and dtype before use (``paged_sparse_attn._outputs``).
    """

    name: ClassVar[str] = "abstract"
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
    def forward_partials(self, problem: Problem, index: KVOuterIndex) -> Partials:
        """Compute the R14 partials of every (edge, query head in group).

        Parameters
        ----------
        problem : Problem
            Validated inputs.
        index : KVOuterIndex
            The R13 index of ``problem.selected``.

        Returns
        -------
        Partials
            ``o`` [E, G, D], ``m`` [E, G], ``l`` [E, G], float32, in index edge order.
        """

    def combine_partials(self, partials: Partials, index: KVOuterIndex) -> tuple[np.ndarray, np.ndarray]:
        """Merge partials into ``out`` [Tq, Hq, D] and ``lse`` [Tq, Hq] (R15). Default: numpy."""
        from .._combine import combine_partials_numpy

        return combine_partials_numpy(partials, index)

    def forward(self, problem: Problem, index: KVOuterIndex) -> tuple[np.ndarray, np.ndarray]:
        """Full forward: partials then combine. Returns ``(out, lse)``, float32."""
        from .._outputs import checked_partials

        # the partials never reach the API here: checked before the combine reads them
        parts = checked_partials(self, "forward", self.forward_partials(problem, index), index.num_edges,
                                 problem.group_size, problem.head_dim)
        return self.combine_partials(parts, index)

    # Index branch (R21-R25). Backends that declare ``index_branch`` override these; the API
    # never calls them on a backend that does not (R18).
    def block_scores(self, problem) -> np.ndarray:  # pragma: no cover - overridden
        """R22: float32 ``[Tq, Hkv, msb]`` block scores of an ``IndexProblem``."""
        raise UnsupportedError(f"backend {self.name!r} does not implement block_scores [R18]")

    def select_topk(self, problem) -> np.ndarray:  # pragma: no cover - overridden
        """R24: int32 ``[Tq, Hkv, topk]`` selection of a ``TopkProblem``."""
        raise UnsupportedError(f"backend {self.name!r} does not implement select_topk [R18]")

    def close(self) -> None:
        """Release device resources. The default has none."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
