// psa_invert.wgsl — the KV-outer inversion (R13) on the device, and the work of the partials
// kernels built from it, for a device-resident selection (no host round trip).
//
// Flags. Entry (t, h, rank) of `selected` with a kept block s (R13: a real block with
// s * BS < hi_t, the first of its row's slots holding s) sets flag bit f(t, h, s) =
// h Tq msb + cu_b msb + s T_b + (t - cu_b), bit f % 32 of word f / 32, where b is t's sequence,
// cu_b its first query and T_b its query count. f is a bijection onto [0, Hkv Tq msb) whose order
// is (KV head, sequence, block, query): the R13 edge order. So the set bits before f (the
// exclusive prefix sum of the words' bit counts, psa_scan.wgsl, and the bits below f in its own
// word) number the entry's edge; a 1 per kept slot (t, h, rank), in slot order after the words,
// gives each kept slot its place in the combine's list of its row and row_ptr; the edge counts
// of each slot group (h, b, s) follow, which the scan counts as the work items of EPI edges they
// make, so that their prefix numbers the items. A group's count is kept in `gsub` words, query t
// adding to word t % gsub (the scan adds them up): in one word the adds of a group's queries
// (~256 of them in the bench's prefill) wait on each other; `mark` took 34-35 us on an H200
// that way, 21 us with 8 words, 14-17 us counting nothing. The same numbers as the host index, by
// construction, whatever order the invocations run in (R19: the bits and counts are set by
// atomicOr and atomicAdd, whose results do not depend on their order).
//
// Entry points, one dispatch each, in this order, with a prefix sum (psa_scan.wgsl: tiles, then
// totals) between `mark` and `scatter`:
//   mark        one invocation per slot (t, h, rank): checks it (R6: an id in [-1, msb), not
//               repeated in its row) and sets its flag bit, its kept mark and (generic and
//               tensor-core kernels) its slot group's count. A violation sets an error bit and
//               the offending entry is skipped, so nothing downstream reads outside a buffer.
//   scatter     one invocation per slot: a kept entry's edge fields (edges), its place in the
//               row's list (merge, with row_ptr), its edge record (plan); with DECODE = 1 its
//               work items (one per edge and head range) and page list for psa_partials_decode,
//               else, where the edge is the last of its work item (every EPI-th edge of its slot
//               group, and the group's last), that item's records and page list. The edge
//               fields are written only with EDGES (the index read back, R33; the attention
//               kernels read the rest). Invocation 0 also writes the partials kernel's indirect
//               dispatch size and params record (copied into its uniform buffer by the host's
//               command encoder).
//   direct      (DECODE = 1, attention only) one invocation per (row, slot), instead of the above:
//               when no sequence has two queries every slot group is one edge, so the partials
//               need no edge order: row r's kept entries, in rank order, take edge ids r K + n
//               (n = 0, 1, ...), each with its work items, edge record and page list; the row's
//               remaining ids get empty items (n_e = 0) and merge elements pointing at the empty
//               partial group `emax` (l = 0, never written). The combine (row_ptr = r K, fixed)
//               then merges exactly the row's edges in rank order, with empties only at its end,
//               which it skips: the same bits as with the inverted index.
// (Measured on an H200 with the bench's prefill, 16384 rows of 16 slots, each command timed on
// its own: with one invocation per row, a flag word per flag (16 MiB to clear and scan), the
// selection copied in and the items numbered by a second scan, the inversion's nine dispatches
// with its clears and copy took 0.20 ms of a layer; these four dispatches and their clears 0.08.
// Benchmarks, 2026-12-04.)
//
// Bindings (group 0)
//   0 params  uniform              InvParams (below)
//   1 sel     storage, read        i32 [Tq, Hkv, K]  the selection (-1 = empty slot)
//   2 lay     storage, read        i32: per query (b, hi) at 0, per sequence (cu_b, T_b) at
//                                  seq_off, block_tables [B, max_pages] at bt_off
//   3 work    storage, read_write  atomic<u32>: flag words [nfw] | kept marks [emax] (slot
//                                  (r, j) at r K + j) | slot group counts [Hkv B msb, gsub]
//                                  (zeroed by the host before `mark`)
//   4 scan    storage, read        u32: prefixes and tile sums of psa_scan.wgsl (offsets below)
//   5 edges   storage, read_write  u32 [6, emax]  edge_query, edge_head, edge_seq, edge_block,
//                                  edge_rank, edge_len (structure of arrays)
//   6 merge   storage, read_write  u32: row_ptr [Tq Hkv + 1] | row_edges [emax]  (psa_merge.wgsl's
//                                  plan for the combine: a row merges its edges in rank order)
//   7 plan    storage, read_write  u32: work items (8 u32) | edge records at erec_base (q row,
//                                  edge_len) | page lists at page_base (PPB entries per edge item)
//   8 args    storage, read_write  atomic<u32>: [0..3) indirect dispatch size, [4..12) the params
//                                  record of the partials kernel, [12] error bits, [13] INVALID minus
//                                  the first bad row (0: none)
//
// Error bits: 1 = a block id outside [-1, msb), 2 = a repeated block id in a row (R6).
//
// Override constants
//   WG      workgroup size        DECODE  1: items for psa_partials_decode (one edge each)
//   EDGES   1: scatter writes the edge fields (the index read back), 0: not (attention)
//   TILE    elements per scan tile (psa_scan.wgsl: 4 x its WG)

override WG: u32 = 64u;
override DECODE: u32 = 1u;
override EDGES: u32 = 1u;
override TILE: u32 = 1024u;
const INVALID: u32 = 0xffffffffu;

struct InvParams {
    tq: u32,          // queries
    hkv: u32,         // KV heads
    k: u32,           // slots per row of `selected`
    msb: u32,         // blocks per sequence
    bs: u32,          // block size
    ppb: u32,         // pages per block
    max_pages: u32,   // row stride of block_tables
    n_flags: u32,     // Hkv Tq msb flag bits
    g: u32,           // query heads per KV head
    nh: u32,          // head ranges per edge item
    hpi: u32,         // heads per item (the last range may hold fewer)
    epi: u32,         // edges per work item (generic kernel)
    erec_base: u32,   // edge records in plan
    page_base: u32,   // page lists in plan
    gx: u32,          // workgroups along x of the partials dispatch (fixed by the host)
    emax: u32,        // edge capacity: Tq Hkv K
    seq_off: u32,     // (cu_b, T_b) in lay
    bt_off: u32,      // block_tables in lay
    s1_dst: u32,      // prefixes of the flag words, kept marks and slot groups in scan
    s1_tiles: u32,    // their tile sums in scan
    s1_ntiles: u32,
    nfw: u32,         // words of flag bits: ceil(n_flags / 32); the kept marks follow them in work
    nseq: u32,        // sequences (B): slot group (h, b, s) is group (h B + b) msb + s
    gsub: u32,        // words per slot group count (>= 1; 1 with DECODE = 1, which counts none)
    _pad5: u32,
    grid_x: u32,      // workgroups along x of this dispatch (2-D grid)
    slab4: u32,       // params record of the partials kernel: slab stride in vec4s
    scale: u32,       // ... and softmax_scale (f32 bits)
    wg_cap: u32,      // workgroups of the partials dispatch at most (0: one per item)
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
}

@group(0) @binding(0) var<uniform> params: InvParams;
@group(0) @binding(1) var<storage, read> sel: array<i32>;
@group(0) @binding(2) var<storage, read> lay: array<i32>;
@group(0) @binding(3) var<storage, read_write> work: array<atomic<u32>>;
@group(0) @binding(4) var<storage, read> scan: array<u32>;
@group(0) @binding(5) var<storage, read_write> edges: array<u32>;
@group(0) @binding(6) var<storage, read_write> merge: array<u32>;
@group(0) @binding(7) var<storage, read_write> plan: array<u32>;
@group(0) @binding(8) var<storage, read_write> args: array<atomic<u32>>;

// exclusive prefix of element i of the scan (flag words' bits, then kept marks, then the slot
// groups' items)
fn prefix1(i: u32) -> u32 {
    return scan[params.s1_dst + i] + scan[params.s1_tiles + i / TILE];
}

// the edge id of flag bit f: the set bits before it (f may be n_flags: then the edge count)
fn edge_id(f: u32) -> u32 {
    let w = f >> 5u;
    let below = (1u << (f & 31u)) - 1u;  // (f % 32 = 0: none of word w, which may be a kept mark)
    return prefix1(w) + countOneBits(atomicLoad(&work[w]) & below);
}

fn num_edges() -> u32 {
    return prefix1(params.nfw);  // the flag words come first: the prefix after them is their bits
}

struct Query {
    b: u32,
    hi: i32,     // exclusive end of the positions the query sees (<= 0: none)
    cu: u32,     // first query of its sequence
    tb: u32,     // queries of its sequence
}

fn query(t: u32) -> Query {
    let b = u32(lay[2u * t]);
    let hi = lay[2u * t + 1u];
    return Query(b, hi, u32(lay[params.seq_off + 2u * b]), u32(lay[params.seq_off + 2u * b + 1u]));
}

// blocks a query may keep: s * BS < hi, i.e. s < ceil(hi / BS)
fn n_visible(hi: i32) -> u32 {
    if (hi <= 0) {
        return 0u;
    }
    return (u32(hi) + params.bs - 1u) / params.bs;
}

fn flag_index(t: u32, h: u32, s: u32, qi: Query) -> u32 {
    return h * params.tq * params.msb + qi.cu * params.msb + s * qi.tb + (t - qi.cu);
}

fn linear_id(wid: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * params.grid_x + wid.x) * WG + lid;
}

// an R6 violation in row `row`: the bit, and the first such row as INVALID - row in a max (the
// host zeroes both words before every run; 0 = none)
fn report(bit: u32, row: u32) {
    atomicOr(&args[12], bit);
    atomicMax(&args[13], INVALID - row);
}

// whether slot j of the row at `base` repeats the id `s` of an earlier slot (R6: the first stands)
fn repeated(base: u32, j: u32, s: i32) -> bool {
    var dup = false;
    for (var j2 = 0u; j2 < j; j2++) {
        if (sel[base + j2] == s) {
            dup = true;
        }
    }
    return dup;
}

// slot group (h, b, s): its index (its element of the scan is nfw + emax + it; its count's
// words in work start at nfw + emax + it gsub)
fn group_index(h: u32, b: u32, s: u32) -> u32 {
    return (h * params.nseq + b) * params.msb + s;
}

@compute @workgroup_size(WG)
fn mark(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = linear_id(wid, lid);  // one invocation per (row, slot)
    let r = x / params.k;
    if (r >= params.tq * params.hkv) {
        return;
    }
    let j = x - r * params.k;
    let base = r * params.k;
    let s = sel[base + j];
    if (s == -1) {
        return;
    }
    if (s < -1 || s >= i32(params.msb)) {
        report(1u, r);
        return;
    }
    if (repeated(base, j, s)) {
        report(2u, r);
        return;  // the first occurrence stands; the row is reported
    }
    let t = r / params.hkv;
    let h = r - t * params.hkv;
    let qi = query(t);
    if (u32(s) < n_visible(qi.hi)) {
        let f = flag_index(t, h, u32(s), qi);
        atomicOr(&work[f >> 5u], 1u << (f & 31u));
        atomicStore(&work[params.nfw + x], 1u);
        if (DECODE == 0u) {
            atomicAdd(&work[params.nfw + params.emax + group_index(h, qi.b, u32(s)) * params.gsub + t % params.gsub], 1u);
        }
    }
}

@compute @workgroup_size(WG)
fn scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = linear_id(wid, lid);  // one invocation per (row, slot)
    if (x == 0u) {
        write_args();
    }
    let n_rows = params.tq * params.hkv;
    let r = x / params.k;
    if (r >= n_rows) {
        return;
    }
    let j = x - r * params.k;
    let E = num_edges();
    let place = prefix1(params.nfw + x) - E;  // the kept slots before this one, of every row
    if (j == 0u) {
        merge[r] = place;  // row_ptr: the kept slots of the rows before
        if (r == n_rows - 1u) {
            merge[n_rows] = prefix1(params.nfw + n_rows * params.k) - E;
        }
    }
    if (atomicLoad(&work[params.nfw + x]) == 0u) {
        return;  // not kept: mark's checks (a valid id, visible, not repeated) left no mark
    }
    let s = sel[x];
    let t = r / params.hkv;
    let h = r - t * params.hkv;
    let qi = query(t);
    let f = flag_index(t, h, u32(s), qi);
    let e = edge_id(f);
    let len = min(params.bs, u32(qi.hi) - u32(s) * params.bs);
    if (EDGES == 1u) {
        let em = params.emax;
        edges[e] = t;
        edges[em + e] = h;
        edges[2u * em + e] = qi.b;
        edges[3u * em + e] = u32(s);
        edges[4u * em + e] = j;
        edges[5u * em + e] = len;
    }
    merge[n_rows + 1u + place] = e;  // its place in the row's list (rank order)
    plan[params.erec_base + 2u * e] = r;        // the q row of the edge: t Hkv + h
    plan[params.erec_base + 2u * e + 1u] = len;
    if (DECODE == 1u) {
        let pages = params.page_base + e * params.ppb;
        write_pages(pages, qi.b, u32(s), h);
        write_items(e, 1u, len, e, pages);
        return;
    }
    // the slot group's edges (its queries in order) make work items of EPI edges; the last edge
    // of an item writes it. Its max_len is this edge's len: hi_t does not decrease with t within
    // a sequence (R9: L_b, or min(L_b, L_b - T_b + i + 1)), and the item's other edges have
    // smaller t in the same block.
    let f0 = h * params.tq * params.msb + qi.cu * params.msb + u32(s) * qi.tb;
    let k = e - edge_id(f0);
    let pos = k % params.epi;
    if (pos + 1u == params.epi || e + 1u == edge_id(f0 + qi.tb)) {
        let gsec = params.nfw + params.emax;
        let item = prefix1(gsec + group_index(h, qi.b, u32(s))) - prefix1(gsec) + k / params.epi;
        let pages = params.page_base + item * params.ppb;
        write_pages(pages, qi.b, u32(s), h);
        write_items(item, pos + 1u, len, e - pos, pages);
    }
}

// page list of block s of sequence b for KV head h: slab p Hkv + h, or INVALID (unmapped)
fn write_pages(at: u32, b: u32, s: u32, h: u32) {
    let row = params.bt_off + b * params.max_pages + s * params.ppb;
    let j_end = params.ppb;
    for (var j = 0u; j < j_end; j++) {
        let p = lay[row + j];
        var slab = INVALID;
        if (p >= 0) {
            slab = u32(p) * params.hkv + h;
        }
        plan[at + j] = slab;
    }
}

// the NH work items (head ranges) of edge item `item`: n_e edges from edge e0
fn write_items(item: u32, n_e: u32, max_len: u32, e0: u32, pages: u32) {
    let hs_end = params.nh;
    for (var hs = 0u; hs < hs_end; hs++) {
        let g0 = hs * params.hpi;
        let ib = (item * params.nh + hs) * 8u;
        plan[ib] = max_len;
        plan[ib + 1u] = n_e;
        plan[ib + 2u] = g0;
        plan[ib + 3u] = min(params.hpi, params.g - g0);
        plan[ib + 4u] = params.erec_base + 2u * e0;
        plan[ib + 5u] = pages;
        plan[ib + 6u] = e0 * params.g + g0;
        plan[ib + 7u] = 0u;
    }
}

// whether slot j of the row at `base` is a kept edge: a valid id, visible (s < nvis). A repeated
// id counts at each of its slots: such a row breaks R6, which `direct` reports (the call then
// raises SpecError when its results reach the host, R31, so which of its slots count does not
// matter), and a row still keeps at most K edges, all inside its own ranges of the buffers.
// (A scan for repeats here made every invocation's loop over the row quadratic in K: 18-23 us
// of the decode layer on the H200.)
fn kept_at(base: u32, j: u32, nvis: u32) -> bool {
    let s = sel[base + j];
    return s >= 0 && s < i32(params.msb) && u32(s) < nvis;
}

@compute @workgroup_size(WG)
fn direct(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let x = linear_id(wid, lid);  // one invocation per (row, slot)
    let n_rows = params.tq * params.hkv;
    let r = x / params.k;
    let j = x - r * params.k;
    if (r >= n_rows) {
        return;
    }
    let base = r * params.k;
    if (j == 0u) {
        merge[r] = base;  // row_ptr = r K (rewritten here: an inverted index may have used the buffer)
        if (r == n_rows - 1u) {
            merge[n_rows] = n_rows * params.k;
        }
    }
    let t = r / params.hkv;
    let h = r - t * params.hkv;
    let qi = query(t);
    let nvis = n_visible(qi.hi);
    let s = sel[base + j];
    if (s < -1 || s >= i32(params.msb)) {
        report(1u, r);
    } else if (s >= 0) {
        let j2_end = j;
        for (var j2 = 0u; j2 < j2_end; j2++) {
            if (sel[base + j2] == s) {
                report(2u, r);
            }
        }
    }
    // n: kept slots before j (this one's place in the row's list); total: kept slots of the row
    var n = 0u;
    var total = 0u;
    let j2_end = params.k;
    for (var j2 = 0u; j2 < j2_end; j2++) {
        if (kept_at(base, j2, nvis)) {
            total += 1u;
            if (j2 < j) {
                n += 1u;
            }
        }
    }
    if (kept_at(base, j, nvis)) {
        let e = base + n;
        let len = min(params.bs, u32(qi.hi) - u32(s) * params.bs);
        plan[params.erec_base + 2u * e] = r;
        plan[params.erec_base + 2u * e + 1u] = len;
        let pages = params.page_base + e * params.ppb;
        write_pages(pages, qi.b, u32(s), h);
        write_items(e, 1u, len, e, pages);
        merge[n_rows + 1u + e] = e;
    }
    if (j >= total) {  // list position j is past the row's edges: an empty item, the empty group
        let e = base + j;
        let hs_end = params.nh;
        for (var hs = 0u; hs < hs_end; hs++) {
            plan[(e * params.nh + hs) * 8u + 1u] = 0u;  // n_e = 0: the workgroup returns at once
        }
        merge[n_rows + 1u + e] = params.emax;
    }
}

// the partials dispatch's size and params record, from the scan (scatter's invocation 0)
fn write_args() {
    var n_items = num_edges() * params.nh;
    if (DECODE == 0u) {
        // the grand total of the scan less its prefix before the slot groups: their items
        n_items = (scan[params.s1_tiles + params.s1_ntiles] - prefix1(params.nfw + params.emax)) * params.nh;
    }
    // workgroups: one per item, or at most wg_cap for a kernel whose workgroups loop over items;
    // the grid no wider than they (a dispatch of gx x rows launches every workgroup of the grid)
    var wgs = n_items;
    if (params.wg_cap != 0u) {
        wgs = min(wgs, params.wg_cap);
    }
    let gx = max(min(params.gx, wgs), 1u);
    atomicStore(&args[0], gx);
    atomicStore(&args[1], (wgs + gx - 1u) / gx);
    atomicStore(&args[2], 1u);
    atomicStore(&args[3], 0u);
    atomicStore(&args[4], 0u);          // item_base
    atomicStore(&args[5], n_items);     // n_items
    atomicStore(&args[6], gx);          // grid_x
    atomicStore(&args[7], params.g);    // group
    atomicStore(&args[8], params.slab4);
    atomicStore(&args[9], params.scale);
    atomicStore(&args[10], 0u);
    atomicStore(&args[11], 0u);
}
