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
// One invocation per (destination row, DV components d0 + i D / DV of it); the order of the sum
// is fixed, so results are bit-for-bit reproducible (R19). Elements are read eight at a time,
// their loads issued together. DV = 4 puts 32 loads of 4 bytes in flight per invocation where
// DV = 1 had 8 (a warp still reads 128 contiguous bytes per load): measured on an H200, the
// prefill combine (1 GiB of partials) took 0.50 ms with one component per invocation, 0.42 ms
// with four (the same bits); a decode combine (1024 rows) about 2 us more with four through Dawn,
// so the host takes DV > 1 only for wide dispatches (_resident.merge_constants).
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
// Override constants: D head dim, WG workgroup size, DV components per invocation (1, 2 or 4;
// D % DV == 0).

override D: u32;
override WG: u32 = 64u;
override DV: u32 = 1u;
override DS: u32 = D / DV;  // invocations per destination row

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

// an element with l == 0 is empty and skipped; not `ml.y != 0.0`: that compiles to an ordered
// compare, false for NaN, and a NaN element must not be dropped
fn take_max(ml: vec2<f32>, m_max: ptr<function, f32>, seen: ptr<function, bool>) {
    if (!(ml.y == 0.0)) {
        *m_max = select(ml.x, max(*m_max, ml.x), *seen);
        *seen = true;
    }
}

// l += w l_e, o += w o_e with w = exp(m_e - M), for a non-empty element; o_e is loaded either way
// (it is the element's own, finite or not, and discarded when the element is empty)
fn add_term(ml: vec2<f32>, oe: vec4<f32>, m_max: f32, l: ptr<function, f32>, o: ptr<function, vec4<f32>>) {
    if (!(ml.y == 0.0)) {
        let w = exp(ml.x - m_max);
        *l += w * ml.y;
        *o += w * oe;
    }
}

struct Elem {
    ml: vec2<f32>,
    o: vec4<f32>,  // components d0 + i DS, i < DV (the others 0)
}

// element i of a segment (i < end), or an empty one
fn elem(eo: u32, i: u32, end: u32, gs: u32, sub: u32, d0: u32) -> Elem {
    var o = vec4<f32>(0.0);
    if (i < end) {
        let e = plan[eo + i] * gs + sub;
        let b = e * D + d0;
        o.x = src_o[b];
        if (DV > 1u) {
            o.y = src_o[b + DS];
        }
        if (DV > 2u) {
            o.z = src_o[b + 2u * DS];
            o.w = src_o[b + 3u * DS];
        }
        return Elem(src_ml[e], o);
    }
    return Elem(vec2<f32>(0.0), o);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = (wid.y * params.grid_x + wid.x) * WG + lid;
    let j = x / DS;
    if (j >= params.n_dest) {
        return;
    }
    let d0 = x - j * DS;
    let dest = params.dest_base + j;
    let seg = dest / params.group_size;
    let sub = dest - seg * params.group_size;
    let start = plan[seg];
    let end = plan[seg + 1u];

    // Elements are merged in chunks of 8 whose loads are all issued first: a row has few
    // elements (top-k of them in decode) and each load is a round trip to memory, so overlapping
    // them, not arithmetic, sets the speed. Per chunk: its max M_c; the running (M, l, o) is
    // rescaled by exp(M - max(M, M_c)) and the chunk's terms added in element order. A row of at
    // most 8 elements is the plain two-pass formula above.
    let eo = params.elem_off;
    let gs = params.group_size;
    var m_run = 0.0;
    var seen = false;
    var l = 0.0;
    var o = vec4<f32>(0.0);
    let c_n = select(0u, (end - start + 7u) / 8u, end > start);
    for (var c_i = 0u; c_i < c_n; c_i++) {
        let c = start + c_i * 8u;
        let e0 = elem(eo, c, end, gs, sub, d0);
        let e1 = elem(eo, c + 1u, end, gs, sub, d0);
        let e2 = elem(eo, c + 2u, end, gs, sub, d0);
        let e3 = elem(eo, c + 3u, end, gs, sub, d0);
        let e4 = elem(eo, c + 4u, end, gs, sub, d0);
        let e5 = elem(eo, c + 5u, end, gs, sub, d0);
        let e6 = elem(eo, c + 6u, end, gs, sub, d0);
        let e7 = elem(eo, c + 7u, end, gs, sub, d0);
        var cm = 0.0;
        var cs = false;
        take_max(e0.ml, &cm, &cs);
        take_max(e1.ml, &cm, &cs);
        take_max(e2.ml, &cm, &cs);
        take_max(e3.ml, &cm, &cs);
        take_max(e4.ml, &cm, &cs);
        take_max(e5.ml, &cm, &cs);
        take_max(e6.ml, &cm, &cs);
        take_max(e7.ml, &cm, &cs);
        if (cs) {
            var m_new = cm;
            if (seen) {
                m_new = max(m_run, cm);
                let a = exp(m_run - m_new);
                l *= a;
                o *= a;
            }
            add_term(e0.ml, e0.o, m_new, &l, &o);
            add_term(e1.ml, e1.o, m_new, &l, &o);
            add_term(e2.ml, e2.o, m_new, &l, &o);
            add_term(e3.ml, e3.o, m_new, &l, &o);
            add_term(e4.ml, e4.o, m_new, &l, &o);
            add_term(e5.ml, e5.o, m_new, &l, &o);
            add_term(e6.ml, e6.o, m_new, &l, &o);
            add_term(e7.ml, e7.o, m_new, &l, &o);
            m_run = m_new;
            seen = true;
        }
    }
    let m_max = m_run;
    if (seen && params.normalize != 0u) {
        o = o / l;
    }
    let b = dest * D + d0;
    dst_o[b] = o.x;
    if (DV > 1u) {
        dst_o[b + DS] = o.y;
    }
    if (DV > 2u) {
        dst_o[b + 2u * DS] = o.z;
        dst_o[b + 3u * DS] = o.w;
    }
    if (d0 == 0u) {
        dst_ml[dest] = vec2<f32>(m_max, l);
    }
}
