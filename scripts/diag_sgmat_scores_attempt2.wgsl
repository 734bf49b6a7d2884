// psa_block_scores_sgmat.wgsl — block scores of the index branch (R22) on 16x16x16 subgroup
// matrices (tensor cores): a drop-in for psa_block_scores.wgsl on float16 index keys.
//
// Same bindings, Params record, work items, output keys and empty / NaN representation as
// psa_block_scores.wgsl (read its header): one workgroup per work item (rows r0 .. r0 + n_rows of
// a sequence x one block s), the order-preserving u32 key of the max visible logit of each row
// combined into `out` with max. Only the arithmetic differs.
//
// 1. Row scaling (exact). Each row's index query is multiplied by a power of two 2^e that puts
//    its largest |q| in [2^14, 2^15) (e clamped to [-113, 126], so that 2^e and 2^-e are normal
//    floats); the logit is multiplied back by 2^-e.
// 2. hi / lo split. x = q 2^e becomes hi = x with its float32 mantissa cut to 11 bits (hi11, a
//    float16 value when |x| >= 2^-14) and lo = f16(x - hi) (x - hi is exact in float32); bits,
//    not f32(f16(x)), which a compiler may fold to x (lo would be 0). q . k = (hi . k + lo . k)
//    2^-e: two matrix products with the float16 keys; f16 x f16 products are exact in float32.
//    No element size sends a row elsewhere: an element's split error is at most
//    2^-22 |x| + 2^-24 (docs/spec/numerics.md, "Block scores on tensor cores").
// 3. Tiles. WG = 128 = 4 subgroups of 32 (subgroup sg = invocations 32 sg .. 32 sg + 31; the host
//    requires a subgroup size of 32). A pass covers RT rows x PT = 128 positions; subgroup sg owns
//    MR 16-row tiles (rows 16 MR (sg % SR) ..) x MP 16-position tiles (positions 16 MP (sg / SR)
//    ..), as MR x MP named f32 result matrices (no array of matrices). Per step of KD dims, the
//    keys [position][dim] and both query parts [row][dim] are staged in workgroup memory (row
//    stride KDP = KD + 8 halves: 16-byte rows, no bank conflicts); for each 16 dims a subgroup
//    loads its left matrices (hi, lo) and one right matrix per position tile (the keys read
//    column-major: K^T) and accumulates acc += hi . k, then acc += lo . k (a fixed order, R19).
// 4. Fold. Per 16-row tile of a subgroup, its MP result matrices are stored side by side in the
//    subgroup's own area of `res` ([row][position], stride RS = 16 MP + 4); after one barrier
//    lane l takes row l / 2 and 8 MP positions, unscales them (z = scale (S' 2^-e)), keeps the
//    largest key of the visible ones (a `select`, as the FMA kernel) and folds it into the row's
//    key with one workgroup atomic max (a max: order-free, R19). Two barriers per row tile.
//
// Exact special cases (R22, R26). An item with a query holding NaN or +-inf, and a pass whose
// loaded keys hold NaN or +-inf (a bit test while staging; hi . inf + lo . inf could give
// inf - inf where q . inf is inf), take the FMA path: each visible (row, position) logit is the
// f32 dot product of psa_block_scores.wgsl (dims ascending) from storage, so NaN and infinities
// come out as IEEE arithmetic gives them. Positions a row does not see never reach its key:
// unloaded positions are staged as zeros and every logit passes the visibility `select`.
// The choice of path depends only on the item's own queries and keys: deterministic (R19).
//
// Bindings (group 0): as psa_block_scores.wgsl; `ik` is read as vec4<f16> (float16 index keys).
//
// Override constants
//   DV  vec4s per index row (ceil(d_idx / 4))     S   page size      BS  block size
//   RT  rows per item tile: 16, 32 or 64 (>= the host's rows per item)
//   SR  subgroups along the rows: 1 or 2 (MR = RT / 16 / SR is 1 or 2; MP = 2 SR)
//   KD  dims staged per step: 16, 32 or 64
// Workgroup memory (bytes): 2 (2 RT + 128) KDP + 4 * 4 * 16 RS + 4 (128 + 5 RT) + 12
// (_index_branch.sgmat_scores_workgroup_bytes). The loader prepends `enable f16;`, the
// subgroup-matrix directive and `enable subgroups;`.

// The matrix builtins need subgroup-uniform arguments; Tint's analysis only knows workgroup
// uniformity, and the tile offsets derive from the subgroup index lid / 32 (uniform within a
// subgroup of 32 consecutive invocations, which the host requires).
diagnostic(off, chromium.subgroup_matrix_uniformity);

override DV: u32;
override S: u32;
override BS: u32;
override RT: u32 = 64u;
override SR: u32 = 2u;
override KD: u32 = 32u;
override KDP: u32 = KD + 8u;           // row stride of the staged tiles (f16 elements)
override MR: u32 = RT / 16u / SR;      // 16-row tiles per subgroup (1 or 2)
override MP: u32 = 2u * SR;            // 16-position tiles per subgroup (2 or 4)
override RS: u32 = 16u * MP + 4u;      // row stride of a subgroup's stored results (f32)
override NKV: u32 = KD / 4u;           // vec4s of a row staged per step
override QLEN: u32 = RT * KDP;         // one staged query part
override KLEN: u32 = PT * KDP;         // the staged keys
override RLEN: u32 = 4u * 16u * RS;    // the stored results of the 4 subgroups
const WG: u32 = 128u;                  // 4 subgroups of 32
const PT: u32 = 128u;                  // positions per pass
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

var<workgroup> qh: array<f16, QLEN>;              // hi of the scaled queries [row][dim]
var<workgroup> ql: array<f16, QLEN>;              // lo
var<workgroup> ks: array<f16, KLEN>;              // keys [position][dim]
var<workgroup> res: array<f32, RLEN>;             // per subgroup: 16 rows x MP tiles of results
var<workgroup> kok: array<u32, PT>;               // 1: position loaded (readable)
var<workgroup> red: array<atomic<u32>, RT>;       // row maxima (max: order-free, R19)
var<workgroup> rmax: array<atomic<u32>, RT>;      // max |q| bits of each row (NaN > inf > finite)
var<workgroup> rq: array<u32, RT>;                // vec4 offset of each row's index query
var<workgroup> rqe: array<i32, RT>;               // exclusive end of its visible positions
var<workgroup> rsc: array<f32, RT>;               // 2^e of each row
var<workgroup> rus: array<f32, RT>;               // 2^-e
var<workgroup> bad_keys: atomic<u32>;             // a loaded key of this pass is not finite
var<workgroup> bad_rows: atomic<u32>;             // a query of the item holds NaN or +-inf
var<workgroup> flag_u: u32;                       // a flag, for workgroupUniformLoad

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

// x with its float32 mantissa cut to the 11 bits of a float16 (see step 2 above)
fn hi11(x: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(x) & vec4<u32>(0xffffe000u));
}

// an exact power of two 2^e, e in [-126, 127]
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(127 + e) << 23u);
}

// Fold the 8 MP results of one lane (row lr of tile row tr, positions from pc) into the row's key.
fn fold_row(sb: u32, lr: u32, lc: u32, row: u32, pc: u32, n_rows: u32, base: u32) {
    if (row < n_rows) {
        let qe = rqe[row];
        let us = rus[row];
        var best = 0u;
        for (var c = 0u; c < 8u * MP; c++) {
            let p = pc + c;
            let vis = kok[p] != 0u && i32(base + p) < qe;
            let z = params.scale * (res[sb + lr * RS + lc + c] * us);
            best = max(best, select(0u, logit_key(z), vis));
        }
        atomicMax(&red[row], best);
    }
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

    // rows (explicit initialisation: not every driver zeroes workgroup memory per workgroup)
    for (var x = lid; x < RT; x += WG) {
        let r = r0 + min(x, n_rows - 1u);
        let t = t0 + r / nh;
        let h = h_off + r % nh;
        rq[x] = (t * params.heads + h) * DV;
        rqe[x] = bitcast<i32>(plan[t]);
        atomicStore(&red[x], 0u);
        atomicStore(&rmax[x], 0u);
    }
    if (lid == 0u) {
        atomicStore(&bad_keys, 0u);
        atomicStore(&bad_rows, 0u);
    }
    workgroupBarrier();
    // each row's largest |q| as bits (finite bits order like magnitudes; inf and NaN lie above)
    for (var x = lid; x < RT * DV; x += WG) {
        let r = x / DV;
        if (r < n_rows) {
            let b = bitcast<vec4<u32>>(iq[rq[r] + x - r * DV]) & vec4<u32>(0x7fffffffu);
            atomicMax(&rmax[r], max(max(b.x, b.y), max(b.z, b.w)));
        }
    }
    workgroupBarrier();
    for (var x = lid; x < RT; x += WG) {
        let mb = atomicLoad(&rmax[x]);
        if (mb >= 0x7f800000u) {
            atomicOr(&bad_rows, 1u);
        }
        // max in [2^E, 2^(E+1)) -> e = 14 - E puts it in [2^14, 2^15); a zero or subnormal max
        // counts as 2^-127 (e = 126)
        let e = clamp(14 - (max(i32(mb >> 23u), 0) - 127), -113, 126);
        rsc[x] = pow2(e);
        rus[x] = pow2(-e);
    }
    workgroupBarrier();
    if (lid == 0u) {
        flag_u = atomicLoad(&bad_rows);
    }
    let rows_bad = workgroupUniformLoad(&flag_u);

    let sg = lid / 32u;          // this invocation's subgroup
    let lane = lid % 32u;
    let rsub = sg % SR;          // its rows: 16 MR rsub ..
    let psub = sg / SR;          // and positions: 16 MP psub ..
    let nstep = (4u * DV + KD - 1u) / KD;
    let sb = sg * 16u * RS;      // its area of res
    let lr = lane >> 1u;         // fold: lane l takes row l / 2 of a tile row,
    let lc = 8u * MP * (lane & 1u);  // and 8 MP of its 16 MP positions
    for (var k0 = 0u; k0 < npos; k0 += PT) {
        let base = s * BS + k0;
        var keys_bad = 1u;
        if (rows_bad == 0u) {
            var a00 = subgroup_matrix_result<f32, 16, 16>();  // (zero: explicitly, every pass)
            var a01 = subgroup_matrix_result<f32, 16, 16>();
            var a02 = subgroup_matrix_result<f32, 16, 16>();
            var a03 = subgroup_matrix_result<f32, 16, 16>();
            var a10 = subgroup_matrix_result<f32, 16, 16>();
            var a11 = subgroup_matrix_result<f32, 16, 16>();
            var a12 = subgroup_matrix_result<f32, 16, 16>();
            var a13 = subgroup_matrix_result<f32, 16, 16>();
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
                        let h = hi11(q);
                        hi = vec4<f16>(h);
                        lo = vec4<f16>(q - h);
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
                for (var kk = 0u; kk < KD; kk += 16u) {
                    let oq = 16u * MR * rsub * KDP + kk;
                    let h0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&qh, oq, KDP);
                    let l0 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&ql, oq, KDP);
                    var h1 = subgroup_matrix_left<f16, 16, 16>();
                    var l1 = subgroup_matrix_left<f16, 16, 16>();
                    if (MR > 1u) {
                        h1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&qh, oq + 16u * KDP, KDP);
                        l1 = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&ql, oq + 16u * KDP, KDP);
                    }
                    // keys [position][dim] read column-major: the right matrix is K^T (dims x positions)
                    let ok0 = 16u * MP * psub * KDP + kk;
                    {
                        let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&ks, ok0, KDP);
                        a00 = subgroupMatrixMultiplyAccumulate(h0, b, a00);
                        a00 = subgroupMatrixMultiplyAccumulate(l0, b, a00);
                        if (MR > 1u) {
                            a10 = subgroupMatrixMultiplyAccumulate(h1, b, a10);
                            a10 = subgroupMatrixMultiplyAccumulate(l1, b, a10);
                        }
                    }
                    {
                        let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&ks, ok0 + 16u * KDP, KDP);
                        a01 = subgroupMatrixMultiplyAccumulate(h0, b, a01);
                        a01 = subgroupMatrixMultiplyAccumulate(l0, b, a01);
                        if (MR > 1u) {
                            a11 = subgroupMatrixMultiplyAccumulate(h1, b, a11);
                            a11 = subgroupMatrixMultiplyAccumulate(l1, b, a11);
                        }
                    }
                    if (MP > 2u) {
                        let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&ks, ok0 + 32u * KDP, KDP);
                        a02 = subgroupMatrixMultiplyAccumulate(h0, b, a02);
                        a02 = subgroupMatrixMultiplyAccumulate(l0, b, a02);
                        if (MR > 1u) {
                            a12 = subgroupMatrixMultiplyAccumulate(h1, b, a12);
                            a12 = subgroupMatrixMultiplyAccumulate(l1, b, a12);
                        }
                    }
                    if (MP > 3u) {
                        let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&ks, ok0 + 48u * KDP, KDP);
                        a03 = subgroupMatrixMultiplyAccumulate(h0, b, a03);
                        a03 = subgroupMatrixMultiplyAccumulate(l0, b, a03);
                        if (MR > 1u) {
                            a13 = subgroupMatrixMultiplyAccumulate(h1, b, a13);
                            a13 = subgroupMatrixMultiplyAccumulate(l1, b, a13);
                        }
                    }
                }
                workgroupBarrier();  // the tiles are restaged by the next step
            }
            if (lid == 0u) {
                flag_u = atomicLoad(&bad_keys);
            }
            keys_bad = workgroupUniformLoad(&flag_u);
            if (lid == 0u) {
                atomicStore(&bad_keys, 0u);  // for the next pass: nothing sets it before the pass's end barrier
            }
            if (keys_bad == 0u) {
                // row tile 0 of the subgroup: its MP result matrices side by side, then the fold
                subgroupMatrixStore<row_major>(&res, sb, a00, RS);
                subgroupMatrixStore<row_major>(&res, sb + 16u, a01, RS);
                if (MP > 2u) {
                    subgroupMatrixStore<row_major>(&res, sb + 32u, a02, RS);
                }
                if (MP > 3u) {
                    subgroupMatrixStore<row_major>(&res, sb + 48u, a03, RS);
                }
                workgroupBarrier();
                let pc = 16u * MP * psub + lc;
                fold_row(sb, lr, lc, 16u * MR * rsub + lr, pc, n_rows, base);
                if (MR > 1u) {
                    workgroupBarrier();  // row tile 1 overwrites the area
                    subgroupMatrixStore<row_major>(&res, sb, a10, RS);
                    subgroupMatrixStore<row_major>(&res, sb + 16u, a11, RS);
                    if (MP > 2u) {
                        subgroupMatrixStore<row_major>(&res, sb + 32u, a12, RS);
                    }
                    if (MP > 3u) {
                        subgroupMatrixStore<row_major>(&res, sb + 48u, a13, RS);
                    }
                    workgroupBarrier();
                    fold_row(sb, lr, lc, 16u * MR * rsub + 16u + lr, pc, n_rows, base);
                }
            }
        }
        if (keys_bad != 0u) {
            // the FMA path (uniform: rows_bad and keys_bad are workgroup-uniform): each visible
            // (row, position) logit as psa_block_scores.wgsl computes it, from storage
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
        workgroupBarrier();  // kok, the tiles, res and the flags are rewritten by the next pass
    }
    if (lid < n_rows) {
        let m = atomicLoad(&red[lid]);
        let r = r0 + lid;
        let t = t0 + r / nh;
        let h = h_off + r % nh;
        let o = (t * params.heads + h) * params.msb + s;
        out[o] = max(out[o], m);
    }
}
