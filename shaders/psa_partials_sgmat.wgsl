// psa_partials_sgmat.wgsl — KV-outer partials (R14) on 16x16x16 subgroup matrices (tensor
// cores): a drop-in for psa_partials.wgsl on float16 caches.
//
// Same bindings, Params, plan records (work items, edge records, page lists), outputs and empty
// representation as psa_partials.wgsl (read its header): work items of up to RMAX rows (edges x
// query heads) reading one KV block; a partial row's o is unnormalised, its (m, l) has l == 0 for
// a row that attended nothing and l >= 1 otherwise. Workgroups loop over the items: workgroup w
// of min(NPW, n_items) runs items w, w + NPW, ... (the host dispatches that many; any further
// workgroup returns), each item as below.
//
// Bindings (group 0); the storage arrays are other views of the same buffers
//   0 params  uniform              Params
//   1 q       storage, read        vec4<f32> [n_qrows * G * D / 4]  (D % 16 == 0)
//   2 k_cache storage, read        vec4<u32> [n_slabs_in_chunk * S * D / 8]: 8 float16 per unit
//                                  (with RH > 1, an NHD cache: whole pages, as psa_partials.wgsl)
//   3 v_cache storage, read        vec4<u32>, same layout
//   4 plan    storage, read        u32 plan words, as psa_partials.wgsl
//   5 o_out   storage, read_write  vec4<f32> [n_prows * D / 4]
//   6 ml_out  storage, read_write  vec2<f32> [n_prows]
//
// The loader prepends `enable f16;` and `enable chromium_experimental_subgroup_matrix;` (the
// kernel table marks it sgmat); the host runs it only where the device has 16x16x16
// f16 x f16 -> f32 subgroup matrices with subgroups of 32 consecutive invocations (subgroup
// s = invocations 32 s .. 32 s + 31), on float16 caches, D % 16 == 0, and blocks of at most BK
// positions.
//
// One array of 16-byte words. Everything the matrices load and store lives in `wmem`, an array
// of vec4<u32>: float16 matrices are loaded from its words and float32 ones stored to them, with
// offsets and strides counted in words (the Tint of wgpudawn 0.32 takes a matrix of another
// component type than the array's element, and reads or writes its bytes), so that areas of
// different types can share the same words at different times. Per row r of the item, SW words
// from word r SW: first the row's split query (hi at word 0, lo at word PW; D / 8 words each),
// then its block of float32 scores (BK floats from word 0), then its split weights written over
// the scores, by groups of 16 positions (group g's P hi in words 4 g, 4 g + 1, its P lo in 4 g + 2,
// 4 g + 3: the words of its 16 scores, so a softmax lane overwrites only its own) with two codes
// per position after them (CW words from word BK / 4, then CW more; below); o at the end (D
// floats from word 0); the row's last word holds its m, l, scaling and edge length (row_word). The K/V tile follows
// the rows (TK rows of HW words). SW = 2 PW + 1 and HW = D / 8 + 1 are odd, so the 8 rows a
// matrix load reads per phase fall in distinct 16-byte bank groups.
//
// Algorithm (one work item; rows = M, keys = N, head dim = K of the matrix products)
//   0. Q: each row's query is scaled by an exact power of two 2^e (its largest |q| into
//      [2^14, 2^15): no float16 overflow, no subnormal loss of a whole row) and split into
//      hi = q 2^e with its mantissa cut to 11 bits (hi11: a float16 value) and
//      lo = f16(q 2^e - hi): hi + lo carries ~21 bits of q 2^e. A row whose q holds NaN or
//      +-inf sets the item's FMA flag (step 1 then runs on FMAs, as psa_partials.wgsl does).
//      The split rows are staged once; each subgroup loads its 16-row block of them as D / 16
//      pairs of left-hand matrices, held in registers for the whole of step 1.
//   1. Scores of the whole block (max_len <= BK positions), a K tile of TK keys at a time:
//      S' = Qhi K^T + Qlo K^T on subgroup matrices (f16 products are exact in f32, f32
//      accumulation), stored over the staged queries; s = (S' 2^-e) * scale (2^-e exact) where
//      step 2 reads them (fma_tiles: the tiles whose scores are final already).
//      A tile whose readable K holds NaN or +-inf (or an item with the FMA flag) computes its
//      scores with f32 FMAs from the f32 q instead: the FMA kernel's scores, in its order.
//   2. Softmax of the whole block (f32, as psa_partials.wgsl step 3 over one tile of max_len
//      keys), SL consecutive lanes per row, each NK = BK / SL consecutive positions: the lane
//      reads its scores into registers and marks the positions whose weight enters (attended,
//      readable, and not -inf: R26, -inf removes its position); m = their max (NaN kept), the
//      lanes' maxima combined by shuffles; p = exp(s - m)
//      where the weight enters, else 0 (which leaves l as it is), l = sum p (the lane's
//      positions in order, then a butterfly). The weights are written over the scores, split
//      like Q (hi = hi11(p), lo = f16(p - hi); 0 for a NaN weight), with two bits per position
//      for step 3's rare path: "its weight enters" (in the CW words after P) and "its weight
//      is 0" (exp underflowed; the CW words after those). Measured on an H200 the softmax was a sixth of the
//      prefill partials and combine (0.80 of 4.87 ms); it computes each weight once, with no
//      marker for removed positions and one cache-row lookup per lane where its positions share
//      a page (same bits as the version before; benchmarks, 2026-12-04). One block is one tile of the online softmax (R14): o is never rescaled, so it
//      stays in registers.
//   3. o = P V, a V tile of TK keys at a time, as two products (P hi V + P lo V). Accumulators
//      stay in subgroup-matrix registers for the whole item; each subgroup owns one 16-row
//      block and NDT 16-column blocks of o.
//   4. o is staged through the words and the item's rows are written out.
// Every K/V tile's global loads are issued into registers one tile ahead (the next K tile, then
// the first V tile during the last K tile and the softmax, then the next V tile). The next item
// is read during this one: its record when this item starts, its edge rows and page list during
// the softmax, stored into workgroup memory after this item's last barrier; its queries and
// first K tile are loaded when it starts. (Loaded into registers during the item before, as
// its rows are, they cost more registers than their wait: on an H200 the prefill layer's
// partials and combine took 0.09-0.15 ms more that way, the same bits; benchmarks, 2026-12-04.)
//
// Special values (R26, R10), as psa_partials.wgsl:
//   - positions of INVALID pages and past max_len are never read (zeros in the tiles);
//   - a masked or removed (row, key) pair has p = 0 in the f16 P tile and adds nothing to l; V
//     values that are NaN or +-inf are replaced by 0 in the staged V tile, so no product 0 * NaN
//     can reach a row through the matrix product. Instead every (row, key) pair whose weight
//     enters and whose v[d] is non-finite marks (row, d) in `poison` (2 bits: +inf seen, -inf
//     seen; both for NaN, for 0 * inf, i.e. a weight that is 0, and for +inf + -inf): the
//     written o[d] is then what the FMA kernel's sum gives, NaN, +inf or -inf;
//   - a row with a NaN l (a NaN or +inf score) gets o = NaN in every component, as p = NaN
//     gives in the FMA kernel (its P entries enter the product as 0);
//   - -inf and NaN are tested on bits: a compiler may turn a select on a comparison into a max
//     or min, which drops a NaN (measured on the H200 through Dawn).
//
// Determinism (R19): the order of every sum is fixed by the constants (tiles, subgroup-matrix
// products in k order, each softmax lane's positions in order, the lanes' partial sums reduced
// by a fixed butterfly).
//
// Override constants
//   D     head dim (multiple of 16, <= 256)  S    page size
//   TK    keys per K/V tile (multiple of 16, <= D)
//   BK    positions per block the kernel holds (multiple of TK, >= max_len of every item)
//   RMAX  rows per work item (multiple of 16)
//   WG    workgroup size: 32 * NSG subgroups; NSG a multiple of RMAX / 16 and the column blocks
//         of o (D / 16) divisible by NSG / (RMAX / 16), at most 8 per subgroup (NDT); the
//         score tiles of a K tile are dealt out to the subgroups (some idle when there are fewer);
//         NK = BK / (WG / RMAX) 8, 16 or 32
//   LD, LQ (derived) K/V and query units an invocation holds in registers: at most 8 each
//   NPW   workgroups at most (persistent: each loops over every NPW-th item)
// Workgroup memory (bytes, each variable rounded to 16): 16 * WCAP + 4 * BK + 2 * 4 * RMAX
//   + 4 * RMAX * D / 16 + 2 * 16 (_sgmat.sgmat_workgroup_bytes: 47648 for D = 128, RMAX = 64
//   and BK = 128). The host checks RMAX * SW + TK * HW <= WCAP.

// FLAG READS. The item's and each tile's flags are read after a workgroupBarrier with a plain
// load, not workgroupUniformLoad: Tint writes that as a barrier, the load and a second barrier,
// and the second is not needed here (nothing writes a flag until the barrier that ends the
// tile: the other flag's reset is of the one read a tile before). Every invocation reads the
// same value, so what depends on it (MMA or FMA scores, the rare V path) is uniform in fact,
// though not to Tint's analysis: those branches hold no barrier, and the subgroup-matrix and
// subgroup uniformity diagnostics are off (below). On an H200 the nine barriers per item this
// saves were about 0.06 ms of the prefill layer's partials and combine, the same bits
// (benchmarks, 2026-12-04).
//
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
override SL: u32 = max(1u, WG / RMAX);     // softmax invocations per row (a power of two, <= 32: one butterfly)
override CW: u32 = (BK + 127u) / 128u;     // words of one code (a bit per position)
override PW: u32 = max(D, BK) / 8u + CW;   // word of a row's split query's lo half (its hi at 0)
override SW: u32 = 2u * PW + 1u;           // words per row (odd)
override SBF: u32 = 4u * SW;               // floats per row (scores, o)
override HW: u32 = D8 + 1u;                // words per K/V tile row (odd)
override KVW: u32 = RMAX * SW;             // word of the K/V tile
override NSG: u32 = WG / 32u;              // subgroups
override NRB: u32 = RMAX / 16u;            // 16-row blocks
override CS: u32 = NSG / NRB;              // subgroups per row block
override NDT: u32 = D / 16u / CS;          // 16-column blocks of o per subgroup
override NST: u32 = (NRB * (TK / 16u) + NSG - 1u) / NSG;  // 16x16 score tiles per subgroup and K tile
override NK: u32 = BK / SL;                // positions per softmax invocation (8, 16 or 32)
override NKL: u32 = NK / 4u;               // their vec4 of scores (<= 8, in registers)
override CG: u32 = min(32u / NK, SL);      // softmax invocations of a row whose codes share a u32
override NPW_POISON: u32 = D / 16u;        // poison words per row (2 bits per column)
override NPW: u32 = 528u;                  // persistent workgroups (the host sets _sgmat.PERSISTENT_WORKGROUPS)
override QV: u32 = D / 4u;                 // vec4 per query row
override LD: u32 = (TK * D8 + WG - 1u) / WG;  // K/V units per invocation and tile (<= 8)
override LQ: u32 = (RMAX * QV + WG - 1u) / WG;  // query units per invocation (<= 8)
// a row's QV query units are QV consecutive invocations of one subgroup (unit x is invocation
// x % WG): its maximum is a butterfly of shuffles, no atomics and no barrier (on an H200 about
// 0.09 ms of the prefill layer's partials and combine, the same bits; benchmarks, 2026-12-04)
override QSG: bool = QV <= 32u && (QV & (QV - 1u)) == 0u;
// NDT <= 8: eight named accumulators, D / 16 <= 16 pairs of named query matrices (no arrays: an
// array of matrices indexed in a loop may live in local memory), those past NDT and D / 16
// removed by the compiler (pipeline constants)
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
@group(0) @binding(5) var<storage, read_write> o_out: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> ml_out: array<vec2<f32>>;

// The capacity of the word array (the builtins take no override-sized array): the largest
// geometry the host picks within 48 KiB (RMAX = 64, D = BK = 128, TK = 32: 64 * 35 + 32 * 17);
// the host checks RMAX * SW + TK * HW <= WCAP.
const WCAP: u32 = 2784u;
var<workgroup> wmem: array<vec4<u32>, WCAP>;
var<workgroup> key_src: array<u32, BK>;             // vec4<u32> index of each position's cache row, or INVALID
var<workgroup> row_q: array<u32, RMAX>;             // vec4 index of the row's query
// (the row's m, l, 2^-e and edge_len live in its last word: row_word)
var<workgroup> row_qmax: array<atomic<u32>, RMAX>;  // bits of the row's largest |q|
var<workgroup> poison: array<atomic<u32>, RMAX * NPW_POISON>;
// The flags in whole 16-byte words (scalars adding up to 12 bytes misplaced the matrix loads
// and stores through Dawn on NVIDIA: docs/backends/dawn.md).
// flags[par] (par = 0, 1): 1 where the tile holds NaN or +-inf at a readable position (two
// flags, alternating by tile, so that a reset never races a set); flags.z: 1 where some
// (row, d) of the item is poisoned
var<workgroup> flags: vec4<u32>;
var<workgroup> q_bad: vec4<u32>;  // [item parity] 1: a query of the item holds NaN or +-inf (FMA scores)


const NEG_INF_BITS: u32 = 0xff800000u;
// bit tests, not comparisons: a compiler may turn select(p, 0, p < 0) into max(p, 0), which
// drops a NaN
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
// Bit 15 (31) of each word set where its low (high) float16 is NaN or +-inf, the others 0: that
// half's exponent field plus one carries into its sign bit only when it is all ones, and never
// past it (the same answer as a test per half, in three operations per word: the staged K/V tiles
// are tested on every load, which cost 0.21 ms of the prefill layer's 4.6 on an H200)
fn nonfinite_bits(u: vec4<u32>) -> vec4<u32> {
    return ((u & vec4<u32>(0x7c007c00u)) + vec4<u32>(0x04000400u)) & vec4<u32>(0x80008000u);
}

// Row r's last word, which no matrix load or store reaches (its P codes end a word before):
// x = bits of m, y = bits of l, z = bits of 2^-e (the query scaling undone), w = edge_len of the
// row's edge (0: no such row; written for the next item once this one's last read is done)
fn row_word(r: u32) -> u32 {
    return r * SW + SW - 1u;
}

// Score k of row r as a word component (the FMA path writes its scores one at a time)
fn s_set(r: u32, k: u32, x: f32) {
    let i = r * SBF + k;
    wmem[i / 4u][i % 4u] = bitcast<u32>(x);
}
// half i (row * 8 HW + column) of the K/V tile
fn kvh(i: u32) -> f16 {
    return bitcast<vec2<f16>>(wmem[KVW + i / 8u][(i % 8u) / 2u])[i % 2u];
}

// The K/V tiles are staged in two steps, so that a tile's loads are in flight while the
// previous tile is multiplied: load_unit reads unit x (8 float16) of the TK-key tile at block
// position k0 from K (which = 0) or V (1) into registers, zeros for an unreadable position;
// store_unit writes it to the tile (one word). store_unit returns true if the unit holds
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
    let f = nonfinite_bits(u);
    let bad = any((f.xy | f.zw) != vec2<u32>(0u));
    if (bad && which == 1u) {
        u = u & ~((f >> vec4<u32>(15u)) * vec4<u32>(0xffffu));  // 0xffff over each such half
    }
    wmem[KVW + k * HW + j] = u;
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

// The vec4 index of row r's query in an item (edge records at erec, heads g0 .. g0 + ng).
fn row_query(r: u32, erec: u32, g0: u32, ng: u32) -> u32 {
    let ie = r / ng;
    return ((plan[erec + 2u * ie] * params.group + g0 + (r - ie * ng)) * D) / 4u;
}

// The bits of the largest |q| of unit x: with QSG its row's (a butterfly over the row's QV
// lanes; every invocation calls it, as shuffles need), else the unit's own, folded into its row's
// maximum with an atomic (read after a barrier); 0 past the item's units.
fn q_fold(x: u32, v: vec4<f32>) -> u32 {
    let a = bitcast<vec4<u32>>(v) & vec4<u32>(0x7fffffffu);
    var mb = max(max(a.x, a.y), max(a.z, a.w));
    if (QSG) {
        for (var j = 0u; j < 5u; j++) {
            let o = (QV / 2u) >> j;
            if (o == 0u) {
                break;  // (uniform: o depends on constants only)
            }
            mb = max(mb, subgroupShuffleXor(mb, o));
        }
    } else if (x < RMAX * QV) {
        atomicMax(&row_qmax[x / QV], mb);
    }
    return select(mb, 0u, x >= RMAX * QV);
}

// The scaled hi / lo split of query unit x into its row's words (hi at word r SW + c / 2, lo PW
// words further; two halves a u32; zeros for a row with a non-finite q: its scores come from FMAs)
fn q_split(x: u32, v: vec4<f32>, mb_x: u32) {
    if (x >= RMAX * QV) {
        return;
    }
    let r = x / QV;
    let c = x - r * QV;
    var hi = vec4<f16>(0.0);
    var lo = vec4<f16>(0.0);
    var mb = mb_x;  // (the row's maximum with QSG)
    if (!QSG) {
        mb = atomicLoad(&row_qmax[r]);
    }
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
        wmem[row_word(r)].z = bitcast<u32>(pow2(-e));
    }
    let w = r * SW + c / 2u;
    let o = (c % 2u) * 2u;
    wmem[w][o] = bitcast<u32>(hi.xy);
    wmem[w][o + 1u] = bitcast<u32>(hi.zw);
    wmem[w + PW][o] = bitcast<u32>(lo.xy);
    wmem[w + PW][o + 1u] = bitcast<u32>(lo.zw);
}

// The vec4<u32> index of position k's cache row in an item's block (max_len positions, page list
// at `pages`), or INVALID for a position past max_len or on an INVALID page.
// R34: HND (RH = 1) slab * slab_stride + off * TD; NHD the page's row off * RH + head, with page
// slab / RH and head slab % RH (as psa_partials.wgsl)
fn key_row(k: u32, max_len: u32, pages: u32) -> u32 {
    var row = INVALID;
    if (k < max_len) {
        let slab = plan[pages + k / S];
        if (slab != INVALID) {
            let page = slab / RH;
            row = (page * RH * params.slab_stride + ((k % S) * RH + (slab - page * RH)) * TD) / 2u;
        }
    }
    return row;
}

// Every (row, d) of the item unpoisoned (invocation tid's share of the words).
fn clear_poison(tid: u32) {
    for (var j = 0u; j < (RMAX * NPW_POISON + WG - 1u) / WG; j++) {
        let x = tid + j * WG;
        if (x >= RMAX * NPW_POISON) {
            break;
        }
        atomicStore(&poison[x], 0u);
    }
}

fn set_flag(par: u32) {
    flags[par] = 1u;
}

alias Left = subgroup_matrix_left<f16, 16, 16>;
alias Right = subgroup_matrix_right<f16, 16, 16>;
alias Result = subgroup_matrix_result<f32, 16, 16>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    // Persistent workgroups: workgroup w of NPW runs items w, w + NPW, ... of the dispatch; while
    // it works on one item it reads the next one's record, rows and page list, and issues its
    // first K tile's and queries' loads, so that no item starts by waiting on memory.
    let w = wid.y * params.grid_x + wid.x;
    let nwg = min(NPW, params.n_items);
    if (w >= nwg) {
        return;
    }
    let sg = tid / 32u;        // this invocation's subgroup
    let rb = sg % NRB;         // its 16-row block
    let cb = sg / NRB;         // its share of the columns

    // the first item's record, rows and page list (buffer 0), as every later item's (below)
    var item = w;
    var ib = (params.item_base + item) * 8u;
    var max_len = plan[ib];
    var n_e = plan[ib + 1u];
    var g0 = plan[ib + 2u];
    var ng = plan[ib + 3u];
    var erec = plan[ib + 4u];
    var pages = plan[ib + 5u];
    var prow0 = plan[ib + 6u];
    for (var j = 0u; j < (RMAX + WG - 1u) / WG; j++) {
        let r = tid + j * WG;
        if (r >= RMAX) {
            break;
        }
        var len = 0u;
        var qo = 0u;
        if (r < n_e * ng) {
            len = plan[erec + 2u * (r / ng) + 1u];
            qo = row_query(r, erec, g0, ng);
        }
        wmem[row_word(r)].w = len;
        row_q[r] = qo;
        atomicStore(&row_qmax[r], 0u);
    }
    clear_poison(tid);
    for (var j = 0u; j < (BK + WG - 1u) / WG; j++) {
        let k = tid + j * WG;
        if (k >= BK) {
            break;
        }
        key_src[k] = key_row(k, max_len, pages);
    }
    if (tid == 0u) {
        q_bad = vec4<u32>(0u);
        flags = vec4<u32>(0u);
    }
    workgroupBarrier();

    let n_mine = (params.n_items - w + nwg - 1u) / nwg;  // items of this workgroup
    for (var ii = 0u; ii < n_mine; ii++) {
        // 0. The first K tile's loads and the queries' loads in flight together
        var t0 = vec4<u32>(0u);
        var t1 = vec4<u32>(0u);
        var t2 = vec4<u32>(0u);
        var t3 = vec4<u32>(0u);
        var t4 = vec4<u32>(0u);
        var t5 = vec4<u32>(0u);
        var t6 = vec4<u32>(0u);
        var t7 = vec4<u32>(0u);
        var q0 = vec4<f32>(0.0);
        var q1 = vec4<f32>(0.0);
        var q2 = vec4<f32>(0.0);
        var q3 = vec4<f32>(0.0);
        var q4 = vec4<f32>(0.0);
        var q5 = vec4<f32>(0.0);
        var q6 = vec4<f32>(0.0);
        var q7 = vec4<f32>(0.0);
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
        if (LQ > 0u) { q0 = q_load(tid + 0u * WG, n_e * ng); }
        if (LQ > 1u) { q1 = q_load(tid + 1u * WG, n_e * ng); }
        if (LQ > 2u) { q2 = q_load(tid + 2u * WG, n_e * ng); }
        if (LQ > 3u) { q3 = q_load(tid + 3u * WG, n_e * ng); }
        if (LQ > 4u) { q4 = q_load(tid + 4u * WG, n_e * ng); }
        if (LQ > 5u) { q5 = q_load(tid + 5u * WG, n_e * ng); }
        if (LQ > 6u) { q6 = q_load(tid + 6u * WG, n_e * ng); }
        if (LQ > 7u) { q7 = q_load(tid + 7u * WG, n_e * ng); }
        let n_rows = n_e * ng;
        let nxt = item + nwg;
        let has_next = nxt < params.n_items;
        // the next item's record: its words fly during this item's queries and scores
        let nib = (params.item_base + select(item, nxt, has_next)) * 8u;
        let n_max_len = plan[nib];
        let n_ne = plan[nib + 1u];
        let n_g0 = plan[nib + 2u];
        let n_ng = plan[nib + 3u];
        let n_erec = plan[nib + 4u];
        let n_pages = plan[nib + 5u];
        let n_prow0 = plan[nib + 6u];

        // each row's largest |q| (bit patterns of non-negative floats order like the values;
        // NaN and +-inf lie above every finite one), then the scaled hi / lo split
        var qbad = false;
        var mb0 = 0u;
        var mb1 = 0u;
        var mb2 = 0u;
        var mb3 = 0u;
        var mb4 = 0u;
        var mb5 = 0u;
        var mb6 = 0u;
        var mb7 = 0u;
        if (LQ > 0u) { mb0 = q_fold(tid + 0u * WG, q0); }
        if (LQ > 1u) { mb1 = q_fold(tid + 1u * WG, q1); }
        if (LQ > 2u) { mb2 = q_fold(tid + 2u * WG, q2); }
        if (LQ > 3u) { mb3 = q_fold(tid + 3u * WG, q3); }
        if (LQ > 4u) { mb4 = q_fold(tid + 4u * WG, q4); }
        if (LQ > 5u) { mb5 = q_fold(tid + 5u * WG, q5); }
        if (LQ > 6u) { mb6 = q_fold(tid + 6u * WG, q6); }
        if (LQ > 7u) { mb7 = q_fold(tid + 7u * WG, q7); }
        if (max(max(max(mb0, mb1), max(mb2, mb3)), max(max(mb4, mb5), max(mb6, mb7))) >= 0x7f800000u) {
            q_bad[ii % 2u] = 1u;
        }
        if (!QSG) {
            workgroupBarrier();  // (the rows' maxima folded by atomics)
        }
        if (LQ > 0u) { q_split(tid + 0u * WG, q0, mb0); }
        if (LQ > 1u) { q_split(tid + 1u * WG, q1, mb1); }
        if (LQ > 2u) { q_split(tid + 2u * WG, q2, mb2); }
        if (LQ > 3u) { q_split(tid + 3u * WG, q3, mb3); }
        if (LQ > 4u) { q_split(tid + 4u * WG, q4, mb4); }
        if (LQ > 5u) { q_split(tid + 5u * WG, q5, mb5); }
        if (LQ > 6u) { q_split(tid + 6u * WG, q6, mb6); }
        if (LQ > 7u) { q_split(tid + 7u * WG, q7, mb7); }
        workgroupBarrier();  // (the split rows and the item's flag; a plain read, see FLAG READS)
        let item_fma = q_bad[ii % 2u];
        // the next item's maxima and poison marks start clear: every read of them (the split
        // above, the item before's rows written out) is past a barrier, and their next writes
        // past another (the item's flag, by item parity, is cleared before o's barrier)
        for (var j = 0u; j < (RMAX + WG - 1u) / WG; j++) {
            let r = tid + j * WG;
            if (QSG || r >= RMAX) {
                break;
            }
            atomicStore(&row_qmax[r], 0u);
        }
        clear_poison(tid);
        if (tid == 0u) {
            flags.z = 0u;  // (poisoned)
        }
        // the subgroup's row block of split queries, held in registers for every K tile
        var qh0: Left;
        var ql0: Left;
        if (D / 16u > 0u) {
            qh0 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 0u, SW);
            ql0 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 0u, SW);
        }
        var qh1: Left;
        var ql1: Left;
        if (D / 16u > 1u) {
            qh1 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 2u, SW);
            ql1 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 2u, SW);
        }
        var qh2: Left;
        var ql2: Left;
        if (D / 16u > 2u) {
            qh2 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 4u, SW);
            ql2 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 4u, SW);
        }
        var qh3: Left;
        var ql3: Left;
        if (D / 16u > 3u) {
            qh3 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 6u, SW);
            ql3 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 6u, SW);
        }
        var qh4: Left;
        var ql4: Left;
        if (D / 16u > 4u) {
            qh4 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 8u, SW);
            ql4 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 8u, SW);
        }
        var qh5: Left;
        var ql5: Left;
        if (D / 16u > 5u) {
            qh5 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 10u, SW);
            ql5 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 10u, SW);
        }
        var qh6: Left;
        var ql6: Left;
        if (D / 16u > 6u) {
            qh6 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 12u, SW);
            ql6 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 12u, SW);
        }
        var qh7: Left;
        var ql7: Left;
        if (D / 16u > 7u) {
            qh7 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 14u, SW);
            ql7 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 14u, SW);
        }
        var qh8: Left;
        var ql8: Left;
        if (D / 16u > 8u) {
            qh8 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 16u, SW);
            ql8 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 16u, SW);
        }
        var qh9: Left;
        var ql9: Left;
        if (D / 16u > 9u) {
            qh9 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 18u, SW);
            ql9 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 18u, SW);
        }
        var qh10: Left;
        var ql10: Left;
        if (D / 16u > 10u) {
            qh10 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 20u, SW);
            ql10 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 20u, SW);
        }
        var qh11: Left;
        var ql11: Left;
        if (D / 16u > 11u) {
            qh11 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 22u, SW);
            ql11 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 22u, SW);
        }
        var qh12: Left;
        var ql12: Left;
        if (D / 16u > 12u) {
            qh12 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 24u, SW);
            ql12 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 24u, SW);
        }
        var qh13: Left;
        var ql13: Left;
        if (D / 16u > 13u) {
            qh13 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 26u, SW);
            ql13 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 26u, SW);
        }
        var qh14: Left;
        var ql14: Left;
        if (D / 16u > 14u) {
            qh14 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 28u, SW);
            ql14 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 28u, SW);
        }
        var qh15: Left;
        var ql15: Left;
        if (D / 16u > 15u) {
            qh15 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + 30u, SW);
            ql15 = subgroupMatrixLoad<Left, row_major>(&wmem, rb * 16u * SW + PW + 30u, SW);
        }


        // 1. Scores of the block, a K tile at a time; the query scaling is undone where the
        //    softmax reads them (fma_tiles: the tiles whose scores came from FMAs, already final)
        var par = 0u;
        var fma_tiles = 0u;
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
            workgroupBarrier();  // (the tile is stored; its flag read as in FLAG READS)
            let bad = flags[par];
            if (tid == 0u) {  // the other flag was last read a tile ago, past a barrier
                flags[1u - par] = 0u;
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
                    if (D / 16u > 0u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 0u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh0, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql0, b, acc);
                    }
                    if (D / 16u > 1u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 2u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh1, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql1, b, acc);
                    }
                    if (D / 16u > 2u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 4u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh2, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql2, b, acc);
                    }
                    if (D / 16u > 3u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 6u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh3, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql3, b, acc);
                    }
                    if (D / 16u > 4u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 8u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh4, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql4, b, acc);
                    }
                    if (D / 16u > 5u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 10u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh5, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql5, b, acc);
                    }
                    if (D / 16u > 6u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 12u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh6, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql6, b, acc);
                    }
                    if (D / 16u > 7u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 14u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh7, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql7, b, acc);
                    }
                    if (D / 16u > 8u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 16u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh8, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql8, b, acc);
                    }
                    if (D / 16u > 9u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 18u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh9, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql9, b, acc);
                    }
                    if (D / 16u > 10u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 20u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh10, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql10, b, acc);
                    }
                    if (D / 16u > 11u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 22u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh11, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql11, b, acc);
                    }
                    if (D / 16u > 12u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 24u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh12, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql12, b, acc);
                    }
                    if (D / 16u > 13u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 26u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh13, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql13, b, acc);
                    }
                    if (D / 16u > 14u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 28u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh14, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql14, b, acc);
                    }
                    if (D / 16u > 15u) {
                        let b = subgroupMatrixLoad<Right, col_major>(&wmem, KVW + kt * 16u * HW + 30u, HW);
                        acc = subgroupMatrixMultiplyAccumulate(qh15, b, acc);
                        acc = subgroupMatrixMultiplyAccumulate(ql15, b, acc);
                    }
                    subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + k0 + kt * 16u) / 4u, acc, SW);
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
                            let kb = k * HW * 8u + 4u * c;
                            s += qv.x * f32(kvh(kb));
                            s += qv.y * f32(kvh(kb + 1u));
                            s += qv.z * f32(kvh(kb + 2u));
                            s += qv.w * f32(kvh(kb + 3u));
                        }
                        s *= params.scale;
                    }
                    s_set(r, k0 + k, s);
                }
            }
            if (bad != 0u || item_fma != 0u) {
                fma_tiles |= 1u << it;
            }
            workgroupBarrier();  // (the tile is overwritten next; the scores are read by the softmax)
            par = 1u - par;
        }

        // the next item's rows and page list (stored when this item is done): loads in flight
        // during the softmax (RMAX <= WG / 2 rows and BK <= 2 WG positions: the host's geometries)
        var n_len = 0u;
        var n_qo = 0u;
        var n_row0 = INVALID;
        var n_row1 = INVALID;
        if (has_next) {
            let n_rows_next = n_ne * n_ng;
            if (tid < RMAX && tid < n_rows_next) {
                n_len = plan[n_erec + 2u * (tid / n_ng) + 1u];
                n_qo = row_query(tid, n_erec, n_g0, n_ng);
            }
            if (tid < BK) {
                n_row0 = key_row(tid, n_max_len, n_pages);
            }
            if (tid + WG < BK) {
                n_row1 = key_row(tid + WG, n_max_len, n_pages);
            }
        }

        // 2. Softmax of the block, SL invocations per row, each NK consecutive positions: the
        //    scores read into registers (the query scaling undone: s = (S' 2^-e) * scale, as
        //    the FMA kernel's s = (q . k) * scale is final), a barrier (every row's scores read),
        //    then the split weights and the codes written over the row's scores.
        let sr = tid / SL;
        let sl = tid - sr * SL;
        let kb0 = sl * NK;
        var kend = 0u;
        if (sr < n_rows) {
            kend = min(wmem[row_word(sr)].w, max_len);
        }
        let down = bitcast<f32>(wmem[row_word(sr)].z);
        var sv: array<vec4<f32>, 8>;  // (NKL <= 8)
        // The lane's readable positions: a page is readable as a whole (key_row: its slab is
        // INVALID or not), and below kend every position is below max_len, so where the lane's NK
        // positions lie in one page (S % NK == 0: kb0 is a multiple of NK) one lookup answers
        // for all of them; otherwise one lookup per position.
        var okm = 0u;  // bit 4 j + c: position kb0 + 4 j + c is attended and readable
        if (S % NK == 0u) {
            if (kb0 < kend && key_src[kb0] != INVALID) {
                let n = min(kend - kb0, NK);
                okm = select((1u << n) - 1u, 0xffffffffu, n >= 32u);
            }
        } else {
            for (var b = 0u; b < NK; b++) {
                if (kb0 + b < kend && key_src[kb0 + b] != INVALID) {
                    okm |= 1u << b;
                }
            }
        }
        // m over the attended scores but -inf (R26), NaN kept: a plain max in position order and
        // a flag for NaN (the maximum's bits are those of the max over the same scores in the same
        // order; a NaN among them makes it NaN, as nan_max does)
        var inc = 0u;  // bit 4 j + c: the position's weight enters (attended, readable, not -inf)
        var mx = bitcast<f32>(MINF_BITS);  // (a private: a constant -inf is refused)
        var m_nan = false;
        for (var j = 0u; j < NKL; j++) {
            var v = vec4<f32>(0.0);
            if (sr < RMAX) {
                v = bitcast<vec4<f32>>(wmem[sr * SW + (kb0 + 4u * j) / 4u]);
            }
            if (((fma_tiles >> ((kb0 + 4u * j) / TK)) & 1u) == 0u) {
                v = (v * down) * params.scale;
            }
            sv[j] = v;
            for (var c = 0u; c < 4u; c++) {
                let bit = 4u * j + c;
                let s = v[c];
                if (((okm >> bit) & 1u) != 0u && !is_ninf(s)) {
                    inc |= 1u << bit;
                    mx = max(mx, s);
                    m_nan = m_nan || is_nan(s);
                }
            }
        }
        let seen = inc != 0u;
        var lmax = 0.0;
        if (seen) {
            lmax = select(mx, bitcast<f32>(NAN_BITS), m_nan);
        }
        var m_new = lmax;
        var found = seen;
        for (var j = 0u; j < 5u; j++) {
            let o = (SL / 2u) >> j;
            if (o == 0u) {
                break;
            }
            let mo = subgroupShuffleXor(m_new, o);
            let fo = subgroupShuffleXor(select(0u, 1u, found), o) != 0u;
            m_new = select(select(m_new, mo, fo), nan_max(m_new, mo), found && fo);
            found = found || fo;
        }
        // Each lane writes its weights over its own scores only (NK >= 16: the P layout below), so
        // no barrier is needed between the reads and the writes; with NK = 8 two lanes share a
        // group of 16 positions and every row's scores must be read first. (On an H200 the
        // barrier this saves was about 0.04 ms of the prefill layer's partials and combine:
        // benchmarks, 2026-12-04.)
        if (NK < 16u) {
            workgroupBarrier();
        }
        // p = exp(s - m) where the weight enters, 0 elsewhere (a removed position adds nothing to
        // l: adding +0 leaves l's bits as they are); split as Q (hi = hi11(p), lo = f16(p - hi)),
        // a NaN weight entering the product as 0 (its row's o is made NaN at the end)
        var psum = 0.0;
        var zb = 0u;  // bit 4 j + c: the weight enters and is 0 (exp underflowed)
        for (var jw = 0u; jw < NKL / 2u; jw++) {  // a word of weights: 8 positions
            let j = 2u * jw;
            var hw = vec4<u32>(0u);
            var lw = vec4<u32>(0u);
            for (var t = 0u; t < 2u; t++) {
                var ph = vec4<f32>(0.0);
                var pl = vec4<f32>(0.0);
                for (var c = 0u; c < 4u; c++) {
                    let bit = 4u * (j + t) + c;
                    var p = 0.0;
                    if (((inc >> bit) & 1u) != 0u) {
                        p = exp(sv[j + t][c] - m_new);
                        if (p == 0.0) {
                            zb |= 1u << bit;
                        }
                    }
                    psum += p;  // (a NaN p stays in the sum)
                    let pm = select(p, 0.0, is_nan(p));
                    let h = hi11(vec4<f32>(pm, 0.0, 0.0, 0.0)).x;
                    ph[c] = h;
                    pl[c] = pm - h;
                }
                let h16 = vec4<f16>(ph);
                let l16 = vec4<f16>(pl);
                hw[2u * t] = bitcast<u32>(h16.xy);
                hw[2u * t + 1u] = bitcast<u32>(h16.zw);
                lw[2u * t] = bitcast<u32>(l16.xy);
                lw[2u * t + 1u] = bitcast<u32>(l16.zw);
            }
            if (sr < RMAX) {  // positions p0 .. p0 + 7: half (p0 % 16) / 8 of their group's words
                let p0 = kb0 + 4u * j;
                let wi = sr * SW + (p0 / 16u) * 4u + (p0 % 16u) / 8u;
                wmem[wi] = hw;
                wmem[wi + 2u] = lw;
            }
        }
        // the codes' bits at k % 32 for position k = kb0 + bit (the lane's NK <= 32 positions
        // start at kb0 % 32, a multiple of NK)
        var enters = inc << (kb0 % 32u);
        var zero = zb << (kb0 % 32u);
        for (var j = 0u; j < 5u; j++) {
            let o = (SL / 2u) >> j;
            if (o == 0u) {
                break;
            }
            psum += subgroupShuffleXor(psum, o);
        }
        // the codes: the CG invocations whose positions share a u32 (consecutive lanes of the row)
        // combine their bits, and the first of them writes it: component (k % 128) / 32 of word
        // k / 128 after P hi (P lo)
        for (var j = 0u; j < 5u; j++) {
            let o = (CG / 2u) >> j;
            if (o == 0u) {
                break;  // (uniform: o depends on constants only)
            }
            enters |= subgroupShuffleXor(enters, o);
            zero |= subgroupShuffleXor(zero, o);
        }
        if (sr < RMAX && sl % CG == 0u) {
            let cw = sr * SW + BK / 4u + kb0 / 128u;
            wmem[cw][(kb0 % 128u) / 32u] = enters;
            wmem[cw + CW][(kb0 % 128u) / 32u] = zero;
        }
        if (sr < n_rows && sl == 0u) {  // (a row that attends nothing: m = l = 0, as m_new and psum are)
            wmem[row_word(sr)].x = bitcast<u32>(m_new);
            wmem[row_word(sr)].y = bitcast<u32>(psum);
        }



        // 3. o += P V, a V tile at a time; accumulators in registers.
        var acc0 = Result();  // (zero: explicitly, every item)
        var acc1 = Result();  // (zero: explicitly, every item)
        var acc2 = Result();  // (zero: explicitly, every item)
        var acc3 = Result();  // (zero: explicitly, every item)
        var acc4 = Result();  // (zero: explicitly, every item)
        var acc5 = Result();  // (zero: explicitly, every item)
        var acc6 = Result();  // (zero: explicitly, every item)
        var acc7 = Result();  // (zero: explicitly, every item)
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
            workgroupBarrier();  // (the tile is stored; its flag read as in FLAG READS)
            let bad = flags[par];
            if (tid == 0u) {
                flags[1u - par] = 0u;
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
                                if (k0 + k < min(wmem[row_word(r)].w, max_len)) {
                                    let kk = k0 + k;
                                    let cw = r * SW + BK / 4u + kk / 128u;  // (step 2's codes)
                                    let bit = 1u << (kk % 32u);
                                    if ((wmem[cw][(kk % 128u) / 32u] & bit) != 0u) {
                                        let z = (wmem[cw + CW][(kk % 128u) / 32u] & bit) != 0u;
                                        // 0 * inf = NaN (a weight that underflowed)
                                        let c = select(cls, 3u, z);
                                        atomicOr(&poison[r * NPW_POISON + d / 16u], c << (2u * (d % 16u)));
                                        flags.z = 1u;
                                    }
                                }
                            }
                        }
                    }
                }
            }
            for (var j = 0u; j < TK / 16u; j++) {
                let kk = 16u * j;
                let pg = rb * 16u * SW + ((k0 + kk) / 16u) * 4u;  // (the group's words: P hi, P lo)
                let ah = subgroupMatrixLoad<Left, row_major>(&wmem, pg, SW);
                let al = subgroupMatrixLoad<Left, row_major>(&wmem, pg + 2u, SW);
                if (NDT > 0u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 0u) * 2u, HW);
                    acc0 = subgroupMatrixMultiplyAccumulate(ah, b, acc0);
                    acc0 = subgroupMatrixMultiplyAccumulate(al, b, acc0);
                }
                if (NDT > 1u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 1u) * 2u, HW);
                    acc1 = subgroupMatrixMultiplyAccumulate(ah, b, acc1);
                    acc1 = subgroupMatrixMultiplyAccumulate(al, b, acc1);
                }
                if (NDT > 2u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 2u) * 2u, HW);
                    acc2 = subgroupMatrixMultiplyAccumulate(ah, b, acc2);
                    acc2 = subgroupMatrixMultiplyAccumulate(al, b, acc2);
                }
                if (NDT > 3u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 3u) * 2u, HW);
                    acc3 = subgroupMatrixMultiplyAccumulate(ah, b, acc3);
                    acc3 = subgroupMatrixMultiplyAccumulate(al, b, acc3);
                }
                if (NDT > 4u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 4u) * 2u, HW);
                    acc4 = subgroupMatrixMultiplyAccumulate(ah, b, acc4);
                    acc4 = subgroupMatrixMultiplyAccumulate(al, b, acc4);
                }
                if (NDT > 5u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 5u) * 2u, HW);
                    acc5 = subgroupMatrixMultiplyAccumulate(ah, b, acc5);
                    acc5 = subgroupMatrixMultiplyAccumulate(al, b, acc5);
                }
                if (NDT > 6u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 6u) * 2u, HW);
                    acc6 = subgroupMatrixMultiplyAccumulate(ah, b, acc6);
                    acc6 = subgroupMatrixMultiplyAccumulate(al, b, acc6);
                }
                if (NDT > 7u) {
                    let b = subgroupMatrixLoad<Right, row_major>(&wmem, KVW + kk * HW + (cb + CS * 7u) * 2u, HW);
                    acc7 = subgroupMatrixMultiplyAccumulate(ah, b, acc7);
                    acc7 = subgroupMatrixMultiplyAccumulate(al, b, acc7);
                }
            }
            workgroupBarrier();
            par = 1u - par;
        }

        // The next item's rows, edge lengths and cache rows, over this item's: their last reads
        // (the queries' loads and FMA scores, the softmax, the V tiles) are past a barrier, and the
        // barrier after o's stores makes them visible where the next item starts. (The item's
        // per-row state needs no clearing between items: m and l are written for every row, the
        // maxima, poison marks and flags are cleared after the next item's queries are split;
        // the tile flags alternate over an even number of tiles, so the one the next item reads
        // first is clear.) On an H200 the two barriers per item this saved were 0.035 ms of the
        // prefill layer's partials and combine, the same bits (benchmarks, 2026-12-04).
        if (tid == 0u) {
            q_bad[(ii + 1u) % 2u] = 0u;  // (the item before's, read after its split's barrier)
        }
        if (has_next) {
            if (tid < RMAX) {
                wmem[row_word(tid)].w = n_len;
                row_q[tid] = n_qo;
            }
            if (tid < BK) {
                key_src[tid] = n_row0;
            }
            if (tid + WG < BK) {
                key_src[tid + WG] = n_row1;
            }
        }

        // 4. o through the words (rows past n_rows belong to no partial row).
        if (NDT > 0u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 0u) * 16u) / 4u, acc0, SW);
        }
        if (NDT > 1u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 1u) * 16u) / 4u, acc1, SW);
        }
        if (NDT > 2u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 2u) * 16u) / 4u, acc2, SW);
        }
        if (NDT > 3u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 3u) * 16u) / 4u, acc3, SW);
        }
        if (NDT > 4u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 4u) * 16u) / 4u, acc4, SW);
        }
        if (NDT > 5u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 5u) * 16u) / 4u, acc5, SW);
        }
        if (NDT > 6u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 6u) * 16u) / 4u, acc6, SW);
        }
        if (NDT > 7u) {
            subgroupMatrixStore<row_major>(&wmem, (rb * 16u * SBF + (cb + CS * 7u) * 16u) / 4u, acc7, SW);
        }
        workgroupBarrier();
        let any_poison = flags.z != 0u;
        // four components a store (o[4 c .. 4 c + 3] of row r is word r SW + c): a quarter of the
        // loop's work of one component a store, in a kernel whose instructions set its pace
        for (var j = 0u; j < (RMAX * QV + WG - 1u) / WG; j++) {
            let x = tid + j * WG;
            if (x >= n_rows * QV) {
                break;
            }
            let r = x / QV;
            let c = x - r * QV;
            var o = bitcast<vec4<f32>>(wmem[r * SW + c]);
            if (any_poison) {
                for (var i = 0u; i < 4u; i++) {
                    let d = 4u * c + i;
                    let code = (atomicLoad(&poison[r * NPW_POISON + d / 16u]) >> (2u * (d % 16u))) & 3u;
                    if (code == 3u) {
                        o[i] = bitcast<f32>(NAN_BITS);
                    } else if (code == 1u) {
                        o[i] = bitcast<f32>(INF_BITS);
                    } else if (code == 2u) {
                        o[i] = bitcast<f32>(MINF_BITS);
                    }
                }
            }
            if (is_nan(bitcast<f32>(wmem[row_word(r)].y))) {
                o = vec4<f32>(bitcast<f32>(NAN_BITS));
            }
            o_out[(prow0 + r) * QV + c] = o;
        }
        for (var j = 0u; j < (RMAX + WG - 1u) / WG; j++) {
            let r = tid + j * WG;
            if (r >= n_rows) {
                break;
            }
            ml_out[prow0 + r] = bitcast<vec2<f32>>(wmem[row_word(r)].xy);
        }

        if (!has_next) {
            break;
        }
        item = nxt;
        max_len = n_max_len;
        n_e = n_ne;
        g0 = n_g0;
        ng = n_ng;
        erec = n_erec;
        pages = n_pages;
        prow0 = n_prow0;
    }
}
