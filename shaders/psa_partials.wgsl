// psa_partials.wgsl — KV-outer partials (R14): one workgroup per work item.
// rolled (every loop): the loops stay as Tint guards them: this kernel's main runtime is
// wgpu-native (no guards there), where the counted form measured slower (prefill attention
// on the H200: 17.02 against 16.73 ms).
//
// A work item is a run of at most RMAX "rows" that all read the same KV block: up to
// RMAX / G edges of one slot group (KV head h, sequence b, block s) times all G query heads of
// the group (or, when G > RMAX, one edge times a range of heads). The workgroup keeps the rows'
// queries in workgroup memory, walks the block in tiles of TK key positions, loads each tile of
// K and V once into workgroup memory and runs an online softmax for every row against it, so
// every K/V element is read from the cache once per work item, for all its rows.
//
// The host splits the page pool into binding-sized chunks; one dispatch binds one K chunk and
// one V chunk and processes the work items of that chunk: a page of another chunk appears as
// INVALID in the item's page list and is skipped, so the partial of such an item covers the
// positions of that chunk only (psa_merge.wgsl combines the pieces).
//
// Bindings (group 0)
//   0 params  uniform              Params (below; one 32-byte record per dispatch)
//   1 q       storage, read        f32 [n_qrows, G, D]  queries of the batch; a q row is one
//                                  (query t, KV head h), i.e. q[t, h*G:(h+1)*G, :]
//   2 k_cache storage, read        vec4<kv_t> [n_slabs_in_chunk, S, D4 / 4]  K pages of one chunk;
//                                  a slab is one (page, KV head): S rows of D4 = 4 * ceil(D / 4)
//                                  elements (a row's padding is never used). With RH > 1 (an NHD
//                                  cache, R34) the chunk holds whole pages [n_pages, S, RH, D4 / 4]:
//                                  slab n is head n % RH of page n / RH, its rows RH rows apart
//   3 v_cache storage, read        vec4<kv_t>, same layout as k_cache
//   4 plan    storage, read        u32: work-item records, edge records and page lists
//   5 o_out   storage, read_write  f32 [n_prows, D]  unnormalised o of every partial row
//   6 ml_out  storage, read_write  vec2<f32> [n_prows]  (m, l) of every partial row
//
// plan layout (u32)
//   work item i (record at (item_base + i) * 8):
//     [0] max_len   key positions of the block to visit: max edge_len of its edges
//     [1] n_e       edges in the item
//     [2] g0        first query head (within the group) of the item
//     [3] ng        heads in the item; rows = n_e * ng <= RMAX, row r = (edge r / ng, head g0 + r % ng)
//     [4] erec      offset of the item's edge records: 2 u32 per edge (q row, edge_len)
//     [5] pages     offset of the page list: ceil(max_len / S) entries, each the slab index
//                   within the bound chunk of the block's j-th page, or INVALID (unmapped page,
//                   or a page held by another chunk)
//     [6] prow0     output row of row 0; row r writes partial row prow0 + r
//     [7] unused
//
// Empty representation: a partial row with l == 0 attended nothing (its m is meaningless, its o
// is 0); a row that attended something has l >= 1 (its max term contributes exp(0) = 1). No
// infinity or sentinel value is ever written or compared.
//
// Masking (R10): INVALID pages and positions >= max_len are never read; their tile slots are
// filled with zeros. A (row, key) pair past the row's edge_len is excluded by `select` (the
// product is discarded, never multiplied by zero), so NaN/Inf in memory that a row does not
// attend cannot reach it, even when another row of the item attends that memory.
//
// Override constants
//   D     head dim                  S     page size
//   RH    KV heads whose rows a page interleaves: 1 (HND, the default) or Hkv (NHD, R34)
//   TK    keys per tile             RMAX  rows per work item (RMAX <= 4 * TR)
//   WG    workgroup size            KS    row stride of the K tile (D padded to an odd number)
//   TD    = ceil(D / 4): vec4s per cache row; in the P·V phase invocation (tr, td) owns dims
//         4 td .. 4 td + 3 of rows tr + a * TR (a < 4), TR = WG / TD
//   LD    = ceil(TK * TD / WG): vec4 loads per invocation and tile
//   PS, QS  strides of the score tile and of the transposed query tile, odd against bank
//         conflicts
// Register tiles are vec4: the score phase computes 4 rows x 1 key per step (the query tile is
// stored transposed, 4 rows per vec4), the P·V phase a 4 x 4 (rows x dims) tile per invocation.
// The cache rows a tile needs are located once per key (row offsets, computed for the next tile
// while the current one is scored) and read as vec4.
// The loader rewrites the `alias kv_t` line to f16 (and prepends `enable f16;`) for float16
// caches; accumulation is f32 in both cases.

alias kv_t = f32;

override D: u32;
override S: u32;
override RH: u32 = 1u;
override TK: u32;
override RMAX: u32;
override WG: u32 = 64u;
override TD: u32;
override KS: u32 = D + 1u - (D & 1u);
override TR: u32 = WG / TD;
override NRG: u32 = (RMAX + 3u) / 4u;  // row groups of 4
override LD: u32 = (TK * TD + WG - 1u) / WG;
override PS: u32 = TK + 1u - (TK & 1u);  // row stride of the score tile (odd: no bank conflicts)
override QS: u32 = NRG | 1u;             // stride (in vec4s) of the transposed query tile (odd)
override SL: u32 = max(1u, WG / RMAX);   // softmax invocations per row (rows >= WG / SL idle)
const INVALID: u32 = 0xffffffffu;

struct Params {
    item_base: u32,    // first work item of this dispatch
    n_items: u32,      // work items in this dispatch
    grid_x: u32,       // workgroups along x (the grid is 2-D: item = y * grid_x + x)
    group: u32,        // G, query heads per KV head
    slab_stride: u32,  // vec4s per slab in the cache chunk (S * TD)
    scale: f32,        // softmax scale
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

var<workgroup> q_tile: array<vec4<f32>, QS * D>;    // [d][row group]: rows 4g..4g+3 at dim d
var<workgroup> k_tile: array<kv_t, TK * KS>;
var<workgroup> v_tile: array<vec4<kv_t>, TK * TD>;  // [k][td]: dims 4 td .. 4 td + 3
var<workgroup> p_tile: array<f32, NRG * 4u * PS>;  // [row][key]: scores, then exp(score - m) (0 if masked)
var<workgroup> key_src: array<u32, 2u * TK>;      // cache row (vec4 index) of each key, or INVALID;
                                                    // two buffers: this tile's and the next one's
var<workgroup> row_len: array<u32, RMAX>;          // edge_len of the row's edge (0: no such row)
var<workgroup> row_m: array<f32, RMAX>;            // running max (meaningful when row_l > 0)
var<workgroup> row_l: array<f32, RMAX>;            // running sum; 0 = nothing attended yet
var<workgroup> row_a: array<f32, RMAX>;            // rescale factor of the current tile
var<workgroup> red_m: array<f32, WG>;              // softmax: partial max per invocation
var<workgroup> red_f: array<u32, WG>;              // 1: the invocation saw a valid key
var<workgroup> red_l: array<f32, WG>;              // partial sum per invocation
var<workgroup> tile_ninf: atomic<u32>;              // 1: an attended pair of the tile scored -inf (R26)

// R26 without relying on WGSL's (unspecified) infinity and NaN arithmetic: bit tests.
// A score of -inf removes its position, value included; a NaN score makes the row NaN.
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
// p v, or nothing for a removed position (weight REMOVED): its value, maybe NaN, is not multiplied
fn pv(p: f32, v: vec4<f32>) -> vec4<f32> {
    return select(p * v, vec4<f32>(0.0), bitcast<u32>(p) == REMOVED_BITS);
}

// Keys of the tile (starting at k0, nk keys) a row with edge_len `len` may attend: k < kend.
fn tile_end(len: u32, k0: u32, nk: u32) -> u32 {
    return min(nk, select(0u, len - k0, len > k0));
}

// vec4 index of the cache row of block position `pos`, or INVALID (page not readable here).
fn key_row(pages: u32, pos: u32) -> u32 {
    let slab = plan[pages + pos / S];
    if (slab == INVALID) {
        return INVALID;
    }
    // R34: HND (RH = 1) slab * slab_stride + off * TD; NHD the page's row off * RH + head, with
    // page slab / RH and head slab % RH (RH = 1 gives the HND expression)
    let page = slab / RH;
    return page * RH * params.slab_stride + ((pos % S) * RH + (slab - page * RH)) * TD;
}

struct KV {
    k: vec4<kv_t>,
    v: vec4<kv_t>,
}

// vec4 x of the tile (key x / TD, lane x % TD) from the cache, or zeros (past the tile, or an
// unreadable page: never read).
fn load_kv(x: u32, nk: u32, cur: u32) -> KV {
    var r = KV(vec4<kv_t>(kv_t(0.0)), vec4<kv_t>(kv_t(0.0)));
    if (x < nk * TD) {
        let k = x / TD;
        let row = key_src[cur + k];
        if (row != INVALID) {
            let j = x - k * TD;
            r.k = k_cache[row + j];
            r.v = v_cache[row + j];
        }
    }
    return r;
}

fn store_kv(x: u32, nk: u32, r: KV) {
    if (x < nk * TD) {
        let k = x / TD;
        let j = x - k * TD;
        let kb = k * KS + 4u * j;
        k_tile[kb] = r.k.x;
        if (4u * j + 1u < D) { k_tile[kb + 1u] = r.k.y; }
        if (4u * j + 2u < D) { k_tile[kb + 2u] = r.k.z; }
        if (4u * j + 3u < D) { k_tile[kb + 3u] = r.k.w; }
        v_tile[k * TD + j] = r.v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let item = wid.y * params.grid_x + wid.x;
    if (item >= params.n_items) {
        return;
    }
    let ib = (params.item_base + item) * 8u;
    let max_len = plan[ib];
    let n_e = plan[ib + 1u];
    let g0 = plan[ib + 2u];
    let ng = plan[ib + 3u];
    let erec = plan[ib + 4u];
    let pages = plan[ib + 5u];
    let prow0 = plan[ib + 6u];
    let n_rows = n_e * ng;

    for (var r = tid; r < RMAX; r += WG) {
        var len = 0u;
        if (r < n_rows) {
            len = plan[erec + 2u * (r / ng) + 1u];
        }
        row_len[r] = len;
        row_m[r] = 0.0;
        row_l[r] = 0.0;
    }
    // invocation x handles row 4 rg + c at dim d, with c fastest, then d: conflict-free stores
    for (var x = tid; x < NRG * 4u * D; x += WG) {
        let c = x & 3u;
        let y = x >> 2u;
        let rg = y / D;
        let d = y - rg * D;
        let r = 4u * rg + c;
        var qv = 0.0;
        if (r < n_rows) {
            let ie = r / ng;
            let g = g0 + (r - ie * ng);
            qv = q[(plan[erec + 2u * ie] * params.group + g) * D + d];
        }
        q_tile[d * QS + rg][c] = qv;
    }
    for (var k = tid; k < TK; k += WG) {
        var row = INVALID;
        if (k < max_len) {
            row = key_row(pages, k);
        }
        key_src[k] = row;
    }
    let tr = tid / TD;
    let td = tid - tr * TD;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    workgroupBarrier();

    for (var k0 = 0u; k0 < max_len; k0 += TK) {
        let nk = min(TK, max_len - k0);

        // 1. Load the tile's K and V rows (vec4); keys on unreadable pages get zeros (not read).
        //    Four K and four V loads per invocation are issued before any of them is stored, so
        //    that eight loads are in flight per invocation (the phase is latency-bound otherwise).
        let cur = ((k0 / TK) & 1u) * TK;
        if (tid == 0u) {
            atomicStore(&tile_ninf, 0u);  // (read after this tile's step 3, reset before its barriers)
        }
        for (var i = 0u; i < LD; i += 4u) {
            let x = tid + i * WG;
            let a = load_kv(x, nk, cur);
            let b = load_kv(x + WG, nk, cur);
            let c = load_kv(x + 2u * WG, nk, cur);
            let d = load_kv(x + 3u * WG, nk, cur);
            store_kv(x, nk, a);
            store_kv(x + WG, nk, b);
            store_kv(x + 2u * WG, nk, c);
            store_kv(x + 3u * WG, nk, d);
        }
        workgroupBarrier();

        // 2. Scaled scores, 4 rows x 1 key per step; meanwhile locate the next tile's keys.
        let nxt = TK - cur;
        let k1 = k0 + TK;
        for (var k = tid; k < TK; k += WG) {
            var row = INVALID;
            if (k1 + k < max_len) {
                row = key_row(pages, k1 + k);
            }
            key_src[nxt + k] = row;
        }
        for (var x = tid; x < NRG * nk; x += WG) {
            let rg = x / nk;
            let k = x - rg * nk;
            var s4 = vec4<f32>(0.0);
            for (var d = 0u; d < D; d++) {
                s4 += q_tile[d * QS + rg] * f32(k_tile[k * KS + d]);
            }
            s4 *= params.scale;
            let pb = rg * 4u * PS + k;
            p_tile[pb] = s4.x;
            p_tile[pb + PS] = s4.y;
            p_tile[pb + 2u * PS] = s4.z;
            p_tile[pb + 3u * PS] = s4.w;
        }
        workgroupBarrier();

        // 3. Online softmax, SL invocations per row (a strided share of the tile's keys each):
        //    partial maxima, then partial sums, go through workgroup memory once each and are
        //    reduced by the row's first invocation in a fixed order; masked pairs get p = 0.
        let sr = tid / SL;
        let sl = tid - sr * SL;
        var kend = 0u;
        var m_old = 0.0;
        var l_old = 0.0;
        if (sr < n_rows) {
            kend = tile_end(row_len[sr], k0, nk);
            m_old = row_m[sr];
            l_old = row_l[sr];
        }
        var lmax = 0.0;
        var seen = false;
        var ninf = false;
        for (var k = sl; k < kend; k += SL) {
            if (key_src[cur + k] != INVALID) {
                let s = p_tile[sr * PS + k];
                if (is_ninf(s)) {
                    ninf = true;  // removed (R26): not in the max, weight REMOVED
                } else {
                    lmax = select(s, nan_max(lmax, s), seen);
                    seen = true;
                }
            }
        }
        if (ninf) {
            atomicOr(&tile_ninf, 1u);
        }
        red_m[tid] = lmax;
        red_f[tid] = select(0u, 1u, seen);
        workgroupBarrier();
        var tmax = 0.0;
        var found = false;
        for (var i = 0u; i < SL; i++) {
            let t = sr * SL + i;
            if (red_f[t] != 0u) {
                tmax = select(red_m[t], nan_max(tmax, red_m[t]), found);
                found = true;
            }
        }
        var alpha = 1.0;
        var m_new = 0.0;
        if (found) {
            m_new = tmax;
            alpha = 0.0;  // nothing attended before: the accumulators are still exactly 0
            if (!(l_old == 0.0)) {  // (a NaN l is not "nothing": it must reach the output)
                m_new = nan_max(m_old, tmax);
                alpha = exp(m_old - m_new);
            }
        }
        var psum = 0.0;
        if (sr < n_rows) {
            for (var k = sl; k < nk; k += SL) {
                var p = 0.0;
                if (k < kend && key_src[cur + k] != INVALID) {
                    let sc = p_tile[sr * PS + k];
                    p = select(exp(sc - m_new), REMOVED, is_ninf(sc));
                }
                p_tile[sr * PS + k] = p;
                psum += select(p, 0.0, bitcast<u32>(p) == REMOVED_BITS);  // (a NaN p stays in the sum)
            }
        }
        red_l[tid] = psum;
        workgroupBarrier();
        if (sr < n_rows && sl == 0u) {
            if (found) {
                var sum = 0.0;
                for (var i = 0u; i < SL; i++) {
                    sum += red_l[sr * SL + i];
                }
                row_m[sr] = m_new;
                row_l[sr] = l_old * alpha + sum;
            }
            row_a[sr] = alpha;
        }
        workgroupBarrier();

        // 4. o += P V on a 4 x 4 (rows x dims) register tile per invocation.
        if (tr < TR) {
            let r0 = tr;
            let r1 = tr + TR;
            let r2 = tr + 2u * TR;
            let r3 = tr + 3u * TR;
            let e0 = select(0u, tile_end(row_len[min(r0, RMAX - 1u)], k0, nk), r0 < n_rows);
            let e1 = select(0u, tile_end(row_len[min(r1, RMAX - 1u)], k0, nk), r1 < n_rows);
            let e2 = select(0u, tile_end(row_len[min(r2, RMAX - 1u)], k0, nk), r2 < n_rows);
            let e3 = select(0u, tile_end(row_len[min(r3, RMAX - 1u)], k0, nk), r3 < n_rows);
            acc0 *= select(1.0, row_a[min(r0, RMAX - 1u)], r0 < n_rows);
            acc1 *= select(1.0, row_a[min(r1, RMAX - 1u)], r1 < n_rows);
            acc2 *= select(1.0, row_a[min(r2, RMAX - 1u)], r2 < n_rows);
            acc3 *= select(1.0, row_a[min(r3, RMAX - 1u)], r3 < n_rows);
            let pr0 = min(r0, NRG * 4u - 1u) * PS;
            let pr1 = min(r1, NRG * 4u - 1u) * PS;
            let pr2 = min(r2, NRG * 4u - 1u) * PS;
            let pr3 = min(r3, NRG * 4u - 1u) * PS;
            let emax = max(max(e0, e1), max(e2, e3));
            var emin = min(min(e0, e1), min(e2, e3));
            if (atomicLoad(&tile_ninf) != 0u) {
                emin = 0u;  // a removed position in the tile: every pair through the checked loop
            }
            // keys every row of the tile attends: plain FMAs; past the shortest row, a pair
            // a row does not attend is excluded by select (V there may hold NaN: R10)
            for (var k = 0u; k < emin; k++) {
                let v = vec4<f32>(v_tile[k * TD + td]);
                acc0 += p_tile[pr0 + k] * v;
                acc1 += p_tile[pr1 + k] * v;
                acc2 += p_tile[pr2 + k] * v;
                acc3 += p_tile[pr3 + k] * v;
            }
            for (var k = emin; k < emax; k++) {
                let v = vec4<f32>(v_tile[k * TD + td]);
                let zero = vec4<f32>(0.0);
                acc0 += select(zero, pv(p_tile[pr0 + k], v), k < e0);
                acc1 += select(zero, pv(p_tile[pr1 + k], v), k < e1);
                acc2 += select(zero, pv(p_tile[pr2 + k], v), k < e2);
                acc3 += select(zero, pv(p_tile[pr3 + k], v), k < e3);
            }
        }
        workgroupBarrier();
    }

    if (tr < TR) {
        for (var b = 0u; b < 4u; b++) {
            let d = 4u * td + b;
            if (d < D) {
                if (tr < n_rows) {
                    o_out[(prow0 + tr) * D + d] = acc0[b];
                }
                if (tr + TR < n_rows) {
                    o_out[(prow0 + tr + TR) * D + d] = acc1[b];
                }
                if (tr + 2u * TR < n_rows) {
                    o_out[(prow0 + tr + 2u * TR) * D + d] = acc2[b];
                }
                if (tr + 3u * TR < n_rows) {
                    o_out[(prow0 + tr + 3u * TR) * D + d] = acc3[b];
                }
            }
        }
    }
    for (var r = tid; r < n_rows; r += WG) {
        ml_out[prow0 + r] = vec2<f32>(row_m[r], row_l[r]);
    }
}
