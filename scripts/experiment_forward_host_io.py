"""Experiment: a decode ``forward()`` with host arrays, with and without the plan's host memory
(Dawn's ``host-mapped-pointer``: results written and lent in host memory).

Each variant runs in a process of its own (two Dawn devices in one process time-slice the GPU
and slow both), one after the other, ``--processes`` times: the bench's decode layer workload
(B = 32, L = 32k, one query each, Hq = 32, Hkv = 4, D = 128, top-16 of 128-token blocks, float16
caches resident), ``forward()`` on 32 float32 query sets in turn, 5 rounds of 64 calls; per
process the median over rounds of each round's median wall time per call, the rounds, and the
medians over the calls of the runtime's ``last_timings``. Variants: ``hostio`` (as the
library runs it), ``f16q`` (the same, q in float16: written and widened on the device),
``nohostio`` (Dawn without ``host-mapped-pointer``), ``wgpu`` (wgpu-native). (Until 2026-12-03
the plan also staged ``q`` and ``selected`` in its host memory; this script's ``writein``
variant, which wrote them with ``queue.write_buffer`` instead, is how that was measured and
changed.) The outputs of the first call are compared bit for bit.

    python scripts/experiment_forward_host_io.py [--processes 2]
    python scripts/experiment_forward_host_io.py --variant hostio     # one process, one variant
    python scripts/experiment_forward_host_io.py --ab [--rounds 8]    # in one process, alternating

``--ab`` alternates, round by round in one process on one Dawn device and plan (so that the
host's pace, which changes between processes and over seconds, is shared): the library as it is
(``lib``), and two earlier transports put back for the comparison: ``pinnedin`` (``q`` and
``selected`` copied into pinned host memory by numpy and from there by the layer's encoder, the
plan's transport before 2026-12-03 17:00), ``promise`` (the polled wait through wgpudawn's
promise per wait, ``on_submitted_work_done_async``, as before 2026-12-03 17:00), ``pypass``
(the layer's pass begun through wgpu-py's ``begin_compute_pass``, as before 2026-12-03 17:40) and
``pyenc`` (the layer's encoder made, finished and submitted through wgpu-py's methods, as before
2026-12-04 02:00). Per variant: the median over rounds of each round's median wall time per
call, and the runtime's stage medians.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

# name: (features disabled on a Dawn device, or None for wgpu-native; q as float16)
VARIANTS = {"hostio": ((), False), "f16q": ((), True), "nohostio": (("host-mapped-pointer",), False),
            "wgpu": (None, False)}


def one(variant: str, save: str | None) -> None:
    import _layer_inputs as li

    import paged_sparse_attn as psa

    lw, prob, _, _ = li.layer_inputs("decode")
    disabled, f16 = VARIANTS[variant]
    if disabled is None:
        be = psa.get_backend("wgpu")
    else:
        be = type(psa.get_backend("dawn"))(disable_features=disabled)
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(32)]
    if f16:
        qs = [q.astype(np.float16) for q in qs]
    k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
    rounds = []
    splits: dict = {}
    for r in range(5):
        ts = []
        for i in range(64):
            t = time.perf_counter()
            out = psa.forward(qs[i % 32], k, v, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"],
                              used_kv_lens=prob["used_kv_lens"], block_size=lw.w.block_size, causal=lw.w.causal,
                              backend=be)
            ts.append(time.perf_counter() - t)
            for key, val in be.last_timings.items():
                if isinstance(val, float):
                    splits.setdefault(key, []).append(val)
            if save and r == 0 and i == 0:
                np.save(save, out)
        rounds.append(float(np.median(ts)) * 1e6)
    med = {a: round(float(np.median(b)) * 1e6, 1) for a, b in splits.items()}
    print(f"{variant:8s} forward() us: median {np.median(rounds):.1f} rounds {[round(x) for x in rounds]} "
          f"runtime medians {med}", flush=True)


def _pinned_stage(orig):
    """``DeviceRuntime._stage`` as before 2026-12-03 17:00: host ``q`` / ``selected`` through
    pinned host memory of the runtime (one block per destination buffer), then a device copy."""
    from paged_sparse_attn.backends.wgpu._webgpu import BufferUsage

    blocks: dict = {}

    def stage(self, enc, src, dst, nbytes, dtype):
        if not (isinstance(src, np.ndarray) and src.dtype == dtype and src.flags.c_contiguous
                and src.nbytes == nbytes and nbytes):
            return orig(self, enc, src, dst, nbytes, dtype)
        hit = blocks.get(dst.uid)
        if hit is None:
            mod = self.ctx.runtime.host_memory_module()
            mem = mod.allocate_host_memory(self.ctx.device, nbytes)
            buf = mod.create_buffer_from_host_memory(self.ctx.device, mem, usage=BufferUsage.COPY_SRC)
            hit = blocks[dst.uid] = (buf, np.frombuffer(mem, dtype=np.uint8))
        np.copyto(hit[1][:nbytes], src.reshape(-1).view(np.uint8))
        enc.copy_buffer_to_buffer(hit[0], 0, dst, 0, nbytes)

    return stage


def _promise_poll(device, spin_s):
    """The polled wait as before 2026-12-03 17:00: wgpudawn's promise per wait."""
    from wgpudawn.backends.dawn import _api

    promise = device.queue.on_submitted_work_done_async()  # (the FlushingQueue flushes first)
    info = _api.ffi.new("WGPUFutureWaitInfo *")
    info.future.id = promise._wgpu_future_id
    instance = _api.get_wgpu_instance()
    end = time.perf_counter() + spin_s
    while not info.completed and time.perf_counter() < end:
        _api.libf.wgpuInstanceWaitAny(instance, 1, info, 0)
    promise.sync_wait()


def _cpu() -> int:
    """The CPU this thread last ran on (Linux; -1 elsewhere)."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def _numa() -> str:
    """The host's NUMA nodes (their CPUs) and the NUMA node of each NVIDIA PCI device (Linux)."""
    import glob

    def read(path: str) -> str:
        return Path(path).read_text().strip()

    nodes = []
    for d in sorted(glob.glob("/sys/devices/system/node/node[0-9]*")):
        try:
            nodes.append(f"{os.path.basename(d)}: cpus {read(d + '/cpulist')}")
        except OSError:
            pass
    gpus = []
    for d in glob.glob("/sys/bus/pci/devices/*"):
        try:
            if read(d + "/vendor") == "0x10de" and read(d + "/class").startswith("0x03"):
                gpus.append(f"{os.path.basename(d)} node {read(d + '/numa_node')}")
        except OSError:
            pass
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"NUMA {nodes or 'unknown'}; GPUs {gpus or 'unknown'}; this process may run on CPUs {allowed}"


def ab(rounds: int) -> None:
    import _layer_inputs as li

    import paged_sparse_attn as psa
    from paged_sparse_attn.backends.wgpu import _layer, _record

    lw, prob, _, _ = li.layer_inputs("decode")
    be = type(psa.get_backend("dawn"))()
    rt = be.device_context.runtime
    lib_stage, lib_poll, lib_begin = _layer.DeviceRuntime._stage, rt.poll_work_done, _record.Recorder.begin
    lib_encodes = _record.Recorder.encodes

    def py_begin(self, enc):
        return enc.begin_compute_pass()

    py_encodes = property(lambda self: False)
    variants = {"lib": (lib_stage, lib_poll, lib_begin, lib_encodes),
                "pinnedin": (_pinned_stage(lib_stage), lib_poll, lib_begin, lib_encodes),
                "promise": (lib_stage, _promise_poll, lib_begin, lib_encodes),
                "pypass": (lib_stage, lib_poll, py_begin, lib_encodes),
                "pyenc": (lib_stage, lib_poll, lib_begin, py_encodes)}
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal(prob["q"].shape, dtype=np.float32) for _ in range(32)]
    k, v = be.upload_kv_cache(prob["k_cache"], prob["v_cache"])
    print(_numa(), flush=True)
    walls: dict = {n: [] for n in variants}
    cpus: dict = {n: [] for n in variants}
    splits: dict = {n: {} for n in variants}
    outs = {}
    for r in range(rounds + 1):
        for name, (stage, poll, begin, encodes) in variants.items():
            _layer.DeviceRuntime._stage = stage
            _record.Recorder.begin = begin
            _record.Recorder.encodes = encodes
            object.__setattr__(rt, "poll_work_done", poll)
            ts = []
            for i in range(64):
                t = time.perf_counter()
                out = psa.forward(qs[i % 32], k, v, prob["block_tables"], prob["selected"], prob["cu_seqlens_q"],
                                  used_kv_lens=prob["used_kv_lens"], block_size=lw.w.block_size,
                                  causal=lw.w.causal, backend=be)
                ts.append(time.perf_counter() - t)
                if r and i:
                    for key, val in be.last_timings.items():
                        if isinstance(val, float):
                            splits[name].setdefault(key, []).append(val)
                if i == 0 and r == 0:
                    outs[name] = np.array(out)
            if r:  # (round 0: warm-up)
                walls[name].append(float(np.median(ts)) * 1e6)
                cpus[name].append(_cpu())
    _layer.DeviceRuntime._stage = lib_stage
    _record.Recorder.begin = lib_begin
    _record.Recorder.encodes = lib_encodes
    object.__setattr__(rt, "poll_work_done", lib_poll)
    for name in variants:
        med = {a: round(float(np.median(b)) * 1e6, 1) for a, b in splits[name].items()}
        print(f"{name:8s} forward() us: median {np.median(walls[name]):.1f} rounds "
              f"{[round(x) for x in walls[name]]} on CPUs {cpus[name]} runtime medians {med}", flush=True)
    print("same bits as lib:", {n: bool(np.array_equal(o, outs["lib"])) for n, o in outs.items()}, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=list(VARIANTS))
    ap.add_argument("--save", help="(with --variant) save the first call's out here (.npy)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--only", action="append", choices=list(VARIANTS), help="variants to run (default: all)")
    ap.add_argument("--ab", action="store_true", help="the transports alternated in one process (see above)")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    if a.ab:
        ab(a.rounds)
        return 0
    if a.variant:
        one(a.variant, a.save)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        names = a.only or list(VARIANTS)
        for _ in range(a.processes):
            for name in names:
                subprocess.run([sys.executable, __file__, "--variant", name, "--save", os.path.join(tmp, f"{name}.npy")],
                               check=True)
        outs = {n: np.load(os.path.join(tmp, f"{n}.npy")) for n in names}
        ref = outs[names[0]]
        print(f"same bits as {names[0]}:", {n: bool(np.array_equal(o, ref)) for n, o in outs.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
