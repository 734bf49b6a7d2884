// psa_score_keys.wgsl — block-score keys decoded to float32 in place (R22), the last dispatch of a
// block_scores() call before its scores are read back.
//
// psa_block_scores.wgsl (and its decode and tensor-core variants) keep each (t, h, s) score as an
// order-preserving u32 key, so that a row's max is an atomicMax: 0 means "nothing visible" and
// 0xffffffff a NaN logit. The public call returns float32; decoding the keys on the host took
// numpy about 18 ms per prefill call on the bench's problem (4.2 M keys: several passes over
// 16 MiB and two masked writes), more than the scores' kernel. Here one invocation decodes one
// word where the scores are, so the host copies the float32 bits out of the readback as they are.
//
// The bits are those the host decoding gave (the tests compare them, the whole key range swept):
// 0 -> -inf (0xff800000), 0xffffffff -> the quiet NaN 0x7fc00000, a key with its top bit set ->
// the float32 >= +0 whose bits are the key without it, any other key -> the negative float32
// whose bits are its complement. Every other key is the key of exactly one float32, so the
// decoding inverts psa_block_scores.wgsl's logit_key bit for bit.
//
// Bindings (group 0)
//   0 params  uniform              Params (below; one record per dispatch)
//   1 words   storage, read_write  u32 [n]: the keys of one batch of queries' scores, replaced by
//                                  float32 bits
//
// Override constant: WG (workgroup size). Workgroup g of a dispatch (g = y * grid_x + x, those
// with g >= count do nothing) decodes words (first + g) WG + lid that are below n.

override WG: u32 = 256u;

struct Params {
    first: u32,   // workgroups of earlier dispatches of this buffer
    count: u32,   // workgroups of this dispatch
    grid_x: u32,  // x size of this dispatch's grid
    n: u32,       // words of the buffer
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> words: array<u32>;

// float32 bits of a block-score key (psa_select_topk.wgsl decodes its KEYS input with the same
// function: WGSL has no includes, and the two must stay equal; the tests check both against the
// encoding)
fn key_bits(k: u32) -> u32 {
    if (k == 0u) {
        return 0xff800000u;
    }
    if (k == 0xffffffffu) {
        return 0x7fc00000u;
    }
    return select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wid.y * params.grid_x + wid.x;
    if (g >= params.count) {
        return;
    }
    let i = (params.first + g) * WG + lid;
    if (i < params.n) {
        words[i] = key_bits(words[i]);
    }
}
