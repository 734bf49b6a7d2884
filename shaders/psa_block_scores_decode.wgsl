// psa_block_scores_decode.wgsl — block scores of the index branch (R22) for items of at most 8
// rows: one workgroup per work item, one invocation per key position.
//
// Same bindings, params record, work items and output keys as psa_block_scores.wgsl (read its
// header); the host uses this kernel when no sequence has more than one query and an item holds
// at most 8 rows (decode: the Hkv KV heads of one query, one shared index key head). Such an item
// has too few rows for a matrix-product tile: its time is the reading of its keys. Here
// invocation p reads key row p of the block itself (whole rows, no workgroup staging, no
// barrier until the end), forms the logits of all the item's rows against the queries held in
// workgroup memory, and keeps each row's maximum key in registers; the maxima of the workgroup's
// invocations are combined with workgroup atomics (a max: the same whatever the order, R19).
//
// Masking (R10, R22) as in psa_block_scores.wgsl: a position is read only when it is below
// npos and its page is in the bound chunk; it counts for a row only when also below the row's
// query_end. Accumulation is f32, dims ascending.
//
// Override constants
//   DV  vec4s per index row     S  page size     BS  block size     WG  invocations (positions per pass)
//   NR  rows per item the host plans (<= 8; 4 or fewer skips the upper four row slots)

alias kv_t = f32;

override DV: u32;
override S: u32;
override RH: u32 = 1u;               // index key heads interleaved per page row: 1 (HND) or Hk_idx (NHD, R34)
override BS: u32;
override WG: u32 = 128u;
override NR: u32 = 8u;
const MAXR: u32 = 8u;
const NAN_KEY: u32 = 0xffffffffu;

struct Params {
    item_base: u32,
    n_items: u32,
    grid_x: u32,
    items_off: u32,
    heads: u32,
    msb: u32,
    scale: f32,
    chunk_first: u32,
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

var<workgroup> qs: array<vec4<f32>, MAXR * DV>;   // [row][vec4] queries of the item
var<workgroup> red: array<atomic<u32>, MAXR>;     // row maxima

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

// row r's running max key with logit a at position pos (rows past n_rows are never counted)
fn upd(best: u32, a: f32, r: u32, pos: i32, r0: u32, n_rows: u32, t0: u32, nh: u32) -> u32 {
    if (r >= n_rows) {
        return best;
    }
    let qend = bitcast<i32>(plan[t0 + (r0 + r) / nh]);
    return select(best, max(best, logit_key(params.scale * a)), pos < qend);
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

    // the item's queries: row r -> qs[r DV ..]; rows past n_rows are zero and never counted
    let x_n = ((MAXR * DV) + WG - 1u) / WG;
    for (var x_i = 0u; x_i < x_n; x_i++) {
        let x = lid + x_i * WG;
        if (x >= (MAXR * DV)) {
            break;
        }
        let r = x / DV;
        let j = x - r * DV;
        var v = vec4<f32>(0.0);
        if (r < n_rows) {
            let rr = r0 + r;
            v = iq[((t0 + rr / nh) * params.heads + h_off + rr % nh) * DV + j];
        }
        qs[x] = v;
    }
    if (lid < MAXR) {
        atomicStore(&red[lid], 0u);  // explicitly: not every driver zeroes workgroup memory
    }
    workgroupBarrier();

    // eight row slots, written out (no dynamically indexed arrays: they may leave registers);
    // slots past n_rows hold zero queries and are never counted
    var b0 = 0u; var b1 = 0u; var b2 = 0u; var b3 = 0u;
    var b4 = 0u; var b5 = 0u; var b6 = 0u; var b7 = 0u;
    let k0_n = (npos + WG - 1u) / WG;
    for (var k0_i = 0u; k0_i < k0_n; k0_i++) {
        let k0 = k0_i * WG;
        let p = k0 + lid;
        var slab = 0xffffffffu;
        if (p < npos) {
            slab = pages[pg + p / S];
        }
        if (slab >= params.chunk_first && slab < params.chunk_end) {
            let kb = ik_row(slab - params.chunk_first, p % S) * DV;
            var a0 = 0.0; var a1 = 0.0; var a2 = 0.0; var a3 = 0.0;
            var a4 = 0.0; var a5 = 0.0; var a6 = 0.0; var a7 = 0.0;
            for (var j = 0u; j < DV; j++) {
                let k = vec4<f32>(ik[kb + j]);
                a0 += dot(qs[j], k);
                a1 += dot(qs[DV + j], k);
                a2 += dot(qs[2u * DV + j], k);
                a3 += dot(qs[3u * DV + j], k);
                if (NR > 4u) {
                    a4 += dot(qs[4u * DV + j], k);
                    a5 += dot(qs[5u * DV + j], k);
                    a6 += dot(qs[6u * DV + j], k);
                    a7 += dot(qs[7u * DV + j], k);
                }
            }
            let pos = i32(s * BS + p);
            b0 = upd(b0, a0, 0u, pos, r0, n_rows, t0, nh);
            b1 = upd(b1, a1, 1u, pos, r0, n_rows, t0, nh);
            b2 = upd(b2, a2, 2u, pos, r0, n_rows, t0, nh);
            b3 = upd(b3, a3, 3u, pos, r0, n_rows, t0, nh);
            b4 = upd(b4, a4, 4u, pos, r0, n_rows, t0, nh);
            b5 = upd(b5, a5, 5u, pos, r0, n_rows, t0, nh);
            b6 = upd(b6, a6, 6u, pos, r0, n_rows, t0, nh);
            b7 = upd(b7, a7, 7u, pos, r0, n_rows, t0, nh);
        }
    }
    atomicMax(&red[0], b0); atomicMax(&red[1], b1); atomicMax(&red[2], b2); atomicMax(&red[3], b3);
    atomicMax(&red[4], b4); atomicMax(&red[5], b5); atomicMax(&red[6], b6); atomicMax(&red[7], b7);
    workgroupBarrier();
    if (lid < n_rows) {
        let rr = r0 + lid;
        let o = ((t0 + rr / nh) * params.heads + h_off + rr % nh) * params.msb + s;
        out[o] = max(out[o], atomicLoad(&red[lid]));
    }
}
