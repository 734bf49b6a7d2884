// psa_partials_decode.wgsl — KV-outer partials (R14) specialised for decode: one workgroup per
// work item, the item's edges processed one after another (a decode item has one edge and up to
// 8 query heads of its slot group: GQA packing, every K/V element is read once for all of them).
//
// Same bindings, Params record, plan layout and output format as psa_partials.wgsl (read its
// header): work items of 8 u32 (max_len, n_e, g0, ng, erec, pages, prow0, -), edge records
// (q row, edge_len), page lists with INVALID entries (unmapped page, or a page of another cache
// chunk), slabs of S rows of TD vec4, unnormalised o [n_prows, D] and (m, l) [n_prows]; l == 0
// means the row attended nothing (no infinity or sentinel is written).
//
// Workgroup memory is kept small on purpose: drivers give a compute workgroup's shared memory
// from a per-SM budget that can be far below the hardware's (measured: 64 KiB per SM on one
// Vulkan driver), and every KiB a workgroup holds costs resident workgroups, hence loads in
// flight. Neither K nor V is staged: both are read from the cache straight into registers.
//
// Per edge, the block is walked in tiles of TK keys (one tile when the block fits); per tile:
//   A. scores: invocation (key k = tid / DS, slice s = tid % DS) reads vec4s s, s + DS, ... of
//      its K row (four loads issued before the math; the DS invocations of a key are
//      neighbours, so one load instruction of a warp touches 32 / DS rows, not 32) and forms
//      partial dot products with all (up to 8) heads, held in two vec4 registers; the query
//      tile is read from workgroup memory at DS consecutive addresses per warp (no bank
//      conflicts); partials go to `sbuf` [slice][key][head];
//   B. softmax: SL = WG / 8 invocations per head slot take a strided share of the tile's keys,
//      sum the DS slices of each score in a fixed order, and exchange partial maxima, then
//      partial sums, once each through workgroup memory; every invocation of a head reduces
//      the same values in the same order, so the running (m, l) is kept, identical, in the
//      registers of all of them; p = exp(s - m) overwrites slice 0 of `sbuf`;
//   C. o += P V: invocation (kg, td) owns vec4 lane td of the head dim for all 8 head slots
//      (eight vec4 registers) and keys kg, kg + KG, ... (KG = WG / TD); V rows are read from
//      the cache, a warp reading whole rows, four keys per step with the loads issued first.
// A masked key (past the edge's edge_len, or on an INVALID page) is never read (R10): its
// scores are not formed, its p is 0 and its V load is skipped, so memory that may hold NaN is
// never multiplied by a zero weight. At the end of an edge the KG key groups' accumulators are
// summed into group 0 through `sbuf`, (group, head) pairs in a fixed order, so results are
// bitwise deterministic (R19).
//
// Override constants
//   D, S   head dim, page size          TD  = ceil(D / 4): vec4s per cache row
//   NG     heads per work item (the host's RMAX; ng <= NG <= 8)
//   WG     workgroup size: a multiple of 8 and of TK, >= TD
//   TK     keys per tile; DS = WG / TK slices of the head dim in the score phase
// The loader rewrites the `alias kv_t` line to f16 (and prepends `enable f16;`) for float16
// caches; accumulation is f32 in both cases.

alias kv_t = f32;

override D: u32;
override S: u32;
override TK: u32;
override NG: u32;
override WG: u32 = 256u;
override TD: u32;
override DS: u32 = WG / TK;                        // head-dim slices of the score phase
override QH: u32 = 4u * ((NG + 3u) / 4u);          // head slots in use: NG rounded up to 4
override KG: u32 = WG / TD;                        // key groups of the P·V phase
override SL: u32 = WG / 8u;                        // softmax invocations per head slot
const INVALID: u32 = 0xffffffffu;

struct Params {
    item_base: u32,
    n_items: u32,
    grid_x: u32,
    group: u32,
    slab_stride: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<vec4<kv_t>>;
@group(0) @binding(3) var<storage, read> v_cache: array<vec4<kv_t>>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> o_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> ml_out: array<vec2<f32>>;

var<workgroup> q_s: array<vec4<f32>, QH * TD>;      // [head][td], zero past ng and past D
var<workgroup> sbuf: array<vec4<f32>, 2u * WG>;     // score partials [slice][key][head quad];
                                                    // then p (slice 0); then accumulators
var<workgroup> key_row: array<u32, 2u * TK>;        // cache row (vec4 index) or INVALID; two tiles
var<workgroup> red_m: array<f32, WG>;               // partial max per invocation
var<workgroup> red_f: array<u32, WG>;               // 1: the invocation saw a valid key
var<workgroup> red_l: array<f32, WG>;               // partial sum per invocation
var<workgroup> row_a: array<f32, 8>;                // rescale factor of the tile, per head slot

// vec4 index of the cache row of block position `pos`, or INVALID (past len, or not readable).
fn locate(pages: u32, pos: u32, len: u32) -> u32 {
    if (pos >= len) {
        return INVALID;
    }
    let slab = plan[pages + pos / S];
    if (slab == INVALID) {
        return INVALID;
    }
    return slab * params.slab_stride + (pos % S) * TD;
}

// K vec4 j of a row, or zeros past the row's TD vec4s
fn kload(row: u32, j: u32) -> vec4<f32> {
    if (j < TD) {
        return vec4<f32>(k_cache[row + j]);
    }
    return vec4<f32>(0.0);
}

fn vload(row: u32, td: u32) -> vec4<f32> {
    if (row != INVALID) {
        return vec4<f32>(v_cache[row + td]);
    }
    return vec4<f32>(0.0);
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

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
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

    let ss = tid % DS;           // scores: head-dim slice and key of this invocation; the DS
    let sk = tid / DS;           // invocations of a key are neighbours and read interleaved vec4s
    let sh = tid / SL;           // softmax: head slot of this invocation (0..7)
    let lane = tid - sh * SL;
    let hq = sh / 4u;            // its vec4 of sbuf and component
    let hc = sh - 4u * hq;
    let kg = tid / TD;           // P·V: key group and vec4 lane (valid when kg < KG)
    let td = tid - kg * TD;

    for (var e = 0u; e < n_e; e++) {
        let qrow = plan[erec + 2u * e];
        let len = plan[erec + 2u * e + 1u];
        for (var x = tid; x < QH * TD; x += WG) {
            let h = x / TD;
            let j = x - h * TD;
            var qv = vec4<f32>(0.0);
            if (h < ng) {
                let base = (qrow * params.group + g0 + h) * D + 4u * j;
                qv.x = q[base];
                if (4u * j + 1u < D) { qv.y = q[base + 1u]; }
                if (4u * j + 2u < D) { qv.z = q[base + 2u]; }
                if (4u * j + 3u < D) { qv.w = q[base + 3u]; }
            }
            q_s[x] = qv;
        }
        for (var k = tid; k < TK; k += WG) {
            key_row[k] = locate(pages, k, len);
        }
        var m = 0.0;   // running max of head slot sh (meaningful when l > 0)
        var l = 0.0;   // running sum of head slot sh; 0 = nothing attended yet
        var a0 = vec4<f32>(0.0);
        var a1 = vec4<f32>(0.0);
        var a2 = vec4<f32>(0.0);
        var a3 = vec4<f32>(0.0);
        var a4 = vec4<f32>(0.0);
        var a5 = vec4<f32>(0.0);
        var a6 = vec4<f32>(0.0);
        var a7 = vec4<f32>(0.0);
        workgroupBarrier();

        for (var k0 = 0u; k0 < len; k0 += TK) {
            let nk = min(TK, len - k0);
            let cur = ((k0 / TK) & 1u) * TK;

            // A. partial scores of key sk over slice ss, all heads; locate the next tile's rows
            var slo = vec4<f32>(0.0);
            var shi = vec4<f32>(0.0);
            let row = key_row[cur + sk];
            if (row != INVALID) {
                for (var j = ss; j < TD; j += 4u * DS) {
                    let k0v = kload(row, j);
                    let k1v = kload(row, j + DS);
                    let k2v = kload(row, j + 2u * DS);
                    let k3v = kload(row, j + 3u * DS);
                    // past TD the K values are zeros; the q index is clamped into the head's row
                    let i1 = min(j + DS, TD - 1u);
                    let i2 = min(j + 2u * DS, TD - 1u);
                    let i3 = min(j + 3u * DS, TD - 1u);
                    slo.x += dot(q_s[j], k0v) + dot(q_s[i1], k1v) + dot(q_s[i2], k2v) + dot(q_s[i3], k3v);
                    slo.y += dot(q_s[TD + j], k0v) + dot(q_s[TD + i1], k1v) + dot(q_s[TD + i2], k2v)
                           + dot(q_s[TD + i3], k3v);
                    slo.z += dot(q_s[2u * TD + j], k0v) + dot(q_s[2u * TD + i1], k1v)
                           + dot(q_s[2u * TD + i2], k2v) + dot(q_s[2u * TD + i3], k3v);
                    slo.w += dot(q_s[3u * TD + j], k0v) + dot(q_s[3u * TD + i1], k1v)
                           + dot(q_s[3u * TD + i2], k2v) + dot(q_s[3u * TD + i3], k3v);
                    if (NG > 4u) {
                        shi.x += dot(q_s[4u * TD + j], k0v) + dot(q_s[4u * TD + i1], k1v)
                               + dot(q_s[4u * TD + i2], k2v) + dot(q_s[4u * TD + i3], k3v);
                        shi.y += dot(q_s[5u * TD + j], k0v) + dot(q_s[5u * TD + i1], k1v)
                               + dot(q_s[5u * TD + i2], k2v) + dot(q_s[5u * TD + i3], k3v);
                        shi.z += dot(q_s[6u * TD + j], k0v) + dot(q_s[6u * TD + i1], k1v)
                               + dot(q_s[6u * TD + i2], k2v) + dot(q_s[6u * TD + i3], k3v);
                        shi.w += dot(q_s[7u * TD + j], k0v) + dot(q_s[7u * TD + i1], k1v)
                               + dot(q_s[7u * TD + i2], k2v) + dot(q_s[7u * TD + i3], k3v);
                    }
                }
            }
            sbuf[2u * (ss * TK + sk)] = slo;        // [slice][key]
            sbuf[2u * (ss * TK + sk) + 1u] = shi;
            for (var k = tid; k < TK; k += WG) {
                key_row[TK - cur + k] = locate(pages, k0 + TK + k, len);
            }
            workgroupBarrier();

            // B1. scores (slices summed in order, scaled) and partial max of head slot sh
            var lmax = 0.0;
            var seen = false;
            for (var k = lane; k < nk; k += SL) {
                if (key_row[cur + k] != INVALID) {
                    var s = 0.0;
                    for (var i = 0u; i < DS; i++) {
                        s += sbuf[2u * (i * TK + k) + hq][hc];
                    }
                    s *= params.scale;
                    sbuf[2u * k + hq][hc] = s;   // this invocation alone reads and writes (k, sh)
                    lmax = select(s, max(lmax, s), seen);
                    seen = true;
                }
            }
            red_m[tid] = lmax;
            red_f[tid] = select(0u, 1u, seen);
            workgroupBarrier();

            // B2. head max, rescale factor, p = exp(s - m) and partial sums
            var tmax = 0.0;
            var found = false;
            for (var i = 0u; i < SL; i++) {
                let t = sh * SL + i;
                if (red_f[t] != 0u) {
                    tmax = select(red_m[t], max(tmax, red_m[t]), found);
                    found = true;
                }
            }
            var alpha = 1.0;
            var m_new = m;
            if (found) {
                m_new = tmax;
                alpha = 0.0;  // nothing attended before: the accumulators are exactly 0
                if (l > 0.0) {
                    m_new = max(m, tmax);
                    alpha = exp(m - m_new);
                }
            }
            var lsum = 0.0;
            for (var k = lane; k < nk; k += SL) {
                var p = 0.0;
                if (key_row[cur + k] != INVALID) {
                    p = exp(sbuf[2u * k + hq][hc] - m_new);
                }
                sbuf[2u * k + hq][hc] = p;
                lsum += p;
            }
            red_l[tid] = lsum;
            if (lane == 0u) {
                row_a[sh] = alpha;
            }
            workgroupBarrier();
            if (found) {
                var tsum = 0.0;
                for (var i = 0u; i < SL; i++) {
                    tsum += red_l[sh * SL + i];
                }
                m = m_new;
                l = l * alpha + tsum;
            }

            // C. o += P V over keys kg, kg + KG, ...; a masked key loads zeros and has p = 0
            if (kg < KG) {
                a0 *= row_a[0];
                a1 *= row_a[1];
                a2 *= row_a[2];
                a3 *= row_a[3];
                if (NG > 4u) {
                    a4 *= row_a[4];
                    a5 *= row_a[5];
                    a6 *= row_a[6];
                    a7 *= row_a[7];
                }
                var k = kg;
                for (; k + 3u * KG < nk; k += 4u * KG) {
                    let v0 = vload(key_row[cur + k], td);
                    let v1 = vload(key_row[cur + k + KG], td);
                    let v2 = vload(key_row[cur + k + 2u * KG], td);
                    let v3 = vload(key_row[cur + k + 3u * KG], td);
                    let p0 = sbuf[2u * k];
                    let p1 = sbuf[2u * (k + KG)];
                    let p2 = sbuf[2u * (k + 2u * KG)];
                    let p3 = sbuf[2u * (k + 3u * KG)];
                    a0 += p0.x * v0 + p1.x * v1 + p2.x * v2 + p3.x * v3;
                    a1 += p0.y * v0 + p1.y * v1 + p2.y * v2 + p3.y * v3;
                    a2 += p0.z * v0 + p1.z * v1 + p2.z * v2 + p3.z * v3;
                    a3 += p0.w * v0 + p1.w * v1 + p2.w * v2 + p3.w * v3;
                    if (NG > 4u) {
                        let u0 = sbuf[2u * k + 1u];
                        let u1 = sbuf[2u * (k + KG) + 1u];
                        let u2 = sbuf[2u * (k + 2u * KG) + 1u];
                        let u3 = sbuf[2u * (k + 3u * KG) + 1u];
                        a4 += u0.x * v0 + u1.x * v1 + u2.x * v2 + u3.x * v3;
                        a5 += u0.y * v0 + u1.y * v1 + u2.y * v2 + u3.y * v3;
                        a6 += u0.z * v0 + u1.z * v1 + u2.z * v2 + u3.z * v3;
                        a7 += u0.w * v0 + u1.w * v1 + u2.w * v2 + u3.w * v3;
                    }
                }
                for (; k < nk; k += KG) {
                    let v = vload(key_row[cur + k], td);
                    let p = sbuf[2u * k];
                    a0 += p.x * v;
                    a1 += p.y * v;
                    a2 += p.z * v;
                    a3 += p.w * v;
                    if (NG > 4u) {
                        let u = sbuf[2u * k + 1u];
                        a4 += u.x * v;
                        a5 += u.y * v;
                        a6 += u.z * v;
                        a7 += u.w * v;
                    }
                }
            }
            workgroupBarrier();
        }

        // sum the key groups into group 0: pairs (group g >= 1, head h) in order g-major, 2 KG
        // pairs (TD vec4s each) per round through sbuf; group 0 adds them in that order
        let npairs = QH * (KG - 1u);
        for (var p0 = 0u; p0 < npairs; p0 += 2u * KG) {
            if (kg >= 1u && kg < KG) {
                for (var h = 0u; h < QH; h++) {
                    let pr = (kg - 1u) * QH + h;
                    if (pr >= p0 && pr < p0 + 2u * KG) {
                        sbuf[(pr - p0) * TD + td] = pick(h, a0, a1, a2, a3, a4, a5, a6, a7);
                    }
                }
            }
            workgroupBarrier();
            if (kg == 0u) {
                let pend = min(npairs, p0 + 2u * KG);
                for (var pr = p0; pr < pend; pr++) {
                    let v = sbuf[(pr - p0) * TD + td];
                    switch pr % QH {
                        case 0u: { a0 += v; }
                        case 1u: { a1 += v; }
                        case 2u: { a2 += v; }
                        case 3u: { a3 += v; }
                        case 4u: { a4 += v; }
                        case 5u: { a5 += v; }
                        case 6u: { a6 += v; }
                        default: { a7 += v; }
                    }
                }
            }
            workgroupBarrier();
        }
        let prow = prow0 + e * ng;
        if (kg == 0u) {
            for (var h = 0u; h < ng; h++) {
                let a = pick(h, a0, a1, a2, a3, a4, a5, a6, a7);
                let ob = (prow + h) * D + 4u * td;
                o_out[ob] = a.x;
                if (4u * td + 1u < D) { o_out[ob + 1u] = a.y; }
                if (4u * td + 2u < D) { o_out[ob + 2u] = a.z; }
                if (4u * td + 3u < D) { o_out[ob + 3u] = a.w; }
            }
        }
        if (sh < ng && lane == 0u) {
            ml_out[prow + sh] = vec2<f32>(m, l);
        }
        workgroupBarrier();  // q_s, key_row and sbuf are rewritten by the next edge
    }
}
