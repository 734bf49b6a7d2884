// psa_gemm_sgmat_tiled.wgsl — a plain f16 matrix product on subgroup matrices (tensor cores) with
// the operands staged in workgroup memory: the faster variant of psa_gemm_sgmat.wgsl for the
// benchmark's matmul ceiling (no attention kernel uses it; its layout is the model for feeding
// tensor cores from WGSL).
//
// C = A · B with A [M, K] and B [K, N] float16, row-major, and C [M, N] float32 (same bindings,
// Params and result as psa_gemm_sgmat.wgsl; A and B are read here as 16-byte units).
//
// Tiles. A workgroup of SGM x SGN subgroups of 32 (WG = 32 SGM SGN invocations) owns a
// BM x BN block of C (BM = 16 TM SGM, BN = 16 TN SGN); subgroup sg (the `subgroup_id` builtin)
// owns the (16 TM) x (16 TN) sub-block at subgroup row sg / SGN and column sg % SGN, as TM x TN
// 16 x 16 f32 result matrices.
//
// One variable per matrix. The result matrices are acc00 .. acc33 and the right-hand ones r0 ..
// r3, each used under an `if` on the override constants (folded when the pipeline is made), not
// elements of function-scope arrays indexed in loops: on the H200 (Dawn, NVIDIA's Vulkan driver)
// such arrays made every block shape larger than 64 x 64 slower, 4096^3 at 55 TFLOP/s at best;
// written out, the same algorithm ran 123 TFLOP/s (128 x 256 blocks), 185 without bounds checks
// (scripts/experiment_gemm.py). K is walked in steps of BK (a multiple of 16). Per step the
// workgroup stages the A tile [BM][BK] and the B tile [BK][BN] in workgroup memory, every
// invocation copying whole 16-byte units (vec4<u32>, 8 halves, coalesced along rows) that it has
// read from storage into registers; then each subgroup, for each 16 of the BK columns, loads its
// TN right-hand matrices (B) and, one at a time, its TM left-hand matrices (A) from the staged
// tiles and accumulates acc[i][j] += left_i · right_j (K ascending: a fixed order, R19).
//
// Staged tiles of 16-byte words. The staged tiles are arrays of vec4<u32>, so that a unit is
// written by one 16-byte store; the float16 matrices are loaded from the same words, with the
// offset and stride of subgroupMatrixLoad counted in the array's elements (16 bytes: 8 halves)
// and the bytes read as float16. Declared as array<f16>, each unit took eight 2-byte stores: on
// the H200 (Dawn, NVIDIA's Vulkan driver) the 128 x 256 block ran 241.0 TFLOP/s that way and
// 255.2 with one store per unit, the same products (scripts/experiment_gemm_matrix_staging.py).
// A matrix load from an array of another element type than the matrix's is what the Tint of
// wgpudawn 0.32 accepts and the driver honours; a runtime that refuses it refuses the pipeline,
// and matmul_rate then skips the tiled variants, saying why (the naive kernel still runs).
//
// Overlap (STAGES = 2). The staging is double-buffered: while the subgroups multiply the tiles of
// step t (stage t % 2), each invocation's loads of step t + 1 are already in flight into its
// registers; after the products it writes them to the other stage, and one barrier per step
// separates the writes of one stage from the reads of the last step that used it. STAGES = 1 keeps
// one stage (half the workgroup memory) and adds a barrier before the writes.
//
// Bank conflicts. Staged rows are padded by PAD halves (row strides SA = BK + PAD for A and
// SB = BN + PAD for B halves, SA8 = SA / 8 and SB8 = SB / 8 words; PAD = 8 makes the 8 rows a
// 16 x 16 matrix load reads per phase start in distinct 16-byte bank groups when the unpadded
// stride is a multiple of 128 bytes).
//
// Bounds. The host asks only for M % BM = N % BN = K % BK = 0, and for tile shapes whose unit
// counts divide evenly: (BM BK / 8) and (BK BN / 8) multiples of WG, at most MAX_UNITS units of
// each operand per invocation, TM, TN <= MAX_T. Every staged-tile matrix load ends inside its
// array (in halves: 8 (offset + 15 stride) + 16 <= 8 length), so the runtime's bounds predicate
// never zeroes one.
// Subgroup-matrix calls and barriers are made by whole subgroups / the whole workgroup: every
// branch and loop bound below is uniform (override constants, the workgroup id and params).
//
// Bindings (group 0)
//   0 params  uniform              Params (below)
//   1 a       storage, read        f16 [M, K] as vec4<u32> (8 halves a unit; K % 8 = 0)
//   2 b       storage, read        f16 [K, N] as vec4<u32> (N % 8 = 0)
//   3 c       storage, read_write  f32 [M, N]
//
// Override constants (defaults: a 128 x 128 block of 8 subgroups, 64 x 32 each, BK = 32, double
// buffered: 37 KiB of workgroup memory; the host skips shapes over the device's limit)
//   SGM, SGN   subgroups along M and N          TM, TN   16 x 16 result tiles per subgroup
//   BK         K per staged step (16, 32, 64)   STAGES   staging buffers: 1 or 2
//   PAD        halves of padding per staged row (a multiple of 8: rows stay 16-byte aligned)
// Workgroup memory: 2 STAGES (BM SA + BK SB) bytes (BM SA / 8 and BK SB / 8 words per stage).
// Needs a subgroup size of 32. The loader prepends `enable f16;`, the subgroup-matrix directive and `enable subgroups;`.

override SGM: u32 = 2u;
override SGN: u32 = 4u;
override TM: u32 = 4u;
override TN: u32 = 2u;
override BK: u32 = 32u;
override STAGES: u32 = 2u;
override PAD: u32 = 8u;

override WG: u32 = 32u * SGM * SGN;
override BM: u32 = 16u * TM * SGM;
override BN: u32 = 16u * TN * SGN;
override SA: u32 = BK + PAD;                  // row stride of a staged A tile (halves)
override SB: u32 = BN + PAD;                  // row stride of a staged B tile
override A_STAGE: u32 = BM * SA;              // halves of one staged A tile
override B_STAGE: u32 = BK * SB;
override SA8: u32 = SA / 8u;                  // the same in 16-byte words
override SB8: u32 = SB / 8u;
override A_STAGE8: u32 = A_STAGE / 8u;
override B_STAGE8: u32 = B_STAGE / 8u;
override A_LEN8: u32 = STAGES * A_STAGE8;     // words of the staged A tiles
override B_LEN8: u32 = STAGES * B_STAGE8;
override A_ROW_UNITS: u32 = BK / 8u;          // 16-byte units of one row of an A tile
override B_ROW_UNITS: u32 = BN / 8u;
override A_UNITS: u32 = BM * A_ROW_UNITS / WG;  // units of A each invocation copies per step
override B_UNITS: u32 = BK * B_ROW_UNITS / WG;

const MAX_T: u32 = 4u;      // largest TM and TN (the variables acc00 .. acc33, r0 .. r3)
const MAX_UNITS: u32 = 8u;  // largest A_UNITS and B_UNITS

struct Params {
    m: u32,
    n: u32,
    k: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

var<workgroup> sa: array<vec4<u32>, A_LEN8>;  // STAGES tiles of A, [row][k] with row stride SA8 words
var<workgroup> sb: array<vec4<u32>, B_LEN8>;  // STAGES tiles of B, [k][col] with row stride SB8 words

alias Left = subgroup_matrix_left<f16, 16, 16>;
alias Right = subgroup_matrix_right<f16, 16, 16>;
alias Result = subgroup_matrix_result<f32, 16, 16>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_id) sg: u32) {
    let n = params.n;
    let k_len = params.k;
    let kq = k_len / 8u;  // units per row of A
    let nq = n / 8u;      // units per row of B
    let row0 = wid.y * BM;
    let col0 = wid.x * BN;
    let srow = (sg / SGN) * 16u * TM;  // this subgroup's block within the workgroup's
    let scol = (sg % SGN) * 16u * TN;
    let steps = k_len / BK;

    // result (i, j) in acc{i}{j} (zero-initialised); right-hand matrix j in r{j}
    var acc00: Result; var acc01: Result; var acc02: Result; var acc03: Result;
    var acc10: Result; var acc11: Result; var acc12: Result; var acc13: Result;
    var acc20: Result; var acc21: Result; var acc22: Result; var acc23: Result;
    var acc30: Result; var acc31: Result; var acc32: Result; var acc33: Result;
    var r0: Right; var r1: Right; var r2: Right; var r3: Right;
    var ra: array<vec4<u32>, MAX_UNITS>;    // the next step's units, in flight
    var rb: array<vec4<u32>, MAX_UNITS>;

    // step 0 to stage 0
    for (var i = 0u; i < A_UNITS; i++) {
        let u = i * WG + lid;
        ra[i] = a[(row0 + u / A_ROW_UNITS) * kq + u % A_ROW_UNITS];
    }
    for (var i = 0u; i < B_UNITS; i++) {
        let u = i * WG + lid;
        rb[i] = b[(u / B_ROW_UNITS) * nq + col0 / 8u + u % B_ROW_UNITS];
    }
    for (var i = 0u; i < A_UNITS; i++) {
        let u = i * WG + lid;
        sa[(u / A_ROW_UNITS) * SA8 + u % A_ROW_UNITS] = ra[i];
    }
    for (var i = 0u; i < B_UNITS; i++) {
        let u = i * WG + lid;
        sb[(u / B_ROW_UNITS) * SB8 + u % B_ROW_UNITS] = rb[i];
    }
    workgroupBarrier();

    for (var t = 0u; t < steps; t++) {
        let more = t + 1u < steps;
        if (more) {  // issue the next step's loads before the products
            let kn = (t + 1u) * BK;
            for (var i = 0u; i < A_UNITS; i++) {
                let u = i * WG + lid;
                ra[i] = a[(row0 + u / A_ROW_UNITS) * kq + kn / 8u + u % A_ROW_UNITS];
            }
            for (var i = 0u; i < B_UNITS; i++) {
                let u = i * WG + lid;
                rb[i] = b[(kn + u / B_ROW_UNITS) * nq + col0 / 8u + u % B_ROW_UNITS];
            }
        }
        // offsets and strides in words (8 halves)
        let sa0 = (t % STAGES) * A_STAGE8 + srow * SA8;
        let sb0 = (t % STAGES) * B_STAGE8 + scol / 8u;
        let kk_n = (BK + 15u) / 16u;
        for (var kk_i = 0u; kk_i < kk_n; kk_i++) {
            let kk = kk_i * 16u;
            let sbk = sb0 + kk * SB8;
            if (TN > 0u) { r0 = subgroupMatrixLoad<Right, row_major>(&sb, sbk, SB8); }
            if (TN > 1u) { r1 = subgroupMatrixLoad<Right, row_major>(&sb, sbk + 2u, SB8); }
            if (TN > 2u) { r2 = subgroupMatrixLoad<Right, row_major>(&sb, sbk + 4u, SB8); }
            if (TN > 3u) { r3 = subgroupMatrixLoad<Right, row_major>(&sb, sbk + 6u, SB8); }
            // left-hand matrices one at a time: row i of result tiles
            if (TM > 0u) {
                let l = subgroupMatrixLoad<Left, row_major>(&sa, sa0 + kk / 8u, SA8);
                if (TN > 0u) { acc00 = subgroupMatrixMultiplyAccumulate(l, r0, acc00); }
                if (TN > 1u) { acc01 = subgroupMatrixMultiplyAccumulate(l, r1, acc01); }
                if (TN > 2u) { acc02 = subgroupMatrixMultiplyAccumulate(l, r2, acc02); }
                if (TN > 3u) { acc03 = subgroupMatrixMultiplyAccumulate(l, r3, acc03); }
            }
            if (TM > 1u) {
                let l = subgroupMatrixLoad<Left, row_major>(&sa, sa0 + 16u * SA8 + kk / 8u, SA8);
                if (TN > 0u) { acc10 = subgroupMatrixMultiplyAccumulate(l, r0, acc10); }
                if (TN > 1u) { acc11 = subgroupMatrixMultiplyAccumulate(l, r1, acc11); }
                if (TN > 2u) { acc12 = subgroupMatrixMultiplyAccumulate(l, r2, acc12); }
                if (TN > 3u) { acc13 = subgroupMatrixMultiplyAccumulate(l, r3, acc13); }
            }
            if (TM > 2u) {
                let l = subgroupMatrixLoad<Left, row_major>(&sa, sa0 + 32u * SA8 + kk / 8u, SA8);
                if (TN > 0u) { acc20 = subgroupMatrixMultiplyAccumulate(l, r0, acc20); }
                if (TN > 1u) { acc21 = subgroupMatrixMultiplyAccumulate(l, r1, acc21); }
                if (TN > 2u) { acc22 = subgroupMatrixMultiplyAccumulate(l, r2, acc22); }
                if (TN > 3u) { acc23 = subgroupMatrixMultiplyAccumulate(l, r3, acc23); }
            }
            if (TM > 3u) {
                let l = subgroupMatrixLoad<Left, row_major>(&sa, sa0 + 48u * SA8 + kk / 8u, SA8);
                if (TN > 0u) { acc30 = subgroupMatrixMultiplyAccumulate(l, r0, acc30); }
                if (TN > 1u) { acc31 = subgroupMatrixMultiplyAccumulate(l, r1, acc31); }
                if (TN > 2u) { acc32 = subgroupMatrixMultiplyAccumulate(l, r2, acc32); }
                if (TN > 3u) { acc33 = subgroupMatrixMultiplyAccumulate(l, r3, acc33); }
            }
        }
        if (more) {
            if (STAGES == 1u) {
                workgroupBarrier();  // every subgroup is done reading the one stage
            }
            let s = (t + 1u) % STAGES;
            for (var i = 0u; i < A_UNITS; i++) {
                let u = i * WG + lid;
                sa[s * A_STAGE8 + (u / A_ROW_UNITS) * SA8 + u % A_ROW_UNITS] = ra[i];
            }
            for (var i = 0u; i < B_UNITS; i++) {
                let u = i * WG + lid;
                sb[s * B_STAGE8 + (u / B_ROW_UNITS) * SB8 + u % B_ROW_UNITS] = rb[i];
            }
        }
        workgroupBarrier();
    }

    let c0 = (row0 + srow) * n + col0 + scol;
    let c1 = c0 + 16u * n;
    let c2 = c0 + 32u * n;
    let c3 = c0 + 48u * n;
    if (TM > 0u && TN > 0u) { subgroupMatrixStore<row_major>(&c, c0, acc00, n); }
    if (TM > 0u && TN > 1u) { subgroupMatrixStore<row_major>(&c, c0 + 16u, acc01, n); }
    if (TM > 0u && TN > 2u) { subgroupMatrixStore<row_major>(&c, c0 + 32u, acc02, n); }
    if (TM > 0u && TN > 3u) { subgroupMatrixStore<row_major>(&c, c0 + 48u, acc03, n); }
    if (TM > 1u && TN > 0u) { subgroupMatrixStore<row_major>(&c, c1, acc10, n); }
    if (TM > 1u && TN > 1u) { subgroupMatrixStore<row_major>(&c, c1 + 16u, acc11, n); }
    if (TM > 1u && TN > 2u) { subgroupMatrixStore<row_major>(&c, c1 + 32u, acc12, n); }
    if (TM > 1u && TN > 3u) { subgroupMatrixStore<row_major>(&c, c1 + 48u, acc13, n); }
    if (TM > 2u && TN > 0u) { subgroupMatrixStore<row_major>(&c, c2, acc20, n); }
    if (TM > 2u && TN > 1u) { subgroupMatrixStore<row_major>(&c, c2 + 16u, acc21, n); }
    if (TM > 2u && TN > 2u) { subgroupMatrixStore<row_major>(&c, c2 + 32u, acc22, n); }
    if (TM > 2u && TN > 3u) { subgroupMatrixStore<row_major>(&c, c2 + 48u, acc23, n); }
    if (TM > 3u && TN > 0u) { subgroupMatrixStore<row_major>(&c, c3, acc30, n); }
    if (TM > 3u && TN > 1u) { subgroupMatrixStore<row_major>(&c, c3 + 16u, acc31, n); }
    if (TM > 3u && TN > 2u) { subgroupMatrixStore<row_major>(&c, c3 + 32u, acc32, n); }
    if (TM > 3u && TN > 3u) { subgroupMatrixStore<row_major>(&c, c3 + 48u, acc33, n); }
}
