// psa_partials_decode.wgsl — KV-outer partials (R14) specialised for decode: one workgroup per
// work item, the item's edges processed one after another (a decode item has one edge and up to
// NG query heads of its slot group).
//
// Same bindings, Params record, plan layout and output format as psa_partials.wgsl (read its
// header): work items of 8 u32 (max_len, n_e, g0, ng, erec, pages, prow0, -), edge records
// (q row, edge_len), page lists with INVALID entries (unmapped page, or a page of another cache
// chunk), slabs of S rows of TD vec4, unnormalised o [n_prows, D] and (m, l) [n_prows]; l == 0
// means the row attended nothing (no infinity or sentinel is written).
//
// Per edge, the block is walked in tiles of TK key positions; per tile (4 barriers):
//   A. scores: invocation k owns key position k0 + k: it locates the key's cache row (or flags
//      it masked: past the edge's edge_len or on an INVALID page; a masked key is never read,
//      R10) and computes the scaled dot products with all NG heads, reading its K row once as
//      vec4 (four loads issued before the math);
//   B. softmax, NG heads in parallel: TPH = WG / NG invocations per head take a strided share
//      of the tile's keys; the partial max (and whether any key was valid) is exchanged once
//      through workgroup memory, then each invocation writes p = exp(s - m) for its keys and its
//      partial sum; every invocation of a head reduces the same values in the same order, so
//      the running (m, l) is kept, identical, in the registers of all of them;
//   C. o += P V: invocation (kg, td) owns vec4 lane td of the head dim for every head and the
//      key positions kg, kg + KG, ... (KG = WG / TD): V rows are read once per tile, consecutive
//      invocations reading consecutive vec4s, four keys per step with the loads issued first;
//      a masked key is never read (its loads give zeros, its p is 0), so memory that may hold
//      NaN is never multiplied by a zero weight.
// At the end of an edge the KG per-group accumulators are summed in a fixed order through
// workgroup memory (RB groups per round), so results are bitwise deterministic.
//
// Override constants
//   D, S    head dim, page size        TD  = ceil(D / 4): vec4s per cache row
//   NG      heads per work item (the host's RMAX; ng <= NG; at most 16)
//   TK      keys per tile              WG  workgroup size (>= TD, >= NG)
//   RB      accumulator slots of the final reduction (1 <= RB)
// The loader rewrites the `alias kv_t` line to f16 (and prepends `enable f16;`) for float16
// caches; accumulation is f32 in both cases.

alias kv_t = f32;

override D: u32;
override S: u32;
override TK: u32;
override NG: u32;
override WG: u32 = 128u;
override TD: u32;
override RB: u32 = 1u;
override TD4: u32 = (TD + 3u) & ~3u;   // q row stride: TD padded to the 4-vec4 load step
override TKP: u32 = TK + 1u - (TK & 1u); // p_tile row stride (odd: no bank conflicts)
override TPH: u32 = WG / NG;            // softmax invocations per head
override KG: u32 = WG / TD;             // key groups of the P·V phase
const INVALID: u32 = 0xffffffffu;
const NGMAX: u32 = 16u;

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

var<workgroup> q_tile: array<vec4<f32>, NG * TD4>;   // [head][td], zero past ng and past D
var<workgroup> p_tile: array<f32, NG * TKP>;         // [head][key]: scores, then p
var<workgroup> key_row: array<u32, TK>;              // cache row (vec4 index) of each key, or INVALID
var<workgroup> red_m: array<f32, WG>;                // partial max per invocation
var<workgroup> red_f: array<u32, WG>;                // 1: the invocation saw a valid key
var<workgroup> red_l: array<f32, WG>;                // partial sum per invocation
var<workgroup> row_a: array<f32, NG>;                // rescale factor of the tile, per head
var<workgroup> red_o: array<vec4<f32>, RB * NG * TD>; // accumulators of key groups 1..KG-1

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

    let sh = tid / TPH;          // softmax: head of this invocation (valid when sh < NG)
    let lane = tid - sh * TPH;
    let kg = tid / TD;           // P·V: key group and vec4 lane (valid when kg < KG)
    let td = tid - kg * TD;

    for (var e = 0u; e < n_e; e++) {
        let qrow = plan[erec + 2u * e];
        let len = plan[erec + 2u * e + 1u];
        for (var x = tid; x < NG * TD4; x += WG) {
            let h = x / TD4;
            let j = x - h * TD4;
            var qv = vec4<f32>(0.0);
            if (h < ng && j < TD) {
                let base = (qrow * params.group + g0 + h) * D + 4u * j;
                qv.x = q[base];
                if (4u * j + 1u < D) { qv.y = q[base + 1u]; }
                if (4u * j + 2u < D) { qv.z = q[base + 2u]; }
                if (4u * j + 3u < D) { qv.w = q[base + 3u]; }
            }
            q_tile[x] = qv;
        }
        var m = 0.0;   // running max of head sh (meaningful when l > 0)
        var l = 0.0;   // running sum of head sh; 0 = nothing attended yet
        var acc: array<vec4<f32>, NGMAX>;
        for (var h = 0u; h < NG; h++) {
            acc[h] = vec4<f32>(0.0);
        }
        workgroupBarrier();

        for (var k0 = 0u; k0 < len; k0 += TK) {
            let nk = min(TK, len - k0);

            // A. scores, one invocation per key, all heads at once
            for (var k = tid; k < TK; k += WG) {
                var row = INVALID;
                if (k < nk) {
                    let pos = k0 + k;
                    let slab = plan[pages + pos / S];
                    if (slab != INVALID) {
                        row = slab * params.slab_stride + (pos % S) * TD;
                    }
                }
                key_row[k] = row;
                var s: array<f32, NGMAX>;
                for (var h = 0u; h < NG; h++) {
                    s[h] = 0.0;
                }
                if (row != INVALID) {
                    for (var j = 0u; j < TD; j += 4u) {
                        let a0 = kload(row, j);
                        let a1 = kload(row, j + 1u);
                        let a2 = kload(row, j + 2u);
                        let a3 = kload(row, j + 3u);
                        for (var h = 0u; h < NG; h++) {
                            let qb = h * TD4 + j;
                            s[h] += dot(q_tile[qb], a0) + dot(q_tile[qb + 1u], a1)
                                  + dot(q_tile[qb + 2u], a2) + dot(q_tile[qb + 3u], a3);
                        }
                    }
                }
                for (var h = 0u; h < NG; h++) {
                    p_tile[h * TKP + k] = s[h] * params.scale;
                }
            }
            workgroupBarrier();

            // B1. partial max over this invocation's keys of head sh
            var lmax = 0.0;
            var seen = false;
            if (sh < NG) {
                for (var k = lane; k < nk; k += TPH) {
                    if (key_row[k] != INVALID) {
                        let sc = p_tile[sh * TKP + k];
                        lmax = select(sc, max(lmax, sc), seen);
                        seen = true;
                    }
                }
            }
            red_m[tid] = lmax;
            red_f[tid] = select(0u, 1u, seen);
            workgroupBarrier();

            // B2. head max, rescale factor, p = exp(s - m) and partial sums
            var tmax = 0.0;
            var found = false;
            var alpha = 1.0;
            var m_new = m;
            if (sh < NG) {
                for (var i = 0u; i < TPH; i++) {
                    let t = sh * TPH + i;
                    if (red_f[t] != 0u) {
                        tmax = select(red_m[t], max(tmax, red_m[t]), found);
                        found = true;
                    }
                }
                if (found) {
                    m_new = tmax;
                    alpha = 0.0;  // nothing attended before: the accumulators are exactly 0
                    if (l > 0.0) {
                        m_new = max(m, tmax);
                        alpha = exp(m - m_new);
                    }
                }
                var lsum = 0.0;
                for (var k = lane; k < nk; k += TPH) {
                    var p = 0.0;
                    if (key_row[k] != INVALID) {
                        p = exp(p_tile[sh * TKP + k] - m_new);
                    }
                    p_tile[sh * TKP + k] = p;
                    lsum += p;
                }
                red_l[tid] = lsum;
                if (lane == 0u) {
                    row_a[sh] = alpha;
                }
            }
            workgroupBarrier();
            if (sh < NG && found) {
                var tsum = 0.0;
                for (var i = 0u; i < TPH; i++) {
                    tsum += red_l[sh * TPH + i];
                }
                m = m_new;
                l = l * alpha + tsum;
            }

            // C. o += P V: lane td of every head, keys kg, kg + KG, ...
            if (kg < KG) {
                for (var h = 0u; h < NG; h++) {
                    acc[h] *= row_a[h];
                }
                // four keys per step, their loads issued before the math; a masked key loads
                // zeros (not memory) and has p = 0
                var k = kg;
                for (; k + 3u * KG < nk; k += 4u * KG) {
                    let v0 = vload(key_row[k], td);
                    let v1 = vload(key_row[k + KG], td);
                    let v2 = vload(key_row[k + 2u * KG], td);
                    let v3 = vload(key_row[k + 3u * KG], td);
                    for (var h = 0u; h < NG; h++) {
                        let pb = h * TKP + k;
                        acc[h] += p_tile[pb] * v0 + p_tile[pb + KG] * v1
                                + p_tile[pb + 2u * KG] * v2 + p_tile[pb + 3u * KG] * v3;
                    }
                }
                for (; k < nk; k += KG) {
                    let row = key_row[k];
                    if (row != INVALID) {
                        let v = vec4<f32>(v_cache[row + td]);
                        for (var h = 0u; h < NG; h++) {
                            acc[h] += p_tile[h * TKP + k] * v;
                        }
                    }
                }
            }
            workgroupBarrier();
        }

        // sum the key groups' accumulators in a fixed order: group 0 adds groups 1, 2, ...
        for (var r0 = 1u; r0 < KG; r0 += RB) {
            if (kg >= r0 && kg < min(r0 + RB, KG)) {
                let slot = (kg - r0) * NG * TD;
                for (var h = 0u; h < NG; h++) {
                    red_o[slot + h * TD + td] = acc[h];
                }
            }
            workgroupBarrier();
            if (kg == 0u) {
                let nr = min(RB, KG - r0);
                for (var i = 0u; i < nr; i++) {
                    for (var h = 0u; h < NG; h++) {
                        acc[h] += red_o[i * NG * TD + h * TD + td];
                    }
                }
            }
            workgroupBarrier();
        }
        let prow = prow0 + e * ng;
        if (kg == 0u) {
            for (var h = 0u; h < ng; h++) {
                for (var b = 0u; b < 4u; b++) {
                    let d = 4u * td + b;
                    if (d < D) {
                        o_out[(prow + h) * D + d] = acc[h][b];
                    }
                }
            }
        }
        if (sh < ng && lane == 0u) {
            ml_out[prow + sh] = vec2<f32>(m, l);
        }
        workgroupBarrier();  // q_tile and red_o are rewritten by the next edge
    }
}
