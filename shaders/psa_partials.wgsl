// psa_partials.wgsl — KV-outer partials (R14): one workgroup per work item.
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
//   2 k_cache storage, read        kv_t [n_slabs_in_chunk, slab_stride]  K pages of one chunk;
//                                  a slab is one (page, KV head): [S, D] contiguous, padded to
//                                  slab_stride elements
//   3 v_cache storage, read        kv_t, same layout as k_cache
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
//   TK    keys per tile             RMAX  rows per work item
//   WG    workgroup size            KS    row stride of the K tile (D padded to an odd number)
//   RS    rows per invocation in the score phase (<= 8)
//   TD    invocations along d in the P·V phase; TR = WG / TD invocations along rows
//   DT    dims per invocation (d = td + b * TD), RT rows per invocation (r = tr + a * TR);
//         RT * DT <= 16, TR * RT >= RMAX, TD * DT >= D
// The loader rewrites the `alias kv_t` line to f16 (and prepends `enable f16;`) for float16
// caches; accumulation is f32 in both cases.

alias kv_t = f32;

override D: u32;
override S: u32;
override TK: u32;
override RMAX: u32;
override WG: u32 = 64u;
override RS: u32 = 4u;
override TD: u32;
override DT: u32;
override RT: u32;
override KS: u32 = D + 1u - (D & 1u);
override TR: u32 = WG / TD;
override RPAD: u32 = (RMAX + RS - 1u) / RS * RS;

const ACC: u32 = 16u;  // P·V accumulators per invocation (RT * DT <= ACC)
const SACC: u32 = 8u;  // score accumulators per invocation (RS <= SACC)
const INVALID: u32 = 0xffffffffu;

struct Params {
    item_base: u32,    // first work item of this dispatch
    n_items: u32,      // work items in this dispatch
    grid_x: u32,       // workgroups along x (the grid is 2-D: item = y * grid_x + x)
    group: u32,        // G, query heads per KV head
    slab_stride: u32,  // elements per slab in the cache chunk
    scale: f32,        // softmax scale
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<kv_t>;
@group(0) @binding(3) var<storage, read> v_cache: array<kv_t>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> o_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> ml_out: array<vec2<f32>>;

var<workgroup> q_tile: array<f32, RPAD * D>;    // the rows' query vectors
var<workgroup> k_tile: array<kv_t, TK * KS>;
var<workgroup> v_tile: array<kv_t, TK * D>;
var<workgroup> p_tile: array<f32, RPAD * TK>;   // scores, then exp(score - m) (0 if masked)
var<workgroup> key_ok: array<u32, TK>;          // 1 if the tile's key lies on a readable page
var<workgroup> row_len: array<u32, RMAX>;       // edge_len of the row's edge (0: no such row)
var<workgroup> row_m: array<f32, RMAX>;         // running max (meaningful when row_l > 0)
var<workgroup> row_l: array<f32, RMAX>;         // running sum; 0 = nothing attended yet
var<workgroup> row_a: array<f32, RMAX>;         // rescale factor of the current tile

// Keys of the tile (starting at k0, nk keys) a row with edge_len `len` may attend: k < kend.
fn tile_end(len: u32, k0: u32, nk: u32) -> u32 {
    return min(nk, select(0u, len - k0, len > k0));
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
    for (var x = tid; x < n_rows * D; x += WG) {
        let r = x / D;
        let ie = r / ng;
        let g = g0 + (r - ie * ng);
        q_tile[x] = q[(plan[erec + 2u * ie] * params.group + g) * D + (x - r * D)];
    }
    var acc: array<f32, ACC>;
    for (var i = 0u; i < ACC; i++) {
        acc[i] = 0.0;
    }
    let tr = tid / TD;
    let td = tid - tr * TD;
    workgroupBarrier();

    for (var k0 = 0u; k0 < max_len; k0 += TK) {
        let nk = min(TK, max_len - k0);

        // 1. Load the tile's K and V rows; keys on unreadable pages get zeros (not read).
        for (var x = tid; x < nk * D; x += WG) {
            let k = x / D;
            let d = x - k * D;
            let pos = k0 + k;
            let slab = plan[pages + pos / S];
            var kk = kv_t(0.0);
            var vv = kv_t(0.0);
            if (slab != INVALID) {
                let src = slab * params.slab_stride + (pos % S) * D + d;
                kk = k_cache[src];
                vv = v_cache[src];
            }
            k_tile[k * KS + d] = kk;
            v_tile[k * D + d] = vv;
            if (d == 0u) {
                key_ok[k] = select(0u, 1u, slab != INVALID);
            }
        }
        workgroupBarrier();

        // 2. Scaled scores: each invocation does RS rows x 1 key per step.
        let n_rg = (n_rows + RS - 1u) / RS;
        for (var x = tid; x < n_rg * nk; x += WG) {
            let rg = x / nk;
            let k = x - rg * nk;
            let r0 = rg * RS;
            var s: array<f32, SACC>;
            for (var a = 0u; a < RS; a++) {
                s[a] = 0.0;
            }
            for (var d = 0u; d < D; d++) {
                let kv = f32(k_tile[k * KS + d]);
                for (var a = 0u; a < RS; a++) {
                    s[a] += q_tile[(r0 + a) * D + d] * kv;
                }
            }
            for (var a = 0u; a < RS; a++) {
                p_tile[(r0 + a) * TK + k] = s[a] * params.scale;
            }
        }
        workgroupBarrier();

        // 3. Online softmax, one invocation per row; masked pairs get p = 0.
        for (var r = tid; r < n_rows; r += WG) {
            let kend = tile_end(row_len[r], k0, nk);
            var tmax = 0.0;
            var seen = false;
            for (var k = 0u; k < kend; k++) {
                if (key_ok[k] != 0u) {
                    let s = p_tile[r * TK + k];
                    tmax = select(s, max(tmax, s), seen);
                    seen = true;
                }
            }
            var alpha = 1.0;
            var m_new = 0.0;
            if (seen) {
                let l_old = row_l[r];
                m_new = tmax;
                alpha = 0.0;  // nothing attended before: the accumulators are still exactly 0
                if (l_old > 0.0) {
                    m_new = max(row_m[r], tmax);
                    alpha = exp(row_m[r] - m_new);
                }
            }
            var sum = 0.0;
            for (var k = 0u; k < nk; k++) {
                var p = 0.0;
                if (k < kend && key_ok[k] != 0u) {
                    p = exp(p_tile[r * TK + k] - m_new);
                }
                p_tile[r * TK + k] = p;
                sum += p;
            }
            if (seen) {
                row_m[r] = m_new;
                row_l[r] = row_l[r] * alpha + sum;
            }
            row_a[r] = alpha;
        }
        workgroupBarrier();

        // 4. o += P V on an RT x DT register tile per invocation.
        if (tr < TR) {
            var kend: array<u32, ACC>;
            for (var a = 0u; a < RT; a++) {
                let r = tr + a * TR;
                let rr = min(r, RMAX - 1u);
                kend[a] = select(0u, tile_end(row_len[rr], k0, nk), r < n_rows);
                let alpha = select(1.0, row_a[rr], r < n_rows);
                for (var b = 0u; b < DT; b++) {
                    acc[a * DT + b] *= alpha;
                }
            }
            for (var k = 0u; k < nk; k++) {
                var v: array<f32, ACC>;
                for (var b = 0u; b < DT; b++) {
                    v[b] = f32(v_tile[k * D + min(td + b * TD, D - 1u)]);
                }
                for (var a = 0u; a < RT; a++) {
                    let p = p_tile[min(tr + a * TR, RPAD - 1u) * TK + k];
                    let live = k < kend[a];
                    for (var b = 0u; b < DT; b++) {
                        acc[a * DT + b] += select(0.0, p * v[b], live);
                    }
                }
            }
        }
        workgroupBarrier();
    }

    if (tr < TR) {
        for (var a = 0u; a < RT; a++) {
            let r = tr + a * TR;
            for (var b = 0u; b < DT; b++) {
                let d = td + b * TD;
                if (r < n_rows && d < D) {
                    o_out[(prow0 + r) * D + d] = acc[a * DT + b];
                }
            }
        }
    }
    for (var r = tid; r < n_rows; r += WG) {
        ml_out[prow0 + r] = vec2<f32>(row_m[r], row_l[r]);
    }
}
