// psa_partials.wgsl — KV-outer partials (R14): one workgroup per work item.
//
// A work item is a run of at most RMAX "rows" that all read the same KV block: up to
// RMAX / G edges of one slot group (KV head h, sequence b, block s) times all G query heads of
// the group (or, when G > RMAX, one edge times a range of heads). The workgroup walks the
// block in tiles of TK key positions, loads each tile of K and V once into workgroup memory and
// runs an online softmax for every row against it, so every K/V element is read from the
// cache once per work item. The host splits the page pool into binding-sized chunks; one
// dispatch binds one K chunk and one V chunk and processes the work items of that chunk: a
// page of another chunk appears as INVALID in the item's page list and is skipped, so the
// partial of such an item covers the positions of that chunk only (the merge kernel combines
// the pieces).
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
// Masking (R10): a (row, key) pair outside the row's edge_len, or on an INVALID page, is skipped
// by a branch, never multiplied by zero; INVALID pages and positions >= max_len are never read.
//
// Override constants
//   D     head dim (1..)            S     page size
//   TK    keys per tile             RMAX  rows per work item (n_e * ng <= RMAX, RMAX * D <= WG * ACC)
//   WG    workgroup size            KS    row stride of the K tile (D, padded to an odd number)
// The loader rewrites the `alias kv_t` line to f16 (and prepends `enable f16;`) for float16
// caches; accumulation is f32 in both cases.

alias kv_t = f32;

override D: u32;
override S: u32;
override TK: u32;
override RMAX: u32;
override WG: u32 = 64u;
override KS: u32 = D + 1u - (D & 1u);

// Accumulators per invocation: a work item holds RMAX * D <= WG * ACC output elements.
const ACC: u32 = 16u;
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

var<workgroup> k_tile: array<kv_t, TK * KS>;
var<workgroup> v_tile: array<kv_t, TK * D>;
var<workgroup> p_tile: array<f32, RMAX * TK>;   // scores, then exp(score - m)
var<workgroup> key_ok: array<u32, TK>;          // 1 if the tile's key lies on a readable page
var<workgroup> row_q: array<u32, RMAX>;         // offset of the row's query vector in q
var<workgroup> row_len: array<u32, RMAX>;       // edge_len of the row's edge
var<workgroup> row_m: array<f32, RMAX>;         // running max (meaningful when row_l > 0)
var<workgroup> row_l: array<f32, RMAX>;         // running sum; 0 = nothing attended yet
var<workgroup> row_a: array<f32, RMAX>;         // rescale factor of the current tile

// Keys of the tile (starting at k0, nk keys) the row with edge_len `len` may attend: k < kend.
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

    for (var r = tid; r < n_rows; r += WG) {
        let ie = r / ng;
        let g = g0 + (r - ie * ng);
        let e = erec + 2u * ie;
        row_q[r] = (plan[e] * params.group + g) * D;
        row_len[r] = plan[e + 1u];
        row_m[r] = 0.0;
        row_l[r] = 0.0;
    }
    var acc: array<f32, ACC>;
    for (var i = 0u; i < ACC; i++) {
        acc[i] = 0.0;
    }
    workgroupBarrier();

    for (var k0 = 0u; k0 < max_len; k0 += TK) {
        let nk = min(TK, max_len - k0);

        // 1. Load the tile's K and V rows (readable pages only).
        for (var x = tid; x < nk * D; x += WG) {
            let k = x / D;
            let d = x - k * D;
            let pos = k0 + k;
            let slab = plan[pages + pos / S];
            if (slab != INVALID) {
                let src = slab * params.slab_stride + (pos % S) * D + d;
                k_tile[k * KS + d] = k_cache[src];
                v_tile[k * D + d] = v_cache[src];
            }
            if (d == 0u) {
                key_ok[k] = select(0u, 1u, slab != INVALID);
            }
        }
        workgroupBarrier();

        // 2. Scaled scores of every attended (row, key) pair.
        for (var x = tid; x < n_rows * nk; x += WG) {
            let r = x / nk;
            let k = x - r * nk;
            if (key_ok[k] != 0u && k0 + k < row_len[r]) {
                let qb = row_q[r];
                let kb = k * KS;
                var s = 0.0;
                for (var d = 0u; d < D; d++) {
                    s += q[qb + d] * f32(k_tile[kb + d]);
                }
                p_tile[r * TK + k] = s * params.scale;
            }
        }
        workgroupBarrier();

        // 3. Online softmax, one invocation per row.
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
            if (seen) {
                let l_old = row_l[r];
                var m_new = tmax;
                alpha = 0.0;  // nothing attended before: the accumulators are still exactly 0
                if (l_old > 0.0) {
                    m_new = max(row_m[r], tmax);
                    alpha = exp(row_m[r] - m_new);
                }
                var sum = 0.0;
                for (var k = 0u; k < kend; k++) {
                    if (key_ok[k] != 0u) {
                        let p = exp(p_tile[r * TK + k] - m_new);
                        p_tile[r * TK + k] = p;
                        sum += p;
                    }
                }
                row_m[r] = m_new;
                row_l[r] = l_old * alpha + sum;
            }
            row_a[r] = alpha;
        }
        workgroupBarrier();

        // 4. o += P V; each invocation owns up to ACC (row, d) accumulators.
        for (var i = 0u; i < ACC; i++) {
            let x = tid + i * WG;
            if (x < n_rows * D) {
                let r = x / D;
                let d = x - r * D;
                let kend = tile_end(row_len[r], k0, nk);
                var a = acc[i] * row_a[r];
                for (var k = 0u; k < kend; k++) {
                    if (key_ok[k] != 0u) {
                        a += p_tile[r * TK + k] * f32(v_tile[k * D + d]);
                    }
                }
                acc[i] = a;
            }
        }
        workgroupBarrier();
    }

    for (var i = 0u; i < ACC; i++) {
        let x = tid + i * WG;
        if (x < n_rows * D) {
            let r = x / D;
            o_out[(prow0 + r) * D + (x - r * D)] = acc[i];
        }
    }
    for (var r = tid; r < n_rows; r += WG) {
        ml_out[prow0 + r] = vec2<f32>(row_m[r], row_l[r]);
    }
}
