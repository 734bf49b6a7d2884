// psa_scan.wgsl — exclusive prefix sums of u32 counts, in two entry points (R13 on the device).
//
// The device-resident KV-outer inversion (psa_invert.wgsl) numbers edges, rows and work items by
// prefix sums. A sum of integers has one result whatever the order of its additions, so the
// numbering is deterministic (R19) and equal to the host's (R13), unlike anything built from the
// order in which atomics land.
//
// `tiles`  one workgroup per tile of TILE = 4 WG consecutive elements: writes the exclusive prefix
//          of each element within its tile to dst[dst_off + i] and the tile's sum to
//          dst[tiles_off + tile].
// `totals` one workgroup: turns the tile sums into their exclusive prefix, in place, and writes
//          the grand total at dst[tiles_off + n_tiles].
// The prefix of element i is then dst[dst_off + i] + dst[tiles_off + i / TILE] (a consumer adds
// the two; no third pass). The elements come in three runs: element i < n_flags is a word of 32
// flag bits and counts as its set bits; n_flags <= i < n_plain counts as src[i] (a count);
// i >= n_plain as ceil(c / div), c the sum of its `sub` words from src[src_off + n_plain +
// (i - n_plain) sub] (a count of edges kept in `sub` parts, as the work items of `div` edges each
// that they make).
//
// Bindings (group 0)
//   0 params  uniform              ScanParams (below)
//   1 src     storage, read        u32 [src_off + n]
//   2 dst     storage, read_write  u32: prefixes at dst_off, tile sums at tiles_off
//
// Override constants: WG workgroup size (a power of two).

override WG: u32 = 256u;
const IPT: u32 = 4u;  // elements per invocation

struct ScanParams {
    n: u32,          // elements
    n_flags: u32,    // the first n_flags elements are words of flag bits (counted by their bits)
    src_off: u32,    // first element in src
    dst_off: u32,    // first prefix in dst
    tiles_off: u32,  // tile sums in dst
    n_tiles: u32,    // ceil(n / TILE)
    grid_x: u32,     // workgroups along x of `tiles` (2-D grid: tile = y * grid_x + x)
    n_plain: u32,    // elements n_flags .. n_plain count as they are, the rest as ceil(x / div)
    div: u32,        // (>= 1)
    sub: u32,        // words per element after n_plain (>= 1)
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: ScanParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

var<workgroup> sh: array<u32, WG>;

// inclusive scan of `x` over the workgroup (Hillis-Steele); every invocation must call it
fn wg_scan(lid: u32, x: u32) -> u32 {
    sh[lid] = x;
    workgroupBarrier();
    for (var j = 0u; j < 32u; j++) {  // off = 1, 2, 4, ... below WG
        let off = 1u << j;
        if (off >= WG) {
            break;
        }
        var y = 0u;
        if (lid >= off) {
            y = sh[lid - off];
        }
        workgroupBarrier();
        sh[lid] = sh[lid] + y;
        workgroupBarrier();
    }
    return sh[lid];
}

fn value(i: u32) -> u32 {
    if (i >= params.n) {
        return 0u;
    }
    if (i < params.n_flags) {
        let x = src[params.src_off + i];
        return countOneBits(x);
    }
    if (i < params.n_plain) {
        return src[params.src_off + i];
    }
    let sub = params.sub;
    let at = params.src_off + params.n_plain + (i - params.n_plain) * sub;
    var c = 0u;
    for (var k = 0u; k < sub; k++) {
        c += src[at + k];
    }
    return (c + params.div - 1u) / params.div;
}

@compute @workgroup_size(WG)
fn tiles(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let tile = wid.y * params.grid_x + wid.x;
    if (tile >= params.n_tiles) {  // uniform per workgroup: the barriers below stay uniform
        return;
    }
    let base = tile * WG * IPT + lid * IPT;
    let v0 = value(base);
    let v1 = value(base + 1u);
    let v2 = value(base + 2u);
    let v3 = value(base + 3u);
    let s = v0 + v1 + v2 + v3;
    let incl = wg_scan(lid, s);
    var run = incl - s;
    let o = params.dst_off + base;
    if (base < params.n) { dst[o] = run; }
    run += v0;
    if (base + 1u < params.n) { dst[o + 1u] = run; }
    run += v1;
    if (base + 2u < params.n) { dst[o + 2u] = run; }
    run += v2;
    if (base + 3u < params.n) { dst[o + 3u] = run; }
    if (lid == WG - 1u) {
        dst[params.tiles_off + tile] = incl;
    }
}

@compute @workgroup_size(WG)
fn totals(@builtin(local_invocation_index) lid: u32) {
    var carry = 0u;
    let c0_n = (params.n_tiles + WG - 1u) / WG;
    for (var c0_i = 0u; c0_i < c0_n; c0_i++) {
        let c0 = c0_i * WG;
        let i = c0 + lid;
        var x = 0u;
        if (i < params.n_tiles) {
            x = dst[params.tiles_off + i];
        }
        let incl = wg_scan(lid, x);
        let chunk = sh[WG - 1u];
        if (i < params.n_tiles) {
            dst[params.tiles_off + i] = carry + incl - x;
        }
        carry += chunk;
        workgroupBarrier();  // sh is rewritten by the next chunk's scan
    }
    if (lid == 0u) {
        dst[params.tiles_off + params.n_tiles] = carry;
    }
}
