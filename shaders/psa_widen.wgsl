// psa_widen.wgsl — a layer's float16 queries widened to float32 on the device (R7), the first
// dispatch of the layer's first pass: a host float16 q is written at half the bytes and never
// widened by the host (numpy widens float16 element by element, about 0.4 ms for the 131072
// values of a decode layer's q), and a device-resident float16 q is read where it is.
//
// float16 -> float32 is exact for every value, and is done here on the bits (not by
// unpack2x16float, whose handling of subnormal halves WGSL leaves to the implementation): a
// normal half gets its exponent rebiased (+112) and its 10 mantissa bits moved up by 13; a zero or
// subnormal half is m * 2^-24, an exact float32 product; +-inf and NaN keep their mantissa bits
// (a NaN's payload too). These are the bits numpy's astype(float32) gives, so the attention
// kernels read the float32 q the host would have written (the tests compare every float16 value
// bit for bit).

// Bindings (group 0)
//   0 src  storage, read        u32 [N2]: two float16 per word, the lower address in the low half
//                               (an odd N's last word: its high half is not read)
//   1 dst  storage, read_write  f32 [N]: the plan's float32 tensor
//
// Override constants: N (values to widen), WG (workgroup size), GX (workgroups per row of the
// grid; the host spreads ceil(N2 / WG) workgroups over rows of GX). Word i (values 2i and 2i + 1)
// is widened by invocation i; those past N2 = ceil(N / 2) do nothing.

override N: u32;
override N2: u32 = (N + 1u) / 2u;
override WG: u32 = 256u;
override GX: u32;

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;

// The float32 of the half in the low 16 bits of h.
fn widen(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {  // zero or subnormal: m * 2^-24 (a normal float32 unless m = 0)
        return bitcast<f32>(sign | bitcast<u32>(ldexp(f32(m), -24)));
    }
    if (e == 31u) {  // +-inf, NaN
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * (GX * WG) + gid.x;
    if (i < N2) {
        let w = src[i];
        dst[2u * i] = widen(w & 0xffffu);
        if (2u * i + 1u < N) {
            dst[2u * i + 1u] = widen(w >> 16u);
        }
    }
}
