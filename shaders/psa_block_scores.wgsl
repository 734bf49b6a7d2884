// psa_block_scores.wgsl — block scores of the index branch (R22): one workgroup per work item.
//
// A work item is (block s of sequence b, index key head hk, a run of at most WG "rows" of the
// sequence's queries that read that index key head). A row is one (query t, KV head h): with
// one shared index key head (Hk_idx = 1) the rows of a sequence are all its (t, h) pairs,
// t-major; with Hk_idx = Hkv they are the sequence's queries for KV head h = hk. The workgroup
// walks the block in tiles of TK positions, loads each tile of index keys once into workgroup
// memory (KV-outer: once for all the item's rows) and every invocation takes the max of its
// row's logits against it.
//
// The host splits the index key pool into binding-sized chunks; one dispatch binds one chunk
// (device slabs [chunk_first, chunk_end)) and runs the items whose block has a page in it; a
// page of another chunk is skipped. Items of different chunks for one (t, h, s) combine through
// max into the output (dispatches of one pass are ordered), so chunking changes nothing.
//
// Bindings (group 0)
//   0 params  uniform              Params (below; one 48-byte record per dispatch)
//   1 iq      storage, read        vec4<f32> [n_q, Hkv, DV]  index queries of the batch (zero-padded
//                                  to DV = ceil(d_idx / 4) vec4s per row)
//   2 ik      storage, read        vec4<kv_t> [n_slabs_in_chunk, S, DV]  index keys of one chunk;
//                                  a slab is one (page, index key head): S rows of DV vec4s
//   3 pages   storage, read        u32 [B, msb, Hk_idx, ppb]  device slab of each page of each
//                                  block (numbered across chunks), or INVALID (unmapped, or
//                                  starting at or past L_b: never uploaded)
//   4 plan    storage, read        u32: query_end of the batch's queries (i32 bits, exclusive end
//                                  of the positions each may see), then work items at items_off
//                                  (a batch's items may be spread over several plan buffers)
//   5 out     storage, read_write  u32 [n_q, Hkv, msb]  the score of every (t, h, s) as a key:
//                                  0 = nothing visible, 0xffffffff = NaN, else the order-preserving
//                                  key of the float32 max (see logit_key); zero-initialised
//
// Work item i (8 u32 at items_off + (item_base + i) * 8):
//   [0] t0      batch-local query of the sequence's first row in the batch
//   [1] r0      first row of the item (rows of the sequence in the batch counted from t0)
//   [2] n_rows  rows in the item (<= WG); row r0 + x is (t0 + (r0 + x) / nh, h_off + (r0 + x) % nh)
//   [3] nh      KV heads per query in the row numbering (Hkv or 1)
//   [4] h_off   first KV head (0, or hk with Hk_idx = Hkv)
//   [5] pages   offset of the block's page list (ppb entries) in `pages`
//   [6] npos    block positions to visit: min(BS, L_b - s BS, max query_end of the rows - s BS)
//   [7] s       block id
//
// Masking (R10, R22): positions >= npos, INVALID pages and pages of other chunks are never read
// (their tile slots hold zeros and are excluded by `select`, never multiplied away); a position
// is visible to a row iff its page is in the bound chunk and s BS + pos < query_end[t]
// (query_end already folds in L_b and the causal limit).
//
// Empty and NaN representation: WGSL guarantees neither infinities nor NaN ordering in max, so a
// row keeps the max of u32 keys. logit_key maps a float32 to an order-preserving u32 (bit test for
// NaN -> 0xffffffff, the largest key, so NaN wins every max as in the reference); 0 is no float's
// key and means "nothing visible". The host decodes 0 -> -inf and 0xffffffff -> NaN.
//
// Override constants
//   DV  vec4s per index row (ceil(d_idx / 4))     S   page size      BS  block size
//   TK  positions per tile (<= TKMAX)             WG  workgroup size = rows per work item
// Each invocation holds QC vec4s of its query in registers at a time and accumulates the TK
// logits of the tile in registers; the key tile is read as broadcasts (every invocation reads
// the same element). Accumulation is f32; the loader rewrites `alias kv_t` to f16 for float16
// index caches.

alias kv_t = f32;

override DV: u32;
override S: u32;
override BS: u32;
override TK: u32;
override WG: u32 = 64u;

const TKMAX: u32 = 32u;
const QC: u32 = 8u;
const INVALID: u32 = 0xffffffffu;
const NAN_KEY: u32 = 0xffffffffu;

struct Params {
    item_base: u32,  // first work item of this dispatch
    n_items: u32,    // work items in this dispatch
    grid_x: u32,     // workgroups along x (the grid is 2-D: item = y * grid_x + x)
    items_off: u32,  // offset of the work items in plan
    heads: u32,      // Hkv
    msb: u32,        // blocks per row of out
    scale: f32,      // index scale
    chunk_first: u32,  // device slabs [chunk_first, chunk_end) are in the bound ik chunk
    chunk_end: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> iq: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> ik: array<vec4<kv_t>>;
@group(0) @binding(3) var<storage, read> pages: array<u32>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<u32>;

var<workgroup> k_tile: array<vec4<f32>, TK * DV>;  // [pos][j]
var<workgroup> k_ok: array<u32, TK>;               // 1: the tile position was loaded (readable)

// Order-preserving u32 key of a float32 (NaN -> NAN_KEY, never 0).
fn logit_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return NAN_KEY;
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let item = wid.y * params.grid_x + wid.x;
    if (item >= params.n_items) {
        return;
    }
    let ib = params.items_off + (params.item_base + item) * 8u;
    let t0 = plan[ib];
    let r0 = plan[ib + 1u];
    let n_rows = plan[ib + 2u];
    let nh = plan[ib + 3u];
    let h_off = plan[ib + 4u];
    let pg = plan[ib + 5u];
    let npos = plan[ib + 6u];
    let s = plan[ib + 7u];

    let live = lid < n_rows;
    let r = r0 + min(lid, n_rows - 1u);
    let t = t0 + r / nh;
    let h = h_off + r % nh;
    let qrow = (t * params.heads + h) * DV;
    let qend = bitcast<i32>(plan[t]);
    let pos0 = s * BS;

    var best = 0u;
    for (var k0 = 0u; k0 < npos; k0 += TK) {
        // load the tile once for all rows; unreadable slots are zeros and flagged
        for (var x = lid; x < TK * DV; x += WG) {
            let p = x / DV;
            let j = x - p * DV;
            let lpos = k0 + p;
            var v = vec4<f32>(0.0);
            var ok = 0u;
            if (lpos < npos) {
                let slab = pages[pg + lpos / S];  // INVALID is >= every chunk_end
                if (slab >= params.chunk_first && slab < params.chunk_end) {
                    v = vec4<f32>(ik[((slab - params.chunk_first) * S + lpos % S) * DV + j]);
                    ok = 1u;
                }
            }
            k_tile[x] = v;
            if (j == 0u) {
                k_ok[p] = ok;
            }
        }
        workgroupBarrier();
        if (live) {
            var acc: array<f32, TKMAX>;
            for (var p = 0u; p < TK; p++) {
                acc[p] = 0.0;
            }
            for (var j0 = 0u; j0 < DV; j0 += QC) {
                var qr: array<vec4<f32>, QC>;
                for (var j = 0u; j < QC; j++) {
                    qr[j] = vec4<f32>(0.0);
                    if (j0 + j < DV) {
                        qr[j] = iq[qrow + j0 + j];
                    }
                }
                for (var p = 0u; p < TK; p++) {
                    var sum = 0.0;
                    for (var j = 0u; j < QC; j++) {
                        if (j0 + j < DV) {
                            sum += dot(qr[j], k_tile[p * DV + j0 + j]);
                        }
                    }
                    acc[p] += sum;
                }
            }
            for (var p = 0u; p < TK; p++) {
                let vis = k_ok[p] != 0u && i32(pos0 + k0 + p) < qend;
                best = max(best, select(0u, logit_key(params.scale * acc[p]), vis));
            }
        }
        workgroupBarrier();
    }
    if (live) {
        let o = (t * params.heads + h) * params.msb + s;
        out[o] = max(out[o], best);
    }
}
