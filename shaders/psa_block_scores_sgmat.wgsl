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
// Workgroup: NSG subgroups of 32 (subgroup sg = invocations 32 sg .. 32 sg + 31; NSG = 4, 8 or
// 16, items of up to 16 NSG rows); subgroup sg owns rows 16 sg .. 16 sg + 15 of the item, over
// every position (a subgroup without rows idles). The subgroups share the staged keys: each
// block's keys are read from storage once per workgroup, so the more rows an item has, the
// fewer times the keys are read (on the H200, prefill shape: 2.58 ms with items of 64 rows,
// 1.79 ms with 256; docs/benchmarks.md, 2026-12-02).
//
// 1. Row scaling (exact). Each row's index query is multiplied by a power of two 2^e that puts
//    its largest |q| in [2^14, 2^15) (e clamped to [-113, 126]: 2^e and 2^-e are normal floats);
//    the logit is multiplied back by 2^-e.
// 2. hi / lo split. x = q 2^e becomes hi = x with its float32 mantissa cut to 11 bits (hi11, a
//    float16 value when |x| >= 2^-14) and lo = f16(x - hi) (x - hi is exact in float32); bits,
//    not f32(f16(x)), which a compiler may fold to x. q . k = (hi . k + lo . k) 2^-e: two matrix
//    products with the float16 keys; f16 x f16 products are exact in float32
//    (docs/spec/numerics.md, "Block scores on tensor cores").
// 3. Queries in registers. When an item's rows differ from the previous item's, each group of
//    128 invocations loads and splits the rows of one 16-row tile (TPP = WG / 128 tiles at once,
//    their loads in flight together: split_row), then the tiles are staged one at a time (hi at
//    qs[0 ..], lo at qs[QH ..], [row][dim], row stride HS = 136 halves; zeros past the item's
//    rows) and the tile's subgroup loads its ND hi and ND lo right-hand matrices (h0 .. h7,
//    l0 .. l7: 16 dims x 16 rows, column-major from the [row][dim] tile); they stay in registers
//    for the item run.
// 4. Keys staged once per workgroup. A 16-position tile of a block lies in one page (S, BS
//    multiples of 16), so its keys are 16 consecutive rows of one slab. Each step, the workgroup
//    copies its NT tiles' keys (whole 16-byte units of `ik`, coalesced rows) into workgroup
//    memory (`qs`, which holds the query tile only while an item run starts: [position][dim],
//    row stride KSP), with the next step's units already in flight in registers; then
//    every subgroup loads each left-hand matrix (16 positions x 16 dims, one key row per matrix
//    row) row-major from there. The keys are the left operand and the queries the right one, so
//    the units compute S^T (with the keys loaded straight from storage this way the prefill
//    block scores took 3.10 ms on the H200, against 5.49 ms with the queries on the left; staged
//    once per workgroup of 64 rows, 2.58 ms). A tile whose page is unmapped or in another chunk
//    is not loaded (its accumulator stays zero, its positions are invisible). Positions past
//    npos in a loaded page are read (whole slabs are bound) but only reach their own result
//    column, which the fold never takes.
// 5. Steps of NT tiles: acc = sum over the ND chunks of (K . hi^T + K . lo^T) (a fixed order,
//    R19: S^T, positions x rows), stored column-major, so as S ([row][position]), to the
//    subgroup's result buffer (two barriers per step: the keys are staged; the results are
//    stored and every load of the staged keys is done); lane l then folds row 16 sg + l / 2, positions l % 2 + 2 c (c = 0 .. 7;
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
// Bindings (group 0): as psa_block_scores.wgsl; `ik` is read as 16-byte units (vec4<u32>: 8
// float16 index-key halves each; HND slabs: RH = 1, rows of 4 DV halves, DV / 2 units).
//
// Override constants
//   DV  vec4s per index row (d_idx / 4: a multiple of 4, at most 32)   S  page size   BS  block size
//   RT  rows per item: 16 .. 256 (>= the host's rows per item, <= 16 NSG)
//   NSG subgroups: 4, 8 or 16 (WG = 32 NSG invocations)
//   NT  16-position tiles per step: 1, 2 or 4      IPW  work items per workgroup (>= 1)
//   TPP (derived) query tiles loaded and split at once while an item run starts: WG / 128
// Workgroup memory (bytes): 2 max(2 * 16 HS, 16 NT KSP) (HS = KSP = 136) + NSG * 4 * 16 (16 NT + 4)
// + 8 * 16 NSG (_index_branch.sgmat_scores_workgroup_bytes: 47616 for NT = 2, NSG = 16; the host
// takes fewer subgroups where the device holds less). Needs subgroups of 32 consecutive invocations.
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
override KU: u32 = DV / 2u;              // 16-byte units of a key row
override KUN: u32 = (NT * 16u * KU + WG - 1u) / WG;  // key units an invocation stages per step
override NSG: u32 = 4u;                  // subgroups = 16-row tiles (4, 8 or 16; >= RT / 16)
override WG: u32 = 32u * NSG;
override TPP: u32 = WG / 128u;           // query tiles split per pass of the staging
// The staged query tile has a constant size that holds every matrix load of the shader, even
// those a smaller ND never runs (Tint checks them all against the array's size).
const HS: u32 = 136u;                    // f16 row stride of the staged query tile (16-byte rows)
const QH: u32 = 16u * HS;                // halves of one staged 16-row tile
const KSP: u32 = 136u;                   // f16 row stride of the staged keys (16-byte rows, padded)
const MAXKU: u32 = 8u;                   // largest KUN (NT = 4, d_idx = 128)
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
@group(0) @binding(2) var<storage, read> ik: array<vec4<u32>>;  // 16-byte units: 8 halves each
@group(0) @binding(3) var<storage, read> pages: array<u32>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<u32>;

// Every workgroup variable is a whole number of 16-byte units (see docs/backends/dawn.md: Dawn on
// NVIDIA misplaced matrix accesses of arrays that followed scalars adding up to 12 bytes).
// One staged 16-row query tile (hi, then lo; while an item run starts) or the keys of a step's NT
// tiles ([position][dim], row stride KSP; during its steps): never both at once, one array.
var<workgroup> qs: array<f16, max(2u * QH, NT * 16u * KSP)>;
var<workgroup> res: array<f32, NSG * RB>;         // S' of a step: [subgroup][row][position]
var<workgroup> rinf: array<vec2<f32>, 16u * NSG>;  // per row: (2^-e, 1 if the query is not finite)

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

// One row's share of a 16-row query tile: hi and lo of its vec4s j = q + 8 m (8 invocations per
// row, consecutive lanes of one subgroup) and the row's record (2^-e, 1 if not finite).
struct Split {
    h: array<vec4<f16>, 4>,
    l: array<vec4<f16>, 4>,
    rec: vec2<f32>,
}

// Invocation x (0 .. 127) of tile i: row rr = x / 8 of the tile, vec4s q = x % 8 + 8 m. A row
// past the item's (or a tile past the last: `valid` false) gives zeros. The row's max |q| bits
// come from a shuffle reduction over its 8 invocations (every lane takes part).
fn split_row(i: u32, valid: bool, x: u32, r0: u32, n_rows: u32, t0: u32, nh: u32, h_off: u32) -> Split {
    let rr = x / 8u;
    let q = x % 8u;
    let r = 16u * i + rr;
    let live = valid && r < n_rows;
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
    var out: Split;
    for (var m = 0u; m < 4u; m++) {
        let xs = v[m] * sc;  // zeros for rows past the item's
        let h = hi11(xs);
        out.h[m] = vec4<f16>(h);
        out.l[m] = vec4<f16>(xs - h);
    }
    out.rec = vec2<f32>(pow2(-e), select(0.0, 1.0, live && mb >= 0x7f800000u));
    return out;
}

// Write invocation x's share of a tile (split_row) to the staged tile and its row's record.
fn put_split(i: u32, x: u32, sp: Split) {
    let rr = x / 8u;
    let q = x % 8u;
    for (var m = 0u; m < 4u; m++) {
        let j = q + 8u * m;
        if (j < DV) {
            put4(rr * HS + 4u * j, sp.h[m]);
            put4(QH + rr * HS + 4u * j, sp.l[m]);
        }
    }
    let r = 16u * i + rr;
    if (q == 0u && r < min(RT, 16u * NSG)) {
        rinf[r] = sp.rec;
    }
}

// The logit of row r at key row kr (element offset in ik) with f32 FMAs, dims ascending.
fn exact_logit(qo: u32, kr: u32) -> f32 {
    var z = 0.0;
    for (var j = 0u; j < DV; j++) {
        let q = iq[qo + j];
        let kb = kr + 4u * j;  // (a multiple of 4: one half of a unit)
        let w = ik[kb / 8u];
        let h = select(w.xy, w.zw, kb % 8u != 0u);
        let k01 = unpack2x16float(h.x);  // (exact, as f32(f16))
        let k23 = unpack2x16float(h.y);
        z += q.x * k01.x;
        z += q.y * k01.y;
        z += q.z * k23.x;
        z += q.w * k23.y;
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

// The 8 halves of a key unit to qs[base ..= base + 7] (component 0 of a u32's vec2<f16> is its
// low half: the lower address).
fn put_k(base: u32, u: vec4<u32>) {
    let h0 = bitcast<vec2<f16>>(u.x);
    let h1 = bitcast<vec2<f16>>(u.y);
    let h2 = bitcast<vec2<f16>>(u.z);
    let h3 = bitcast<vec2<f16>>(u.w);
    qs[base] = h0.x;
    qs[base + 1u] = h0.y;
    qs[base + 2u] = h1.x;
    qs[base + 3u] = h1.y;
    qs[base + 4u] = h2.x;
    qs[base + 5u] = h2.y;
    qs[base + 6u] = h3.x;
    qs[base + 7u] = h3.y;
}

// Key unit x of this invocation for the step at block position k0: unit x WG + lid of the
// step's NT tiles, [tile][position][unit]; zero where the tile is past npos or not loaded.
fn key_unit(x: u32, lid: u32, k0: u32, pg: u32, npos: u32) -> vec4<u32> {
    let u = x * WG + lid;
    let tp = k0 + 16u * (u / (16u * KU));
    if (u < NT * 16u * KU && tp < npos) {
        let kb = key_row(pg, tp);
        if (kb != INVALID) {
            return ik[kb / 8u + ((u / KU) % 16u) * KU + u % KU];
        }
    }
    return vec4<u32>(0u);
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
    var us = 1.0;                    // 2^-e of the fold row
    var fbad = false;                // its query holds NaN or +-inf
    var qo = 0u;                     // its vec4 offset in iq
    var qe = 0;                      // exclusive end of its visible positions
    let sgn = select(1.0, -1.0, params.scale < 0.0);  // (see order_key)
    let fold_max = params.scale != 0.0;
    var kin: array<vec4<u32>, MAXKU>;  // this invocation's key units of a step, loaded ahead
    var kbs: array<u32, 4>;            // the step's tiles' key rows (key_row), for the fold
    let fo = (fr % 16u) * RW;          // the fold row's offset in its subgroup's result buffer

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
            // TPP tiles per pass: each group of 128 invocations loads and splits one tile's rows
            // (their loads in flight together), then the tiles are staged one after another
            let i_end = (min(n_rows, RT) + 15u) / 16u;
            let p_end = (i_end + TPP - 1u) / TPP;
            for (var pa = 0u; pa < p_end; pa++) {
                let ti = TPP * pa + lid / 128u;  // this invocation's tile of the pass
                let sp = split_row(ti, ti < i_end, lid % 128u, r0, n_rows, t0, nh, h_off);
                for (var j = 0u; j < TPP; j++) {
                    let i = TPP * pa + j;
                    workgroupBarrier();  // the previous tile's loads (or a previous item's) are done
                    if (lid / 128u == j && i < i_end) {
                        put_split(i, lid % 128u, sp);
                    }
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
            let rb = sg * RB;               // the subgroup's result buffer
            // the step's keys to qs: each 16-byte unit read from storage once by the workgroup
            // (coalesced rows), then shared by the subgroups' matrix loads
            if (k0 == 0u) {  // (later steps' units were loaded during the step before)
                for (var x = 0u; x < KUN; x++) {
                    kin[x] = key_unit(x, lid, k0, pg, npos);
                }
            }
            for (var x = 0u; x < KUN; x++) {
                let u = x * WG + lid;
                if (u < NT * 16u * KU) {
                    put_k((u / KU) * KSP + 8u * (u % KU), kin[x]);
                }
            }
            workgroupBarrier();  // the step's keys are staged
            if (k0 + 16u * NT < npos) {  // the next step's units in flight
                for (var x = 0u; x < KUN; x++) {
                    kin[x] = key_unit(x, lid, k0 + 16u * NT, pg, npos);
                }
            }
            for (var u = 0u; u < NT; u++) {
                let tp = k0 + 16u * u;      // the tile's first position in the block
                var acc = Result();         // (zero: explicitly, every tile)
                var kb = INVALID;
                if (tp < npos) {
                    kb = key_row(pg, tp);
                }
                kbs[u] = kb;
                let ko = 16u * u * KSP;     // the tile's keys in qs
                if (kb != INVALID && 16u * sg < n_rows) {  // (a subgroup without rows idles)
                    if (ND > 0u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 0u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h0, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l0, acc);
                    }
                    if (ND > 1u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 16u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h1, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l1, acc);
                    }
                    if (ND > 2u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 32u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h2, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l2, acc);
                    }
                    if (ND > 3u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 48u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h3, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l3, acc);
                    }
                    if (ND > 4u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 64u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h4, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l4, acc);
                    }
                    if (ND > 5u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 80u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h5, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l5, acc);
                    }
                    if (ND > 6u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 96u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h6, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l6, acc);
                    }
                    if (ND > 7u) {
                        let b = subgroupMatrixLoad<Left, row_major>(&qs, ko + 112u, KSP);
                        acc = subgroupMatrixMultiplyAccumulate(b, h7, acc);
                        acc = subgroupMatrixMultiplyAccumulate(b, l7, acc);
                    }
                }
                subgroupMatrixStore<col_major>(&res, rb + 16u * u, acc, RW);
            }
            workgroupBarrier();  // the stores are visible, and every matrix load of the keys is done
            // fold: row fr, positions pc (below) of each tile of the step
            for (var u = 0u; u < NT; u++) {
                let tp = k0 + 16u * u;
                let kb = kbs[u];
                if (live && kb != INVALID) {
                    var bad = false;  // a visible position needs a key of its own
                    let zb = rb + fo + 16u * u;
                    if (fastrow && i32(tp) + 16 <= lim) {  // every position of the tile is visible
                        for (var c = 0u; c < 8u; c++) {
                            let z = res[zb + (lane % 2u) + 2u * ((c + lane / 16u) % 8u)];
                            let fast = (bitcast<u32>(z) & 0x7f800000u) != 0x7f800000u;
                            bad = bad | !fast;
                            zk = max(zk, select(NO_KEY, order_key(sgn * z), fast));
                        }
                    } else {
                        for (var c = 0u; c < 8u; c++) {
                            let pc = (lane % 2u) + 2u * ((c + lane / 16u) % 8u);
                            let vis = i32(tp + pc) < lim;
                            let z = res[zb + pc];
                            let fast = vis & fastrow & ((bitcast<u32>(z) & 0x7f800000u) != 0x7f800000u);
                            bad = bad | (vis & !fast);
                            zk = max(zk, select(NO_KEY, order_key(sgn * z), fast));
                        }
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
