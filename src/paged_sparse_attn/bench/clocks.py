"""GPU clock samples taken while a measurement runs (NVIDIA's ``nvidia-smi``, where present).

Kernel times depend on the clock the GPU runs at, and a GPU runs at its idle clock until it has
been busy for a while: a kernel timed between long host pauses is timed at that clock. The GPU
suite therefore measures at steady state (back-to-back replays after a warm-up) and records the
SM clock and power seen during each measurement, so that a reader can check the state the
numbers were taken in. Without ``nvidia-smi`` nothing is sampled and the rows say so.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from typing import Optional

import numpy as np

__all__ = ["ClockSampler"]


class ClockSampler:
    """Samples ``clocks.sm`` (MHz) and ``power.draw`` (W) every ``interval_ms`` while active.

    Use as a context manager around one measurement; :meth:`summary` gives the median and the
    range of the samples (``None`` when nothing could be sampled).
    """

    def __init__(self, interval_ms: int = 50):
        self.interval_ms = int(interval_ms)
        self.sm: list[float] = []
        self.power: list[float] = []
        self._proc: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def available() -> bool:
        return shutil.which("nvidia-smi") is not None

    def __enter__(self) -> "ClockSampler":
        if not self.available():
            return self
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms), "-i", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                sm, pw = (float(x) for x in line.strip().split(",")[:2])
            except ValueError:
                continue
            self.sm.append(sm)
            self.power.append(pw)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def summary(self) -> Optional[dict]:
        """``dict(sm_mhz, sm_min_mhz, sm_max_mhz, power_w, samples)`` or ``None``."""
        if not self.sm:
            return None
        return dict(sm_mhz=float(np.median(self.sm)), sm_min_mhz=float(min(self.sm)),
                    sm_max_mhz=float(max(self.sm)), power_w=float(np.median(self.power)), samples=len(self.sm))
