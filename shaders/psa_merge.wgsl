// psa_merge.wgsl — segmented log-sum-exp merge of partial rows (R14 pieces, R15 combine).
//
// Partial rows come in groups of GS consecutive rows (GS = G: the G query heads of one edge
// piece). Destination j merges, for c = j % GS, the partial rows e * GS + c of the groups
// e in elems[ptr[j / GS] .. ptr[j / GS + 1]), in that order:
//   M = max m_e over non-empty elements,  l = sum exp(m_e - M) l_e,
//   o = sum exp(m_e - M) o_e,  and with `normalize` o / l.
// Used twice: pieces of one edge (one per cache chunk its block touches) -> the edge's
// unnormalised partial (forward_partials), and the partials of all edges of a (query, KV head)
// row -> normalised attention (the combine of forward). The host turns (M, l) into
// lse = M + ln l, or -inf where l == 0.
//
// One invocation per (destination row, d); the order of the sum is fixed, so results are
// bit-for-bit reproducible (R19).
//
// Bindings (group 0)
//   0 params  uniform              Params (below)
//   1 src_o   storage, read        f32 [n_prows, D]
//   2 src_ml  storage, read        vec2<f32> [n_prows]  (m, l); l == 0 means empty
//   3 plan    storage, read        u32: ptr [n_dest / GS + 1] then elems (group ids) at elem_off
//   4 dst_o   storage, read_write  f32 [n_dest, D]
//   5 dst_ml  storage, read_write  vec2<f32> [n_dest]  (M, l); l == 0 means empty (then o = 0)
//
// Empty representation: an element with l == 0 is skipped (never multiplied by 0); a
// destination with no non-empty element gets o = 0, l = 0. No infinity is written or compared.
// An element whose l is NaN (NaN or Inf in the data it attended) is not empty: it makes its
// destination NaN, as in the reference, instead of being dropped.
//
// Override constants: D head dim, WG workgroup size.

override D: u32;
override WG: u32 = 64u;

struct Params {
    dest_base: u32,   // first destination row of this dispatch
    n_dest: u32,      // destination rows in this dispatch
    grid_x: u32,      // workgroups along x (2-D grid)
    elem_off: u32,    // offset of elems in plan
    normalize: u32,   // 1: write o / l (attention), 0: unnormalised o (a partial)
    group_size: u32,  // GS: partial rows per group, destinations per group list
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> src_o: array<f32>;
@group(0) @binding(2) var<storage, read> src_ml: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> plan: array<u32>;
@group(0) @binding(4) var<storage, read_write> dst_o: array<f32>;
@group(0) @binding(5) var<storage, read_write> dst_ml: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = (wid.y * params.grid_x + wid.x) * WG + lid;
    let j = x / D;
    if (j >= params.n_dest) {
        return;
    }
    let d = x - j * D;
    let dest = params.dest_base + j;
    let seg = dest / params.group_size;
    let sub = dest - seg * params.group_size;
    let start = plan[seg];
    let end = plan[seg + 1u];

    var m_max = 0.0;
    var seen = false;
    for (var i = start; i < end; i++) {
        let ml = src_ml[plan[params.elem_off + i] * params.group_size + sub];
        if (!(ml.y == 0.0)) {  // not `ml.y != 0.0`: that compiles to an ordered compare, false for NaN
            m_max = select(ml.x, max(m_max, ml.x), seen);
            seen = true;
        }
    }
    var l = 0.0;
    var o = 0.0;
    if (seen) {
        for (var i = start; i < end; i++) {
            let e = plan[params.elem_off + i] * params.group_size + sub;
            let ml = src_ml[e];
            if (!(ml.y == 0.0)) {  // not `ml.y != 0.0`: that compiles to an ordered compare, false for NaN
                let w = exp(ml.x - m_max);
                l += w * ml.y;
                o += w * src_o[e * D + d];
            }
        }
        if (params.normalize != 0u) {
            o = o / l;
        }
    }
    dst_o[dest * D + d] = o;
    if (d == 0u) {
        dst_ml[dest] = vec2<f32>(m_max, l);
    }
}
