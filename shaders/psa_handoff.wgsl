// psa_handoff.wgsl — hands a planned decode layer's R6 error words over to its results and
// zeroes them for the next layer: the last dispatch of the layer's pass, in place of a clear of
// the words before the pass and a copy after it (two commands outside the pass per layer; R31).
//
// The words are those psa_invert.wgsl writes (`args`: [12] error bits, [13] INVALID minus the
// first bad row; 0 and 0 when the selection was valid). The plan keeps them zero between its
// calls: the buffer starts zeroed, this kernel zeroes them after each call that hands over, and
// every other call of the plan clears them after copying them out (see the plan runtime).
//
// Bindings (group 0)
//   0 args  storage, read_write  u32: the plan's args record (psa_invert.wgsl)
//   1 dst   storage, read_write  u32: the call's result buffer, out | (m, l) | error words
//
// Override constants: DST (the error words' word index in dst), SRC (in args: 12).

override DST: u32;
override SRC: u32 = 12u;

@group(0) @binding(0) var<storage, read_write> args: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(1)
fn main() {
    dst[DST] = args[SRC];
    dst[DST + 1u] = args[SRC + 1u];
    args[SRC] = 0u;
    args[SRC + 1u] = 0u;
}
