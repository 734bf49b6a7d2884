// psa_block_scores.wgsl — block scores of the index branch (R22): one workgroup per work item.
//
// A work item is (block s of sequence b, index key head hk, a run of at most RT "rows" of the
// sequence's queries that read that index key head; RT is 64, or fewer when no sequence has that
// many rows: 8 for decode, so that a workgroup is one subgroup and no invocation idles). A row is one (query t, KV head h): with
// one shared index key head (Hk_idx = 1) the rows of a sequence are all its (t, h) pairs,
// t-major; with Hk_idx = Hkv they are the sequence's queries for KV head h = hk. The workgroup
// computes the item's logits as a register-tiled matrix product, [RT rows] x [d_idx] x [128
// positions] per pass: the index queries and keys are staged 4 DCV dims at a time in workgroup
// memory (KV-outer: each key is loaded once for all the item's rows), and each of the WG = 4 RT
// invocations accumulates a 4 rows x 8 positions tile in registers (RT / 4 row groups x 16
// position groups). The max over the visible positions of each row is taken in registers,
// then across the 16 position groups with workgroup atomics (a max: the same whatever the order). Row groups past the item's rows skip
// the arithmetic (decode items have Hkv rows).
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
//                                  a slab is one (page, index key head): S rows of DV vec4s; with
//                                  RH > 1 (NHD, R34) whole pages [n_pages, S, RH, DV]
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
//   [2] n_rows  rows in the item (<= RT); row r0 + x is (t0 + (r0 + x) / nh, h_off + (r0 + x) % nh)
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
// key and means "nothing visible". psa_score_keys.wgsl decodes 0 -> -inf and 0xffffffff -> NaN
// (block_scores(); a device-resident layer feeds the keys to the top-k as they are).
//
// Override constants
//   DV  vec4s per index row (ceil(d_idx / 4))     S   page size      BS  block size
//   DCV vec4s of each row staged per step (the host fits it to the workgroup memory)
//   RT  rows per work item (64, or the next power of two >= the rows of the longest sequence, >= 8)
// Accumulation is f32, in a fixed order per logit (dims ascending): results do not depend on the
// schedule (R19). The loader rewrites `alias kv_t` to f16 for float16 index caches.

alias kv_t = f32;

override DV: u32;
override S: u32;
override RH: u32 = 1u;               // index key heads interleaved per page row: 1 (HND) or Hk_idx (NHD, R34)
override BS: u32;
override DCV: u32 = 8u;
override RT: u32 = 64u;             // rows per item: a power of two, 8 .. 64
override NRG: u32 = RT / 4u;        // row groups of 4 rows
override WG: u32 = NRG * 16u;       // invocations: NRG row groups x 16 position groups
const PT: u32 = 128u;       // positions per pass
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

var<workgroup> qs: array<f32, DCV * 4u * RT>;  // [dim][row]
var<workgroup> ks: array<f32, DCV * 4u * PT>;  // [dim][position]
var<workgroup> kok: array<u32, PT>;                           // 1: position loaded (readable)
var<workgroup> red: array<atomic<u32>, RT>;                   // row maxima (max: order-free, R19)

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

struct Row {
    qrow: u32,   // vec4 offset of the row's index query
    qend: i32,   // exclusive end of its visible positions
    o: u32,      // its output (t, h, s)
}

fn row_of(r0: u32, x: u32, n_rows: u32, t0: u32, nh: u32, h_off: u32, s: u32) -> Row {
    let r = r0 + min(x, n_rows - 1u);
    let t = t0 + r / nh;
    let h = h_off + r % nh;
    return Row((t * params.heads + h) * DV, bitcast<i32>(plan[t]), (t * params.heads + h) * params.msb + s);
}

// the key of logit x at position p of the pass, 0 where the row does not see it
fn vis_key(x: f32, p: u32, base: u32, qend: i32) -> u32 {
    let vis = kok[p] != 0u && i32(base + p) < qend;
    return select(0u, logit_key(params.scale * x), vis);
}

// the max key of 4 logits of one row at positions p0 .. p0 + 3 of the pass (no dynamic
// indexing of vectors: it may compile to memory instead of registers)
fn quad_max(best: u32, a: vec4<f32>, p0: u32, base: u32, qend: i32) -> u32 {
    return max(max(max(best, vis_key(a.x, p0, base, qend)), vis_key(a.y, p0 + 1u, base, qend)),
               max(vis_key(a.z, p0 + 2u, base, qend), vis_key(a.w, p0 + 3u, base, qend)));
}

// Row of offset `off` of slab `slab` of the bound chunk (R34): HND (RH = 1) slab * S + off; NHD
// the page's row off * RH + head, with page slab / RH and head slab % RH.
fn ik_row(slab: u32, off: u32) -> u32 {
    let page = slab / RH;
    return (page * S + off) * RH + (slab - page * RH);
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

    let rg = lid % NRG;          // rows 4 rg .. 4 rg + 3
    let pgp = lid / NRG;         // positions 8 pgp .. 8 pgp + 7 of a pass
    let live = 4u * rg < n_rows;
    let qe0 = row_of(r0, 4u * rg, n_rows, t0, nh, h_off, s).qend;
    let qe1 = row_of(r0, 4u * rg + 1u, n_rows, t0, nh, h_off, s).qend;
    let qe2 = row_of(r0, 4u * rg + 2u, n_rows, t0, nh, h_off, s).qend;
    let qe3 = row_of(r0, 4u * rg + 3u, n_rows, t0, nh, h_off, s).qend;
    var best0 = 0u;
    var best1 = 0u;
    var best2 = 0u;
    var best3 = 0u;
    if (lid < RT) {
        atomicStore(&red[lid], 0u);  // explicitly: not every driver zeroes workgroup memory per workgroup
    }
    let nstep = (DV + DCV - 1u) / DCV;

    let k0_n = (npos + PT - 1u) / PT;
    for (var k0_i = 0u; k0_i < k0_n; k0_i++) {
        let k0 = k0_i * PT;
        var a0 = vec4<f32>(0.0); var b0 = vec4<f32>(0.0);
        var a1 = vec4<f32>(0.0); var b1 = vec4<f32>(0.0);
        var a2 = vec4<f32>(0.0); var b2 = vec4<f32>(0.0);
        var a3 = vec4<f32>(0.0); var b3 = vec4<f32>(0.0);
        for (var st = 0u; st < nstep; st++) {
            let j0 = st * DCV;
            // stage the keys: position p, vec4 j of the step -> ks[(4 j + c) PT + p]
            let x_n = ((PT * DCV) + WG - 1u) / WG;
            for (var x_i = 0u; x_i < x_n; x_i++) {
                let x = lid + x_i * WG;
                if (x >= (PT * DCV)) {
                    break;
                }
                let p = x / DCV;
                let j = x - p * DCV;
                let lpos = k0 + p;
                var v = vec4<f32>(0.0);
                var ok = 0u;
                if (lpos < npos && j0 + j < DV) {
                    let slab = pages[pg + lpos / S];  // INVALID is >= every chunk_end
                    if (slab >= params.chunk_first && slab < params.chunk_end) {
                        v = vec4<f32>(ik[ik_row(slab - params.chunk_first, lpos % S) * DV + j0 + j]);
                        ok = 1u;
                    }
                }
                let o = 4u * j * PT + p;
                ks[o] = v.x;
                ks[o + PT] = v.y;
                ks[o + 2u * PT] = v.z;
                ks[o + 3u * PT] = v.w;
                if (st == 0u && j == 0u) {
                    kok[p] = ok;
                }
            }
            // stage the queries: row r, vec4 j -> qs[(4 j + c) RT + r]
            let x_n2 = ((RT * DCV) + WG - 1u) / WG;
            for (var x_i = 0u; x_i < x_n2; x_i++) {
                let x = lid + x_i * WG;
                if (x >= (RT * DCV)) {
                    break;
                }
                let r = x / DCV;
                let j = x - r * DCV;
                var v = vec4<f32>(0.0);
                if (r < n_rows && j0 + j < DV) {
                    let rr = row_of(r0, r, n_rows, t0, nh, h_off, s);
                    v = iq[rr.qrow + j0 + j];
                }
                let o = 4u * j * RT + r;
                qs[o] = v.x;
                qs[o + RT] = v.y;
                qs[o + 2u * RT] = v.z;
                qs[o + 3u * RT] = v.w;
            }
            workgroupBarrier();
            if (live) {
                let dd_end = 4u * DCV;
                for (var dd = 0u; dd < dd_end; dd++) {
                    let qo = dd * RT + 4u * rg;
                    let ko = dd * PT + 8u * pgp;
                    let q = vec4<f32>(qs[qo], qs[qo + 1u], qs[qo + 2u], qs[qo + 3u]);
                    let ka = vec4<f32>(ks[ko], ks[ko + 1u], ks[ko + 2u], ks[ko + 3u]);
                    let kb = vec4<f32>(ks[ko + 4u], ks[ko + 5u], ks[ko + 6u], ks[ko + 7u]);
                    a0 += q.x * ka; b0 += q.x * kb;
                    a1 += q.y * ka; b1 += q.y * kb;
                    a2 += q.z * ka; b2 += q.z * kb;
                    a3 += q.w * ka; b3 += q.w * kb;
                }
            }
            workgroupBarrier();
        }
        if (live) {
            let base = s * BS + k0;
            let p0 = 8u * pgp;
            best0 = quad_max(quad_max(best0, a0, p0, base, qe0), b0, p0 + 4u, base, qe0);
            best1 = quad_max(quad_max(best1, a1, p0, base, qe1), b1, p0 + 4u, base, qe1);
            best2 = quad_max(quad_max(best2, a2, p0, base, qe2), b2, p0 + 4u, base, qe2);
            best3 = quad_max(quad_max(best3, a3, p0, base, qe3), b3, p0 + 4u, base, qe3);
        }
        workgroupBarrier();  // kok is rewritten by the next pass
    }
    // max over the 16 position groups of each row (red was zeroed before the first barrier)
    if (live) {
        atomicMax(&red[4u * rg], best0);
        atomicMax(&red[4u * rg + 1u], best1);
        atomicMax(&red[4u * rg + 2u], best2);
        atomicMax(&red[4u * rg + 3u], best3);
    }
    workgroupBarrier();
    if (lid < n_rows) {
        let m = atomicLoad(&red[lid]);
        let rr = row_of(r0, lid, n_rows, t0, nh, h_off, s);
        out[rr.o] = max(out[rr.o], m);
    }
}
