// psa_partials_decode.wgsl — KV-outer partials (R14) specialised for decode: one workgroup per
// work item, the item's edges processed one after another (a decode item has one edge and up to
// 8 query heads of its slot group: GQA packing, every K/V element is read once for all of them).
// Needs the `subgroup` feature (shuffles); the host runs it only on devices where it measured a
// subgroup size of at least R.
//
// Same Params record, plan layout and output format as psa_partials.wgsl (read its header):
// work items of 8 u32 (max_len, n_e, g0, ng, erec, pages, prow0, -), edge records (q row,
// edge_len), page lists with INVALID entries (unmapped page, or a page of another cache chunk),
// unnormalised o [n_prows, D] and (m, l) [n_prows]; l == 0 means the row attended nothing (no
// infinity or sentinel is written). The caches are bound as 16-byte units (vec4<u32>), whatever
// their dtype: a unit holds EU = 4 float32 or EU = 8 float16 elements (bitcast, or
// unpack2x16float: float16 caches need no shader-f16 feature). A cache row is TE = D4 / EU units
// (D4 = 4 ceil(D / 4)); the host uses this kernel only when a row is whole units and TE <= R.
//
// Bindings (group 0)
//   0 params  uniform              Params (psa_partials.wgsl)
//   1 q       storage, read        f32 [n_qrows, G, D]
//   2 k_cache storage, read        vec4<u32> [n_slabs_in_chunk, S, TE]  K slabs of one chunk (with
//                                  RH > 1, an NHD cache: whole pages [n_pages, S, RH, TE], R34)
//   3 v_cache storage, read        vec4<u32>, same layout as k_cache
//   4 plan    storage, read        u32 (psa_partials.wgsl)
//   5 o_out   storage, read_write  f32 [n_prows, D]
//   6 ml_out  storage, read_write  vec2<f32> [n_prows]
//
// Layout. A key group is R consecutive lanes of one subgroup; lane r owns unit r of every K and
// V row it reads (a group reads whole rows, coalesced) and holds the query's dims of that unit
// for all 8 head slots in registers (loaded once per edge). The workgroup's NGRP = WG / R groups
// take the block's keys in chunks of 4: chunk c of group g is keys (c NGRP + g) 4 .. + 3. A
// chunk's 4 K and 4 V loads are issued together; with PF = 1 a lane issues the next chunk's
// loads before the current chunk's math (two chunks in flight). Rows are found from the block's
// page list, held one entry per lane and read with a shuffle when it fits in R entries. For each
// key of a chunk the lane forms 8 partial dot products (one per head slot) and reduce-scatters
// them across the group with shuffles (4, 2, 1, then 1 value per step: 8 shuffles leave lane r
// with the full score of head slot hs(r) = 4 [r & R/2] + 2 [r & R/4] + [r & R/8]); the lane
// updates that head's running (m, l) over the chunk, and the rescale factor and the 4 weights p
// of every head are shuffled to all lanes, which update their accumulators
// o_h = o_h alpha_h + sum_i p_hi v_i (8 head slots x EU dims). No workgroup memory and no
// barrier is used until the end of an edge, where the groups' (m, l, o) are merged with
// log-sum-exp weights: the groups of a subgroup pairwise with shuffles, then the NSG subgroups
// in order through workgroup memory (nothing to do there with one subgroup per workgroup).
//
// Special values (R26). Each edge is first run by a fast pass (see edge_keys) that multiplies
// every key's value by its weight; a score of -inf must remove its position value included (a
// NaN value times its weight would reach the row), so a lane that meets one sets a workgroup
// flag and the whole edge is redone by the exact pass, which keeps such values out of the sums.
// Which pass counts depends only on the data: results stay deterministic (R19).
//
// A masked key (past the edge's edge_len, or on an INVALID page) is never read (R10): its K and V
// units stay zero, it is left out of the maximum and its p is 0, so memory that may hold NaN is
// never multiplied by a zero weight. Every sum is in a fixed order (shuffle steps, chunk order,
// pairwise, then subgroup order), so results are bitwise deterministic (R19). Loops run the same
// trip counts on every lane of the workgroup (masked keys instead of shorter loops), so shuffles
// never execute in divergent control flow.
//
// Override constants
//   D, S   head dim, page size          TD  = ceil(D / 4): vec4s of a q / o row
//   EU     cache elements per unit (4: float32, 8: float16); TE = 4 TD / EU units per row
//   NG     heads per work item (the host's RMAX; ng <= NG <= 8)
//   R      lanes per key group: a power of two, 8 <= R <= SG, TE <= R
//   SG     the device's subgroup size, as the host measured it (lanes = invocation index mod SG)
//   WG     workgroup size: a multiple of R and of SG
//   PF     1: the next chunk's loads in flight during a chunk (more registers per lane)

override D: u32;
override S: u32;
override RH: u32 = 1u;                             // KV heads interleaved per page row: 1 (HND) or Hkv (NHD, R34)
override NG: u32;
override WG: u32 = 32u;
override TD: u32;
override EU: u32 = 4u;
override R: u32 = 16u;
override TE: u32 = TD * 4u / EU;                   // 16-byte units per cache row
override SG: u32 = 32u;                            // the device's subgroup size (measured by the host)
override PF: u32 = 1u;                             // 1: the next chunk's loads in flight during a chunk
override NGRP: u32 = WG / R;                       // key groups per workgroup
override GW: u32 = min(SG, WG);                    // lanes of one subgroup in the workgroup
override NSG: u32 = WG / GW;                       // subgroups per workgroup
override OB: u32 = max(1u, (NSG - 1u) * 8u * TD);  // vec4s of the subgroup merge buffer
const INVALID: u32 = 0xffffffffu;

struct Params {
    item_base: u32,
    n_items: u32,
    grid_x: u32,
    group: u32,
    slab_stride: u32,   // vec4s of 4 elements per slab (the layout's slab_stride / 4)
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> v_cache: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> o_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> ml_out: array<vec2<f32>>;

// R26 without relying on WGSL's (unspecified) infinity and NaN arithmetic: bit tests. A score of
// -inf removes its position, value included (its weight is REMOVED, which exp never gives, and
// such a weight multiplies nothing); a NaN score makes the row NaN.
const NEG_INF_BITS: u32 = 0xff800000u;
// the weight of a removed position: exp never gives a negative number (a -0 marker is not
// safe: compilers may treat -0 and +0 as one constant)
const REMOVED: f32 = -1.0;
const REMOVED_BITS: u32 = 0xbf800000u;  // (tested by bits: a float compare may be turned into a max that drops NaN)
fn is_ninf(x: f32) -> bool {
    return bitcast<u32>(x) == NEG_INF_BITS;
}
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
// a NaN as a runtime value: a constant NaN expression is a shader-creation error in Tint
var<private> NAN_BITS: u32 = 0x7fc00000u;
fn nan_max(a: f32, b: f32) -> f32 {  // max that keeps a NaN (WGSL's max may drop it)
    return select(max(a, b), bitcast<f32>(NAN_BITS), is_nan(a) || is_nan(b));
}
fn pv(p: f32, v: vec4<f32>) -> vec4<f32> {
    return select(p * v, vec4<f32>(0.0), bitcast<u32>(p) == REMOVED_BITS);
}

var<workgroup> gm: array<f32, 8u * NSG>;            // subgroup merge: running max [subgroup][head slot]
var<workgroup> gl: array<f32, 8u * NSG>;            // running sum [subgroup][head slot]
var<workgroup> obuf: array<vec4<f32>, OB>;          // accumulators of subgroups 1.. [sg-1][head][td]
var<workgroup> redo: atomic<u32>;                   // a lane saw a removed key: the edge is redone exactly
var<workgroup> redo_u: u32;                         // (redo, for workgroupUniformLoad)

// unit index of the cache row of block position `pos`, or INVALID (past len, or not readable)
fn locate(pages: u32, pos: u32, len: u32) -> u32 {
    if (pos >= len) {
        return INVALID;
    }
    let slab = plan[pages + pos / S];
    if (slab == INVALID) {
        return INVALID;
    }
    return row_of(slab, pos);
}

// unit index of block position `pos` on slab `slab`
fn row_of(slab: u32, pos: u32) -> u32 {
    // R34: HND (RH = 1) slab * slab units + off * TE; NHD row off * RH + head of page slab / RH
    let page = slab / RH;
    return page * RH * (params.slab_stride * 4u / EU) + ((pos % S) * RH + (slab - page * RH)) * TE;
}

// rows of block positions k0 .. k0 + 3 (INVALID past len or on an unreadable page). With the page
// list in the lanes (pg: entry r on lane r of the group, base: the group's first subgroup lane),
// a page's slab comes from a shuffle; the shuffle runs on every lane (uniform control flow)
fn locate4(pages: u32, k0: u32, len: u32, pg: u32, base: u32, pages_in_lanes: bool) -> vec4<u32> {
    var rows = vec4<u32>(INVALID);
    if (pages_in_lanes) {
        for (var i = 0u; i < 4u; i++) {
            let pos = k0 + i;
            let slab = subgroupShuffle(pg, base + min(pos / S, R - 1u));
            if (pos < len && slab != INVALID) {
                rows[i] = row_of(slab, pos);
            }
        }
    } else {
        for (var i = 0u; i < 4u; i++) {
            rows[i] = locate(pages, k0 + i, len);
        }
    }
    return rows;
}

// a chunk: the rows of 4 keys and this lane's unit of their K and V rows
struct Chunk {
    rows: vec4<u32>,
    k0: vec4<u32>,
    k1: vec4<u32>,
    k2: vec4<u32>,
    k3: vec4<u32>,
    v0: vec4<u32>,
    v1: vec4<u32>,
    v2: vec4<u32>,
    v3: vec4<u32>,
}

// the chunk of keys k0 .. k0 + 3, its 8 loads issued together
fn load_chunk(pages: u32, k0: u32, len: u32, pg: u32, base: u32, pages_in_lanes: bool, r: u32) -> Chunk {
    let rows = locate4(pages, k0, len, pg, base, pages_in_lanes);
    return Chunk(rows, kunit(rows.x, r), kunit(rows.y, r), kunit(rows.z, r), kunit(rows.w, r),
                 vunit(rows.x, r), vunit(rows.y, r), vunit(rows.z, r), vunit(rows.w, r));
}

// unit r of a row (zeros for a masked row or past the row's TE units)
fn kunit(row: u32, r: u32) -> vec4<u32> {
    if (row != INVALID && r < TE) {
        return k_cache[row + r];
    }
    return vec4<u32>(0u);
}

fn vunit(row: u32, r: u32) -> vec4<u32> {
    if (row != INVALID && r < TE) {
        return v_cache[row + r];
    }
    return vec4<u32>(0u);
}

// elements 0..3 of a unit, and 4..7 when EU = 8
fn lo4(u: vec4<u32>) -> vec4<f32> {
    if (EU == 8u) {
        return vec4<f32>(unpack2x16float(u.x), unpack2x16float(u.y));
    }
    return bitcast<vec4<f32>>(u);
}

fn hi4(u: vec4<u32>) -> vec4<f32> {
    if (EU == 8u) {
        return vec4<f32>(unpack2x16float(u.z), unpack2x16float(u.w));
    }
    return vec4<f32>(0.0);
}

// q vec4 j of head slot h of q row qrow (zeros past ng and past D)
fn qload(qrow: u32, g0: u32, ng: u32, h: u32, j: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (h < ng && 4u * j < D) {
        let base = (qrow * params.group + g0 + h) * D + 4u * j;
        v.x = q[base];
        if (4u * j + 1u < D) { v.y = q[base + 1u]; }
        if (4u * j + 2u < D) { v.z = q[base + 2u]; }
        if (4u * j + 3u < D) { v.w = q[base + 3u]; }
    }
    return v;
}

// reduce-scatter of 8 per-head partial scores (lo: slots 0..3, hi: 4..7) over the R lanes of a
// group: returns the full score of head slot hs(r) on lane r
fn reduce8(lo: vec4<f32>, hi: vec4<f32>, r: u32) -> f32 {
    let ba = (r & (R / 2u)) != 0u;
    let w4 = select(lo, hi, ba) + subgroupShuffleXor(select(hi, lo, ba), R / 2u);
    let bb = (r & (R / 4u)) != 0u;
    let w2 = select(w4.xy, w4.zw, bb) + subgroupShuffleXor(select(w4.zw, w4.xy, bb), R / 4u);
    let bc = (r & (R / 8u)) != 0u;
    var w = select(w2.x, w2.y, bc) + subgroupShuffleXor(select(w2.y, w2.x, bc), R / 8u);
    for (var j = 0u; j < 32u; j++) {  // msk = R / 16, R / 32, ..., 1
        let msk = (R / 16u) >> j;
        if (msk == 0u) {
            break;
        }
        w += subgroupShuffleXor(w, msk);
    }
    return w;
}

// x w0 + (the partner's x) w1: one accumulator of a key-group pair at lane distance k
fn pair_sum(x: vec4<f32>, w0: f32, w1: f32, k: u32) -> vec4<f32> {
    return x * w0 + subgroupShuffleXor(x, k) * w1;
}

// the lane of a group that holds head slot h after reduce8
fn slot_lane(h: u32) -> u32 {
    return select(0u, R / 2u, (h & 4u) != 0u) + select(0u, R / 4u, (h & 2u) != 0u)
         + select(0u, R / 8u, (h & 1u) != 0u);
}

fn pick(h: u32, a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, a4: vec4<f32>, a5: vec4<f32>,
        a6: vec4<f32>, a7: vec4<f32>) -> vec4<f32> {
    switch h {
        case 0u: { return a0; }
        case 1u: { return a1; }
        case 2u: { return a2; }
        case 3u: { return a3; }
        case 4u: { return a4; }
        case 5u: { return a5; }
        case 6u: { return a6; }
        default: { return a7; }
    }
}

// o row `prow`, vec4 `j` (dims 4 j .. 4 j + 3, those < D)
fn store4(prow: u32, j: u32, a: vec4<f32>) {
    if (4u * j >= D) {
        return;
    }
    let ob = prow * D + 4u * j;
    o_out[ob] = a.x;
    if (4u * j + 1u < D) { o_out[ob + 1u] = a.y; }
    if (4u * j + 2u < D) { o_out[ob + 2u] = a.z; }
    if (4u * j + 3u < D) { o_out[ob + 3u] = a.w; }
}

// a lane's dims of the query for the 8 head slots: q0..q7 vec4 jo of the unit, u0..u7 vec4 jo + 1
// (EU = 8)
struct Query {
    q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>,
    q4: vec4<f32>, q5: vec4<f32>, q6: vec4<f32>, q7: vec4<f32>,
    u0: vec4<f32>, u1: vec4<f32>, u2: vec4<f32>, u3: vec4<f32>,
    u4: vec4<f32>, u5: vec4<f32>, u6: vec4<f32>, u7: vec4<f32>,
}

// a key group's state after an edge's keys: the running (m, l) of the lane's head slot, the
// accumulators of the 8 head slots (a: vec4 jo, b: vec4 jo + 1), and whether the lane saw a key
// scored -inf (removed, R26)
struct Edge {
    m: f32,
    l: f32,
    a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>,
    a4: vec4<f32>, a5: vec4<f32>, a6: vec4<f32>, a7: vec4<f32>,
    b0: vec4<f32>, b1: vec4<f32>, b2: vec4<f32>, b3: vec4<f32>,
    b4: vec4<f32>, b5: vec4<f32>, b6: vec4<f32>, b7: vec4<f32>,
    removed: bool,
}

// The keys of one edge (len keys of the block whose page list is at `pages`) for this lane's key
// group. Called twice from main with constant `exact` and `pf`, so that each call compiles to its
// own loop: the fast pass (exact = false, the kernel's PF) multiplies every key's value by its
// weight, which is R26-exact unless a key is removed (its weight must multiply nothing, a NaN
// value included); it only records whether a removal happened. The exact pass (exact = true,
// no prefetch: fewer registers than the fast one) keeps removed keys' values out of the sums.
// Keeping the exact arithmetic out of the fast loop measured 82-86 us against 110 us per decode
// call on the H200 (a never-taken branch per chunk cost that much).
fn edge_keys(exact: bool, pf: u32, qv: Query, pages: u32, len: u32, r: u32, grp: u32, base: u32) -> Edge {
    let q0 = qv.q0;
    let q1 = qv.q1;
    let q2 = qv.q2;
    let q3 = qv.q3;
    let q4 = qv.q4;
    let q5 = qv.q5;
    let q6 = qv.q6;
    let q7 = qv.q7;
    let u0 = qv.u0;
    let u1 = qv.u1;
    let u2 = qv.u2;
    let u3 = qv.u3;
    let u4 = qv.u4;
    let u5 = qv.u5;
    let u6 = qv.u6;
    let u7 = qv.u7;
    var m = 0.0;   // running max of head slot hs over this group's keys (meaningful when l > 0)
    var l = 0.0;   // running sum; 0 = nothing attended yet
    // accumulators of head slots 0..7: dims of vec4 jo (a) and jo + 1 (b, when EU = 8)
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    var b0 = vec4<f32>(0.0);
    var b1 = vec4<f32>(0.0);
    var b2 = vec4<f32>(0.0);
    var b3 = vec4<f32>(0.0);
    var b4 = vec4<f32>(0.0);
    var b5 = vec4<f32>(0.0);
    var b6 = vec4<f32>(0.0);
    var b7 = vec4<f32>(0.0);
    var saw = false;  // a key of this lane's head slot was scored -inf

    // the block's page list, one entry per lane (when it fits: a row is then found with a
    // shuffle instead of a memory round trip); read from the plan otherwise
    let npages = (len + S - 1u) / S;
    let pages_in_lanes = npages <= R;
    var pg = INVALID;
    if (r < npages && pages_in_lanes) {
        pg = plan[pages + r];
    }
    let step = NGRP * 4u;
    // PF = 1: chunk 0's loads here; in the loop the next chunk's loads are issued before the
    // current chunk's math (two chunks in flight per lane). PF = 0: each chunk's loads at
    // the top of its iteration (half the registers for loads)
    var kn = grp * 4u;  // first key of the chunk to load next
    var next: Chunk;
    if (pf == 1u) {
        next = load_chunk(pages, kn, len, pg, base, pages_in_lanes, r);
        kn += step;
    }
    let n_chunks = (len + step - 1u) / step;  // chunks of this lane's key group
    for (var c_i = 0u; c_i < n_chunks; c_i++) {
        var c = next;
        if (pf == 0u) {
            c = load_chunk(pages, kn, len, pg, base, pages_in_lanes, r);
        } else {
            next = load_chunk(pages, kn, len, pg, base, pages_in_lanes, r);
        }
        kn += step;
        let row0 = c.rows.x;
        let row1 = c.rows.y;
        let row2 = c.rows.z;
        let row3 = c.rows.w;

        // scores of head slot hs for the 4 keys
        var s = vec4<f32>(0.0);
        for (var i = 0u; i < 4u; i++) {
            var kk = c.k0;
            switch i {
                case 1u: { kk = c.k1; }
                case 2u: { kk = c.k2; }
                case 3u: { kk = c.k3; }
                default: {}
            }
            let x = lo4(kk);
            let y = hi4(kk);
            var lo = vec4<f32>(dot(q0, x), dot(q1, x), dot(q2, x), dot(q3, x));
            var hi = vec4<f32>(0.0);
            if (NG > 4u) {
                hi = vec4<f32>(dot(q4, x), dot(q5, x), dot(q6, x), dot(q7, x));
            }
            if (EU == 8u) {
                lo += vec4<f32>(dot(u0, y), dot(u1, y), dot(u2, y), dot(u3, y));
                if (NG > 4u) {
                    hi += vec4<f32>(dot(u4, y), dot(u5, y), dot(u6, y), dot(u7, y));
                }
            }
            s[i] = reduce8(lo, hi, r) * params.scale;
        }

        // running softmax of head slot hs over the chunk's valid keys; a key scored -inf is
        // removed (R26): out of the max, weight REMOVED
        let valid = vec4<bool>(row0 != INVALID, row1 != INVALID, row2 != INVALID, row3 != INVALID);
        let ninf = vec4<bool>(is_ninf(s[0]), is_ninf(s[1]), is_ninf(s[2]), is_ninf(s[3]));
        let att = valid & !ninf;
        var alpha = 1.0;
        var p = select(vec4<f32>(0.0), vec4<f32>(REMOVED), valid & ninf);
        if (any(att)) {
            var cmax = 0.0;
            var seen = false;
            for (var i = 0u; i < 4u; i++) {
                if (att[i]) {
                    cmax = select(s[i], nan_max(cmax, s[i]), seen);
                    seen = true;
                }
            }
            var m_new = cmax;
            alpha = 0.0;  // nothing attended before: the accumulators are exactly 0
            if (!(l == 0.0)) {  // (a NaN l is not "nothing": it must reach the output, R11)
                m_new = nan_max(m, cmax);
                alpha = exp(m - m_new);
            }
            for (var i = 0u; i < 4u; i++) {
                if (att[i]) {
                    p[i] = exp(s[i] - m_new);
                }
            }
            m = m_new;
            let pl = select(p, vec4<f32>(0.0), bitcast<vec4<u32>>(p) == vec4<u32>(REMOVED_BITS));  // removed keys weigh nothing
            l = l * alpha + ((pl.x + pl.y) + (pl.z + pl.w));
        }
        saw = saw || any(valid & ninf);  // the fast pass is redone exactly (see edge_keys)

        // o_h = o_h alpha_h + sum_i p_hi v_i, alpha and p of head h from its slot lane
        let x0 = lo4(c.v0);
        let x1 = lo4(c.v1);
        let x2 = lo4(c.v2);
        let x3 = lo4(c.v3);
        let y0 = hi4(c.v0);
        let y1 = hi4(c.v1);
        let y2 = hi4(c.v2);
        let y3 = hi4(c.v3);
        for (var h = 0u; h < NG; h++) {
            let src = base + slot_lane(h);
            let ph = subgroupShuffle(p, src);
            let ah = subgroupShuffle(alpha, src);
            var da = ph.x * x0 + ph.y * x1 + ph.z * x2 + ph.w * x3;
            var db = vec4<f32>(0.0);
            if (EU == 8u) {
                db = ph.x * y0 + ph.y * y1 + ph.z * y2 + ph.w * y3;
            }
            if (exact) {  // a removed key's value (maybe NaN) is not multiplied by its weight
                da = pv(ph.x, x0) + pv(ph.y, x1) + pv(ph.z, x2) + pv(ph.w, x3);
                if (EU == 8u) {
                    db = pv(ph.x, y0) + pv(ph.y, y1) + pv(ph.z, y2) + pv(ph.w, y3);
                }
            }
            switch h {
                case 0u: { a0 = a0 * ah + da; b0 = b0 * ah + db; }
                case 1u: { a1 = a1 * ah + da; b1 = b1 * ah + db; }
                case 2u: { a2 = a2 * ah + da; b2 = b2 * ah + db; }
                case 3u: { a3 = a3 * ah + da; b3 = b3 * ah + db; }
                case 4u: { a4 = a4 * ah + da; b4 = b4 * ah + db; }
                case 5u: { a5 = a5 * ah + da; b5 = b5 * ah + db; }
                case 6u: { a6 = a6 * ah + da; b6 = b6 * ah + db; }
                default: { a7 = a7 * ah + da; b7 = b7 * ah + db; }
            }
        }
    }
    return Edge(m, l, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, saw);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32,
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_size) sgs: u32) {
    let item = wid.y * params.grid_x + wid.x;
    if (item >= params.n_items) {
        return;
    }
    let ib = (params.item_base + item) * 8u;
    let n_e = plan[ib + 1u];
    let g0 = plan[ib + 2u];
    let ng = plan[ib + 3u];
    let erec = plan[ib + 4u];
    let pages = plan[ib + 5u];
    let prow0 = plan[ib + 6u];

    let r = tid % R;             // lane in the key group: owns unit r of every row
    let grp = tid / R;           // key group
    let hs = 4u * select(0u, 1u, (r & (R / 2u)) != 0u) + 2u * select(0u, 1u, (r & (R / 4u)) != 0u)
           + select(0u, 1u, (r & (R / 8u)) != 0u);  // head slot whose score lane r holds
    let base = sl - r;           // subgroup lane of the group's lane 0
    // the layout assumes subgroups of SG consecutive invocations (what the host measured); a
    // device that breaks it gets NaN rows (loud), never plausible numbers
    let broken = sgs != SG || sl != tid % SG;
    let jo = r * (EU / 4u);      // q / o vec4 of the unit's first 4 dims
    let nan = bitcast<f32>(NAN_BITS);

    if (tid == 0u) {
        atomicStore(&redo, 0u);  // explicitly: not every driver zeroes workgroup memory per workgroup
    }
    workgroupBarrier();
    for (var e = 0u; e < n_e; e++) {
        let qrow = plan[erec + 2u * e];
        let len = plan[erec + 2u * e + 1u];
        // this lane's dims of the query, every head slot (hi: dims 4..7 of the unit, EU = 8)
        let q0 = qload(qrow, g0, ng, 0u, jo);
        let q1 = qload(qrow, g0, ng, 1u, jo);
        let q2 = qload(qrow, g0, ng, 2u, jo);
        let q3 = qload(qrow, g0, ng, 3u, jo);
        let q4 = qload(qrow, g0, ng, 4u, jo);
        let q5 = qload(qrow, g0, ng, 5u, jo);
        let q6 = qload(qrow, g0, ng, 6u, jo);
        let q7 = qload(qrow, g0, ng, 7u, jo);
        var u0 = vec4<f32>(0.0);
        var u1 = vec4<f32>(0.0);
        var u2 = vec4<f32>(0.0);
        var u3 = vec4<f32>(0.0);
        var u4 = vec4<f32>(0.0);
        var u5 = vec4<f32>(0.0);
        var u6 = vec4<f32>(0.0);
        var u7 = vec4<f32>(0.0);
        if (EU == 8u) {
            u0 = qload(qrow, g0, ng, 0u, jo + 1u);
            u1 = qload(qrow, g0, ng, 1u, jo + 1u);
            u2 = qload(qrow, g0, ng, 2u, jo + 1u);
            u3 = qload(qrow, g0, ng, 3u, jo + 1u);
            u4 = qload(qrow, g0, ng, 4u, jo + 1u);
            u5 = qload(qrow, g0, ng, 5u, jo + 1u);
            u6 = qload(qrow, g0, ng, 6u, jo + 1u);
            u7 = qload(qrow, g0, ng, 7u, jo + 1u);
        }
        let qv = Query(q0, q1, q2, q3, q4, q5, q6, q7, u0, u1, u2, u3, u4, u5, u6, u7);
        var st = edge_keys(false, PF, qv, pages, len, r, grp, base);
        // a removed key somewhere in the workgroup: redo the edge exactly (uniform: a workgroup flag)
        if (st.removed) {
            atomicOr(&redo, 1u);
        }
        workgroupBarrier();
        if (tid == 0u) {
            redo_u = atomicLoad(&redo);
            atomicStore(&redo, 0u);  // for the next edge (set again only after the barrier below)
        }
        if (workgroupUniformLoad(&redo_u) != 0u) {
            st = edge_keys(true, 0u, qv, pages, len, r, grp, base);
        }
        var m = st.m;
        var l = st.l;
        var a0 = st.a0;
        var a1 = st.a1;
        var a2 = st.a2;
        var a3 = st.a3;
        var a4 = st.a4;
        var a5 = st.a5;
        var a6 = st.a6;
        var a7 = st.a7;
        var b0 = st.b0;
        var b1 = st.b1;
        var b2 = st.b2;
        var b3 = st.b3;
        var b4 = st.b4;
        var b5 = st.b5;
        var b6 = st.b6;
        var b7 = st.b7;

        // merge the key groups: M = max m_g over groups that attended something, w_g =
        // exp(m_g - M), L = sum w_g l_g, o = sum w_g o_g. "Attended something" is !(l == 0): a
        // group whose l is NaN (NaN or Inf in data it attended) is kept, so the NaN reaches the
        // row as in the reference (R11), never dropped as empty.
        // 1. the groups of one subgroup, pairwise at lane distance R, 2R, ... with shuffles; both
        //    lanes of a pair form the same two products and add them (a + b == b + a), so the
        //    pair ends with identical, deterministic state
        for (var j = 0u; j < 32u; j++) {  // k = R, 2 R, 4 R, ... below GW
            let k = R << j;
            if (k >= GW) {
                break;
            }
            let mo = subgroupShuffleXor(m, k);
            let lo = subgroupShuffleXor(l, k);
            let own = !(l == 0.0);
            let oth = !(lo == 0.0);
            var mm = m;
            if (own && oth) {
                mm = nan_max(m, mo);
            } else if (oth) {
                mm = mo;
            }
            let wo = select(0.0, exp(m - mm), own);
            let wt = select(0.0, exp(mo - mm), oth);
            l = wo * l + wt * lo;
            m = mm;
            for (var h = 0u; h < NG; h++) {
                let src = base + slot_lane(h);
                let w0 = subgroupShuffle(wo, src);
                let w1 = subgroupShuffle(wt, src);
                switch h {
                    case 0u: { a0 = pair_sum(a0, w0, w1, k); b0 = pair_sum(b0, w0, w1, k); }
                    case 1u: { a1 = pair_sum(a1, w0, w1, k); b1 = pair_sum(b1, w0, w1, k); }
                    case 2u: { a2 = pair_sum(a2, w0, w1, k); b2 = pair_sum(b2, w0, w1, k); }
                    case 3u: { a3 = pair_sum(a3, w0, w1, k); b3 = pair_sum(b3, w0, w1, k); }
                    case 4u: { a4 = pair_sum(a4, w0, w1, k); b4 = pair_sum(b4, w0, w1, k); }
                    case 5u: { a5 = pair_sum(a5, w0, w1, k); b5 = pair_sum(b5, w0, w1, k); }
                    case 6u: { a6 = pair_sum(a6, w0, w1, k); b6 = pair_sum(b6, w0, w1, k); }
                    default: { a7 = pair_sum(a7, w0, w1, k); b7 = pair_sum(b7, w0, w1, k); }
                }
            }
        }
        // 2. the subgroups (NSG = WG / GW of them), in subgroup order, through workgroup memory;
        //    the first group of each subgroup speaks for it
        let prow = prow0 + e * ng;
        let sg = tid / GW;
        let lead = (tid % GW) < R;
        if (NSG == 1u) {
            if (grp == 0u && r == slot_lane(hs) && hs < ng) {
                ml_out[prow + hs] = select(vec2<f32>(m, l), vec2<f32>(nan), broken);
            }
        } else {
            if (lead && r == slot_lane(hs)) {
                gm[sg * 8u + hs] = m;
                gl[sg * 8u + hs] = l;
            }
            workgroupBarrier();
            // this subgroup's weight for every head slot; subgroup 0 also forms (M, L)
            var wl = vec4<f32>(0.0);
            var wh = vec4<f32>(0.0);
            for (var h = 0u; h < 8u; h++) {
                var mx = 0.0;
                var seen = false;
                for (var g = 0u; g < NSG; g++) {
                    if (!(gl[g * 8u + h] == 0.0)) {
                        mx = select(gm[g * 8u + h], nan_max(mx, gm[g * 8u + h]), seen);
                        seen = true;
                    }
                }
                var w = 0.0;
                if (!(gl[sg * 8u + h] == 0.0)) {
                    w = exp(gm[sg * 8u + h] - mx);
                }
                if (h < 4u) { wl[h] = w; } else { wh[h - 4u] = w; }
                if (tid == 0u && h < ng) {
                    var lsum = 0.0;
                    for (var g = 0u; g < NSG; g++) {
                        if (!(gl[g * 8u + h] == 0.0)) {
                            lsum += exp(gm[g * 8u + h] - mx) * gl[g * 8u + h];
                        }
                    }
                    ml_out[prow + h] = select(vec2<f32>(mx, lsum), vec2<f32>(nan), broken);
                }
            }
            a0 *= wl.x; b0 *= wl.x;
            a1 *= wl.y; b1 *= wl.y;
            a2 *= wl.z; b2 *= wl.z;
            a3 *= wl.w; b3 *= wl.w;
            a4 *= wh.x; b4 *= wh.x;
            a5 *= wh.y; b5 *= wh.y;
            a6 *= wh.z; b6 *= wh.z;
            a7 *= wh.w; b7 *= wh.w;
            if (sg > 0u && lead && r < TE) {
                for (var h = 0u; h < 8u; h++) {
                    let ob = ((sg - 1u) * 8u + h) * TD + jo;
                    obuf[ob] = pick(h, a0, a1, a2, a3, a4, a5, a6, a7);
                    if (EU == 8u) {
                        obuf[ob + 1u] = pick(h, b0, b1, b2, b3, b4, b5, b6, b7);
                    }
                }
            }
            workgroupBarrier();
            if (grp == 0u && r < TE) {
                for (var g = 1u; g < NSG; g++) {
                    let gb = (g - 1u) * 8u * TD + jo;
                    a0 += obuf[gb];
                    a1 += obuf[gb + TD];
                    a2 += obuf[gb + 2u * TD];
                    a3 += obuf[gb + 3u * TD];
                    a4 += obuf[gb + 4u * TD];
                    a5 += obuf[gb + 5u * TD];
                    a6 += obuf[gb + 6u * TD];
                    a7 += obuf[gb + 7u * TD];
                    if (EU == 8u) {
                        b0 += obuf[gb + 1u];
                        b1 += obuf[gb + TD + 1u];
                        b2 += obuf[gb + 2u * TD + 1u];
                        b3 += obuf[gb + 3u * TD + 1u];
                        b4 += obuf[gb + 4u * TD + 1u];
                        b5 += obuf[gb + 5u * TD + 1u];
                        b6 += obuf[gb + 6u * TD + 1u];
                        b7 += obuf[gb + 7u * TD + 1u];
                    }
                }
            }
            workgroupBarrier();  // gm, gl and obuf are rewritten by the next edge
        }
        if (grp == 0u && r < TE) {
            for (var h = 0u; h < ng; h++) {
                store4(prow + h, jo, pick(h, a0, a1, a2, a3, a4, a5, a6, a7));
                if (EU == 8u) {
                    store4(prow + h, jo + 1u, pick(h, b0, b1, b2, b3, b4, b5, b6, b7));
                }
            }
        }
    }
}
