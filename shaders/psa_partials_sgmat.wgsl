// psa_partials_sgmat.wgsl — KV-outer partials (R14) on 16x16x16 subgroup matrices (tensor
// cores): a drop-in for psa_partials.wgsl on float16 caches.
//
// Same bindings, Params, plan records (work items, edge records, page lists), outputs and empty
// representation as psa_partials.wgsl (read its header): one workgroup per work item of up to
// RMAX rows (edges x query heads) reading one KV block; a partial row's o is unnormalised, its
// (m, l) has l == 0 for a row that attended nothing and l >= 1 otherwise.
//
// Bindings (group 0); the storage arrays are other views of the same buffers
//   0 params  uniform              Params
//   1 q       storage, read        vec4<f32> [n_qrows * G * D / 4]  (D % 16 == 0)
//   2 k_cache storage, read        vec4<u32> [n_slabs_in_chunk * S * D / 8]: 8 float16 per unit
//                                  (with RH > 1, an NHD cache: whole pages, as psa_partials.wgsl)
//   3 v_cache storage, read        vec4<u32>, same layout
//   4 plan    storage, read        u32 plan words, as psa_partials.wgsl
//   5 o_out   storage, read_write  f32 [n_prows * D]
//   6 ml_out  storage, read_write  vec2<f32> [n_prows]
//
// The loader prepends `enable f16;` and `enable chromium_experimental_subgroup_matrix;` (the
// kernel table marks it sgmat); the host runs it only where the device has 16x16x16
// f16 x f16 -> f32 subgroup matrices with subgroups of 32 consecutive invocations (subgroup
// s = invocations 32 s .. 32 s + 31), on float16 caches, D % 16 == 0, and blocks of at most BK
// positions.
//
// Algorithm (one work item; rows = M, keys = N, head dim = K of the matrix products)
//   0. Q: each row's query is scaled by an exact power of two 2^e (its largest |q| into
//      [2^14, 2^15): no float16 overflow, no subnormal loss of a whole row) and split into
//      hi = q 2^e with its mantissa cut to 11 bits (hi11: a float16 value) and
//      lo = f16(q 2^e - hi): hi + lo carries ~21 bits of q 2^e. A row whose q holds NaN or
//      +-inf sets the item's FMA flag (step 1 then runs on FMAs, as psa_partials.wgsl does).
//   1. Scores of the whole block (max_len <= BK positions), a K tile of TK keys at a time:
//      S' = Qhi K^T + Qlo K^T on subgroup matrices (f16 products are exact in f32, f32
//      accumulation), stored to workgroup memory, then s = (S' 2^-e) * scale (2^-e exact). A
//      tile whose readable K holds NaN or +-inf (or an item with the FMA flag) computes its
//      scores with f32 FMAs from the f32 q instead: the FMA kernel's scores, in its order.
//   2. Softmax of the whole block (f32, as psa_partials.wgsl step 3 over one tile of max_len
//      keys), SL consecutive lanes per row: m = max over attended scores (R26: -inf removes its
//      position, NaN is kept), p = exp(s - m) (REMOVED = -1: removed; 0: not attended), l = sum
//      p, the lanes' maxima and sums combined by shuffles. Each weight is written at once, split
//      like Q (hi = hi11(p), lo = f16(p - hi); 0 for a removed weight or a NaN row), into the
//      block's P hi / P lo where Q was; the scores stay (the rare path of step 3 forms a weight
//      again from its score). One block is one tile of the online softmax (R14): o is never
//      rescaled, so it stays in registers.
//   3. o = P V, a V tile of TK keys at a time, as two products (P hi V + P lo V). Accumulators
//      stay in subgroup-matrix registers for the whole item; each subgroup owns one 16-row
//      block and NDT 16-column blocks of o.
//   4. o is staged through workgroup memory and the item's rows are written out.
// Every K/V tile's global loads are issued into registers one tile ahead (the next K tile, then
// the first V tile during the last K tile and the softmax, then the next V tile), the first K
// tile's together with the queries': the kernel waits on a load only once per item.
//
// Special values (R26, R10), as psa_partials.wgsl:
//   - positions of INVALID pages and past max_len are never read (zeros in the tiles);
//   - a masked (row, key) pair has p = 0 and a removed one p = REMOVED -> 0 in the f16 P tile; V
//     values that are NaN or +-inf are replaced by 0 in the staged V tile, so no product 0 * NaN
//     can reach a row through the matrix product. Instead every attended, not removed (row,
//     key) pair whose v[d] is non-finite marks (row, d) in `poison` (2 bits: +inf seen, -inf
//     seen; both for NaN, for 0 * inf and for +inf + -inf): the written o[d] is then what the
//     FMA kernel's sum gives, NaN, +inf or -inf;
//   - a row with a NaN l (a NaN or +inf score) gets o = NaN in every component, as p = NaN
//     gives in the FMA kernel (its P entries enter the product as 0);
//   - REMOVED and NaN are tested on bits: a compiler may turn select(p, 0, p < 0) into
//     max(p, 0), which drops a NaN (measured on the H200 through Dawn).
//
// Determinism (R19): the order of every sum is fixed by the constants (tiles, subgroup-matrix
// products in k order, the softmax's strided partial sums reduced by a fixed butterfly).
//
// Override constants
//   D     head dim (multiple of 16)         S    page size
//   TK    keys per K/V tile (multiple of 16, <= D)
//   BK    positions per block the kernel holds (multiple of TK, >= max_len of every item)
//   RMAX  rows per work item (multiple of 16)
//   WG    workgroup size: 32 * NSG subgroups; NSG a multiple of RMAX / 16 and the column blocks
//         of o (D / 16) divisible by NSG / (RMAX / 16), at most 8 per subgroup (NDT); the
//         score tiles of a K tile are dealt out to the subgroups (some idle when there are fewer)
//   LD, LQ (derived) K/V and query units an invocation holds in registers: at most 8 each
// Workgroup memory (bytes, each variable rounded to 16): 2 * HCAP + 4 * SCAP + 4 * BK
//   + 6 * 4 * RMAX + 4 * RMAX * D / 16 + 4 * 16 (_sgmat.sgmat_workgroup_bytes: 45376 for
//   D = 128, RMAX = 32 and BK = 128, whatever WG). The host checks
//   2 * RMAX * max(HS, PB) + TK * HS <= HCAP and RMAX * SB <= SCAP, HS = D + 8, PB = BK + 8,
//   SB = max(BK, D) + 4.

// The matrix builtins need subgroup-uniform arguments; Tint's analysis only knows workgroup
// uniformity, and the tile offsets derive from the subgroup index tid / 32 (uniform within a
// subgroup of 32 consecutive invocations, which the host requires). The softmax's shuffles run
// where every invocation of the workgroup does (after the item's workgroup-uniform return).
diagnostic(off, chromium.subgroup_matrix_uniformity);
diagnostic(off, subgroup_uniformity);

override D: u32;
override S: u32;
override RH: u32 = 1u;                     // KV heads interleaved per page row: 1 (HND) or Hkv (NHD, R34)
override TK: u32;
override BK: u32;
override RMAX: u32;
override WG: u32 = 128u;
override TD: u32 = D / 4u;                 // vec4<f16> per cache row (the Params' slab units)
override D8: u32 = D / 8u;                 // vec4<u32> (8 halves) per cache row
override HS: u32 = D + 8u;                 // f16 row stride of the Q and K/V tiles (16-byte rows)
override PB: u32 = BK + 8u;                // f16 row stride of the block's P hi / P lo (in the Q area)
override QA: u32 = max(HS, PB);           // f16 row stride of the Q / P area (rows of both fit)
override SB: u32 = max(BK, D) + 4u;        // f32 row stride of the score / o tile
override NSG: u32 = WG / 32u;              // subgroups
override NRB: u32 = RMAX / 16u;            // 16-row blocks
override CS: u32 = NSG / NRB;              // subgroups per row block
override NDT: u32 = D / 16u / CS;          // 16-column blocks of o per subgroup
override NST: u32 = (NRB * (TK / 16u) + NSG - 1u) / NSG;  // 16x16 score tiles per subgroup and K tile
override SL: u32 = max(1u, WG / RMAX);     // softmax invocations per row (a power of two, <= 32: one butterfly)
override NPW: u32 = D / 16u;               // poison words per row (2 bits per column)
override QV: u32 = D / 4u;                 // vec4 per query row
override LD: u32 = (TK * D8 + WG - 1u) / WG;  // K/V units per invocation and tile (<= 8)
override LQ: u32 = (RMAX * QV + WG - 1u) / WG;  // query units per invocation (<= 8)
// NDT <= 8: eight named accumulators (no array: an array of matrices indexed in a loop may
// live in local memory), those past NDT removed by the compiler (NDT is a pipeline constant)
const INVALID: u32 = 0xffffffffu;

struct Params {
    item_base: u32,
    n_items: u32,
    grid_x: u32,
    group: u32,
    slab_stride: u32,  // vec4<f16> per slab (S * TD)
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> v_cache: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> o_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> ml_out: array<vec2<f32>>;

// The arrays the subgroup matrices load from and store to have constant sizes (the builtins take
// no override-sized array): capacities for the largest geometry the host picks within 48 KiB;
// the host checks 2 * RMAX * max(HS, PB) + TK * HS <= HCAP and RMAX * SB <= SCAP.
const HCAP: u32 = 13056u;  // f16: Q hi at 0, Q lo at RMAX * QA ([row][d], stride HS) in step 1, P hi
                           // / P lo there ([row][key], stride PB) from step 2; the K or V tile at KVO
const SCAP: u32 = 4224u;   // f32: scores, then o ([row][position or d], stride SB)
override KVO: u32 = 2u * RMAX * QA;
var<workgroup> hmem: array<f16, HCAP>;
var<workgroup> sbuf: array<f32, SCAP>;
var<workgroup> key_src: array<u32, BK>;             // vec4<u32> index of each position's cache row, or INVALID
var<workgroup> row_len: array<u32, RMAX>;           // edge_len of the row's edge (0: no such row)
var<workgroup> row_q: array<u32, RMAX>;             // vec4 index of the row's query
var<workgroup> row_down: array<f32, RMAX>;          // 2^-e of the row's query scaling
var<workgroup> row_m: array<f32, RMAX>;
var<workgroup> row_l: array<f32, RMAX>;
var<workgroup> row_qmax: array<atomic<u32>, RMAX>;  // bits of the row's largest |q|
var<workgroup> poison: array<atomic<u32>, RMAX * NPW>;
var<workgroup> q_bad: u32;      // 1: a query of the item holds NaN or +-inf (FMA scores)
var<workgroup> flag0: u32;      // 1: the tile holds NaN or +-inf at a readable position;
var<workgroup> flag1: u32;      //    two flags, alternating by tile, so that a reset never races a set
var<workgroup> poisoned: u32;   // 1: some (row, d) of the item is poisoned

const NEG_INF_BITS: u32 = 0xff800000u;
// the weight of a removed position (exp never gives a negative number; a -0 marker is not safe:
// compilers may treat -0 and +0 as one constant)
const REMOVED: f32 = -1.0;
const REMOVED_BITS: u32 = 0xbf800000u;
// bit tests, not p < 0: a compiler may turn select(p, 0, p < 0) into max(p, 0), which drops a NaN
fn is_removed(p: f32) -> bool {
    return bitcast<u32>(p) == REMOVED_BITS;
}
fn is_ninf(x: f32) -> bool {
    return bitcast<u32>(x) == NEG_INF_BITS;
}
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
var<private> NAN_BITS: u32 = 0x7fc00000u;
var<private> INF_BITS: u32 = 0x7f800000u;      // (+inf)
var<private> MINF_BITS: u32 = 0xff800000u;     // (-inf)
fn nan_max(a: f32, b: f32) -> f32 {
    return select(max(a, b), bitcast<f32>(NAN_BITS), is_nan(a) || is_nan(b));
}
// The high part of a split x = hi + lo: x with its float32 mantissa cut to the 11 bits of a
// float16 (exact in float16 for |x| in [2^-14, 65504]; below, f16() rounds it to a subnormal,
// at most 2^-25 away), so that x - hi is exact in float32 and lo = f16(x - hi). Bits, not
// f32(f16(x)): a compiler may fold that round trip to x, which would make lo 0.
fn hi11(x: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(x) & vec4<u32>(0xffffe000u));
}
// an exact power of two 2^e, e in [-126, 127]
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(127 + e) << 23u);
}
// 1 in each 16-bit half of w whose float16 is NaN or +-inf (bit 0: low half, bit 1: high half)
fn nonfinite_halves(w: u32) -> u32 {
    return select(0u, 1u, (w & 0x7c00u) == 0x7c00u) | select(0u, 2u, (w & 0x7c000000u) == 0x7c000000u);
}

fn tile_end(len: u32, k0: u32, nk: u32) -> u32 {
    return min(nk, select(0u, len - k0, len > k0));
}

// The K/V tiles are staged in two steps, so that a tile's loads are in flight while the
// previous tile is multiplied: load_unit reads unit x (8 float16) of the TK-key tile at block
// position k0 from K (which = 0) or V (1) into registers, zeros for an unreadable position;
// store_unit writes it to the tile in workgroup memory. store_unit returns true if the unit holds
// NaN or +-inf (at a readable position: unreadable ones are zeros); in V such halves are stored
// as 0, so that no product 0 * NaN can reach a row through the matrix product (R10, R26).
fn load_unit(x: u32, k0: u32, which: u32) -> vec4<u32> {
    var u = vec4<u32>(0u);
    if (x < TK * D8) {
        let k = x / D8;
        let row = key_src[k0 + k];
        if (row != INVALID) {
            if (which == 0u) {
                u = k_cache[row + x - k * D8];
            } else {
                u = v_cache[row + x - k * D8];
            }
        }
    }
    return u;
}

fn store_unit(x: u32, u_in: vec4<u32>, which: u32) -> bool {
    if (x >= TK * D8) {
        return false;
    }
    let k = x / D8;
    let j = x - k * D8;
    var u = u_in;
    let f = vec4<u32>(nonfinite_halves(u.x), nonfinite_halves(u.y), nonfinite_halves(u.z), nonfinite_halves(u.w));
    let bad = any(f != vec4<u32>(0u));
    if (bad && which == 1u) {
        let keep = ~(select(vec4<u32>(0u), vec4<u32>(0xffffu), (f & vec4<u32>(1u)) != vec4<u32>(0u))
                     | select(vec4<u32>(0u), vec4<u32>(0xffff0000u), (f & vec4<u32>(2u)) != vec4<u32>(0u)));
        u = u & keep;
    }
    let b = KVO + k * HS + 8u * j;
    let h0 = bitcast<vec2<f16>>(u.x);
    let h1 = bitcast<vec2<f16>>(u.y);
    let h2 = bitcast<vec2<f16>>(u.z);
    let h3 = bitcast<vec2<f16>>(u.w);
    hmem[b] = h0.x;
    hmem[b + 1u] = h0.y;
    hmem[b + 2u] = h1.x;
    hmem[b + 3u] = h1.y;
    hmem[b + 4u] = h2.x;
    hmem[b + 5u] = h2.y;
    hmem[b + 6u] = h3.x;
    hmem[b + 7u] = h3.y;
    return bad;
}

// Query unit x (vec4 c of row r = x / QV) of the item, or zeros past its rows.
fn q_load(x: u32, n_rows: u32) -> vec4<f32> {
    let r = x / QV;
    var v = vec4<f32>(0.0);
    if (x < RMAX * QV && r < n_rows) {
        v = q[row_q[r] + x - r * QV];
    }
    return v;
}

// Fold |v| into its row's maximum; true if v holds NaN or +-inf.
fn q_max(x: u32, v: vec4<f32>) -> bool {
    if (x >= RMAX * QV) {
        return false;
    }
    let a = bitcast<vec4<u32>>(v) & vec4<u32>(0x7fffffffu);
    let mb = max(max(a.x, a.y), max(a.z, a.w));
    atomicMax(&row_qmax[x / QV], mb);
    return mb >= 0x7f800000u;
}

// Write the scaled hi / lo split of query unit x (zeros for a row with a non-finite q: its
// scores come from FMAs).
fn q_split(x: u32, v: vec4<f32>) {
    if (x >= RMAX * QV) {
        return;
    }
    let r = x / QV;
    let c = x - r * QV;
    var hi = vec4<f16>(0.0);
    var lo = vec4<f16>(0.0);
    let mb = atomicLoad(&row_qmax[r]);
    // max in [2^E, 2^(E+1)) -> e = 14 - E puts it in [2^14, 2^15); subnormal maxima count as
    // 2^-127; e stays in [-113, 126] so that 2^e and 2^-e are normal floats
    let e = clamp(14 - (max(i32(mb >> 23u), 0) - 127), -113, 126);
    if (mb < 0x7f800000u) {
        let qs = v * pow2(e);
        let h = hi11(qs);
        hi = vec4<f16>(h);
        lo = vec4<f16>(qs - h);
    }
    if (c == 0u) {
        row_down[r] = pow2(-e);
    }
    let b = r * HS + 4u * c;
    hmem[b] = hi.x;
    hmem[b + 1u] = hi.y;
    hmem[b + 2u] = hi.z;
    hmem[b + 3u] = hi.w;
    let bl = RMAX * QA + b;
    hmem[bl] = lo.x;
    hmem[bl + 1u] = lo.y;
    hmem[bl + 2u] = lo.z;
    hmem[bl + 3u] = lo.w;
}

fn set_flag(par: u32) {
    if (par == 0u) {
        flag0 = 1u;
    } else {
        flag1 = 1u;
    }
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
    let sg = tid / 32u;        // this invocation's subgroup
    let rb = sg % NRB;         // its 16-row block
    let cb = sg / NRB;         // its share of the columns

    for (var j = 0u; j < (RMAX + WG - 1u) / WG; j++) {
        let r = tid + j * WG;
        if (r >= RMAX) {
            break;
        }
        var len = 0u;
        var qo = 0u;
        if (r < n_rows) {
            let ie = r / ng;
            len = plan[erec + 2u * ie + 1u];
            qo = ((plan[erec + 2u * ie] * params.group + g0 + (r - ie * ng)) * D) / 4u;
        }
        row_len[r] = len;
        row_q[r] = qo;
        row_m[r] = 0.0;
        row_l[r] = 0.0;
        atomicStore(&row_qmax[r], 0u);
    }
    for (var j = 0u; j < (RMAX * NPW + WG - 1u) / WG; j++) {
        let x = tid + j * WG;
        if (x >= RMAX * NPW) {
            break;
        }
        atomicStore(&poison[x], 0u);
    }
    for (var j = 0u; j < (BK + WG - 1u) / WG; j++) {
        let k = tid + j * WG;
        if (k >= BK) {
            break;
        }
        var row = INVALID;
        if (k < max_len) {
            let slab = plan[pages + k / S];
            if (slab != INVALID) {
                // R34: HND (RH = 1) slab * slab_stride + off * TD; NHD the page's row off * RH +
                // head, with page slab / RH and head slab % RH (as psa_partials.wgsl)
                let page = slab / RH;
                row = (page * RH * params.slab_stride + ((k % S) * RH + (slab - page * RH)) * TD) / 2u;
            }
        }
        key_src[k] = row;
    }
    if (tid == 0u) {
        q_bad = 0u;
        flag0 = 0u;
        flag1 = 0u;
        poisoned = 0u;
    }
    workgroupBarrier();

    // 0. The first K tile's loads and the queries' loads in flight together; then each row's
    //    largest |q| (bit patterns of non-negative floats order like the values; NaN and +-inf
    //    lie above every finite one), then the scaled hi / lo split.
    var t0 = vec4<u32>(0u);
    var t1 = vec4<u32>(0u);
    var t2 = vec4<u32>(0u);
    var t3 = vec4<u32>(0u);
    var t4 = vec4<u32>(0u);
    var t5 = vec4<u32>(0u);
    var t6 = vec4<u32>(0u);
    var t7 = vec4<u32>(0u);
    if (max_len > 0u) {
        if (LD > 0u) { t0 = load_unit(tid + 0u * WG, 0u, 0u); }
        if (LD > 1u) { t1 = load_unit(tid + 1u * WG, 0u, 0u); }
        if (LD > 2u) { t2 = load_unit(tid + 2u * WG, 0u, 0u); }
        if (LD > 3u) { t3 = load_unit(tid + 3u * WG, 0u, 0u); }
        if (LD > 4u) { t4 = load_unit(tid + 4u * WG, 0u, 0u); }
        if (LD > 5u) { t5 = load_unit(tid + 5u * WG, 0u, 0u); }
        if (LD > 6u) { t6 = load_unit(tid + 6u * WG, 0u, 0u); }
        if (LD > 7u) { t7 = load_unit(tid + 7u * WG, 0u, 0u); }
    }
    var q0 = vec4<f32>(0.0);
    if (LQ > 0u) { q0 = q_load(tid + 0u * WG, n_rows); }
    var q1 = vec4<f32>(0.0);
    if (LQ > 1u) { q1 = q_load(tid + 1u * WG, n_rows); }
    var q2 = vec4<f32>(0.0);
    if (LQ > 2u) { q2 = q_load(tid + 2u * WG, n_rows); }
    var q3 = vec4<f32>(0.0);
    if (LQ > 3u) { q3 = q_load(tid + 3u * WG, n_rows); }
    var q4 = vec4<f32>(0.0);
    if (LQ > 4u) { q4 = q_load(tid + 4u * WG, n_rows); }
    var q5 = vec4<f32>(0.0);
    if (LQ > 5u) { q5 = q_load(tid + 5u * WG, n_rows); }
    var q6 = vec4<f32>(0.0);
    if (LQ > 6u) { q6 = q_load(tid + 6u * WG, n_rows); }
    var q7 = vec4<f32>(0.0);
    if (LQ > 7u) { q7 = q_load(tid + 7u * WG, n_rows); }
    var qbad = false;
    if (LQ > 0u) { qbad = qbad | q_max(tid + 0u * WG, q0); }
    if (LQ > 1u) { qbad = qbad | q_max(tid + 1u * WG, q1); }
    if (LQ > 2u) { qbad = qbad | q_max(tid + 2u * WG, q2); }
    if (LQ > 3u) { qbad = qbad | q_max(tid + 3u * WG, q3); }
    if (LQ > 4u) { qbad = qbad | q_max(tid + 4u * WG, q4); }
    if (LQ > 5u) { qbad = qbad | q_max(tid + 5u * WG, q5); }
    if (LQ > 6u) { qbad = qbad | q_max(tid + 6u * WG, q6); }
    if (LQ > 7u) { qbad = qbad | q_max(tid + 7u * WG, q7); }
    if (qbad) {
        q_bad = 1u;
    }
    let item_fma = workgroupUniformLoad(&q_bad);  // (also the barrier after the maxima)
    if (LQ > 0u) { q_split(tid + 0u * WG, q0); }
    if (LQ > 1u) { q_split(tid + 1u * WG, q1); }
    if (LQ > 2u) { q_split(tid + 2u * WG, q2); }
    if (LQ > 3u) { q_split(tid + 3u * WG, q3); }
    if (LQ > 4u) { q_split(tid + 4u * WG, q4); }
    if (LQ > 5u) { q_split(tid + 5u * WG, q5); }
    if (LQ > 6u) { q_split(tid + 6u * WG, q6); }
    if (LQ > 7u) { q_split(tid + 7u * WG, q7); }

    // 1. Scores of the block, a K tile at a time.
    var par = 0u;
    let nkt = (max_len + TK - 1u) / TK;  // K (and V) tiles
    for (var it = 0u; it < nkt; it++) {
        let k0 = it * TK;
        var tb = false;
        if (LD > 0u) { tb = tb | store_unit(tid + 0u * WG, t0, 0u); }
        if (LD > 1u) { tb = tb | store_unit(tid + 1u * WG, t1, 0u); }
        if (LD > 2u) { tb = tb | store_unit(tid + 2u * WG, t2, 0u); }
        if (LD > 3u) { tb = tb | store_unit(tid + 3u * WG, t3, 0u); }
        if (LD > 4u) { tb = tb | store_unit(tid + 4u * WG, t4, 0u); }
        if (LD > 5u) { tb = tb | store_unit(tid + 5u * WG, t5, 0u); }
        if (LD > 6u) { tb = tb | store_unit(tid + 6u * WG, t6, 0u); }
        if (LD > 7u) { tb = tb | store_unit(tid + 7u * WG, t7, 0u); }
        if (tb) {
            set_flag(par);
        }
        var bad = 0u;
        if (par == 0u) {
            bad = workgroupUniformLoad(&flag0);
        } else {
            bad = workgroupUniformLoad(&flag1);
        }
        if (tid == 0u) {  // the other flag was last read a tile ago, past a barrier
            if (par == 0u) { flag1 = 0u; } else { flag0 = 0u; }
        }
        // the next K tile's loads (after the last one: the first V tile's) fly during this one
        let kn = k0 + TK;
        let nw = select(1u, 0u, kn < max_len);
        let kl = select(0u, kn, kn < max_len);
        if (LD > 0u) { t0 = load_unit(tid + 0u * WG, kl, nw); }
        if (LD > 1u) { t1 = load_unit(tid + 1u * WG, kl, nw); }
        if (LD > 2u) { t2 = load_unit(tid + 2u * WG, kl, nw); }
        if (LD > 3u) { t3 = load_unit(tid + 3u * WG, kl, nw); }
        if (LD > 4u) { t4 = load_unit(tid + 4u * WG, kl, nw); }
        if (LD > 5u) { t5 = load_unit(tid + 5u * WG, kl, nw); }
        if (LD > 6u) { t6 = load_unit(tid + 6u * WG, kl, nw); }
        if (LD > 7u) { t7 = load_unit(tid + 7u * WG, kl, nw); }
        if (bad == 0u && item_fma == 0u) {
            for (var i = 0u; i < NST; i++) {
                let kt = cb + CS * i;  // 16-key block of the tile (the row block is rb)
                if (kt >= TK / 16u) {
                    break;  // (subgroup-uniform: more subgroups than score tiles)
                }
                var acc = subgroup_matrix_result<f32, 16, 16>();  // (zero: explicitly, every tile)
                for (var j = 0u; j < D / 16u; j++) {
                    let d0 = 16u * j;
                    let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&hmem, KVO + kt * 16u * HS + d0, HS);
                    let ah = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, rb * 16u * HS + d0, HS);
                    let al = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, RMAX * QA + rb * 16u * HS + d0, HS);
                    acc = subgroupMatrixMultiplyAccumulate(ah, b, acc);
                    acc = subgroupMatrixMultiplyAccumulate(al, b, acc);
                }
                subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + k0 + kt * 16u, acc, SB);
            }
        } else {
            // f32 FMAs from the f32 query, as psa_partials.wgsl (non-finite q or K)
            for (var j = 0u; j < (RMAX * TK + WG - 1u) / WG; j++) {
                let x = tid + j * WG;
                if (x >= RMAX * TK) {
                    break;
                }
                let r = x / TK;
                let k = x - r * TK;
                var s = 0.0;
                if (r < n_rows && k0 + k < max_len) {
                    for (var c = 0u; c < QV; c++) {
                        let qv = q[row_q[r] + c];
                        let kb = k * HS + 4u * c;
                        s += qv.x * f32(hmem[KVO + kb]);
                        s += qv.y * f32(hmem[KVO + kb + 1u]);
                        s += qv.z * f32(hmem[KVO + kb + 2u]);
                        s += qv.w * f32(hmem[KVO + kb + 3u]);
                    }
                    s *= params.scale;
                }
                sbuf[r * SB + k0 + k] = s;
            }
        }
        workgroupBarrier();
        if (bad == 0u && item_fma == 0u) {  // undo the query scaling: s = (S' 2^-e) * scale
            for (var j = 0u; j < (RMAX * TK + WG - 1u) / WG; j++) {
                let x = tid + j * WG;
                if (x >= RMAX * TK) {
                    break;
                }
                let r = x / TK;
                let i = r * SB + k0 + x - r * TK;
                sbuf[i] = (sbuf[i] * row_down[r]) * params.scale;
            }
        }
        par = 1u - par;
    }
    workgroupBarrier();

    // 2. Softmax of the block, SL invocations per row (a strided share of the keys each).
    let sr = tid / SL;
    let sl = tid - sr * SL;
    var kend = 0u;
    if (sr < n_rows) {
        kend = min(row_len[sr], max_len);
    }
    var lmax = 0.0;
    var seen = false;
    let nks = (kend + SL - 1u - sl) / SL;  // keys k = sl, sl + SL, ... below kend
    for (var j = 0u; j < nks; j++) {
        let k = sl + j * SL;
        if (key_src[k] != INVALID) {
            let s = sbuf[sr * SB + k];
            if (!is_ninf(s)) {
                lmax = select(s, nan_max(lmax, s), seen);
                seen = true;
            }
        }
    }
    // the row's SL invocations are consecutive lanes of one subgroup: a butterfly over them
    var m_new = lmax;
    var found = seen;
    for (var j = 0u; j < 5u; j++) {  // lane distances SL / 2, SL / 4, ..., 1 (SL <= 32)
        let o = (SL / 2u) >> j;
        if (o == 0u) {
            break;  // (uniform: o depends on constants only)
        }
        let mo = subgroupShuffleXor(m_new, o);
        let fo = subgroupShuffleXor(select(0u, 1u, found), o) != 0u;
        m_new = select(select(m_new, mo, fo), nan_max(m_new, mo), found && fo);
        found = found || fo;
    }
    var psum = 0.0;
    if (sr < RMAX) {
        // every position of the V tiles gets its weight (0 past max_len: V is 0 there)
        let nkm = (nkt * TK + SL - 1u - sl) / SL;
        for (var j = 0u; j < nkm; j++) {
            let k = sl + j * SL;
            var p = 0.0;
            if (k < kend && key_src[k] != INVALID) {
                let sc = sbuf[sr * SB + k];
                p = select(exp(sc - m_new), REMOVED, is_ninf(sc));
            }
            if (!is_removed(p)) {
                psum += p;  // (a NaN p stays in the sum)
            }
            // the weight as the split P hi + P lo of step 3: a removed weight and a NaN row's
            // (its o is made NaN at the end) enter the product as 0
            var pm = p;
            if (is_nan(p) || is_removed(p)) {
                pm = 0.0;
            }
            let h = hi11(vec4<f32>(pm, 0.0, 0.0, 0.0)).x;
            hmem[sr * PB + k] = f16(h);
            hmem[RMAX * QA + sr * PB + k] = f16(pm - h);
        }
    }
    for (var j = 0u; j < 5u; j++) {
        let o = (SL / 2u) >> j;
        if (o == 0u) {
            break;
        }
        psum += subgroupShuffleXor(psum, o);
    }
    if (sr < n_rows && sl == 0u && found) {
        row_m[sr] = m_new;
        row_l[sr] = psum;
    }

    // 3. o += P V, a V tile at a time; accumulators in registers.
    var acc0: subgroup_matrix_result<f32, 16, 16>;
    var acc1: subgroup_matrix_result<f32, 16, 16>;
    var acc2: subgroup_matrix_result<f32, 16, 16>;
    var acc3: subgroup_matrix_result<f32, 16, 16>;
    var acc4: subgroup_matrix_result<f32, 16, 16>;
    var acc5: subgroup_matrix_result<f32, 16, 16>;
    var acc6: subgroup_matrix_result<f32, 16, 16>;
    var acc7: subgroup_matrix_result<f32, 16, 16>;
    for (var it = 0u; it < nkt; it++) {
        let k0 = it * TK;
        var tb = false;
        if (LD > 0u) { tb = tb | store_unit(tid + 0u * WG, t0, 1u); }
        if (LD > 1u) { tb = tb | store_unit(tid + 1u * WG, t1, 1u); }
        if (LD > 2u) { tb = tb | store_unit(tid + 2u * WG, t2, 1u); }
        if (LD > 3u) { tb = tb | store_unit(tid + 3u * WG, t3, 1u); }
        if (LD > 4u) { tb = tb | store_unit(tid + 4u * WG, t4, 1u); }
        if (LD > 5u) { tb = tb | store_unit(tid + 5u * WG, t5, 1u); }
        if (LD > 6u) { tb = tb | store_unit(tid + 6u * WG, t6, 1u); }
        if (LD > 7u) { tb = tb | store_unit(tid + 7u * WG, t7, 1u); }
        if (tb) {
            set_flag(par);
        }
        var bad = 0u;
        if (par == 0u) {
            bad = workgroupUniformLoad(&flag0);
        } else {
            bad = workgroupUniformLoad(&flag1);
        }
        if (tid == 0u) {
            if (par == 0u) { flag1 = 0u; } else { flag0 = 0u; }
        }
        if (k0 + TK < max_len) {  // the next V tile's loads fly during this one
            if (LD > 0u) { t0 = load_unit(tid + 0u * WG, k0 + TK, 1u); }
            if (LD > 1u) { t1 = load_unit(tid + 1u * WG, k0 + TK, 1u); }
            if (LD > 2u) { t2 = load_unit(tid + 2u * WG, k0 + TK, 1u); }
            if (LD > 3u) { t3 = load_unit(tid + 3u * WG, k0 + TK, 1u); }
            if (LD > 4u) { t4 = load_unit(tid + 4u * WG, k0 + TK, 1u); }
            if (LD > 5u) { t5 = load_unit(tid + 5u * WG, k0 + TK, 1u); }
            if (LD > 6u) { t6 = load_unit(tid + 6u * WG, k0 + TK, 1u); }
            if (LD > 7u) { t7 = load_unit(tid + 7u * WG, k0 + TK, 1u); }
        }
        if (bad != 0u) {
            // NaN / +-inf values of the tile: mark the (row, d) of every attended, not removed
            // pair, reading the value again from the cache (the staged tile holds 0 there)
            for (var x = tid; x < TK * D; x += WG) {  // rolled: a rare path (unrolled, it costs registers)
                let k = x / D;
                let d = x - k * D;
                let row = key_src[k0 + k];
                if (row != INVALID) {
                    let w = v_cache[row + d / 8u][(d % 8u) / 2u];
                    let h = (w >> (16u * (d % 2u))) & 0xffffu;
                    if ((h & 0x7c00u) == 0x7c00u) {
                        var cls = 3u;  // NaN: both bits
                        if ((h & 0x3ffu) == 0u) {
                            cls = select(1u, 2u, (h & 0x8000u) != 0u);  // +inf: bit 0, -inf: bit 1
                        }
                        for (var r = 0u; r < n_rows; r++) {  // rolled: a rare path (as above)
                            if (k0 + k < min(row_len[r], max_len)) {
                                let sc = sbuf[r * SB + k0 + k];
                                if (!is_ninf(sc)) {  // (not removed: the weight of step 2, again)
                                    let p = exp(sc - row_m[r]);
                                    // 0 * inf = NaN (a weight that underflowed)
                                    let c = select(cls, 3u, p == 0.0);
                                    atomicOr(&poison[r * NPW + d / 16u], c << (2u * (d % 16u)));
                                    poisoned = 1u;
                                }
                            }
                        }
                    }
                }
            }
        }
        for (var j = 0u; j < TK / 16u; j++) {
            let kk = 16u * j;
            let ah = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, rb * 16u * PB + k0 + kk, PB);
            let al = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, RMAX * QA + rb * 16u * PB + k0 + kk, PB);
            if (NDT > 0u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 0u) * 16u, HS);
                acc0 = subgroupMatrixMultiplyAccumulate(ah, b, acc0);
                acc0 = subgroupMatrixMultiplyAccumulate(al, b, acc0);
            }
            if (NDT > 1u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 1u) * 16u, HS);
                acc1 = subgroupMatrixMultiplyAccumulate(ah, b, acc1);
                acc1 = subgroupMatrixMultiplyAccumulate(al, b, acc1);
            }
            if (NDT > 2u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 2u) * 16u, HS);
                acc2 = subgroupMatrixMultiplyAccumulate(ah, b, acc2);
                acc2 = subgroupMatrixMultiplyAccumulate(al, b, acc2);
            }
            if (NDT > 3u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 3u) * 16u, HS);
                acc3 = subgroupMatrixMultiplyAccumulate(ah, b, acc3);
                acc3 = subgroupMatrixMultiplyAccumulate(al, b, acc3);
            }
            if (NDT > 4u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 4u) * 16u, HS);
                acc4 = subgroupMatrixMultiplyAccumulate(ah, b, acc4);
                acc4 = subgroupMatrixMultiplyAccumulate(al, b, acc4);
            }
            if (NDT > 5u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 5u) * 16u, HS);
                acc5 = subgroupMatrixMultiplyAccumulate(ah, b, acc5);
                acc5 = subgroupMatrixMultiplyAccumulate(al, b, acc5);
            }
            if (NDT > 6u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 6u) * 16u, HS);
                acc6 = subgroupMatrixMultiplyAccumulate(ah, b, acc6);
                acc6 = subgroupMatrixMultiplyAccumulate(al, b, acc6);
            }
            if (NDT > 7u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&hmem, KVO + kk * HS + (cb + CS * 7u) * 16u, HS);
                acc7 = subgroupMatrixMultiplyAccumulate(ah, b, acc7);
                acc7 = subgroupMatrixMultiplyAccumulate(al, b, acc7);
            }
        }
        workgroupBarrier();
        par = 1u - par;
    }

    // 4. o through workgroup memory (rows past n_rows belong to no partial row).
    if (NDT > 0u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 0u) * 16u, acc0, SB);
    }
    if (NDT > 1u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 1u) * 16u, acc1, SB);
    }
    if (NDT > 2u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 2u) * 16u, acc2, SB);
    }
    if (NDT > 3u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 3u) * 16u, acc3, SB);
    }
    if (NDT > 4u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 4u) * 16u, acc4, SB);
    }
    if (NDT > 5u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 5u) * 16u, acc5, SB);
    }
    if (NDT > 6u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 6u) * 16u, acc6, SB);
    }
    if (NDT > 7u) {
        subgroupMatrixStore<row_major>(&sbuf, rb * 16u * SB + (cb + CS * 7u) * 16u, acc7, SB);
    }
    workgroupBarrier();
    let any_poison = poisoned != 0u;
    for (var j = 0u; j < (RMAX * D + WG - 1u) / WG; j++) {
        let x = tid + j * WG;
        if (x >= n_rows * D) {
            break;
        }
        let r = x / D;
        let d = x - r * D;
        var o = sbuf[r * SB + d];
        if (any_poison) {
            let c = (atomicLoad(&poison[r * NPW + d / 16u]) >> (2u * (d % 16u))) & 3u;
            if (c == 3u) {
                o = bitcast<f32>(NAN_BITS);
            } else if (c == 1u) {
                o = bitcast<f32>(INF_BITS);
            } else if (c == 2u) {
                o = bitcast<f32>(MINF_BITS);
            }
        }
        if (is_nan(row_l[r])) {
            o = bitcast<f32>(NAN_BITS);
        }
        o_out[(prow0 + r) * D + d] = o;
    }
    for (var j = 0u; j < (RMAX + WG - 1u) / WG; j++) {
        let r = tid + j * WG;
        if (r >= n_rows) {
            break;
        }
        ml_out[prow0 + r] = vec2<f32>(row_m[r], row_l[r]);
    }
}
