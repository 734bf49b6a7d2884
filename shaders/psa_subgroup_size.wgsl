// psa_subgroup_size.wgsl — what subgroup size the device runs compute shaders with (needs the
// `subgroup` feature). The decode partials kernel shuffles within groups of R lanes of one
// subgroup; the host measures the size once per device with this kernel instead of trusting the
// adapter's advertised range.
//
// Every invocation of one workgroup writes its subgroup size and its lane, so the host sees
// whether the size is the same for all and whether lanes follow the invocation index.
//
// Bindings (group 0)
//   0 out  storage, read_write  vec2<u32> [WG]  (subgroup_size, subgroup_invocation_id)
//
// Override constants: WG workgroup size.

override WG: u32 = 64u;

@group(0) @binding(0) var<storage, read_write> out: array<vec2<u32>>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(subgroup_size) sgs: u32,
        @builtin(subgroup_invocation_id) sl: u32) {
    out[tid] = vec2<u32>(sgs, sl);
}
