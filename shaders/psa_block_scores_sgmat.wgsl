// psa_block_scores_sgmat.wgsl — block scores of the index branch (R22) on 16x16x16 subgroup
// matrices (tensor cores): a drop-in for psa_block_scores.wgsl on float16 HND index keys whose
// rows are whole 16-dim chunks (d_idx a multiple of 16) and whose pages and blocks are whole
// 16-position tiles (S and BS multiples of 16).
//
// Same bindings, Params record, work items, output keys and empty / NaN representation as
// psa_block_scores.wgsl (read its header). Only the arithmetic and the schedule differ: one
// workgroup runs IPW consecutive work items (items item0 IPW .. item0 IPW + IPW - 1 of the
// dispatch: the host dispatches ceil(n_items / IPW) workgroups); consecutive items of the same
// rows (the host plans the blocks of one row run one after another) reuse the staged queries.
//
// Workgroup: 4 subgroups of 32 (subgroup sg = invocations 32 sg .. 32 sg + 31); subgroup sg owns
// rows 16 sg .. 16 sg + 15 of the item, over every position: the subgroups share no data after
// the queries are staged (a subgroup without rows idles: items of fewer than 64 rows).
//
// 1. Row scaling (exact). Each row's index query is multiplied by a power of two 2^e that puts
//    its largest |q| in [2^14, 2^15) (e clamped to [-113, 126]: 2^e and 2^-e are normal floats);
//    the logit is multiplied back by 2^-e.
// 2. hi / lo split. x = q 2^e becomes hi = x with its float32 mantissa cut to 11 bits (hi11, a
//    float16 value when |x| >= 2^-14) and lo = f16(x - hi) (x - hi is exact in float32); bits,
//    not f32(f16(x)), which a compiler may fold to x. q . k = (hi . k + lo . k) 2^-e: two matrix
//    products with the float16 keys; f16 x f16 products are exact in float32
//    (docs/spec/numerics.md, "Block scores on tensor cores").
// 3. Queries in registers. When an item's rows differ from the previous item's, the rows are
//    staged one 16-row tile at a time (hi at qs[0 ..], lo at qs[QH ..], [row][dim], row stride
//    HS = 16 ND + 8 halves; zeros past the item's rows) by the whole workgroup, and the tile's
//    subgroup loads its ND hi and ND lo right-hand matrices (h0 .. h7, l0 .. l7: 16 dims x 16
//    rows, column-major from the [row][dim] tile); they stay in registers for the item run.
// 4. Keys straight from storage. A 16-position tile of a block lies in one page (S, BS multiples
//    of 16), so its keys are 16 consecutive rows of one slab: each left-hand matrix (16 positions
//    x 16 dims, one key row per matrix row) is loaded row-major from `ik` (stride 4 DV halves).
//    The keys are the left operand and the queries the right one, so the units compute S^T: on
//    the H200 (Dawn) the prefill block scores took 3.10 ms this way against 5.49 ms with the
//    queries on the left and the keys loaded column-major as the right operand, with the same
//    selections (docs/benchmarks.md, 2026-12-02). A tile whose page is
//    unmapped or in another chunk is not loaded (its accumulator stays zero, its positions are
//    invisible). Positions past npos in a loaded page are read (whole slabs are bound) but only
//    reach their own result column, which the fold never takes.
// 5. Steps of NT tiles: acc = sum over the ND chunks of (K . hi^T + K . lo^T) (a fixed order,
//    R19: S^T, positions x rows), stored column-major, so as S ([row][position]), to the
//    subgroup's result buffer (two buffers per subgroup, alternating: one
//    barrier per step); lane l then folds row 16 sg + l / 2, positions l % 2 + 2 c (c = 0 .. 7;
//    rows 8 .. 15 start one c later, so the 32 lanes read 32 banks at every c) of every tile:
//    where visible (position < lim, the block's positions the row sees) it keeps the largest
//    order key of sgn S' (sgn = -1 for a negative scale) in a register, and after the item it
//    scales that one S' (z = scale (S' 2^-e), as the FMA kernel's) into a key: the largest key of
//    the positions' logits, bit for bit (see order_key). The two lanes of a row then combine
//    (subgroupShuffleXor) and one writes max(out, key).
//
// Exact special cases (R22, R26). With finite operands no scaled product or sum overflows
// (|hi|, |lo| < 2^15, |k| <= 65504, 128 terms: < 2^38), so a non-finite S' means a key of that
// position holds NaN or +-inf; and a row whose query holds NaN or +-inf is flagged while
// staging. For a visible position with a non-finite S', and for every visible position of a
// flagged row, the fold recomputes the logit with f32 FMAs from the f32 query and the f16 key
// (storage; dims ascending, as psa_block_scores.wgsl), unscaled, so NaN and infinities come out
// as IEEE arithmetic gives them; such positions (rare: the lane's 8 positions of a tile are
// checked first, and redone one by one only when one needs it) and all positions when the scale
// is zero take a key each. Positions a row does not see never reach its key. The choice
// depends only on the item's own queries and keys: deterministic (R19).
//
// Bindings (group 0): as psa_block_scores.wgsl; `ik` is read as f16 (float16 index keys, HND
// slabs: RH = 1, rows of 4 DV halves).
//
// Override constants
//   DV  vec4s per index row (d_idx / 4: a multiple of 4, at most 32)   S  page size   BS  block size
//   RT  rows per item: 16, 32 or 64 (>= the host's rows per item)
//   NT  16-position tiles per step: 1, 2 or 4      IPW  work items per workgroup (>= 1)
// Workgroup memory (bytes): 2 * 2 * 16 HS (HS = 136) + 4 * 2 * 4 * 16 (16 NT + 4) + 16 * 64
// (_index_branch.sgmat_scores_workgroup_bytes: 19968, 28160, 44544 for NT = 1, 2, 4). Needs subgroups of 32 consecutive invocations.
// The loader prepends `enable f16;`, the subgroup-matrix directive and `enable subgroups;`.

// The matrix builtins need subgroup-uniform arguments; Tint's analysis only knows workgroup
// uniformity, and the tile offsets derive from the subgroup index lid / 32 (uniform within a
// subgroup of 32 consecutive invocations, which the host requires).
diagnostic(off, chromium.subgroup_matrix_uniformity);

override DV: u32;
override S: u32;
override BS: u32;
override RT: u32 = 64u;
override NT: u32 = 2u;
override IPW: u32 = 8u;
override ND: u32 = DV / 4u;              // 16-dim chunks of a row (1 .. 8)
override RW: u32 = 16u * NT + 4u;        // f32 row stride of a result buffer
override RB: u32 = 16u * RW;             // f32 of one result buffer (16 rows)
override KS: u32 = 4u * DV;              // f16 row stride of the keys in storage
const NSG: u32 = 4u;                     // subgroups = 16-row tiles
const WG: u32 = 128u;
// The staged query tile has a constant size that holds every matrix load of the shader, even
// those a smaller ND never runs (Tint checks them all against the array's size).
const HS: u32 = 136u;                    // f16 row stride of the staged query tile (16-byte rows)
const QH: u32 = 16u * HS;                // halves of one staged 16-row tile
const INVALID: u32 = 0xffffffffu;
const NAN_KEY: u32 = 0xffffffffu;

struct Params {
    item_base: u32,  // first work item of this dispatch
    n_items: u32,    // work items in this dispatch
    grid_x: u32,     // workgroups along x (the grid is 2-D: workgroup = y * grid_x + x)
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
@group(0) @binding(2) var<storage, read> ik: array<f16>;
@group(0) @binding(3) var<storage, read> pages: array<u32>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<u32>;

// Every workgroup variable is a whole number of 16-byte units (see docs/backends/dawn.md: Dawn on
// NVIDIA misplaced matrix accesses of arrays that followed scalars adding up to 12 bytes).
var<workgroup> qs: array<f16, 2u * QH>;           // one staged 16-row query tile: hi, then lo
var<workgroup> res: array<f32, 2u * NSG * RB>;    // S' of a step: [subgroup][buffer][row][position]
var<workgroup> rinf: array<vec4<f32>, 64>;        // per row: (2^-e, 1 if the query is not finite, 0, 0)

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

// Order-preserving i32 of a finite float32 (-0 below +0; never NO_KEY) and its inverse. With a
// nonzero scale the fold keeps the largest order key of sgn S' over a row's positions and scales
// that one S': scale (S' 2^-e) is a non-decreasing function of sgn S' in this order (two
// correctly rounded products by factors sgn makes positive; signed zeros, subnormals and
// overflow to +-inf included: tests/test_wgpu_sgmat_scores.py checks it in float32), so its
// logit_key is the largest of the positions' logit_keys. A zero scale would map an overflowed
// S' 2^-e to NaN (no order to keep): it keeps a key per position.
const NO_KEY: i32 = -2147483647 - 1;

fn order_key(x: f32) -> i32 {
    let b = bitcast<i32>(x);
    return b ^ ((b >> 31u) & 0x7fffffff);
}

fn order_value(k: i32) -> f32 {
    return bitcast<f32>(k ^ ((k >> 31u) & 0x7fffffff));
}

// x with its float32 mantissa cut to the 11 bits of a float16 (see step 2 above)
fn hi11(x: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(x) & vec4<u32>(0xffffe000u));
}

// an exact power of two 2^e, e in [-126, 127]
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(127 + e) << 23u);
}

// vec4 offset in iq of row r of a sequence's rows in the batch: (t0 + r / nh, h_off + r % nh)
fn row_q(r: u32, t0: u32, nh: u32, h_off: u32) -> u32 {
    return ((t0 + r / nh) * params.heads + h_off + r % nh) * DV;
}

fn put4(o: u32, v: vec4<f16>) {
    qs[o] = v.x;
    qs[o + 1u] = v.y;
    qs[o + 2u] = v.z;
    qs[o + 3u] = v.w;
}

// Stage hi and lo of rows 16 i .. 16 i + 15: 8 invocations per row (consecutive lanes of one
// subgroup), each holding vec4s j = q + 8 m; the row's max |q| bits by a shuffle reduction.
fn stage_tile(i: u32, lid: u32, r0: u32, n_rows: u32, t0: u32, nh: u32, h_off: u32) {
    let x0_n = (128u + WG - 1u) / WG;  // (a uniform loop: the shuffles need every lane)
    for (var x0_i = 0u; x0_i < x0_n; x0_i++) {
        let x0 = x0_i * WG;
        let x = x0 + lid;
        let rr = x / 8u;
        let q = x % 8u;
        let r = 16u * i + rr;
        let live = r < n_rows;
        var v: array<vec4<f32>, 4>;
        var mb = 0u;
        if (live) {
            let o = row_q(r0 + r, t0, nh, h_off);
            for (var m = 0u; m < 4u; m++) {
                let j = q + 8u * m;
                if (j < DV) {
                    v[m] = iq[o + j];
                    let b = bitcast<vec4<u32>>(v[m]) & vec4<u32>(0x7fffffffu);
                    mb = max(mb, max(max(b.x, b.y), max(b.z, b.w)));
                }
            }
        }
        // finite bits order like magnitudes; inf and NaN lie above
        mb = max(mb, subgroupShuffleXor(mb, 4u));
        mb = max(mb, subgroupShuffleXor(mb, 2u));
        mb = max(mb, subgroupShuffleXor(mb, 1u));
        // max in [2^E, 2^(E+1)) -> e = 14 - E puts it in [2^14, 2^15); a zero or subnormal max
        // counts as 2^-127 (e = 126)
        let e = clamp(14 - (max(i32(mb >> 23u), 0) - 127), -113, 126);
        let sc = pow2(e);
        for (var m = 0u; m < 4u; m++) {
            let j = q + 8u * m;
            if (j < DV) {
                let xs = v[m] * sc;  // zeros for rows past the item's
                let h = hi11(xs);
                put4(rr * HS + 4u * j, vec4<f16>(h));
                put4(QH + rr * HS + 4u * j, vec4<f16>(xs - h));
            }
        }
        if (q == 0u && r < RT) {
            rinf[r] = vec4<f32>(pow2(-e), select(0.0, 1.0, live && mb >= 0x7f800000u), 0.0, 0.0);
        }
    }
}

// The logit of row r at key row kr (element offset in ik) with f32 FMAs, dims ascending.
fn exact_logit(qo: u32, kr: u32) -> f32 {
    var z = 0.0;
    for (var j = 0u; j < DV; j++) {
        let q = iq[qo + j];
        let kb = kr + 4u * j;
        z += q.x * f32(ik[kb]);
        z += q.y * f32(ik[kb + 1u]);
        z += q.z * f32(ik[kb + 2u]);
        z += q.w * f32(ik[kb + 3u]);
    }
    return z;
}

// element offset in ik of the key row of block position p, or INVALID where it is not loaded
fn key_row(pg: u32, p: u32) -> u32 {
    let slab = pages[pg + p / S];  // INVALID is >= every chunk_end
    if (slab >= params.chunk_first && slab < params.chunk_end) {
        return ((slab - params.chunk_first) * S + p % S) * KS;
    }
    return INVALID;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let first = (wid.y * params.grid_x + wid.x) * IPW;
    if (first >= params.n_items) {
        return;
    }
    let sg = lid / 32u;          // this invocation's subgroup = its 16-row tile
    let lane = lid % 32u;
    let fr = 16u * sg + lane / 2u;  // fold: row of this lane
    let fh = 8u * (lane % 2u);      // and its 8 positions of each tile

    var h0: Right; var h1: Right; var h2: Right; var h3: Right;
    var h4: Right; var h5: Right; var h6: Right; var h7: Right;
    var l0: Right; var l1: Right; var l2: Right; var l3: Right;
    var l4: Right; var l5: Right; var l6: Right; var l7: Right;
    var prev = vec4<u32>(INVALID);   // (t0, r0, n_rows, nh) of the staged rows
    var prev_h = INVALID;            // and h_off
    var par = 0u;                    // result buffer of the next step
    var us = 1.0;                    // 2^-e of the fold row
    var fbad = false;                // its query holds NaN or +-inf
    var qo = 0u;                     // its vec4 offset in iq
    var qe = 0;                      // exclusive end of its visible positions
    let sgn = select(1.0, -1.0, params.scale < 0.0);  // (see order_key)
    let fold_max = params.scale != 0.0;

    let it_end = min(first + IPW, params.n_items);
    for (var it = first; it < it_end; it++) {
        let ib = params.items_off + (params.item_base + it) * 8u;
        let t0 = plan[ib];
        let r0 = plan[ib + 1u];
        let n_rows = plan[ib + 2u];
        let nh = plan[ib + 3u];
        let h_off = plan[ib + 4u];
        let pg = plan[ib + 5u];
        let npos = plan[ib + 6u];
        let s = plan[ib + 7u];
        let live = fr < n_rows;

        if (any(vec4<u32>(t0, r0, n_rows, nh) != prev) || h_off != prev_h) {
            prev = vec4<u32>(t0, r0, n_rows, nh);
            prev_h = h_off;
            let i_end = (min(n_rows, RT) + 15u) / 16u;
            for (var i = 0u; i < i_end; i++) {
                workgroupBarrier();  // the previous tile's loads (or a previous item's) are done
                stage_tile(i, lid, r0, n_rows, t0, nh, h_off);
                workgroupBarrier();
                if (sg == i) {
                    if (ND > 0u) { h0 = subgroupMatrixLoad<Right, col_major>(&qs, 0u, HS); l0 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 0u, HS); }
                    if (ND > 1u) { h1 = subgroupMatrixLoad<Right, col_major>(&qs, 16u, HS); l1 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 16u, HS); }
                    if (ND > 2u) { h2 = subgroupMatrixLoad<Right, col_major>(&qs, 32u, HS); l2 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 32u, HS); }
                    if (ND > 3u) { h3 = subgroupMatrixLoad<Right, col_major>(&qs, 48u, HS); l3 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 48u, HS); }
                    if (ND > 4u) { h4 = subgroupMatrixLoad<Right, col_major>(&qs, 64u, HS); l4 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 64u, HS); }
                    if (ND > 5u) { h5 = subgroupMatrixLoad<Right, col_major>(&qs, 80u, HS); l5 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 80u, HS); }
                    if (ND > 6u) { h6 = subgroupMatrixLoad<Right, col_major>(&qs, 96u, HS); l6 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 96u, HS); }
                    if (ND > 7u) { h7 = subgroupMatrixLoad<Right, col_major>(&qs, 112u, HS); l7 = subgroupMatrixLoad<Right, col_major>(&qs, QH + 112u, HS); }
                }
            }
            workgroupBarrier();  // rinf is complete
            let ri = rinf[fr];
            us = ri.x;
            fbad = ri.y != 0.0;
            let rs = min(fr, n_rows - 1u);
            qo = row_q(r0 + rs, t0, nh, h_off);
            qe = bitcast<i32>(plan[t0 + (r0 + rs) / nh]);
        }

        var best = 0u;                       // the largest key of the positions keyed one by one
        var zk = NO_KEY;                     // the largest order key of sgn S' (fast path)
        let fastrow = fold_max & !fbad;      // (per item: its rows may change)
        let lim = min(i32(npos), qe - i32(s * BS));  // visible positions of the block: p < lim
        for (var k0 = 0u; k0 < npos; k0 += 16u * NT) {  // rolled: faster so on the H200 (5.00 against 5.04 ms)
            let rb = (2u * sg + par) * RB;  // this step's result buffer
            for (var u = 0u; u < NT; u++) {
                let tp = k0 + 16u * u;      // the tile's first position in the block
                var acc = Result();         // (zero: explicitly, every tile)
                var kb = INVALID;
                if (tp < npos) {
                    kb = key_row(pg, tp);
                }
                if (kb != INVALID && 16u * sg < n_rows) {  // (a subgroup without rows idles)
                    if (ND > 0u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 0u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h0, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l0, acc);
                    }
                    if (ND > 1u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 16u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h1, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l1, acc);
                    }
                    if (ND > 2u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 32u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h2, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l2, acc);
                    }
                    if (ND > 3u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 48u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h3, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l3, acc);
                    }
                    if (ND > 4u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 64u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h4, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l4, acc);
                    }
                    if (ND > 5u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 80u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h5, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l5, acc);
                    }
                    if (ND > 6u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 96u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h6, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l6, acc);
                    }
                    if (ND > 7u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&ik, kb + 112u, KS);
                        acc = subgroupMatrixMultiplyAccumulate(b, h7, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l7, acc);
                    }
                }
                subgroupMatrixStore<col_major>(&res, rb + 16u * u, acc, RW);
            }
            workgroupBarrier();  // the stores are visible (and the other buffer's fold is done)
            par = 1u - par;
            // fold: row fr, positions pc (below) of each tile of the step
            for (var u = 0u; u < NT; u++) {
                let tp = k0 + 16u * u;
                var kb = INVALID;
                if (tp < npos) {
                    kb = key_row(pg, tp);
                }
                if (live && kb != INVALID) {
                    var bad = false;  // a visible position needs a key of its own
                    for (var c = 0u; c < 8u; c++) {
                        let pc = (lane % 2u) + 2u * ((c + lane / 16u) % 8u);
                        let p = tp + pc;
                        let vis = i32(p) < lim;
                        let z = res[rb + (fr % 16u) * RW + 16u * u + pc];
                        let fast = vis & fastrow & ((bitcast<u32>(z) & 0x7f800000u) != 0x7f800000u);
                        bad = bad | (vis & !fast);
                        zk = max(zk, select(NO_KEY, order_key(sgn * z), fast));
                    }
                    if (bad) {
                        for (var c = 0u; c < 8u; c++) {
                            let pc = (lane % 2u) + 2u * ((c + lane / 16u) % 8u);
                            let p = tp + pc;
                            let vis = i32(p) < lim;
                            let z = res[rb + (fr % 16u) * RW + 16u * u + pc];
                            if (vis & (fbad | ((bitcast<u32>(z) & 0x7f800000u) == 0x7f800000u))) {
                                best = max(best, logit_key(params.scale * exact_logit(qo, kb + pc * KS)));
                            } else if (vis & !fold_max) {
                                best = max(best, logit_key(params.scale * (z * us)));
                            }
                        }
                    }
                }
            }
        }
        if (zk != NO_KEY) {  // the fast path's largest logit: its S' scaled once
            best = max(best, logit_key(params.scale * ((sgn * order_value(zk)) * us)));
        }
        // the two lanes of a row combine; the even one writes
        best = max(best, subgroupShuffleXor(best, 1u));
        if (live && fh == 0u) {
            let t = t0 + (r0 + fr) / nh;
            let h = h_off + (r0 + fr) % nh;
            let o = (t * params.heads + h) * params.msb + s;
            out[o] = max(out[o], best);
        }
    }
}
