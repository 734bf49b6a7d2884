// psa_gemm_sgmat.wgsl — a plain f16 matrix product on subgroup matrices (tensor cores): the
// ceiling that a kernel multiplying through this API, compiler and driver can reach (the
// benchmark reports it beside torch's bf16 matmul; no attention kernel uses it).
//
// C = A · B with A [M, K] and B [K, N] float16, row-major, and C [M, N] float32. One workgroup
// of one subgroup (32 invocations) owns a tile of (16 TM) x (16 TN) outputs and walks K in steps
// of 16: per step it loads TN right-hand 16x16 tiles of B and, one at a time, TM left-hand tiles
// of A straight from storage (the caches of the device serve the reuse between workgroups), and
// accumulates TM x TN 16x16 f32 result tiles. Subgroup-matrix calls are made by the whole
// subgroup: every loop bound below is uniform.
//
// Bindings (group 0)
//   0 params  uniform              Params (below)
//   1 a       storage, read        f16 [M, K]
//   2 b       storage, read        f16 [K, N]
//   3 c       storage, read_write  f32 [M, N]
//
// Override constants: TM, TN result tiles per subgroup along M and N. M must be a multiple of
// 16 TM, N of 16 TN and K of 16 (the host only asks for such shapes). The loader prepends
// `enable f16;` and the subgroup-matrix directive.

override TM: u32 = 4u;
override TN: u32 = 2u;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<f16>;
@group(0) @binding(2) var<storage, read> b: array<f16>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

alias Left = subgroup_matrix_left<f16, 16, 16>;
alias Right = subgroup_matrix_right<f16, 16, 16>;
alias Result = subgroup_matrix_result<f32, 16, 16>;

const MAX_T: u32 = 4u;  // largest TM and TN the host asks for (function arrays need a constant size)

@compute @workgroup_size(32)
fn main(@builtin(workgroup_id) wid: vec3<u32>) {
    let n = params.n;
    let k_len = params.k;
    let row0 = wid.y * 16u * TM;
    let col0 = wid.x * 16u * TN;
    var acc: array<Result, MAX_T * MAX_T>;  // (i, j) at i * MAX_T + j; zero-initialised
    var right: array<Right, MAX_T>;
    let k0_n = (k_len + 15u) / 16u;
    for (var k0_i = 0u; k0_i < k0_n; k0_i++) {
        let k0 = k0_i * 16u;
        for (var j = 0u; j < TN; j++) {
            right[j] = subgroupMatrixLoad<Right>(&b, k0 * n + col0 + 16u * j, false, n);
        }
        for (var i = 0u; i < TM; i++) {
            let left = subgroupMatrixLoad<Left>(&a, (row0 + 16u * i) * k_len + k0, false, k_len);
            for (var j = 0u; j < TN; j++) {
                acc[i * MAX_T + j] = subgroupMatrixMultiplyAccumulate(left, right[j], acc[i * MAX_T + j]);
            }
        }
    }
    for (var i = 0u; i < TM; i++) {
        for (var j = 0u; j < TN; j++) {
            subgroupMatrixStore(&c, (row0 + 16u * i) * n + col0 + 16u * j, acc[i * MAX_T + j], false, n);
        }
    }
}
