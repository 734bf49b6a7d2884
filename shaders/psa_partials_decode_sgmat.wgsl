// psa_partials_decode_sgmat.wgsl — KV-outer partials (R14) for decode on 16x8x16 subgroup
// matrices (tensor cores): a drop-in for psa_partials_decode.wgsl on float16 caches.
//
// Same bindings, Params, plan records (work items, edge records, page lists), outputs and empty
// representation as psa_partials_decode.wgsl / psa_partials.wgsl (read their headers): one
// workgroup per work item; an item has one edge (one query: decode) and ng <= 8 query heads of
// its slot group, so every K/V element of the block is read once for all of them (GQA packing).
// A partial row's o is unnormalised, its (m, l) has l == 0 for a row that attended nothing.
//
// Bindings (group 0); the caches are the same buffers as the decode kernel's, read as float16
//   0 params  uniform              Params (psa_partials_decode.wgsl)
//   1 q       storage, read        f32 [n_qrows, G, D]
//   2 k_cache storage, read        f16 [n_slabs_in_chunk, S, D] (with RH > 1, an NHD cache: whole
//                                  pages [n_pages, S, RH, D], R34)
//   3 v_cache storage, read        f16, same layout as k_cache
//   4 plan    storage, read        u32 plan words (psa_partials.wgsl)
//   5 o_out   storage, read_write  f32 [n_prows, D]
//   6 ml_out  storage, read_write  vec2<f32> [n_prows]
//
// The loader prepends `enable f16;`, the subgroup-matrix directive and `enable subgroups;`; the
// host runs it only where the device has 16x8x16 f16 x f16 -> f32 subgroup matrices and
// subgroups of 32 consecutive invocations, on float16 caches, D a multiple of 16 up to 128, pages
// of a multiple of 16 positions and blocks of at most KCAP positions.
//
// Algorithm, per edge (len keys of the block, the work item's heads g0 .. g0 + ng - 1), with the
// products transposed so that the 8 heads are the 8 columns of the matrix unit:
//   0. Q: 16 lanes per head load its query; the head's largest |q| gives an exact power of two
//      2^e that puts it in [2^14, 2^15), and q 2^e is split into hi = hi11(q 2^e) and
//      lo = f16(q 2^e - hi) (as psa_partials_sgmat.wgsl; the numerics page says why), stored
//      [head][d] in workgroup memory. A head whose q holds NaN or +-inf makes the edge take
//      FMA scores (step 2). A 16-key tile that holds the edge's end (len not a multiple of 16) is
//      staged in workgroup memory with zeros past len, so that no position past len is read.
//   1. S'^T = K Q^T, one 16-key tile per subgroup at a time: K tiles are loaded as matrices
//      straight from the cache (16 keys x 16 dims, row-major), Q^T from workgroup memory, hi and
//      lo products accumulated in f32; the 16 x 8 result is stored to sc [key][head].
//   2. Scores s = (S' 2^-e) scale. Finite data give finite scores; a NaN or +-inf in the readable
//      keys gives a non-finite S' for every head (0 * inf and inf * x are not finite), and then
//      (or with a non-finite query) the edge's scores are recomputed with f32 FMAs from the f32
//      q, as the FMA kernels compute them (R26 then applies to those scores).
//   3. Softmax of the whole block per head (16 lanes, strided keys, shuffle trees in a fixed
//      order): m over attended scores (R26: -inf removes its position, NaN is kept; a NaN or +inf
//      maximum makes the row NaN), p = exp(s - m) kept in sc, l = sum p in f32, P^T split hi / lo
//      like Q into workgroup memory [head][key].
//   4. O^T = V^T P^T: each subgroup owns 16-dim tiles of o; V^T tiles (16 dims x 16 keys,
//      column-major) straight from the cache, accumulated over the block's key tiles. Tiles on
//      INVALID pages (or past len) are skipped: their p are 0 and they are never read (R10).
//      The result goes through workgroup memory: if every component is finite it is written out;
//      if not (a NaN or +-inf value, or a NaN row), and whenever a position was removed (R26: a
//      removed position's value, NaN included, must multiply nothing), o is computed again with
//      f32 FMAs from the f32 p, leaving removed positions out, exactly as the FMA kernels do.
// Which path counts depends only on the data, and every sum has a fixed order (matrix products in
// key / dim order, shuffle trees, key order), so results are deterministic (R19).
//
// Override constants
//   D   head dim (multiple of 16, <= 128)    S   page size (multiple of 16)
//   RH  KV heads interleaved per page row: 1 (HND) or Hkv (NHD, R34)
//   WG  workgroup size: 128 or 256 (4 or 8 subgroups; the softmax uses the first 128 lanes)
// Workgroup memory: 4 * 4352 + 4096 + 4224 + 32 + 32 + 16 + 16 = 25824 bytes (_decode.DECODE_SGMAT_BYTES;
// every variable a whole number of 16-byte units: see docs/backends/dawn.md).

// The matrix builtins need subgroup-uniform arguments; Tint's analysis only knows workgroup
// uniformity, and the tile choices derive from the subgroup index tid / 32 (uniform within a
// subgroup of 32 consecutive invocations, which the host requires).
diagnostic(off, chromium.subgroup_matrix_uniformity);

override D: u32;
override S: u32;
override RH: u32 = 1u;
override WG: u32 = 128u;
override ND: u32 = D / 16u;                 // 16-dim steps of a row
override NSG: u32 = WG / 32u;               // subgroups
override RS: u32 = RH * D;                  // f16 between consecutive positions of a slab
const KCAP: u32 = 128u;                     // positions of a block the kernel holds
const HS: u32 = 136u;                       // f16 row stride of Q and of the staged tiles (D <= 128)
const PS: u32 = KCAP + 8u;                  // f16 row stride of P (one row per head)
const OS: u32 = 132u;                       // f32 row stride of o (one row per head)
const INVALID: u32 = 0xffffffffu;

struct Params {
    item_base: u32,
    n_items: u32,
    grid_x: u32,
    group: u32,
    slab_stride: u32,   // vec4s of 4 elements per slab (the layout's slab_stride / 4)
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<f16>;
@group(0) @binding(3) var<storage, read> v_cache: array<f16>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> o_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> ml_out: array<vec2<f32>>;

var<workgroup> qs: array<f16, 16u * HS>;     // Q hi [head][d] (rows 0..7), Q lo (rows 8..15)
var<workgroup> kst: array<f16, 16u * HS>;    // the staged K tile of the edge's end [key][d]
var<workgroup> vst: array<f16, 16u * HS>;    // the staged V tile [key][d]
var<workgroup> ps: array<f16, 16u * PS>;     // P hi [head][key] (rows 0..7), P lo (rows 8..15)
var<workgroup> sc: array<f32, KCAP * 8u>;    // S' [key][head], then p
var<workgroup> ob: array<f32, 8u * OS>;      // o [head][d]
var<workgroup> hl: array<f32, 8>;            // l of each head
var<workgroup> tsl: array<u32, KCAP / 16u>;  // the slab of each 16-key tile of the edge, INVALID past len
var<workgroup> fl: array<atomic<u32>, 4>;    // flags: 0 q not finite, 1 S' not finite, 2 removed, 3 o not finite
var<workgroup> flu: array<u32, 4>;           // (a flag, for workgroupUniformLoad)

alias Left = subgroup_matrix_left<f16, 16, 16>;    // 16 rows x 16 columns
alias Right = subgroup_matrix_right<f16, 8, 16>;   // 16 rows x 8 columns
alias Result = subgroup_matrix_result<f32, 8, 16>; // 16 rows x 8 columns

// R26 by bit tests, not by WGSL's (unspecified) infinity and NaN arithmetic
const NEG_INF_BITS: u32 = 0xff800000u;
const POS_INF_BITS: u32 = 0x7f800000u;
const REMOVED: f32 = -1.0;                   // the weight of a removed position (exp never gives it)
const REMOVED_BITS: u32 = 0xbf800000u;
var<private> NAN_BITS: u32 = 0x7fc00000u;    // a NaN as a runtime value (a constant one is an error in Tint)
fn is_ninf(x: f32) -> bool {
    return bitcast<u32>(x) == NEG_INF_BITS;
}
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}
fn nan_max(a: f32, b: f32) -> f32 {  // max that keeps a NaN (WGSL's max may drop it)
    return select(max(a, b), bitcast<f32>(NAN_BITS), is_nan(a) || is_nan(b));
}
// x with its mantissa cut to the 11 bits of a float16 (bits, not f32(f16(x)), which a compiler
// may fold to x)
fn hi11(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) & 0xffffe000u);
}
// an exact power of two 2^e, e in [-126, 127]
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(127 + e) << 23u);
}

// f16 element index of block position `pos` on slab `slab` (R34: HND rows D apart, NHD rows RH D)
fn row_elem(slab: u32, pos: u32) -> u32 {
    let page = slab / RH;
    return page * RH * params.slab_stride * 4u + ((pos % S) * RH + (slab - page * RH)) * D;
}

// the slab of block position `pos` (INVALID: unmapped, or a page of another chunk)
fn slab_of(pages: u32, pos: u32) -> u32 {
    return plan[pages + pos / S];
}

// the slab of block position k, INVALID when it is not readable (past len, unmapped, other chunk)
fn key_slab(k: u32, len: u32) -> u32 {
    return select(INVALID, tsl[k / 16u], k < len);
}

// S'^T of one 16-key tile: K (16 keys x 16 dims, row-major at `kb` of the cache, or of the staged
// tile) times Q^T, hi and lo; the tile's ND loads are issued before its products
fn score_tile(kb: u32, staged: bool) -> Result {
    var k0 = Left(); var k1 = Left(); var k2 = Left(); var k3 = Left();
    var k4 = Left(); var k5 = Left(); var k6 = Left(); var k7 = Left();
    if (staged) {
        k0 = subgroupMatrixLoad<Left, row_major>(&kst, 0u, HS);
        if (ND > 1u) { k1 = subgroupMatrixLoad<Left, row_major>(&kst, 16u, HS); }
        if (ND > 2u) { k2 = subgroupMatrixLoad<Left, row_major>(&kst, 32u, HS); }
        if (ND > 3u) { k3 = subgroupMatrixLoad<Left, row_major>(&kst, 48u, HS); }
        if (ND > 4u) { k4 = subgroupMatrixLoad<Left, row_major>(&kst, 64u, HS); }
        if (ND > 5u) { k5 = subgroupMatrixLoad<Left, row_major>(&kst, 80u, HS); }
        if (ND > 6u) { k6 = subgroupMatrixLoad<Left, row_major>(&kst, 96u, HS); }
        if (ND > 7u) { k7 = subgroupMatrixLoad<Left, row_major>(&kst, 112u, HS); }
    } else {
        k0 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb, RS);
        if (ND > 1u) { k1 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb + 16u, RS); }
        if (ND > 2u) { k2 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb + 32u, RS); }
        if (ND > 3u) { k3 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb + 48u, RS); }
        if (ND > 4u) { k4 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb + 64u, RS); }
        if (ND > 5u) { k5 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb + 80u, RS); }
        if (ND > 6u) { k6 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb + 96u, RS); }
        if (ND > 7u) { k7 = subgroupMatrixLoad<Left, row_major>(&k_cache, kb + 112u, RS); }
    }
    var acc = Result();
    acc = qk(k0, 0u, acc);
    if (ND > 1u) { acc = qk(k1, 1u, acc); }
    if (ND > 2u) { acc = qk(k2, 2u, acc); }
    if (ND > 3u) { acc = qk(k3, 3u, acc); }
    if (ND > 4u) { acc = qk(k4, 4u, acc); }
    if (ND > 5u) { acc = qk(k5, 5u, acc); }
    if (ND > 6u) { acc = qk(k6, 6u, acc); }
    if (ND > 7u) { acc = qk(k7, 7u, acc); }
    return acc;
}

fn qk(a: Left, jd: u32, acc: Result) -> Result {
    let r = subgroupMatrixMultiplyAccumulate(a, subgroupMatrixLoad<Right, col_major>(&qs, 16u * jd, HS), acc);
    return subgroupMatrixMultiplyAccumulate(a, subgroupMatrixLoad<Right, col_major>(&qs, 8u * HS + 16u * jd, HS), r);
}

// V^T tile (16 dims at dim 16 dt x the 16 keys of key tile t), column-major: zeros for a tile that
// is not readable (never loaded), the staged tile for the one holding the edge's end
fn v_tile(dt: u32, t: u32, len: u32) -> Left {
    let slab = tsl[t];
    if (slab == INVALID) {
        return Left();
    }
    if (16u * t + 16u > len) {
        return subgroupMatrixLoad<Left, col_major>(&vst, 16u * dt, HS);
    }
    return subgroupMatrixLoad<Left, col_major>(&v_cache, row_elem(slab, 16u * t) + 16u * dt, RS);
}

fn pv(a: Left, t: u32, acc: Result) -> Result {
    let r = subgroupMatrixMultiplyAccumulate(a, subgroupMatrixLoad<Right, col_major>(&ps, 16u * t, PS), acc);
    return subgroupMatrixMultiplyAccumulate(a, subgroupMatrixLoad<Right, col_major>(&ps, 8u * PS + 16u * t, PS), r);
}

// O^T of one 16-dim tile over the edge's key tiles (at most KCAP / 16 = 8): every load first
fn o_tile(dt: u32, len: u32, nt: u32) -> Result {
    let v0 = v_tile(dt, 0u, len);
    var v1 = Left(); var v2 = Left(); var v3 = Left(); var v4 = Left(); var v5 = Left(); var v6 = Left();
    var v7 = Left();
    if (nt > 1u) { v1 = v_tile(dt, 1u, len); }
    if (nt > 2u) { v2 = v_tile(dt, 2u, len); }
    if (nt > 3u) { v3 = v_tile(dt, 3u, len); }
    if (nt > 4u) { v4 = v_tile(dt, 4u, len); }
    if (nt > 5u) { v5 = v_tile(dt, 5u, len); }
    if (nt > 6u) { v6 = v_tile(dt, 6u, len); }
    if (nt > 7u) { v7 = v_tile(dt, 7u, len); }
    var acc = Result();
    acc = pv(v0, 0u, acc);
    if (nt > 1u) { acc = pv(v1, 1u, acc); }
    if (nt > 2u) { acc = pv(v2, 2u, acc); }
    if (nt > 3u) { acc = pv(v3, 3u, acc); }
    if (nt > 4u) { acc = pv(v4, 4u, acc); }
    if (nt > 5u) { acc = pv(v5, 5u, acc); }
    if (nt > 6u) { acc = pv(v6, 6u, acc); }
    if (nt > 7u) { acc = pv(v7, 7u, acc); }
    return acc;
}

// flag i of the workgroup, uniformly (a barrier first: every invocation's atomicOr is seen)
fn uniform_flag(i: u32, tid: u32) -> bool {
    workgroupBarrier();
    if (tid == 0u) {
        flu[i] = atomicLoad(&fl[i]);
    }
    return workgroupUniformLoad(&flu[i]) != 0u;
}

// the readable positions' scores of heads < ng with f32 FMAs from the f32 q, in d order (as the
// FMA kernels), into sc as S' (factor 1)
fn fma_scores(tid: u32, qrow: u32, g0: u32, ng: u32, pages: u32, len: u32) {
    for (var x = tid; x < len * 8u; x += WG) {
        let k = x / 8u;
        let h = x % 8u;
        let slab = key_slab(k, len);
        if (h < ng && slab != INVALID) {
            let qb = (qrow * params.group + g0 + h) * D;
            let kb = row_elem(slab, k);
            var acc = 0.0;
            for (var d = 0u; d < D; d++) {
                acc += q[qb + d] * f32(k_cache[kb + d]);
            }
            sc[x] = acc;
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32,
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_size) sgs: u32) {
    let item = wid.y * params.grid_x + wid.x;
    if (item >= params.n_items) {
        return;
    }
    let ib = (params.item_base + item) * 8u;
    let n_e = plan[ib + 1u];
    let g0 = plan[ib + 2u];
    let ng = plan[ib + 3u];
    let erec = plan[ib + 4u];
    let pages = plan[ib + 5u];
    let prow0 = plan[ib + 6u];
    let sg = tid / 32u;          // this invocation's subgroup
    let h = tid / 16u;           // steps 0 and 3: the head of this lane (lanes past 128: none)
    let j = tid % 16u;           //   and its lane among the head's 16
    let hv = h < 8u && h < ng;   // a lane of a real head
    // the layout assumes subgroups of 32 consecutive invocations (what the host measured); a
    // device that breaks it gets NaN rows (loud), never plausible numbers
    let broken = sgs != 32u || sl != tid % 32u;
    let nan = bitcast<f32>(NAN_BITS);

    if (tid < 4u) {
        atomicStore(&fl[tid], 0u);  // explicitly: not every driver zeroes workgroup memory
    }
    for (var e = 0u; e < n_e; e++) {
        let qrow = plan[erec + 2u * e];
        let len = min(plan[erec + 2u * e + 1u], KCAP);  // (the host checks block_size <= KCAP)
        let nt = (len + 15u) / 16u;                      // 16-key tiles of the edge
        workgroupBarrier();  // the previous edge is done with every buffer and flag

        // 0. Q: lane j of head h holds dims j, j + 16, ... (ND of them)
        var mb = 0u;  // bits of the head's largest |q|
        if (hv) {
            let qb = (qrow * params.group + g0 + h) * D;
            for (var i = 0u; i < ND; i++) {
                mb = max(mb, bitcast<u32>(q[qb + j + 16u * i]) & 0x7fffffffu);
            }
        }
        for (var msk = 8u; msk > 0u; msk >>= 1u) {
            mb = max(mb, subgroupShuffleXor(mb, msk));
        }
        // max in [2^E, 2^(E+1)) -> e = 14 - E puts it in [2^14, 2^15); subnormal maxima count as
        // 2^-127; e stays in [-113, 126] so that 2^e and 2^-e are normal floats
        let ex = clamp(14 - (max(i32(mb >> 23u), 0) - 127), -113, 126);
        let qbad_h = hv && mb >= 0x7f800000u;
        if (qbad_h) {
            atomicOr(&fl[0], 1u);
        }
        if (h < 8u) {
            let qb = (qrow * params.group + g0 + h) * D;
            for (var i = 0u; i < ND; i++) {
                let d = j + 16u * i;
                var hi = f16(0.0);
                var lo = f16(0.0);
                if (hv && !qbad_h) {
                    let x = q[qb + d] * pow2(ex);
                    let xh = hi11(x);
                    hi = f16(xh);
                    lo = f16(x - xh);
                }
                qs[h * HS + d] = hi;
                qs[(8u + h) * HS + d] = lo;
            }
        }
        let down = pow2(-ex);  // 2^-e of this lane's head
        if (tid < KCAP / 16u) {
            tsl[tid] = select(INVALID, slab_of(pages, 16u * tid), 16u * tid < len);
        }
        // the tile holding the edge's end, staged with zeros past len (never read there, R10)
        let tp = len / 16u;
        if (len % 16u != 0u) {
            let slab = slab_of(pages, 16u * tp);
            if (slab != INVALID) {
                for (var x = tid; x < 16u * D; x += WG) {
                    let r = x / D;
                    let d = x % D;
                    let pos = 16u * tp + r;
                    var kx = f16(0.0);
                    var vx = f16(0.0);
                    if (pos < len) {
                        let rb = row_elem(slab, pos);
                        kx = k_cache[rb + d];
                        vx = v_cache[rb + d];
                    }
                    kst[r * HS + d] = kx;
                    vst[r * HS + d] = vx;
                }
            }
        }
        let qbad = uniform_flag(0u, tid);

        // 1. S'^T = K Q^T on the matrix units, tile t of the edge on subgroup t mod NSG
        if (!qbad) {
            for (var t = sg; t < nt; t += NSG) {
                let t0 = 16u * t;
                let slab = tsl[t];
                if (slab != INVALID) {
                    let acc = score_tile(row_elem(slab, t0), t0 + 16u > len);
                    subgroupMatrixStore<row_major>(&sc, t0 * 8u, acc, 8u);
                }
            }
        }
        workgroupBarrier();

        // 2. a non-finite score from the units (or a non-finite query): FMA scores for the edge
        var fma = qbad;
        if (!qbad) {
            var bad = false;
            if (hv) {
                for (var k = j; k < len; k += 16u) {
                    if (key_slab(k, len) != INVALID && !finite((sc[k * 8u + h] * down) * params.scale)) {
                        bad = true;
                    }
                }
            }
            if (bad) {
                atomicOr(&fl[1], 1u);
            }
            fma = uniform_flag(1u, tid);
        }
        if (fma) {
            fma_scores(tid, qrow, g0, ng, pages, len);
            workgroupBarrier();
        }
        let f = select(down, 1.0, fma);

        // 3. softmax of the block, 16 lanes per head, keys k = j + 16 i
        var m = 0.0;
        var seen = 0u;
        var rem = false;
        if (hv) {
            for (var k = j; k < len; k += 16u) {
                if (key_slab(k, len) != INVALID) {
                    let s = (sc[k * 8u + h] * f) * params.scale;
                    if (is_ninf(s)) {
                        rem = true;
                    } else {
                        m = select(s, nan_max(m, s), seen != 0u);
                        seen = 1u;
                    }
                }
            }
        }
        for (var msk = 8u; msk > 0u; msk >>= 1u) {
            let mo = subgroupShuffleXor(m, msk);
            let so = subgroupShuffleXor(seen, msk);
            if (seen != 0u && so != 0u) {
                m = nan_max(m, mo);
            } else if (so != 0u) {
                m = mo;
            }
            seen |= so;
        }
        // a NaN or +inf maximum makes the row NaN (R26), whatever exp does with it
        let nanrow = is_nan(m) || bitcast<u32>(m) == POS_INF_BITS;
        var l = 0.0;
        if (h < 8u) {
            for (var k = j; k < 16u * nt; k += 16u) {
                var p = 0.0;
                var att = false;
                if (hv && key_slab(k, len) != INVALID) {
                    let s = (sc[k * 8u + h] * f) * params.scale;
                    if (is_ninf(s)) {
                        p = REMOVED;
                    } else {
                        p = select(exp(s - m), nan, nanrow);
                        att = true;
                    }
                    sc[k * 8u + h] = p;
                }
                var ph = f16(0.0);
                var pl = f16(0.0);
                if (att) {
                    l += p;
                    let xh = hi11(p);
                    ph = f16(xh);
                    pl = f16(p - xh);
                }
                ps[h * PS + k] = ph;
                ps[(8u + h) * PS + k] = pl;
            }
        }
        for (var msk = 8u; msk > 0u; msk >>= 1u) {
            l += subgroupShuffleXor(l, msk);
        }
        if (nanrow && seen != 0u) {
            l = nan;
        }
        let remany = subgroupAny(rem && hv);  // (a subgroup holds two heads: both may flag)
        if (remany && j == 0u) {
            atomicOr(&fl[2], 1u);
        }
        let prow = prow0 + e * ng;
        if (hv && j == 0u) {
            hl[h] = l;
            ml_out[prow + h] = select(vec2<f32>(m, l), vec2<f32>(nan), broken);
        }
        let removed = uniform_flag(2u, tid);

        // 4. O^T = V^T P^T on the matrix units, 16-dim tile dt on subgroup dt mod NSG
        var exact = removed;
        if (!removed) {
            for (var dt = sg; dt < ND; dt += NSG) {
                subgroupMatrixStore<col_major>(&ob, 16u * dt, o_tile(dt, len, nt), OS);
            }
            workgroupBarrier();
            var bad = false;
            for (var x = tid; x < ng * D; x += WG) {
                if (!finite(ob[(x / D) * OS + x % D])) {
                    bad = true;
                }
            }
            if (bad) {
                atomicOr(&fl[3], 1u);
            }
            exact = uniform_flag(3u, tid);
            if (!exact) {
                for (var x = tid; x < ng * D; x += WG) {
                    o_out[(prow + x / D) * D + x % D] = ob[(x / D) * OS + x % D];
                }
            }
        }
        // ... else o with f32 FMAs from the f32 p, removed positions left out (their value may
        // be NaN), in key order
        if (exact) {
            for (var x = tid; x < ng * D; x += WG) {
                let hh = x / D;
                let d = x % D;
                var o = 0.0;
                for (var k = 0u; k < len; k++) {
                    let slab = key_slab(k, len);
                    if (slab != INVALID) {
                        let p = sc[k * 8u + hh];
                        if (bitcast<u32>(p) != REMOVED_BITS) {
                            o += p * f32(v_cache[row_elem(slab, k) + d]);
                        }
                    }
                }
                if (is_nan(hl[hh])) {
                    o = nan;
                }
                o_out[(prow + hh) * D + d] = o;
            }
        }
        workgroupBarrier();
        if (tid < 4u) {
            atomicStore(&fl[tid], 0u);  // for the next edge (its first flag is set after a barrier)
        }
    }
}
