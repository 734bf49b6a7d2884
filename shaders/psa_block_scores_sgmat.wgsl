// psa_block_scores_sgmat.wgsl — block scores of the index branch (R22) on 16x16x16 subgroup
// matrices (tensor cores): a drop-in for psa_block_scores.wgsl on float16 HND index keys.
//
// Same bindings, Params record, work items, output keys and empty / NaN representation as
// psa_block_scores.wgsl (read its header): one workgroup per work item (rows r0 .. r0 + n_rows of
// a sequence x one block s), the order-preserving u32 key of the max visible logit of each row
// combined into `out` with max. Only the arithmetic differs.
//
// Layout: only the patterns of psa_partials_sgmat.wgsl, whose Q.K^T is right on the device. Every
// f16 operand the matrix loads read lives in ONE workgroup array of constant size (`hmem`), every
// result they store in ONE f32 array of constant size (`res`); each matrix access ends inside
// its array (the host checks max(RT, PT) HS <= HCAP), so the runtime's bounds rule never
// drops one; a result tile is accumulated over the whole head dim at once, then stored.
//
// 1. Row scaling (exact). Each row's index query is multiplied by a power of two 2^e that puts
//    its largest |q| in [2^14, 2^15) (e clamped to [-113, 126]: 2^e and 2^-e are normal floats);
//    the logit is multiplied back by 2^-e.
// 2. hi / lo split. x = q 2^e becomes hi = x with its float32 mantissa cut to 11 bits (hi11, a
//    float16 value when |x| >= 2^-14) and lo = f16(x - hi) (x - hi is exact in float32); bits,
//    not f32(f16(x)), which a compiler may fold to x. q . k = (hi . k + lo . k) 2^-e: two matrix
//    products with the float16 keys; f16 x f16 products are exact in float32
//    (docs/spec/numerics.md, "Block scores on tensor cores").
// 3. Queries in registers. Once per item the hi parts of the item's RT rows are staged in hmem
//    ([row][dim], row stride HS = 16 ND + 8 halves, dims past d_idx zero), and each subgroup
//    loads the ND left matrices of its 16-row tile (named h0 .. h7); then the same for lo (l0 ..
//    l7). They stay in registers for the whole item.
// 4. Passes of PT = 64 positions. The keys are staged in hmem ([position][dim], stride HS; zeros
//    for positions that are not loaded); subgroup sg owns row tile sg % NRT and the NPT position
//    tiles sg / NRT + CS i; per tile acc = sum over the ND 16-dim chunks of (hi . K^T + lo . K^T)
//    (the right matrix is the staged keys read column-major; a fixed order, R19), stored
//    row-major to res ([row][position], stride RSB). After a barrier, SLR = WG / RT invocations
//    per row fold the row's visible logits (z = scale (S' 2^-e); the visibility `select` of the
//    FMA kernel) into its key with one workgroup atomic max (order-free, R19).
//
// Exact special cases (R22, R26). An item whose query holds NaN or +-inf, and a pass whose
// loaded keys hold NaN or +-inf (a bit test while staging: hi . inf + lo . inf could give
// inf - inf where q . inf is inf), compute that pass's logits with f32 FMAs from the f32 query
// (storage) and the staged f16 keys (dims ascending), so NaN and infinities come out as IEEE
// arithmetic gives them. Positions a row does not see never reach its key. The choice of path
// depends only on the item's own queries and keys: deterministic (R19).
//
// Bindings (group 0): as psa_block_scores.wgsl; `ik` is read as vec4<f16> (float16 index keys,
// HND slabs: RH = 1).
//
// Override constants
//   DV  vec4s per index row (ceil(d_idx / 4), at most 32)   S  page size   BS  block size
//   RT  rows per item tile: 16, 32 or 64 (>= the host's rows per item)
// Workgroup memory (bytes, each variable rounded to 16): 2 HCAP + 4 RCAP + 4 PT + 6 * 4 RT + 2 * 16
// (_index_branch.sgmat_scores_workgroup_bytes: 36640 for RT = 64). Needs subgroups of 32
// consecutive invocations (subgroup sg = invocations 32 sg .. 32 sg + 31). The loader prepends
// `enable f16;`, the subgroup-matrix directive and `enable subgroups;`.

// The matrix builtins need subgroup-uniform arguments; Tint's analysis only knows workgroup
// uniformity, and the tile offsets derive from the subgroup index lid / 32 (uniform within a
// subgroup of 32 consecutive invocations, which the host requires).
diagnostic(off, chromium.subgroup_matrix_uniformity);

override DV: u32;
override S: u32;
override BS: u32;
override RT: u32 = 64u;
override ND: u32 = (DV + 3u) / 4u;       // 16-dim chunks of a row (1 .. 8)
override NU: u32 = 4u * ND;              // vec4 units of a staged row (units past DV are zeros)
override HS: u32 = 16u * ND + 8u;        // f16 row stride of the staged tiles (16-byte rows)
override NRT: u32 = RT / 16u;            // 16-row tiles (1, 2, 4)
override CS: u32 = 4u / NRT;             // subgroups per row tile (4, 2, 1)
override NPT: u32 = (PT / 16u) / CS;     // 16-position tiles per subgroup and pass
override SLR: u32 = WG / RT;             // fold invocations per row (8, 4, 2)
const WG: u32 = 128u;                    // 4 subgroups of 32
const PT: u32 = 64u;                     // positions per pass
const RSB: u32 = PT + 4u;                // f32 row stride of res
// The arrays the matrices load from and store to have constant sizes (as psa_partials_sgmat.wgsl):
const HCAP: u32 = 8704u;                 // f16: 64 rows (or positions) x 136 (HS of d_idx 128)
const RCAP: u32 = 4352u;                 // f32: 64 rows x RSB
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

var<workgroup> hmem: array<f16, HCAP>;            // staged queries (hi, then lo), then the keys
var<workgroup> res: array<f32, RCAP>;             // S' of a pass [row][position]
var<workgroup> kok: array<u32, PT>;               // 1: position loaded (readable)
var<workgroup> red: array<atomic<u32>, RT>;       // row maxima (max: order-free, R19)
var<workgroup> rmax: array<atomic<u32>, RT>;      // max |q| bits of each row (NaN > inf > finite)
var<workgroup> rq: array<u32, RT>;                // vec4 offset of each row's index query
var<workgroup> rqe: array<i32, RT>;               // exclusive end of its visible positions
var<workgroup> rsc: array<f32, RT>;               // 2^e of each row
var<workgroup> rus: array<f32, RT>;               // 2^-e
// Every workgroup variable is a whole number of 16-byte units: the flags are vectors and arrays
// of 4, not scalars. Measured on the H200 through Dawn: with three 4-byte flags the matrix loads
// from hmem read 12 bytes (6 halves) below their offset and the stores to res landed 4 bytes
// below theirs (16- and 8-byte accesses on variables the driver placed at 12 mod 16), which
// silently dropped dims 10..15 of every 16 and shifted every result by one position.
var<workgroup> bad: array<atomic<u32>, 4>;        // [0]: a loaded key of this pass is not finite,
                                                  // [1]: a query of the item holds NaN or +-inf
var<workgroup> flag_u: vec4<u32>;                 // a flag (.x), for workgroupUniformLoad

alias Left = subgroup_matrix_left<f16, 16, 16>;
alias Right = subgroup_matrix_right<f16, 16, 16>;
alias Result = subgroup_matrix_result<f32, 16, 16>;

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

fn put4(o: u32, v: vec4<f16>) {
    hmem[o] = v.x;
    hmem[o + 1u] = v.y;
    hmem[o + 2u] = v.z;
    hmem[o + 3u] = v.w;
}

// Stage part `which` (0: hi, 1: lo) of the scaled queries [row][dim] (zeros past d_idx and past
// the item's rows; a row with a non-finite q is never multiplied: its item takes the FMA path).
fn stage_queries(which: u32, lid: u32, n_rows: u32) {
    for (var x = lid; x < RT * NU; x += WG) {
        let r = x / NU;
        let j = x - r * NU;
        var v = vec4<f16>(0.0h);
        if (r < n_rows && j < DV) {
            let q = iq[rq[r] + j] * rsc[r];
            let h = hi11(q);
            if (which == 0u) {
                v = vec4<f16>(h);
            } else {
                v = vec4<f16>(q - h);
            }
        }
        put4(r * HS + 4u * j, v);
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
        atomicStore(&bad[0], 0u);
        atomicStore(&bad[1], 0u);
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
        if (x < n_rows && mb >= 0x7f800000u) {
            atomicOr(&bad[1], 1u);
        }
        // max in [2^E, 2^(E+1)) -> e = 14 - E puts it in [2^14, 2^15); a zero or subnormal max
        // counts as 2^-127 (e = 126)
        let e = clamp(14 - (max(i32(mb >> 23u), 0) - 127), -113, 126);
        rsc[x] = pow2(e);
        rus[x] = pow2(-e);
    }
    workgroupBarrier();
    if (lid == 0u) {
        flag_u = vec4<u32>(atomicLoad(&bad[1]));
    }
    let rows_bad = workgroupUniformLoad(&flag_u).x;

    let sg = lid / 32u;          // this invocation's subgroup
    let rt = sg % NRT;           // its 16-row tile
    let cs = sg / NRT;           // its share of the position tiles: cs + CS i
    let qo = rt * 16u * HS;      // its rows in the staged queries

    // 3. the item's queries as left matrices, in registers for the whole item (zero when the
    //    item takes the FMA path)
    var h0: Left; var h1: Left; var h2: Left; var h3: Left;
    var h4: Left; var h5: Left; var h6: Left; var h7: Left;
    var l0: Left; var l1: Left; var l2: Left; var l3: Left;
    var l4: Left; var l5: Left; var l6: Left; var l7: Left;
    if (rows_bad == 0u) {
        stage_queries(0u, lid, n_rows);
        workgroupBarrier();
        if (ND > 0u) { h0 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 0u, HS); }
        if (ND > 1u) { h1 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 16u, HS); }
        if (ND > 2u) { h2 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 32u, HS); }
        if (ND > 3u) { h3 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 48u, HS); }
        if (ND > 4u) { h4 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 64u, HS); }
        if (ND > 5u) { h5 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 80u, HS); }
        if (ND > 6u) { h6 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 96u, HS); }
        if (ND > 7u) { h7 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 112u, HS); }
        workgroupBarrier();
        stage_queries(1u, lid, n_rows);
        workgroupBarrier();
        if (ND > 0u) { l0 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 0u, HS); }
        if (ND > 1u) { l1 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 16u, HS); }
        if (ND > 2u) { l2 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 32u, HS); }
        if (ND > 3u) { l3 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 48u, HS); }
        if (ND > 4u) { l4 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 64u, HS); }
        if (ND > 5u) { l5 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 80u, HS); }
        if (ND > 6u) { l6 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 96u, HS); }
        if (ND > 7u) { l7 = subgroupMatrixLoad<Left, row_major>(&hmem, qo + 112u, HS); }
        workgroupBarrier();  // the keys overwrite the staged queries
    }

    let fr = lid / SLR;          // fold: row of this invocation
    let fp = lid - fr * SLR;     // and its positions fp + SLR c
    for (var k0 = 0u; k0 < npos; k0 += PT) {
        let base = s * BS + k0;
        // stage the keys: position p, vec4 j -> hmem[p HS + 4 j ..]
        for (var x = lid; x < PT * NU; x += WG) {
            let p = x / NU;
            let j = x - p * NU;
            let lpos = k0 + p;
            var v = vec4<f16>(0.0h);
            var ok = 0u;
            if (lpos < npos) {
                let slab = pages[pg + lpos / S];  // INVALID is >= every chunk_end
                if (slab >= params.chunk_first && slab < params.chunk_end) {
                    ok = 1u;
                    if (j < DV) {
                        v = ik[((slab - params.chunk_first) * S + lpos % S) * DV + j];
                        let w = bitcast<vec2<u32>>(v);
                        if (f16_pair_nonfinite(w.x) || f16_pair_nonfinite(w.y)) {
                            atomicOr(&bad[0], 1u);
                        }
                    }
                }
            }
            put4(p * HS + 4u * j, v);
            if (j == 0u) {
                kok[p] = ok;
            }
        }
        workgroupBarrier();
        if (lid == 0u) {
            flag_u = vec4<u32>(atomicLoad(&bad[0]));
        }
        let keys_bad = workgroupUniformLoad(&flag_u).x;
        let fma = rows_bad != 0u || keys_bad != 0u;
        if (lid == 0u) {
            atomicStore(&bad[0], 0u);  // for the next pass: set again only after the end barrier
        }
        if (!fma) {
            for (var i = 0u; i < NPT; i++) {
                let ko = (cs + CS * i) * 16u * HS;  // the tile's positions in the staged keys
                var acc = Result();                  // (zero: explicitly, every tile)
                if (ND > 0u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 0u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h0, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l0, b, acc);
                }
                if (ND > 1u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 16u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h1, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l1, b, acc);
                }
                if (ND > 2u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 32u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h2, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l2, b, acc);
                }
                if (ND > 3u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 48u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h3, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l3, b, acc);
                }
                if (ND > 4u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 64u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h4, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l4, b, acc);
                }
                if (ND > 5u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 80u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h5, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l5, b, acc);
                }
                if (ND > 6u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 96u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h6, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l6, b, acc);
                }
                if (ND > 7u) {
                    let b = subgroupMatrixLoad<Right, col_major>(&hmem, ko + 112u, HS);
                    acc = subgroupMatrixMultiplyAccumulate(h7, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(l7, b, acc);
                }
                subgroupMatrixStore<row_major>(&res, rt * 16u * RSB + (cs + CS * i) * 16u, acc, RSB);
            }
        } else {
            // f32 FMAs from the f32 query and the staged keys (dims ascending), unscaled
            for (var x = lid; x < RT * PT; x += WG) {
                let r = x / PT;
                let p = x - r * PT;
                var z = 0.0;
                if (r < n_rows && kok[p] != 0u) {
                    let qr = rq[r];
                    for (var j = 0u; j < DV; j++) {
                        let q = iq[qr + j];
                        let kb = p * HS + 4u * j;
                        z += q.x * f32(hmem[kb]);
                        z += q.y * f32(hmem[kb + 1u]);
                        z += q.z * f32(hmem[kb + 2u]);
                        z += q.w * f32(hmem[kb + 3u]);
                    }
                }
                res[r * RSB + p] = z;
            }
        }
        workgroupBarrier();
        // fold: the visible logits of row fr at positions fp, fp + SLR, ... into its key
        if (fr < n_rows) {
            let qe = rqe[fr];
            let us = select(rus[fr], 1.0, fma);
            var best = 0u;
            for (var p = fp; p < PT; p += SLR) {
                let vis = kok[p] != 0u && i32(base + p) < qe;
                let z = params.scale * (res[fr * RSB + p] * us);
                best = max(best, select(0u, logit_key(z), vis));
            }
            atomicMax(&red[fr], best);
        }
        workgroupBarrier();  // the keys, kok, res and the flags are rewritten by the next pass
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
