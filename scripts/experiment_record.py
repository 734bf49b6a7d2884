"""What a dispatch costs the host: recorded through the runtime's C functions (``_record.py``,
what a planned layer does) or through wgpu-py's wrappers.

Usage: ``python scripts/experiment_record.py [wgpu] [dawn]``. Per runtime, three rounds of 3000
dispatches (pipeline, bind group, a dispatch of no workgroups) recorded into one compute pass
each way; prints microseconds per dispatch. Host work only: the GPU runs nothing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_sparse_attn import registry
from paged_sparse_attn.backends.wgpu._record import recorder

CODE = ("@group(0) @binding(0) var<storage, read_write> a: array<u32>;\n"
        "@compute @workgroup_size(1) fn main() { a[0] = 1u; }")
N = 3000


def main(names: list[str]) -> None:
    for name in names:
        avail = registry.list_backends().get(name)
        if avail is None or not avail.ok:
            print(f"{name}: unavailable ({avail.reason if avail is not None else 'not registered'})")
            continue
        ctx = registry.get_backend(name).device_context
        dev, gpu = ctx.device, ctx.runtime.gpu()
        pipe = dev.create_compute_pipeline(layout="auto", compute={
            "module": dev.create_shader_module(code=CODE), "entry_point": "main"})
        buf = dev.create_buffer(size=64, usage=gpu.BufferUsage.STORAGE)
        bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                   entries=[{"binding": 0, "resource": {"buffer": buf}}])
        rec = recorder(ctx.runtime)
        for rnd in range(3):
            for mode in ("C functions", "wgpu-py"):
                enc = dev.create_command_encoder()
                cp = enc.begin_compute_pass()
                t0 = time.perf_counter()
                for _ in range(N):
                    if mode == "wgpu-py":
                        cp.set_pipeline(pipe)
                        cp.set_bind_group(0, bg)
                        cp.dispatch_workgroups(0, 1, 1)
                    else:
                        rec.dispatch3(cp, pipe, bg, 0, 1)
                t = (time.perf_counter() - t0) / N
                cp.end()
                dev.queue.submit([enc.finish()])
                print(f"{name} round {rnd} {mode:12s}: {t * 1e6:.2f} us per dispatch", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["wgpu", "dawn"])
