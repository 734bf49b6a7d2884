// psa_partials_sgmat2.wgsl — KV-outer partials (R14) on 16x16x16 subgroup matrices with K and V
// read straight from storage: a variant of psa_partials_sgmat.wgsl (read its header: same
// bindings, Params, plan records, outputs, empty representation, query split and softmax).
//
// Differences from psa_partials_sgmat.wgsl
//   - k_cache and v_cache are read as f16 (the same buffers, another view). A 16-position group
//     of a block lies in one page (S % 16 == 0, blocks start at page boundaries), so its keys are
//     16 rows of one slab with stride KS = RH * D halves: K is loaded as a column-major right
//     matrix for S = Q K^T, V as a row-major right matrix for O = P V, straight from storage. A
//     group whose page is INVALID is not loaded (its scores are never read, its P entries are 0
//     and its V product is skipped). No K/V tile is staged in workgroup memory.
//   - Step 1 computes the scores of the whole block (every (row block, 16-key group) tile dealt
//     out to the subgroups, no barrier between tiles), then one pass scales them back
//     (s = (S' 2^-e) * scale) or, where S' is not finite or the item's queries are not (FMA
//     flag), recomputes the score with f32 FMAs from the f32 query and the f16 key in storage
//     (dims ascending, as psa_partials.wgsl). With finite operands no S' overflows (|hi|, |lo| <
//     2^15, |k| <= 65504, D <= 256 terms: < 2^41). Each subgroup also accumulates KCHK = 1 K^T
//     over its tiles (a left matrix of ones: sums of finite float16 keys stay < 2^31, finite), so
//     a non-finite KCHK entry means a loaded key holds NaN or +-inf (or a position past max_len
//     in a loaded page does): then every score of the item comes from FMAs (exact IEEE special
//     values, as the FMA kernel; no reliance on 0 * inf on the tensor cores).
//   - Step 3 splits all of P (hi / lo, [row][position], stride PSTR = BK + 8) into the query
//     area once, then runs O += P V over every group without a barrier. Each subgroup also
//     accumulates CHK = 1 * V over its column blocks and groups (a left matrix of ones: a column
//     sum of 16 keys, <= 2^24 for finite float16 values: finite); a non-finite CHK entry means a
//     loaded V value is NaN or +-inf (or a position past max_len in a loaded page holds one).
//     Then the whole item's o is recomputed by f32 FMAs (each attended, not removed position in
//     order: o += p v, as psa_partials.wgsl's sum, so NaN / +-inf land exactly where the FMA
//     kernel puts them and masked / removed positions never reach a row: R10, R12, R26).
//   - Workgroup memory (bytes): 2 * HCAP2 + 4 * SCAP + 4 * CCAP + 4 * BK + 6 * 4 * RMAX
//     + 3 * 4 * WG + 16 (_sgmat.sgmat2_workgroup_bytes): 41232 for D = 128, RMAX = 32, BK = 128,
//     WG = 128 (one workgroup per SM where pipelines get 64 KiB, as psa_partials_sgmat.wgsl).
//     The host checks 2 * RMAX * max(HS, PSTR) <= HCAP2, RMAX * SB <= SCAP, NSG <= CCAP / 256.
//   - psa_partials_sgmat2_r16.wgsl is this file with the capacities of the block below cut to
//     RMAX = 16, D <= 128, BK <= 128 (22928 bytes with WG = 128: two workgroups per SM); a test
//     holds the two files equal outside that block.
//
// Determinism (R19): every sum's order is fixed by the constants.
//
// Override constants: D, S, RH, BK, RMAX, WG as psa_partials_sgmat.wgsl (TK is accepted and
// unused: the geometry record is shared).

diagnostic(off, chromium.subgroup_matrix_uniformity);

override D: u32;
override S: u32;
override RH: u32 = 1u;
override TK: u32 = 16u;
override BK: u32;
override RMAX: u32;
override WG: u32 = 128u;
override TD: u32 = D / 4u;
override KS: u32 = RH * D;                 // f16 row stride of K / V in storage
override HS: u32 = D + 8u;                 // f16 row stride of the staged Q tile
override PSTR: u32 = BK + 8u;              // f16 row stride of the P tile (the Q area, reused)
override SB: u32 = max(BK, D) + 4u;        // f32 row stride of the score / o tile
override NSG: u32 = WG / 32u;
override NRB: u32 = RMAX / 16u;
override CS: u32 = NSG / NRB;
override NDT: u32 = D / 16u / CS;
override SL: u32 = max(1u, WG / RMAX);
override QV: u32 = D / 4u;
override LQ: u32 = (RMAX * QV + WG - 1u) / WG;
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
@group(0) @binding(2) var<storage, read> k_cache: array<f16>;
@group(0) @binding(3) var<storage, read> v_cache: array<f16>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> o_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> ml_out: array<vec2<f32>>;

// constant capacities (the builtins take no override-sized array); the host checks them
// -- capacities --
const HCAP2: u32 = 8704u;  // f16: Q hi at 0, Q lo at RMAX * HS (step 1); P hi at 0, P lo at RMAX * PSTR (step 3)
const SCAP: u32 = 4224u;   // f32: scores, then p, then o ([row][position or d], stride SB)
const CCAP: u32 = 1024u;   // f32: each subgroup's 16x16 CHK
// -- end of capacities --
override PLO: u32 = RMAX * PSTR;
override QLO: u32 = RMAX * HS;
// Every workgroup variable is a whole number of 16-byte units (Dawn on NVIDIA misplaced matrix
// accesses of arrays that followed scalars adding up to 12 bytes): the flags are one array of 4.
var<workgroup> hmem: array<f16, HCAP2>;
var<workgroup> sbuf: array<f32, SCAP>;
var<workgroup> cbuf: array<f32, CCAP>;
var<workgroup> key_src: array<u32, BK>;             // f16 index of each position's cache row, or INVALID
var<workgroup> row_len: array<u32, RMAX>;
var<workgroup> row_q: array<u32, RMAX>;
var<workgroup> row_down: array<f32, RMAX>;
var<workgroup> row_m: array<f32, RMAX>;
var<workgroup> row_l: array<f32, RMAX>;
var<workgroup> row_qmax: array<atomic<u32>, RMAX>;
var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_f: array<u32, WG>;
var<workgroup> red_l: array<f32, WG>;
var<workgroup> flags: array<u32, 4>;  // 1 where the item has: [0] a non-finite query, [1] a non-finite V value loaded, [2] a K one

const NEG_INF_BITS: u32 = 0xff800000u;
const REMOVED: f32 = -1.0;
const REMOVED_BITS: u32 = 0xbf800000u;
fn is_removed(p: f32) -> bool {
    return bitcast<u32>(p) == REMOVED_BITS;
}
fn is_ninf(x: f32) -> bool {
    return bitcast<u32>(x) == NEG_INF_BITS;
}
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}
var<private> NAN_BITS: u32 = 0x7fc00000u;
fn nan_max(a: f32, b: f32) -> f32 {
    return select(max(a, b), bitcast<f32>(NAN_BITS), is_nan(a) || is_nan(b));
}
fn hi11(x: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(x) & vec4<u32>(0xffffe000u));
}
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(127 + e) << 23u);
}

fn q_load(x: u32, n_rows: u32) -> vec4<f32> {
    let r = x / QV;
    var v = vec4<f32>(0.0);
    if (x < RMAX * QV && r < n_rows) {
        v = q[row_q[r] + x - r * QV];
    }
    return v;
}

fn q_max(x: u32, v: vec4<f32>) -> bool {
    if (x >= RMAX * QV) {
        return false;
    }
    let a = bitcast<vec4<u32>>(v) & vec4<u32>(0x7fffffffu);
    let mb = max(max(a.x, a.y), max(a.z, a.w));
    atomicMax(&row_qmax[x / QV], mb);
    return mb >= 0x7f800000u;
}

fn q_split(x: u32, v: vec4<f32>) {
    if (x >= RMAX * QV) {
        return;
    }
    let r = x / QV;
    let c = x - r * QV;
    var hi = vec4<f16>(0.0);
    var lo = vec4<f16>(0.0);
    let mb = atomicLoad(&row_qmax[r]);
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
    let bl = QLO + b;
    hmem[bl] = lo.x;
    hmem[bl + 1u] = lo.y;
    hmem[bl + 2u] = lo.z;
    hmem[bl + 3u] = lo.w;
}

// The FMA score of row r at block position k (f32 query, f16 key in storage, dims ascending).
fn fma_score(r: u32, k: u32) -> f32 {
    let kb = key_src[k];
    var s = 0.0;
    for (var c = 0u; c < QV; c++) {
        let qv = q[row_q[r] + c];
        let b = kb + 4u * c;
        s += qv.x * f32(k_cache[b]);
        s += qv.y * f32(k_cache[b + 1u]);
        s += qv.z * f32(k_cache[b + 2u]);
        s += qv.w * f32(k_cache[b + 3u]);
    }
    return s * params.scale;
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
    let sg = tid / 32u;
    let rb = sg % NRB;
    let cb = sg / NRB;
    let ng16 = (max_len + 15u) / 16u;  // 16-position groups of the block

    for (var r = tid; r < RMAX; r += WG) {
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
    for (var k = tid; k < BK; k += WG) {
        var row = INVALID;
        if (k < max_len) {
            let slab = plan[pages + k / S];
            if (slab != INVALID) {
                // R34 (as psa_partials.wgsl), in f16 units: 4 per vec4<f16> slab unit
                let page = slab / RH;
                row = (page * RH * params.slab_stride + ((k % S) * RH + (slab - page * RH)) * TD) * 4u;
            }
        }
        key_src[k] = row;
    }
    if (tid == 0u) {
        flags[0] = 0u;
        flags[1] = 0u;
        flags[2] = 0u;
    }
    workgroupBarrier();

    // 0. Queries: each row's largest |q|, then the scaled hi / lo split.
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
        flags[0] = 1u;
    }
    let item_fma = workgroupUniformLoad(&flags[0]);
    if (LQ > 0u) { q_split(tid + 0u * WG, q0); }
    if (LQ > 1u) { q_split(tid + 1u * WG, q1); }
    if (LQ > 2u) { q_split(tid + 2u * WG, q2); }
    if (LQ > 3u) { q_split(tid + 3u * WG, q3); }
    if (LQ > 4u) { q_split(tid + 4u * WG, q4); }
    if (LQ > 5u) { q_split(tid + 5u * WG, q5); }
    if (LQ > 6u) { q_split(tid + 6u * WG, q6); }
    if (LQ > 7u) { q_split(tid + 7u * WG, q7); }
    workgroupBarrier();

    // 1. S' of every (row block, group) tile, K straight from storage; no barrier between tiles.
    //    CHK = 1 K^T (key sums over the dims, <= 2^24 for finite float16 keys) finds a NaN or
    //    +-inf key without relying on 0 * inf on the tensor cores: the item's scores are then FMAs.
    let ones = subgroup_matrix_left<f16, 16, 16>(f16(1.0));
    var kchk: subgroup_matrix_result<f32, 16, 16>;
    if (item_fma == 0u) {
        for (var t = sg; t < NRB * ng16; t += NSG) {
            let tr = t % NRB;
            let tg = t / NRB;
            let kb = key_src[tg * 16u];
            if (kb == INVALID) {
                continue;  // (subgroup-uniform) an unmapped page: its scores are never read
            }
            var acc = subgroup_matrix_result<f32, 16, 16>();
            for (var d0 = 0u; d0 < D; d0 += 16u) {
                let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, col_major>(&k_cache, kb + d0, KS);
                let ah = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, tr * 16u * HS + d0, HS);
                let al = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, QLO + tr * 16u * HS + d0, HS);
                acc = subgroupMatrixMultiplyAccumulate(ah, b, acc);
                acc = subgroupMatrixMultiplyAccumulate(al, b, acc);
                kchk = subgroupMatrixMultiplyAccumulate(ones, b, kchk);
            }
            subgroupMatrixStore<row_major>(&sbuf, tr * 16u * SB + tg * 16u, acc, SB);
        }
    }
    subgroupMatrixStore<row_major>(&cbuf, sg * 256u, kchk, 16u);
    workgroupBarrier();
    var kbad = false;
    for (var x = tid; x < NSG * 256u; x += WG) {
        kbad = kbad || !is_finite(cbuf[x]);
    }
    if (kbad) {
        flags[2] = 1u;
    }
    let item_kbad = workgroupUniformLoad(&flags[2]);  // (also the barrier after S')
    // scale back, or FMAs where S' is not finite (a non-finite key) or the queries are not
    for (var x = tid; x < RMAX * max_len; x += WG) {
        let r = x / max_len;
        let k = x - r * max_len;
        let i = r * SB + k;
        var s = 0.0;
        if (r < n_rows && key_src[k] != INVALID) {
            let sp = sbuf[i];
            if (item_fma != 0u || item_kbad != 0u || !is_finite(sp)) {
                s = fma_score(r, k);
            } else {
                s = (sp * row_down[r]) * params.scale;
            }
        }
        sbuf[i] = s;
    }
    workgroupBarrier();

    // 2. Softmax of the block, SL invocations per row (as psa_partials_sgmat.wgsl).
    let sr = tid / SL;
    let sl = tid - sr * SL;
    var kend = 0u;
    if (sr < n_rows) {
        kend = min(row_len[sr], max_len);
    }
    var lmax = 0.0;
    var seen = false;
    for (var k = sl; k < kend; k += SL) {
        if (key_src[k] != INVALID) {
            let s = sbuf[sr * SB + k];
            if (!is_ninf(s)) {
                lmax = select(s, nan_max(lmax, s), seen);
                seen = true;
            }
        }
    }
    red_m[tid] = lmax;
    red_f[tid] = select(0u, 1u, seen);
    workgroupBarrier();
    var m_new = 0.0;
    var found = false;
    for (var i = 0u; i < SL; i++) {
        let t = sr * SL + i;
        if (t < WG && red_f[t] != 0u) {
            m_new = select(red_m[t], nan_max(m_new, red_m[t]), found);
            found = true;
        }
    }
    var psum = 0.0;
    if (sr < RMAX) {
        for (var k = sl; k < ng16 * 16u; k += SL) {
            var p = 0.0;
            if (k < kend && key_src[k] != INVALID) {
                let sc = sbuf[sr * SB + k];
                p = select(exp(sc - m_new), REMOVED, is_ninf(sc));
            }
            sbuf[sr * SB + k] = p;
            if (!is_removed(p)) {
                psum += p;
            }
            // P hi / lo for the products (removed and NaN enter as 0; a NaN row is made NaN
            // at the end)
            var pz = p;
            if (is_nan(pz) || is_removed(pz)) {
                pz = 0.0;
            }
            let h = hi11(vec4<f32>(pz, 0.0, 0.0, 0.0)).x;
            hmem[sr * PSTR + k] = f16(h);
            hmem[PLO + sr * PSTR + k] = f16(pz - h);
        }
    }
    red_l[tid] = psum;
    workgroupBarrier();
    if (sr < n_rows && sl == 0u && found) {
        var sum = 0.0;
        for (var i = 0u; i < SL; i++) {
            sum += red_l[sr * SL + i];
        }
        row_m[sr] = m_new;
        row_l[sr] = sum;
    }

    // 3. o = P V over every group, V straight from storage; CHK = 1 V finds non-finite values.
    var acc0: subgroup_matrix_result<f32, 16, 16>;
    var acc1: subgroup_matrix_result<f32, 16, 16>;
    var acc2: subgroup_matrix_result<f32, 16, 16>;
    var acc3: subgroup_matrix_result<f32, 16, 16>;
    var acc4: subgroup_matrix_result<f32, 16, 16>;
    var acc5: subgroup_matrix_result<f32, 16, 16>;
    var acc6: subgroup_matrix_result<f32, 16, 16>;
    var acc7: subgroup_matrix_result<f32, 16, 16>;
    var chk: subgroup_matrix_result<f32, 16, 16>;
    for (var g = 0u; g < ng16; g++) {
        let vb = key_src[g * 16u];
        if (vb == INVALID) {
            continue;  // (uniform) an unmapped page: its P entries are 0
        }
        let kk = g * 16u;
        let ah = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, rb * 16u * PSTR + kk, PSTR);
        let al = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>, row_major>(&hmem, PLO + rb * 16u * PSTR + kk, PSTR);
        if (NDT > 0u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 0u) * 16u, KS);
            acc0 = subgroupMatrixMultiplyAccumulate(ah, b, acc0);
            acc0 = subgroupMatrixMultiplyAccumulate(al, b, acc0);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
        if (NDT > 1u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 1u) * 16u, KS);
            acc1 = subgroupMatrixMultiplyAccumulate(ah, b, acc1);
            acc1 = subgroupMatrixMultiplyAccumulate(al, b, acc1);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
        if (NDT > 2u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 2u) * 16u, KS);
            acc2 = subgroupMatrixMultiplyAccumulate(ah, b, acc2);
            acc2 = subgroupMatrixMultiplyAccumulate(al, b, acc2);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
        if (NDT > 3u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 3u) * 16u, KS);
            acc3 = subgroupMatrixMultiplyAccumulate(ah, b, acc3);
            acc3 = subgroupMatrixMultiplyAccumulate(al, b, acc3);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
        if (NDT > 4u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 4u) * 16u, KS);
            acc4 = subgroupMatrixMultiplyAccumulate(ah, b, acc4);
            acc4 = subgroupMatrixMultiplyAccumulate(al, b, acc4);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
        if (NDT > 5u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 5u) * 16u, KS);
            acc5 = subgroupMatrixMultiplyAccumulate(ah, b, acc5);
            acc5 = subgroupMatrixMultiplyAccumulate(al, b, acc5);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
        if (NDT > 6u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 6u) * 16u, KS);
            acc6 = subgroupMatrixMultiplyAccumulate(ah, b, acc6);
            acc6 = subgroupMatrixMultiplyAccumulate(al, b, acc6);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
        if (NDT > 7u) {
            let b = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>, row_major>(&v_cache, vb + (cb + CS * 7u) * 16u, KS);
            acc7 = subgroupMatrixMultiplyAccumulate(ah, b, acc7);
            acc7 = subgroupMatrixMultiplyAccumulate(al, b, acc7);
            chk = subgroupMatrixMultiplyAccumulate(ones, b, chk);
        }
    }
    subgroupMatrixStore<row_major>(&cbuf, sg * 256u, chk, 16u);
    workgroupBarrier();
    var vbad = false;
    for (var x = tid; x < NSG * 256u; x += WG) {
        vbad = vbad || !is_finite(cbuf[x]);
    }
    if (vbad) {
        flags[1] = 1u;
    }
    let item_vbad = workgroupUniformLoad(&flags[1]);

    if (item_vbad != 0u) {
        // 4'. A loaded V value is NaN or +-inf: o by f32 FMAs over the attended, not removed
        //     positions in order (psa_partials.wgsl's sum), straight to the output.
        for (var x = tid; x < n_rows * D; x += WG) {
            let r = x / D;
            let d = x - r * D;
            let kend_r = min(row_len[r], max_len);
            var o = 0.0;
            for (var k = 0u; k < kend_r; k++) {
                let kb = key_src[k];
                if (kb != INVALID) {
                    let p = sbuf[r * SB + k];
                    if (!is_removed(p)) {
                        o += p * f32(v_cache[kb + d]);
                    }
                }
            }
            if (is_nan(row_l[r])) {
                o = bitcast<f32>(NAN_BITS);
            }
            o_out[(prow0 + r) * D + d] = o;
        }
    } else {
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
        for (var x = tid; x < n_rows * D; x += WG) {
            let r = x / D;
            let d = x - r * D;
            var o = sbuf[r * SB + d];
            if (is_nan(row_l[r])) {
                o = bitcast<f32>(NAN_BITS);
            }
            o_out[(prow0 + r) * D + d] = o;
        }
    }
    for (var r = tid; r < n_rows; r += WG) {
        ml_out[prow0 + r] = vec2<f32>(row_m[r], row_l[r]);
    }
}
