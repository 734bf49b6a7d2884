"""Backends: the numpy reference backend and optional device backends (imported lazily)."""

from .base import Backend

__all__ = ["Backend"]
