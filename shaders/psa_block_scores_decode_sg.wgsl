// psa_block_scores_decode_sg.wgsl — block scores of the index branch (R22) for items of at most 8
// rows, read as whole coalesced key rows by key groups of one subgroup (needs the `subgroup`
// feature: shuffles). The host prefers it to psa_block_scores_decode.wgsl wherever it applies.
//
// Same bindings, params record, work items and output keys as psa_block_scores.wgsl (read its
// header); the host uses this kernel when an item holds at most 8 rows (decode: the Hkv KV heads
// of one query, one shared index key head), a key row is whole 16-byte units and one key group of
// R <= subgroup-size lanes holds a row. Such an item's time is the reading of its keys: in
// psa_block_scores_decode.wgsl each invocation reads one whole key row (a warp's load touches 32
// rows 8 bytes each), here the R lanes of a group read one row together (a warp's load is R
// consecutive 16-byte units of each of 32 / R rows: whole sectors), which is what a bandwidth-bound
// read wants.
//
// Layout (the one of psa_partials_decode.wgsl's score half). A key group is R consecutive lanes
// of one subgroup; lane r owns unit r of every key row it reads and holds the item's queries'
// dims of that unit (EU of them) for all row slots in registers. The workgroup's NGRP = WG / R
// groups take the block's positions in chunks of 4: chunk c of group g is positions
// (c NGRP + g) 4 .. + 3, its 4 loads issued together (with PF = 1 before the previous
// chunk's math). Per position a lane forms a partial dot
// product per row slot (8, or 4 when NR <= 4) and reduce-scatters them across the group with
// shuffles (see `logit`), which leaves lane r with the full logit of one row slot; the lane
// keeps that row's largest key over the visible positions in a register. At the end the lanes' keys are combined per row with
// workgroup atomics (a max: the same whatever the order, R19). Every sum is in a fixed order
// (dims within a lane, then the shuffle steps), so results are bitwise deterministic (R19).
//
// With JR = 1 (R = 16 lanes and NR = 4 row slots: the MSA decode shape) a chunk's 4 positions x 4
// slots are reduce-scattered together (see `logits16`): 15 shuffles per chunk instead of 20, and
// each lane ends with one logit of the chunk (position 2 [r & 8] + [r & 4] of slot 2 [r & 2] +
// [r & 1]) instead of one per position, so the masking, key and maximum run once per chunk: a
// quarter of that work, and the same sums in another fixed order (R19).
//
// Masking (R10, R22) as in psa_block_scores.wgsl: a position is read only when it is below
// npos and its page is in the bound chunk (its units stay zero otherwise, and it is never
// counted); it counts for a row only when also below the row's query_end. Loops run the same
// trip counts on every lane of the workgroup, so shuffles never run in divergent control flow.
//
// Bindings (group 0): as psa_block_scores.wgsl, except
//   2 ik      storage, read        vec4<u32> [n_slabs_in_chunk, S, TE]  index keys of one chunk as
//                                  16-byte units (EU = 4 float32 or EU = 8 float16 elements;
//                                  float16 needs no shader-f16 feature: unpack2x16float); with
//                                  RH > 1 (NHD, R34) whole pages [n_pages, S, RH, TE]
//
// Override constants
//   DV  vec4s per index query row (ceil(d_idx / 4))     S  page size     BS  block size
//   EU  index-key elements per unit (4: float32, 8: float16); TE = 4 DV / EU units per key row
//   NR  row slots the host plans (<= 8; 4 or fewer skips the upper four slots' arithmetic)
//   R   lanes per key group: a power of two, 8 <= R <= SG, TE <= R
//   SG  the device's subgroup size, as the host measured it (lanes = invocation index mod SG)
//   WG  workgroup size: a multiple of R and of SG
//   PF  1: the next chunk's loads in flight during a chunk (more registers per lane)
//   JR  1: a chunk's logits reduce-scattered together (needs R = 16 and NR = 4)
//   ONCE 1: every (row, block) key of `out` belongs to exactly one work item of the dispatch (the
//        host proves it from its items: a device-resident decode layer): the item stores its
//        maxima instead of merging them into `out`, which then needs no clearing first

override DV: u32;
override S: u32;
override RH: u32 = 1u;               // index key heads interleaved per page row: 1 (HND) or Hk_idx (NHD, R34)
override BS: u32;
override EU: u32 = 8u;
override TE: u32 = DV * 4u / EU;     // 16-byte units per key row
override NR: u32 = 8u;
override R: u32 = 16u;
override SG: u32 = 32u;
override WG: u32 = 128u;
override PF: u32 = 0u;               // 1: the next chunk's loads in flight during a chunk
override JR: u32 = 0u;               // 1: a chunk's 4 x 4 logits reduce-scattered together (R = 16, NR = 4)
override ONCE: u32 = 0u;             // 1: each key of `out` has exactly one item: stored, not merged
override NGRP: u32 = WG / R;         // key groups per workgroup
const INVALID: u32 = 0xffffffffu;
const NAN_KEY: u32 = 0xffffffffu;

struct Params {
    item_base: u32,
    n_items: u32,
    grid_x: u32,
    items_off: u32,
    heads: u32,
    msb: u32,
    scale: f32,
    chunk_first: u32,
    chunk_end: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> iq: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> ik: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> pages: array<u32>;
@group(0) @binding(4) var<storage, read> plan: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<u32>;

var<workgroup> red: array<atomic<u32>, 8>;  // row maxima (max: order-free, R19)

fn logit_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return NAN_KEY;
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

// Row of offset `off` of slab `slab` of the bound chunk (R34): HND (RH = 1) slab * S + off; NHD
// the page's row off * RH + head, with page slab / RH and head slab % RH.
fn ik_row(slab: u32, off: u32) -> u32 {
    let page = slab / RH;
    return (page * S + off) * RH + (slab - page * RH);
}

// unit r of the key row of block position p (zeros when p is not readable: past npos, or its
// page is not in the bound chunk), and whether it was read
fn key_unit(pg: u32, p: u32, npos: u32, r: u32, ok: ptr<function, bool>) -> vec4<u32> {
    *ok = false;
    if (p < npos) {
        let slab = pages[pg + p / S];  // INVALID is >= every chunk_end
        if (slab >= params.chunk_first && slab < params.chunk_end) {
            *ok = true;
            if (r < TE) {
                return ik[ik_row(slab - params.chunk_first, p % S) * TE + r];
            }
        }
    }
    return vec4<u32>(0u);
}

// a chunk: this lane's unit of the key rows of positions k0 .. k0 + 3, and which were read
struct Chunk {
    u0: vec4<u32>,
    u1: vec4<u32>,
    u2: vec4<u32>,
    u3: vec4<u32>,
    ok: vec4<bool>,
}

// the chunk of positions k0 .. k0 + 3, its 4 loads issued together
fn load_chunk(pg: u32, k0: u32, npos: u32, r: u32) -> Chunk {
    var ok0: bool;
    var ok1: bool;
    var ok2: bool;
    var ok3: bool;
    let u0 = key_unit(pg, k0, npos, r, &ok0);
    let u1 = key_unit(pg, k0 + 1u, npos, r, &ok1);
    let u2 = key_unit(pg, k0 + 2u, npos, r, &ok2);
    let u3 = key_unit(pg, k0 + 3u, npos, r, &ok3);
    return Chunk(u0, u1, u2, u3, vec4<bool>(ok0, ok1, ok2, ok3));
}

// elements 0..3 of a unit, and 4..7 when EU = 8
fn lo4(u: vec4<u32>) -> vec4<f32> {
    if (EU == 8u) {
        return vec4<f32>(unpack2x16float(u.x), unpack2x16float(u.y));
    }
    return bitcast<vec4<f32>>(u);
}

fn hi4(u: vec4<u32>) -> vec4<f32> {
    if (EU == 8u) {
        return vec4<f32>(unpack2x16float(u.z), unpack2x16float(u.w));
    }
    return vec4<f32>(0.0);
}

// query vec4 j of row slot x of the item (zeros past n_rows and past the row)
fn qload(x: u32, j: u32, r0: u32, n_rows: u32, t0: u32, nh: u32, h_off: u32) -> vec4<f32> {
    if (x >= n_rows || j >= DV) {
        return vec4<f32>(0.0);
    }
    let rr = r0 + x;
    return iq[((t0 + rr / nh) * params.heads + h_off + rr % nh) * DV + j];
}

// a lane's dims of the 8 row slots' queries: a0..a7 elements 0..3 of its unit, b0..b7 4..7
// (named members, no dynamically indexed array: it may leave registers)
struct Queries {
    a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>,
    a4: vec4<f32>, a5: vec4<f32>, a6: vec4<f32>, a7: vec4<f32>,
    b0: vec4<f32>, b1: vec4<f32>, b2: vec4<f32>, b3: vec4<f32>,
    b4: vec4<f32>, b5: vec4<f32>, b6: vec4<f32>, b7: vec4<f32>,
}

// the full logit of row slot hs(r) on lane r from a unit's elements (x: 0..3, y: 4..7): per-slot
// partial dot products, reduce-scattered over the R lanes of the group. NR > 4: 8 slots (4, 2,
// 1, then 1 value per shuffle step), hs(r) = 4 [r & R/2] + 2 [r & R/4] + [r & R/8]; else 4 slots
// (2, 1, then 1), hs(r) = 2 [r & R/2] + [r & R/4]
fn logit(qs: Queries, x: vec4<f32>, y: vec4<f32>, r: u32) -> f32 {
    var lo = vec4<f32>(dot(qs.a0, x), dot(qs.a1, x), dot(qs.a2, x), dot(qs.a3, x));
    if (EU == 8u) {
        lo += vec4<f32>(dot(qs.b0, y), dot(qs.b1, y), dot(qs.b2, y), dot(qs.b3, y));
    }
    let ba = (r & (R / 2u)) != 0u;
    var w2: vec2<f32>;
    var msk0 = R / 4u;  // the first full-sum step
    if (NR > 4u) {
        var hi = vec4<f32>(dot(qs.a4, x), dot(qs.a5, x), dot(qs.a6, x), dot(qs.a7, x));
        if (EU == 8u) {
            hi += vec4<f32>(dot(qs.b4, y), dot(qs.b5, y), dot(qs.b6, y), dot(qs.b7, y));
        }
        let w4 = select(lo, hi, ba) + subgroupShuffleXor(select(hi, lo, ba), R / 2u);
        let bb = (r & (R / 4u)) != 0u;
        w2 = select(w4.xy, w4.zw, bb) + subgroupShuffleXor(select(w4.zw, w4.xy, bb), R / 4u);
        msk0 = R / 8u;
    } else {
        w2 = select(lo.xy, lo.zw, ba) + subgroupShuffleXor(select(lo.zw, lo.xy, ba), R / 2u);
    }
    let bc = (r & msk0) != 0u;
    var w = select(w2.x, w2.y, bc) + subgroupShuffleXor(select(w2.y, w2.x, bc), msk0);
    for (var msk = msk0 / 2u; msk > 0u; msk >>= 1u) {  // rolled: no faster counted (H200 decode layer: Dawn 113.0 -> 112.0 us, wgpu-native 108.8 -> 110.2 us)
        w += subgroupShuffleXor(w, msk);
    }
    return w;
}

// slots 0..3 of a unit's partial dot products (x: elements 0..3, y: 4..7)
fn partial4(qs: Queries, u: vec4<u32>) -> vec4<f32> {
    let x = lo4(u);
    var p = vec4<f32>(dot(qs.a0, x), dot(qs.a1, x), dot(qs.a2, x), dot(qs.a3, x));
    if (EU == 8u) {
        let y = hi4(u);
        p += vec4<f32>(dot(qs.b0, y), dot(qs.b1, y), dot(qs.b2, y), dot(qs.b3, y));
    }
    return p;
}

// JR = 1: the 4 x 4 logits of a chunk (positions k0 .. k0 + 3, slots 0..3) reduce-scattered over
// the 16 lanes of the group, halving what is exchanged at each step (8 values, 4, 2, 1): lane r
// keeps positions {0, 1} or {2, 3} (r & 8), then one of them (r & 4), then slots {0, 1} or {2, 3}
// (r & 2), then one slot (r & 1). Both lanes of a pair add the same two values (a + b == b + a).
fn logits16(qs: Queries, c: Chunk, r: u32) -> f32 {
    let p0 = partial4(qs, c.u0);
    let p1 = partial4(qs, c.u1);
    let p2 = partial4(qs, c.u2);
    let p3 = partial4(qs, c.u3);
    let b8 = (r & 8u) != 0u;
    let w0 = select(p0, p2, b8) + subgroupShuffleXor(select(p2, p0, b8), 8u);
    let w1 = select(p1, p3, b8) + subgroupShuffleXor(select(p3, p1, b8), 8u);
    let b4 = (r & 4u) != 0u;
    let v = select(w0, w1, b4) + subgroupShuffleXor(select(w1, w0, b4), 4u);
    let b2 = (r & 2u) != 0u;
    let t = select(v.xy, v.zw, b2) + subgroupShuffleXor(select(v.zw, v.xy, b2), 2u);
    let b1 = (r & 1u) != 0u;
    return select(t.x, t.y, b1) + subgroupShuffleXor(select(t.y, t.x, b1), 1u);
}

// the row slot whose logit lane r holds after `logit`
fn slot_of(r: u32) -> u32 {
    if (JR == 1u) {  // after `logits16`
        return 2u * select(0u, 1u, (r & 2u) != 0u) + select(0u, 1u, (r & 1u) != 0u);
    }
    let ba = select(0u, 1u, (r & (R / 2u)) != 0u);
    let bb = select(0u, 1u, (r & (R / 4u)) != 0u);
    if (NR > 4u) {
        return 4u * ba + 2u * bb + select(0u, 1u, (r & (R / 8u)) != 0u);
    }
    return 2u * ba + bb;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_size) sgs: u32) {
    let item = wid.y * params.grid_x + wid.x;
    if (item >= params.n_items) {
        return;
    }
    let ib = params.items_off + (params.item_base + item) * 8u;
    let t0 = plan[ib];
    let r0 = plan[ib + 1u];
    let n_rows = plan[ib + 2u];
    let nh = plan[ib + 3u];
    let h_off = plan[ib + 4u];
    let pg = plan[ib + 5u];
    let npos = plan[ib + 6u];
    let s = plan[ib + 7u];

    let r = lid % R;             // lane in the key group: owns unit r of every key row
    let grp = lid / R;           // key group
    let hs = slot_of(r);         // row slot whose logit lane r holds
    // the layout assumes subgroups of SG consecutive invocations (what the host measured); a
    // device that breaks it gets NaN scores (loud), never plausible numbers
    let broken = sgs != SG || sl != lid % SG;

    if (lid < 8u) {
        atomicStore(&red[lid], 0u);  // explicitly: not every driver zeroes workgroup memory
    }
    // this lane's dims of the item's queries (unit r: vec4s jo and jo + 1 of each row slot), and
    // the query_end of its slot's row
    let jo = r * (EU / 4u);
    var qs: Queries;
    qs.a0 = qload(0u, jo, r0, n_rows, t0, nh, h_off);
    qs.a1 = qload(1u, jo, r0, n_rows, t0, nh, h_off);
    qs.a2 = qload(2u, jo, r0, n_rows, t0, nh, h_off);
    qs.a3 = qload(3u, jo, r0, n_rows, t0, nh, h_off);
    qs.a4 = qload(4u, jo, r0, n_rows, t0, nh, h_off);
    qs.a5 = qload(5u, jo, r0, n_rows, t0, nh, h_off);
    qs.a6 = qload(6u, jo, r0, n_rows, t0, nh, h_off);
    qs.a7 = qload(7u, jo, r0, n_rows, t0, nh, h_off);
    if (EU == 8u) {
        qs.b0 = qload(0u, jo + 1u, r0, n_rows, t0, nh, h_off);
        qs.b1 = qload(1u, jo + 1u, r0, n_rows, t0, nh, h_off);
        qs.b2 = qload(2u, jo + 1u, r0, n_rows, t0, nh, h_off);
        qs.b3 = qload(3u, jo + 1u, r0, n_rows, t0, nh, h_off);
        qs.b4 = qload(4u, jo + 1u, r0, n_rows, t0, nh, h_off);
        qs.b5 = qload(5u, jo + 1u, r0, n_rows, t0, nh, h_off);
        qs.b6 = qload(6u, jo + 1u, r0, n_rows, t0, nh, h_off);
        qs.b7 = qload(7u, jo + 1u, r0, n_rows, t0, nh, h_off);
    }
    var qend = 0;
    if (hs < n_rows) {
        qend = bitcast<i32>(plan[t0 + (r0 + hs) / nh]);
    }
    workgroupBarrier();

    var best = 0u;
    let step = NGRP * 4u;
    // PF = 1: chunk 0's loads here, and in the loop the next chunk's loads are issued before the
    // current chunk's math (two chunks in flight per lane); PF = 0: each chunk's loads at the top
    // of its iteration
    var next: Chunk;
    if (PF == 1u) {
        next = load_chunk(pg, grp * 4u, npos, r);
    }
    // (the same trip count on every lane)
    for (var kb = 0u; kb < npos; kb += step) {  // rolled: no faster counted (H200 decode layer: Dawn 113.0 -> 112.0 us, wgpu-native 108.8 -> 110.2 us)
        let k0 = kb + grp * 4u;
        var c = next;
        if (PF == 1u) {
            next = load_chunk(pg, k0 + step, npos, r);
        } else {
            c = load_chunk(pg, k0, npos, r);
        }
        if (JR == 1u) {
            // this lane's one logit of the chunk: position k0 + pj of its slot
            let pj = 2u * select(0u, 1u, (r & 8u) != 0u) + select(0u, 1u, (r & 4u) != 0u);
            let z = logits16(qs, c, r);
            let pos = i32(s * BS + k0 + pj);
            best = max(best, select(0u, logit_key(params.scale * z), c.ok[pj] && pos < qend));
            continue;
        }
        let z0 = logit(qs, lo4(c.u0), hi4(c.u0), r);
        let z1 = logit(qs, lo4(c.u1), hi4(c.u1), r);
        let z2 = logit(qs, lo4(c.u2), hi4(c.u2), r);
        let z3 = logit(qs, lo4(c.u3), hi4(c.u3), r);
        let pos = i32(s * BS + k0);
        best = max(best, select(0u, logit_key(params.scale * z0), c.ok.x && pos < qend));
        best = max(best, select(0u, logit_key(params.scale * z1), c.ok.y && pos + 1 < qend));
        best = max(best, select(0u, logit_key(params.scale * z2), c.ok.z && pos + 2 < qend));
        best = max(best, select(0u, logit_key(params.scale * z3), c.ok.w && pos + 3 < qend));
    }
    if (broken) {
        best = NAN_KEY;
    }
    if (hs < n_rows) {
        atomicMax(&red[hs], best);
    }
    workgroupBarrier();
    if (lid < n_rows) {
        let rr = r0 + lid;
        let o = ((t0 + rr / nh) * params.heads + h_off + rr % nh) * params.msb + s;
        if (ONCE == 1u) {
            out[o] = atomicLoad(&red[lid]);
        } else {
            out[o] = max(out[o], atomicLoad(&red[lid]));
        }
    }
}
