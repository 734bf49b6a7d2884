// psa_block_scores_sgmat.wgsl — block scores of the index branch (R22) with subgroup matrices
// (tensor cores): a drop-in for psa_block_scores.wgsl on devices with f16 x f16 -> f32 16x16x16
// subgroup matrices, float16 index keys and a subgroup size of 32.
//
// Same bindings, Params record, work items, output keys and empty/NaN representation as
// psa_block_scores.wgsl (read its header): one workgroup per work item (rows r0 .. r0 + n_rows of
// a sequence x one block s), the order-preserving u32 key of the max visible logit of each row
// combined into `out` with max. Only the arithmetic differs:
//
// 1. Row scaling. Each row's index query is scaled by a power of two 2^e_r that puts its largest
//    magnitude in [2^14, 2^15) (exact: an exponent change), so that it fits float16 whatever its
//    size; the logit is unscaled by 2^-e_r (exact unless the logit itself leaves the float32 range).
// 2. hi/lo split. The scaled query x is split into hi = f16(x) and lo = f16(x - hi); x = hi + lo
//    within 2^-22 |x| (round-to-nearest conversions), and q . k = hi . k + lo . k, two matrix
//    products with the float16 keys. f16 x f16 products are exact in float32; the sums are float32.
// 3. Tiles. The workgroup is 4 subgroups of 32 (WG = 128); the item is RT rows x 128 positions
//    (PT) per pass, each subgroup owns (RT / SR) rows x (128 SR / 4) positions as MR x MP 16 x 16
//    result matrices. The queries (as hi and lo) and the keys are staged KD dims at a time in
//    workgroup memory ([row][dim] and [position][dim], row stride KDP = KD + 8 f16 against bank
//    conflicts); for each 16 dims a subgroup loads its hi, lo and key matrices and accumulates
//    acc += hi . k then acc += lo . k (a fixed order: R19). Each result matrix is then stored to
//    workgroup memory and every lane folds 8 logits of one row (visible ones only, by `select`)
//    into the row's key with a workgroup atomic max, as the FMA kernel does.
//
// Exact special cases (R22, R26). A row whose query holds NaN or +-inf, is not representable by
// the split (max |q| < 2^-112, a subnormal element, or a nonzero element below 2^-17 max |q|, which
// would lose bits in lo) makes the whole item take the FMA path below; so does a pass whose loaded
// keys hold NaN or +-inf (found by a bit test while staging; hi . inf + lo . inf could give
// inf - inf where q . inf is inf). The FMA path computes each (row, position) logit as the f32 dot
// product of psa_block_scores.wgsl (dims ascending) from storage, so NaN and infinities come out as
// IEEE arithmetic gives them, as in that kernel. Positions a row does not see never reach its key:
// unloaded positions are staged as zeros and every logit passes the same visibility `select`
// (a key held at a position some rows see and others do not only reaches the rows that see it).
// Items are whole sequences' rows and whole blocks, so a row's path depends only on its sequence's
// queries and its block's keys. Rounding: docs/spec/numerics.md, "Block scores on tensor cores".
//
// Bindings (group 0): as psa_block_scores.wgsl; `ik` is read as vec4<f16> (float16 index keys only).
//
// Override constants
//   DV  vec4s per index row (ceil(d_idx / 4))     S   page size      BS  block size
//   RT  rows per item tile: 16, 32 or 64 (>= the host's rows per item)
//   SR  subgroups along the rows: 1 or 2 (RT / 16 divisible by SR, MR = RT / 16 / SR <= 2)
//   KD  dims staged per step: 16, 32 or 64 (the host fits it to the workgroup memory)
// The loader prepends `enable f16;` and `enable chromium_experimental_subgroup_matrix;`.

override DV: u32;
override S: u32;
override BS: u32;
override RT: u32 = 64u;
override SR: u32 = 2u;
override KD: u32 = 32u;
override KDP: u32 = KD + 8u;        // row stride of the staged tiles (f16 elements)
override MR: u32 = RT / 16u / SR;   // 16-row tiles per subgroup (1 or 2)
override MP: u32 = 2u * SR;         // 16-position tiles per subgroup (128 positions / (4 / SR) subgroups)
override NKV: u32 = KD / 4u;        // vec4s of a row staged per step
override QLEN: u32 = (RT + 1u) * KDP;  // staged queries (one spare row: no matrix load reaches past the
override KLEN: u32 = (PT + 1u) * KDP;  // end, whatever the implementation's bounds rule); staged keys
const WG: u32 = 128u;               // 4 subgroups of 32
const PT: u32 = 128u;               // positions per pass
const RS: u32 = 20u;                // row stride of a stored result matrix (f32 elements)
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
@group(0) @binding(2) var<storage, read> ik: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> pages: array<u32>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<u32>;

// staged tiles (sized by override identifiers: matrix loads take no other override-sized arrays)
var<workgroup> qh: array<f16, QLEN>;   // hi of the scaled queries [row][dim]
var<workgroup> ql: array<f16, QLEN>;   // lo
var<workgroup> ks: array<f16, KLEN>;   // keys [position][dim]
var<workgroup> res: array<f32, 65u * RS>;         // one 16 x 16 result matrix per subgroup
var<workgroup> kok: array<u32, PT>;               // 1: position loaded (readable)
var<workgroup> red: array<atomic<u32>, RT>;       // row maxima (max: order-free, R19)
var<workgroup> rmax: array<atomic<u32>, RT>;      // max |q| bits of each row (NaN > inf > finite)
var<workgroup> rmin: array<atomic<u32>, RT>;      // min nonzero |q| bits of each row
var<workgroup> rq: array<u32, RT>;                // vec4 offset of each row's index query
var<workgroup> rqe: array<i32, RT>;               // exclusive end of its visible positions
var<workgroup> rsc: array<f32, RT>;               // 2^e of each row
var<workgroup> rus: array<f32, RT>;               // 2^-e
var<workgroup> bad_rows: atomic<u32>;             // some row cannot take the matrix path
var<workgroup> bad_keys: atomic<u32>;             // a loaded key of this pass is not finite
var<workgroup> flag_u: u32;                       // the flag, for workgroupUniformLoad

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

// true where a float16 pair word holds an infinity or NaN in either half
fn f16_pair_nonfinite(w: u32) -> bool {
    return (w & 0x7c00u) == 0x7c00u || (w & 0x7c000000u) == 0x7c000000u;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) lane: u32) {
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

    // rows (explicit initialisation: not every driver zeroes workgroup memory per workgroup)
    if (lid < RT) {
        let r = r0 + min(lid, n_rows - 1u);
        let t = t0 + r / nh;
        let h = h_off + r % nh;
        rq[lid] = (t * params.heads + h) * DV;
        rqe[lid] = bitcast<i32>(plan[t]);
        atomicStore(&red[lid], 0u);
        atomicStore(&rmax[lid], 0u);
        atomicStore(&rmin[lid], 0xffffffffu);
    }
    if (lid == 0u) {
        atomicStore(&bad_rows, 0u);
        atomicStore(&bad_keys, 0u);
    }
    workgroupBarrier();
    // per row: max |q| and min nonzero |q| as bits (finite bits order like magnitudes; NaN above inf)
    for (var x = lid; x < RT * DV; x += WG) {
        let r = x / DV;
        if (r < n_rows) {
            let b = bitcast<vec4<u32>>(iq[rq[r] + x - r * DV]) & vec4<u32>(0x7fffffffu);
            let nz = select(b, vec4<u32>(0xffffffffu), b == vec4<u32>(0u));
            atomicMax(&rmax[r], max(max(b.x, b.y), max(b.z, b.w)));
            atomicMin(&rmin[r], min(min(nz.x, nz.y), min(nz.z, nz.w)));
        }
    }
    workgroupBarrier();
    if (lid < RT) {
        let mx = atomicLoad(&rmax[lid]);
        let mn = atomicLoad(&rmin[lid]);
        var sc = 1.0;
        var us = 1.0;
        if (mx != 0u) {
            let e_max = mx >> 23u;  // biased exponent of max |q|
            // not finite, too small for 2^e to be a normal float, a subnormal element, or an element
            // below 2^-17 max |q| (scaled below 2^-3, where lo would lose bits)
            if (mx >= 0x7f800000u || e_max < 15u || mn < 0x00800000u || (mn >> 23u) + 17u < e_max) {
                atomicOr(&bad_rows, 1u);
            } else {
                sc = bitcast<f32>((268u - e_max) << 23u);  // 2^(141 - e_max): max |q| -> [2^14, 2^15)
                us = bitcast<f32>((e_max - 14u) << 23u);   // 2^(e_max - 141)
            }
        }
        rsc[lid] = sc;
        rus[lid] = us;
    }
    workgroupBarrier();
    if (lid == 0u) {
        flag_u = atomicLoad(&bad_rows);
    }
    let rows_bad = workgroupUniformLoad(&flag_u);

    let rsub = sg % SR;          // this subgroup's rows: 16 MR rsub ..
    let psub = sg / SR;          // and positions: 16 MP psub ..
    let nstep = (4u * DV + KD - 1u) / KD;
    let sb = sg * 16u * RS;      // this subgroup's result matrix in res
    for (var k0 = 0u; k0 < npos; k0 += PT) {
        let base = s * BS + k0;
        var keys_bad = 1u;
        if (rows_bad == 0u) {
            var acc: array<subgroup_matrix_result<f32, 16, 16>, 8>;  // zero
            for (var st = 0u; st < nstep; st++) {
                let j0 = st * NKV;
                // stage the keys: position p, vec4 j of the step -> ks[p KDP + 4 j ..]
                for (var x = lid; x < PT * NKV; x += WG) {
                    let p = x / NKV;
                    let j = x - p * NKV;
                    let lpos = k0 + p;
                    var v = vec4<f16>(0.0h);
                    var ok = 0u;
                    if (lpos < npos) {
                        let slab = pages[pg + lpos / S];  // INVALID is >= every chunk_end
                        if (slab >= params.chunk_first && slab < params.chunk_end) {
                            ok = 1u;
                            if (j0 + j < DV) {
                                v = ik[((slab - params.chunk_first) * S + lpos % S) * DV + j0 + j];
                                let w = bitcast<vec2<u32>>(v);
                                if (f16_pair_nonfinite(w.x) || f16_pair_nonfinite(w.y)) {
                                    atomicOr(&bad_keys, 1u);
                                }
                            }
                        }
                    }
                    let o = p * KDP + 4u * j;
                    ks[o] = v.x;
                    ks[o + 1u] = v.y;
                    ks[o + 2u] = v.z;
                    ks[o + 3u] = v.w;
                    if (st == 0u && j == 0u) {
                        kok[p] = ok;
                    }
                }
                // stage the queries: row r, vec4 j -> hi and lo of 2^e q
                for (var x = lid; x < RT * NKV; x += WG) {
                    let r = x / NKV;
                    let j = x - r * NKV;
                    var hi = vec4<f16>(0.0h);
                    var lo = vec4<f16>(0.0h);
                    if (r < n_rows && j0 + j < DV) {
                        let q = iq[rq[r] + j0 + j] * rsc[r];
                        hi = vec4<f16>(q);
                        lo = vec4<f16>(q - vec4<f32>(hi));
                    }
                    let o = r * KDP + 4u * j;
                    qh[o] = hi.x;
                    qh[o + 1u] = hi.y;
                    qh[o + 2u] = hi.z;
                    qh[o + 3u] = hi.w;
                    ql[o] = lo.x;
                    ql[o + 1u] = lo.y;
                    ql[o + 2u] = lo.z;
                    ql[o + 3u] = lo.w;
                }
                workgroupBarrier();
                for (var kk = 0u; kk < KD / 16u; kk++) {
                    var ah: array<subgroup_matrix_left<f16, 16, 16>, 2>;
                    var al: array<subgroup_matrix_left<f16, 16, 16>, 2>;
                    for (var i = 0u; i < MR; i++) {
                        let o = 16u * (rsub * MR + i) * KDP + 16u * kk;
                        ah[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&qh, o, KDP);
                        al[i] = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&ql, o, KDP);
                    }
                    for (var j = 0u; j < MP; j++) {
                        // keys [position][dim] read column-major: the right matrix is K^T (dims x positions)
                        let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(
                            &ks, 16u * (psub * MP + j) * KDP + 16u * kk, KDP);
                        for (var i = 0u; i < MR; i++) {
                            acc[i * MP + j] = subgroupMatrixMultiplyAccumulate(ah[i], b, acc[i * MP + j]);
                            acc[i * MP + j] = subgroupMatrixMultiplyAccumulate(al[i], b, acc[i * MP + j]);
                        }
                    }
                }
                workgroupBarrier();
            }
            if (lid == 0u) {
                flag_u = atomicLoad(&bad_keys);
            }
            keys_bad = workgroupUniformLoad(&flag_u);
            if (lid == 0u) {
                atomicStore(&bad_keys, 0u);  // for the next pass: nothing sets it before the pass's end barrier
            }
            if (keys_bad == 0u) {
                // fold: lane l takes row l / 2 of the matrix, positions 8 (l % 2) .. + 7
                let lr = lane >> 1u;
                let lc = 8u * (lane & 1u);
                for (var t = 0u; t < MR * MP; t++) {
                    subgroupMatrixStore<row_major>(&res, sb, acc[t], RS);
                    workgroupBarrier();
                    let row = 16u * (rsub * MR + t / MP) + lr;
                    let p0 = 16u * (psub * MP + t % MP) + lc;
                    if (row < n_rows) {
                        let qe = rqe[row];
                        let us = rus[row];
                        var best = 0u;
                        for (var c = 0u; c < 8u; c++) {
                            let p = p0 + c;
                            let vis = kok[p] != 0u && i32(base + p) < qe;
                            let z = params.scale * (res[sb + lr * RS + lc + c] * us);
                            best = max(best, select(0u, logit_key(z), vis));
                        }
                        atomicMax(&red[row], best);
                    }
                    workgroupBarrier();
                }
            }
        }
        if (keys_bad != 0u) {
            // the FMA path (uniform: rows_bad and keys_bad are workgroup-uniform): each (row, position)
            // logit as psa_block_scores.wgsl computes it, from storage
            for (var x = lid; x < RT * PT; x += WG) {
                let r = x / PT;
                let p = x - r * PT;
                let lpos = k0 + p;
                if (r < n_rows && lpos < npos) {
                    let slab = pages[pg + lpos / S];
                    if (slab >= params.chunk_first && slab < params.chunk_end && i32(base + p) < rqe[r]) {
                        let ko = ((slab - params.chunk_first) * S + lpos % S) * DV;
                        let qo = rq[r];
                        var z = 0.0;
                        for (var j = 0u; j < DV; j++) {
                            let q = iq[qo + j];
                            let k = vec4<f32>(ik[ko + j]);
                            z += q.x * k.x;
                            z += q.y * k.y;
                            z += q.z * k.z;
                            z += q.w * k.w;
                        }
                        atomicMax(&red[r], logit_key(params.scale * z));
                    }
                }
            }
        }
        workgroupBarrier();  // kok, the tiles and the flags are rewritten by the next pass
    }
    workgroupBarrier();
    if (lid < n_rows) {
        let m = atomicLoad(&red[lid]);
        let r = r0 + lid;
        let t = t0 + r / nh;
        let h = h_off + r % nh;
        let o = (t * params.heads + h) * params.msb + s;
        out[o] = max(out[o], m);
    }
}
