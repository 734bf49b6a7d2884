// psa_select_topk.wgsl — exp-free top-k of the index branch (R24): one workgroup per row (t, h).
//
// Ranking uses integers only. Every score (float32 bits, uploaded as u32) gets a rank key:
// 0 for NaN (a bit test), -inf and the row's local block (never candidates), else the
// order-preserving u32 of the float with -0 canonicalised to +0. A candidate's composite value is
// (key, msb - 1 - id): larger is better, and two candidates never compare equal, so "descending
// score, ties to the lower id" is a strict total order that any algorithm reproduces exactly.
//
// Two entry points, one per kind of row (the host picks by msb; RANK_MAX = 4 WG):
//   main       rows of more than RANK_MAX scores: steps 1-4 below;
//   rank_rows  rows of at most RANK_MAX scores: ranked by counting (below).
//
// Per row, with n = min(slots left after the local block, candidates):
//   1. count the candidates;
//   2. if n < count: radix-select the n-th best composite, 8 bits at a time (4 passes over the
//      key, lo_passes over the id part), histograms in workgroup memory (atomic counts are
//      order-independent, so the result is deterministic, R19);
//      the chosen set is then {composite >= threshold}, exactly n candidates;
//   3. the rank of a chosen candidate = the number of candidates better than it (all of them
//      chosen): counted within workgroup memory when n <= CAP (compacted there), else by a scan
//      of the row; the candidate is written to slot (local ? 1 : 0) + rank;
//   4. slot 0 = the local block (if any), slots past the chosen ones = -1.
//
// Short rows (rank_rows) skip 2 and 3: every candidate counts the candidates better than it; a
// rank below n is its slot. Same order, same result, bit for bit; one pass over the row and a
// few barriers instead of 4 + lo_passes radix passes of 4 barriers each (the decode layer's
// 256-block rows: 25-28 us of top-k on the H200, nearly all of it barriers). Lane l holds ids l,
// l + WG, l + 2 WG, l + 3 WG. When n <= WG only a short list is counted: T = the n-th best of
// the lanes' best candidates bounds the n-th best of the row from below (n distinct lanes hold a
// candidate >= T), so the row's best n are among the candidates >= T, at most 4 n of them (only
// n lanes have a best >= T), and a candidate of the best n has the same rank in that list as in
// the row (prefill rows of 256 blocks on an H200: 315 -> 277 us for 16384 rows; and 89 us with
// rank_rows' smaller workgroup memory). Else each candidate counts over the row's keys.
//
// Bindings (group 0)
//   0 params  uniform              Params (below; one record per dispatch)
//   1 scores  storage, read        u32 [n_rows, msb]  float32 bits of the batch's block scores;
//                                  row = t_local * Hkv + h
//   2 local   storage, read        i32 [n_q]  local block of each of the batch's queries, -1 = none
//   3 out     storage, read_write  i32 [n_rows, k_out]  k_out = min(topk, msb) slots per row (the
//                                  host pads the rest of topk with -1)
//
// Override constants
//   WG   workgroup size
//   CAP  chosen candidates ranked in workgroup memory (8 bytes each; rank_rows: 4 WG)
//   KEYS 1: `scores` holds the u32 keys of psa_block_scores.wgsl instead of float32 bits (a
//        device-resident MSA layer feeds the block scores straight in; key_bits decodes them)
//   BOUND 1: rank_rows counts only the list of candidates >= T (above) when n <= WG; 0: always
//        over the whole row. The list pays where rows are many (prefill, 16384 rows on an H200:
//        89.9 against 265.7 us) and costs where they are one wave (decode, 128 rows: 19.4
//        against 16.5 us); the host chooses by the dispatch's row count. Same result either way.

override WG: u32 = 64u;
override CAP: u32 = 1024u;
override KEYS: u32 = 0u;  // 1: `scores` holds psa_block_scores.wgsl keys (the device-resident layer)
override BOUND: u32 = 1u;  // 1: short rows ranked within the list of candidates >= T
const INVALID_ID: u32 = 0xffffffffu;  // no local block

struct Params {
    row_base: u32,   // first row of this dispatch
    n_rows: u32,     // rows in this dispatch
    grid_x: u32,     // workgroups along x (the grid is 2-D: row = y * grid_x + x)
    msb: u32,        // scores per row
    k_out: u32,      // slots written per row
    heads: u32,      // Hkv: row r belongs to query r / Hkv
    lo_passes: u32,  // 8-bit radix passes over the id part: ceil(bit_length(msb - 1) / 8)
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> scores: array<u32>;
@group(0) @binding(2) var<storage, read> local_block: array<i32>;
@group(0) @binding(3) var<storage, read_write> out: array<i32>;

var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> grp: array<u32, 64>;  // sums of 4 consecutive bins
var<workgroup> n_cand: atomic<u32>;
var<workgroup> n_fill: atomic<u32>;
var<workgroup> bcast_cnt: u32;
var<workgroup> bcast_digit: u32;
var<workgroup> rem: u32;  // rank still to find within the current prefix (thread 0 only)
var<workgroup> c_key: array<u32, CAP>;
var<workgroup> c_id: array<u32, CAP>;
var<workgroup> lane_key: array<u32, WG>;  // short rows: each lane's best candidate (key, id)
var<workgroup> lane_id: array<u32, WG>;
var<workgroup> t_key: u32;                // and the n-th best of them (key 0: no bound)
var<workgroup> t_id: u32;

// float32 bits of a block-score key of psa_block_scores.wgsl (KEYS = 1): 0 = nothing visible
// (-inf), 0xffffffff = NaN, else the inverse of its order-preserving map
fn key_bits(k: u32) -> u32 {
    if (k == 0u) {
        return 0xff800000u;
    }
    if (k == 0xffffffffu) {
        return 0x7fc00000u;
    }
    return select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u);
}

// Rank key of a float32 score (bits, or a block-score key when KEYS = 1): 0 = never a
// candidate (NaN, -inf).
fn score_key(raw: u32) -> u32 {
    var b = raw;
    if (KEYS == 1u) {
        b = key_bits(raw);
    }
    let mag = b & 0x7fffffffu;
    if (mag > 0x7f800000u || b == 0xff800000u) {
        return 0u;
    }
    if (mag == 0u) {
        return 0x80000000u;  // -0 == +0
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

// A row of this dispatch (workgroup wi): where its scores and slots are, its local block.
struct Row {
    base: u32,       // its first score
    obase: u32,      // its first slot
    msb: u32,
    local: i32,      // its local block, -1 = none
    has_local: bool,
    lb: u32,         // the same as an id (INVALID_ID = none)
    slot0: u32,      // 1 when slot 0 holds the local block
    kk: u32,         // slots for candidates
}

// the key of block j of row rw; 0 (never a candidate) for the local block, ranked apart
fn block_key(rw: Row, j: u32) -> u32 {
    return select(score_key(scores[rw.base + j]), 0u, j == rw.lb);
}

fn row_of(wi: u32) -> Row {
    let row = params.row_base + wi;
    let local = local_block[row / params.heads];
    let slot0 = select(0u, 1u, local >= 0);
    return Row(row * params.msb, row * params.k_out, params.msb, local, local >= 0,
               select(INVALID_ID, u32(local), local >= 0), slot0, params.k_out - slot0);
}

// the counters every row starts from (zeroed by one invocation; a barrier follows)
fn clear_counters(lid: u32) {
    if (lid == 0u) {
        atomicStore(&n_cand, 0u);
        atomicStore(&n_fill, 0u);
        t_key = 0u;
        t_id = 0u;
    }
}

// Step 4 of a row with n chosen candidates in slots slot0 .. slot0 + n - 1: the local block to
// slot 0 (when the row has one) and -1 to every slot after the chosen ones.
fn finish_row(lid: u32, rw: Row, n: u32) {
    if (rw.has_local && lid == 0u) {
        out[rw.obase] = rw.local;
    }
    let pad0 = rw.slot0 + n;  // the row's first padding slot
    let x_n = (params.k_out - min(pad0, params.k_out) + WG - 1u) / WG;
    for (var x_i = 0u; x_i < x_n; x_i++) {
        let x = pad0 + lid + x_i * WG;
        if (x >= params.k_out) {
            break;
        }
        out[rw.obase + x] = -1;
    }
}

// Rows of more than RANK_MAX scores (RANK_MAX = 4 WG): steps 1-4 of the header.
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let wi = wid.y * params.grid_x + wid.x;
    if (wi >= params.n_rows) {
        return;
    }
    clear_counters(lid);
    workgroupBarrier();
    radix_row(lid, row_of(wi));
}

// Rows of at most RANK_MAX scores, ranked by counting. A pipeline of this entry point takes
// CAP = 4 WG and none of the radix select's workgroup memory, so more workgroups fit on a
// multiprocessor than with `main`'s CAP.
@compute @workgroup_size(WG)
fn rank_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let wi = wid.y * params.grid_x + wid.x;
    if (wi >= params.n_rows) {
        return;
    }
    clear_counters(lid);
    workgroupBarrier();
    rank_row(lid, row_of(wi));
}

fn radix_row(lid: u32, rw: Row) {

    // 1. candidates
    var mine = 0u;
    let j_n = (rw.msb + WG - 1u) / WG;
    for (var j_i = 0u; j_i < j_n; j_i++) {
        let j = lid + j_i * WG;
        if (j >= rw.msb) {
            break;
        }
        if (block_key(rw, j) != 0u) {
            mine += 1u;
        }
    }
    atomicAdd(&n_cand, mine);
    workgroupBarrier();
    if (lid == 0u) {
        bcast_cnt = atomicLoad(&n_cand);
    }
    let cnt = workgroupUniformLoad(&bcast_cnt);
    let n = min(rw.kk, cnt);

    // 2. threshold: the n-th best composite (hi = key, lo = msb - 1 - id)
    var phi = 0u;
    var plo = 0u;
    if (n > 0u && n < cnt) {
        var mhi = 0u;
        var mlo = 0u;
        if (lid == 0u) {
            rem = n;
        }
        let npass = 4u + params.lo_passes;
        for (var ps = 0u; ps < npass; ps++) {
            let b_n = (256u + WG - 1u) / WG;
            for (var b_i = 0u; b_i < b_n; b_i++) {
                let b = lid + b_i * WG;
                if (b >= 256u) {
                    break;
                }
                atomicStore(&hist[b], 0u);
            }
            workgroupBarrier();
            let is_hi = ps < 4u;
            var shift = 0u;
            if (is_hi) {
                shift = 24u - 8u * ps;
            } else {
                shift = 8u * (params.lo_passes - 1u - (ps - 4u));
            }
            let j_n2 = (rw.msb + WG - 1u) / WG;
            for (var j_i = 0u; j_i < j_n2; j_i++) {
                let j = lid + j_i * WG;
                if (j >= rw.msb) {
                    break;
                }
                let key = block_key(rw, j);
                let lo = rw.msb - 1u - j;
                if (key != 0u && (key & mhi) == phi && (lo & mlo) == plo) {
                    let dg = select((lo >> shift) & 255u, (key >> shift) & 255u, is_hi);
                    atomicAdd(&hist[dg], 1u);
                }
            }
            workgroupBarrier();
            let g_n = (64u + WG - 1u) / WG;
            for (var g_i = 0u; g_i < g_n; g_i++) {
                let g = lid + g_i * WG;
                if (g >= 64u) {
                    break;
                }
                grp[g] = atomicLoad(&hist[4u * g]) + atomicLoad(&hist[4u * g + 1u])
                       + atomicLoad(&hist[4u * g + 2u]) + atomicLoad(&hist[4u * g + 3u]);
            }
            workgroupBarrier();
            if (lid == 0u) {
                // walk the bins from the top until the rank `rem` is reached
                var cum = 0u;
                var gsel = 0u;
                for (var gi = 0u; gi < 64u; gi++) {
                    let g = 63u - gi;
                    if (cum + grp[g] >= rem) {
                        gsel = g;
                        break;
                    }
                    cum += grp[g];
                }
                var dsel = 4u * gsel;
                for (var bi = 0u; bi < 4u; bi++) {
                    let b = 4u * gsel + 3u - bi;
                    let c = atomicLoad(&hist[b]);
                    if (cum + c >= rem) {
                        dsel = b;
                        break;
                    }
                    cum += c;
                }
                rem = rem - cum;
                bcast_digit = dsel;
            }
            let d = workgroupUniformLoad(&bcast_digit);
            if (is_hi) {
                phi |= d << shift;
                mhi |= 255u << shift;
            } else {
                plo |= d << shift;
                mlo |= 255u << shift;
            }
        }
    }

    // 3. rank the chosen candidates: composite >= (phi, plo)
    if (n > 0u && n <= CAP) {
        let j_n3 = (rw.msb + WG - 1u) / WG;
        for (var j_i = 0u; j_i < j_n3; j_i++) {
            let j = lid + j_i * WG;
            if (j >= rw.msb) {
                break;
            }
            let key = block_key(rw, j);
            let lo = rw.msb - 1u - j;
            if (key != 0u && (key > phi || (key == phi && lo >= plo))) {
                let x = atomicAdd(&n_fill, 1u);  // fill order is free: the rank below is not
                c_key[x] = key;
                c_id[x] = j;
            }
        }
        workgroupBarrier();
        let x_n = (n + WG - 1u) / WG;
        for (var x_i = 0u; x_i < x_n; x_i++) {
            let x = lid + x_i * WG;
            if (x >= n) {
                break;
            }
            let ki = c_key[x];
            let ii = c_id[x];
            var rank = 0u;
            for (var m = 0u; m < n; m++) {
                let km = c_key[m];
                if (km > ki || (km == ki && c_id[m] < ii)) {
                    rank += 1u;
                }
            }
            out[rw.obase + rw.slot0 + rank] = i32(ii);
        }
    } else if (n > CAP) {
        let j_n4 = (rw.msb + WG - 1u) / WG;
        for (var j_i = 0u; j_i < j_n4; j_i++) {
            let j = lid + j_i * WG;
            if (j >= rw.msb) {
                break;
            }
            let key = block_key(rw, j);
            let lo = rw.msb - 1u - j;
            if (key != 0u && (key > phi || (key == phi && lo >= plo))) {
                var rank = 0u;
                let m_end = rw.msb;
                for (var m = 0u; m < m_end; m++) {
                    let km = block_key(rw, m);
                    if (km > key || (km == key && m < j)) {
                        rank += 1u;
                    }
                }
                out[rw.obase + rw.slot0 + rank] = i32(j);
            }
        }
    }

    finish_row(lid, rw, n);  // 4.
}

// A short row (msb <= CAP <= 4 WG: the host's RANK_MAX): lane l holds the keys of ids l, l + WG,
// l + 2 WG, l + 3 WG (four ids per loop step, so the reads overlap); a candidate's rank is the
// number of candidates better than it, among the list of candidates >= T when n <= WG and the
// list's at most 4 n entries fit in c_key / c_id (see the header), else among the whole row's
// keys there; a rank below n = min(kk, candidates) is the candidate's slot.
fn rank_row(lid: u32, rw: Row) {
    let jv = vec4<u32>(lid, lid + WG, lid + 2u * WG, lid + 3u * WG);
    var kv = vec4<u32>(0u);  // keys of ids jv (0 past msb: never a candidate)
    var bk = 0u;             // this lane's best candidate (ids ascend: a tie keeps the first)
    var bj = 0u;
    for (var i = 0u; i < 4u; i++) {
        if (jv[i] < rw.msb) {
            let key = block_key(rw, jv[i]);
            kv[i] = key;
            if (key > bk) {
                bk = key;
                bj = jv[i];
            }
        }
    }
    lane_key[lid] = bk;
    lane_id[lid] = bj;
    let mine = dot(select(vec4<u32>(0u), vec4<u32>(1u), kv != vec4<u32>(0u)), vec4<u32>(1u));
    atomicAdd(&n_cand, mine);
    workgroupBarrier();
    if (lid == 0u) {
        bcast_cnt = atomicLoad(&n_cand);
    }
    let n = min(rw.kk, workgroupUniformLoad(&bcast_cnt));
    var rank = vec4<u32>(0u);
    if (BOUND == 1u && n > 0u && n <= WG && 4u * n <= CAP) {  // (uniform)
        // T: the lane best of rank n - 1 among the lane bests (none when fewer lanes have one)
        if (bk != 0u) {
            var r = 0u;
            for (var m = 0u; m < WG; m++) {
                let km = lane_key[m];
                r += select(0u, 1u, km > bk || (km == bk && lane_id[m] < bj));
            }
            if (r == n - 1u) {
                t_key = bk;
                t_id = bj;
            }
        }
        workgroupBarrier();
        let tk = t_key;
        let tj = t_id;
        for (var i = 0u; i < 4u; i++) {
            if (kv[i] != 0u && (kv[i] > tk || (kv[i] == tk && jv[i] <= tj))) {
                let x = atomicAdd(&n_fill, 1u);  // list order is free: the rank below is not
                c_key[x] = kv[i];
                c_id[x] = jv[i];
            }
        }
        workgroupBarrier();
        let c = atomicLoad(&n_fill);
        let x_n = (c + WG - 1u) / WG;
        for (var x_i = 0u; x_i < x_n; x_i++) {
            let x = lid + x_i * WG;
            if (x >= c) {
                break;
            }
            let ki = c_key[x];
            let ii = c_id[x];
            var r = 0u;
            for (var m = 0u; m < c; m++) {
                let km = c_key[m];
                r += select(0u, 1u, km > ki || (km == ki && c_id[m] < ii));
            }
            if (r < n) {
                out[rw.obase + rw.slot0 + r] = i32(ii);
            }
        }
    } else {
        for (var i = 0u; i < 4u; i++) {
            if (jv[i] < rw.msb) {
                c_key[jv[i]] = kv[i];
            }
        }
        workgroupBarrier();
        let m4 = rw.msb & ~3u;
        let m_n = (m4 + 3u) / 4u;
        for (var m_i = 0u; m_i < m_n; m_i++) {
            let m = m_i * 4u;
            let k0 = vec4<u32>(c_key[m]);
            let k1 = vec4<u32>(c_key[m + 1u]);
            let k2 = vec4<u32>(c_key[m + 2u]);
            let k3 = vec4<u32>(c_key[m + 3u]);
            rank += select(vec4<u32>(0u), vec4<u32>(1u), (k0 > kv) | ((k0 == kv) & (vec4<u32>(m) < jv)));
            rank += select(vec4<u32>(0u), vec4<u32>(1u), (k1 > kv) | ((k1 == kv) & (vec4<u32>(m + 1u) < jv)));
            rank += select(vec4<u32>(0u), vec4<u32>(1u), (k2 > kv) | ((k2 == kv) & (vec4<u32>(m + 2u) < jv)));
            rank += select(vec4<u32>(0u), vec4<u32>(1u), (k3 > kv) | ((k3 == kv) & (vec4<u32>(m + 3u) < jv)));
        }
        let m_end = rw.msb;
        for (var m = m4; m < m_end; m++) {
            let km = vec4<u32>(c_key[m]);
            rank += select(vec4<u32>(0u), vec4<u32>(1u), (km > kv) | ((km == kv) & (vec4<u32>(m) < jv)));
        }
        for (var i = 0u; i < 4u; i++) {
            if (kv[i] != 0u && rank[i] < n) {
                out[rw.obase + rw.slot0 + rank[i]] = i32(jv[i]);
            }
        }
    }
    finish_row(lid, rw, n);
}
