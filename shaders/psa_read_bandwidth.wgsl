// psa_read_bandwidth.wgsl — a streaming read of one storage buffer: the ceiling that a kernel
// reading its inputs once through this API and driver can reach (the benchmark reports it next to
// the copy bandwidth; no attention kernel uses it).
//
// Every invocation reads vec4<u32> elements gid, gid + N, gid + 2N, ... (N = invocations in the
// grid, so consecutive invocations read consecutive 16-byte elements), four loads issued before
// they are combined, and xors them together. The result is written only when it equals a value
// the data never produces, so the loads cannot be optimised away and nothing is written.
//
// Bindings (group 0)
//   0 params  uniform              Params (below)
//   1 src     storage, read        vec4<u32> [n_vec4]  the buffer to read
//   2 sink    storage, read_write  u32 [1]             written only on the impossible value
//
// Override constants: WG workgroup size.

override WG: u32 = 256u;

struct Params {
    n_vec4: u32,     // elements of src to read
    n_inv: u32,      // invocations in the grid (workgroups * WG)
    magic: u32,      // a value the xor of the data never equals
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> sink: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let n = params.n_inv;
    var acc = vec4<u32>(0u);
    var i = gid.x;
    let n4 = select(0u, (params.n_vec4 - 3u * n - i + 4u * n - 1u) / (4u * n), params.n_vec4 > i + 3u * n);
    for (var j = 0u; j < n4; j++) {
        let a = src[i];
        let b = src[i + n];
        let c = src[i + 2u * n];
        let d = src[i + 3u * n];
        acc ^= a ^ b ^ c ^ d;
        i += 4u * n;
    }
    let n1 = select(0u, (params.n_vec4 - i + n - 1u) / n, params.n_vec4 > i);
    for (var j = 0u; j < n1; j++) {
        acc ^= src[i];
        i += n;
    }
    let r = acc.x ^ acc.y ^ acc.z ^ acc.w;
    if (r == params.magic) {
        sink[0] = r;
    }
}
