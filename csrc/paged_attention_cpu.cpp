// CPU kernel of tree attention over a paged KV cache (torch.ops.specdec_native.paged_tree_attention),
// and over a dense one read as a pool (tree_attention).
//
// The algorithm of tree_attention's Triton kernel (specdec_kernels.ops.tree_attention), on the CPU: for each
// (sequence b, KV head h), the G * N query rows (node i, query head
// h * G + g, row r = i * G + g; GQA: the G heads of a KV head share every K/V row read from memory) walk the
// keys they see in chunks of CHUNK keys with an online softmax (flash attention, Dao et al. 2022;
// fp32 scores and accumulators).  Row i sees the prefix, slots 0 .. cache_seqlens[b] - 1, then the
// tree slots cache_seqlens[b] + j with tree_mask[i, j] (the causal chain j <= i when there is no
// mask; N = 1 is plain decoding), in slot order:
//
//   1. the whole chunks of the prefix, slots 0 .. P - 1 (P: cache_seqlens[b] rounded down to a
//      multiple of CHUNK), for all rows at once;
//   2. the rest of each node's list, row group by row group (the G heads of node i): the prefix
//      slots P .. cache_seqlens[b] - 1, then the node's visible tree slots, in chunks of CHUNK of
//      that list.  A node never touches a slot it cannot see.
//
// So the chunks a row's softmax walks are the CHUNK-aligned pieces of its own list of visible keys,
// and each row's arithmetic is the same whichever rows share its call (row blocks only share loads):
// a row's output is bit-identical whether it is computed alone, with its ancestors as part of the
// prefix (N = 1, decoding), or inside a pass of any N, chain or tree, and whatever the other
// sequences of the batch hold (tests/ops/tree_attention/test_row_independence.py).
//
// The list is also cut at positions SPLIT, 2 SPLIT, ... (SPLIT = 64 keys, a constant): each split
// runs its own online softmax from nothing, and a row's output combines its splits' states in
// split order (flash-decoding, Dao et al. 2023, with a fixed split size instead of a split count).
// The unit of work is (sequence, KV heads, split): the splits of one sequence, even of one
// decoding step, run on all the threads, and a row's bits depend on neither the threads nor the
// cut of the items among them (tests/ops/tree_attention/test_paged_native.py).  A list of at
// most SPLIT keys gives exactly the bits of one online softmax.
//
// K/V rows are read through the block table in place (logical slot s of sequence b is slot
// s % block_size of block block_table[b, s / block_size]): nothing is gathered.  fp16 / bf16
// rows, and rows whose head-dim stride is not 1, are converted to fp32 as they are loaded, one
// chunk at a time.  q, k and v are read through their strides: views and expanded (stride-0)
// inputs, e.g. one prefix cache shared by the batch, cost no copy.
//
// Bounds, whatever the caller passes: cache_seqlens is clamped into [0, capacity - N] (capacity =
// max_blocks_per_seq * block_size), as the reference does, so every table entry read lies inside
// the table's first ceil((cache_seqlens + N) / block_size) columns; block ids are clamped into
// [0, num_blocks), as the Triton kernel and the reference do, so no id reads outside the pools.
//
// Non-finite keys or values reach exactly the queries that see their slot, as in the reference:
// a visible key row that is not finite makes the row's score non-finite (flagged, the row's
// output is NaN); a visible value row that is not finite makes the accumulator non-finite
// (p * inf and p * NaN are never finite, even for p = 0, and rescaling keeps them so), and a row
// whose accumulator is not finite outputs NaN.  Invisible slots are never multiplied at all.
#include "common.h"
#include "cpu_kernels.h"
#include "vec8.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace specdec {
namespace {

constexpr int64_t CHUNK = 32;  // key slots per online-softmax step (K and V rows stay in L1)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The sum of x's lanes as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): the order of
// sum8x8's lanes, so that a score is the same number whether its key was in a group of 8.
SPECDEC_INLINE float hsum8(v8sf x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

// SHUFFLE8(a, b, i0, ..., i7): lane k = lane ik of the 16 lanes of a then b.  clang and GCC >= 12
// have __builtin_shufflevector (constant indices); older GCC only __builtin_shuffle (a mask).
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SPECDEC_SHUFFLEVECTOR 1
#endif
#endif
#ifdef SPECDEC_SHUFFLEVECTOR
#define SHUFFLE8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define SHUFFLE8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, v8si{i0, i1, i2, i3, i4, i5, i6, i7})
#endif

// The lane sums of 8 vectors at once, lane j = hsum8(c[j]) (same order), by three rounds of
// pairwise shuffles and adds instead of 8 horizontal sums.
SPECDEC_INLINE v8sf sum8x8(const v8sf* c) {
  v8sf a[4], b[2];
  for (int j = 0; j < 4; ++j) {  // lanes 2i, 2i + 1: x_2i + x_2i+1 of c[2j], c[2j + 1]
    const v8sf x = c[2 * j], y = c[2 * j + 1];
    a[j] = SHUFFLE8(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE8(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int j = 0; j < 2; ++j) {  // (x0 + x1) + (x2 + x3) of c[4j .. 4j + 3], then (x4 + x5) + (x6 + x7)
    const v8sf x = a[2 * j], y = a[2 * j + 1];
    b[j] = SHUFFLE8(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE8(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return SHUFFLE8(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE8(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Runs Rows::run<RB>(r0, args...) over R rows: blocks of RB = 4 rows, then one block of the
// 1 to 3 rows left (RB is a template argument so that each block keeps its rows in registers).
template <typename Rows, typename... Args>
SPECDEC_INLINE void in_row_blocks(int64_t R, Args... args) {
  int64_t r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) Rows::template run<4>(r0, args...);
  switch (R - r0) {
    case 3: Rows::template run<3>(r0, args...); break;
    case 2: Rows::template run<2>(r0, args...); break;
    case 1: Rows::template run<1>(r0, args...); break;
    default: break;
  }
}

// acc[r] += sum_t probs[r * T + t] v_t for RB rows r0 .. r0 + RB - 1 at once (each value row
// loaded once per RB rows), every slot visible.
struct PvRows {
  template <int RB>
  static SPECDEC_INLINE void run(int64_t r0, const float* probs, int64_t D, const float* const* vp, int64_t T,
                                 float* acc) {
    for (int64_t d = 0; d < D; d += 16) {
      v8sf a0[RB], a1[RB];
      for (int e = 0; e < RB; ++e) {
        a0[e] = load8(acc + (r0 + e) * D + d);
        a1[e] = load8(acc + (r0 + e) * D + d + 8);
      }
      for (int64_t t = 0; t < T; ++t) {
        const v8sf v0 = load8(vp[t] + d), v1 = load8(vp[t] + d + 8);
        for (int e = 0; e < RB; ++e) {
          const float p = probs[(r0 + e) * T + t];
          a0[e] += p * v0;
          a1[e] += p * v1;
        }
      }
      for (int e = 0; e < RB; ++e) {
        store8(acc + (r0 + e) * D + d, a0[e]);
        store8(acc + (r0 + e) * D + d + 8, a1[e]);
      }
    }
  }
};

// scores[t] = q . k_t over T keys (D a multiple of 8): groups of 8 keys share each load of q
// and are summed across lanes together (sum8x8); every key's score is the same arithmetic
// (lane-wise products and sums over d, then hsum8's order) in a group or in the tail.
SPECDEC_INLINE void dot_row(const float* q, int64_t D, const float* const* kp, int64_t T, float* scores) {
  int64_t t = 0;
  for (; t + 8 <= T; t += 8) {
    v8sf c[8];
    for (int j = 0; j < 8; ++j) c[j] = v8sf{0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < D; d += 8) {
      const v8sf qd = load8(q + d);
      for (int j = 0; j < 8; ++j) c[j] += qd * load8(kp[t + j] + d);
    }
    store8(scores + t, sum8x8(c));
  }
  for (; t < T; ++t) {
    v8sf c = v8sf{0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < D; d += 8) c += load8(q + d) * load8(kp[t] + d);
    scores[t] = hsum8(c);
  }
}

// One online-softmax step of R query rows (q: R x D fp32, already times sm_scale) over T key
// slots that every row sees (row pointers kp[t], vp[t] into fp32 data).  m, l, acc (R x D): the
// running maximum, sum and output of each row; bad: rows that saw a non-finite key.  scores:
// R x T floats of scratch (the scores, then the weights).  Each row's arithmetic depends on its
// own q, the T keys and values and its state only: the same for any R (blocks of rows share
// loads, not sums).
// Built twice, picked at load time (SPECDEC_TARGET_CLONES): for FMA, which implies AVX (256-bit
// float vectors), and for the baseline.
SPECDEC_TARGET_CLONES("fma")
void attend_chunk(const float* q, int64_t R, int64_t D, const float* const* kp, const float* const* vp, int64_t T,
                  float* m, float* l, uint8_t* bad, float* acc, float* scores) {
  for (int64_t r = 0; r < R; ++r) dot_row(q + r * D, D, kp, T, scores + r * T);
  // per row: running maximum, rescale, probabilities (in place of the scores)
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores + r * T;
    float mc = NEG_INF;
    for (int64_t t = 0; t < T; ++t) {
      float s = sr[t];
      if (!std::isfinite(s)) {  // a non-finite key (or query): this row's output is NaN
        bad[r] = 1;
        s = NEG_INF;
      }
      sr[t] = s;
      mc = s > mc ? s : mc;
    }
    const float m_new = mc > m[r] ? mc : m[r];
    if (m_new != m[r]) {  // m_new > m[r] >= -inf
      const float alpha = m[r] == NEG_INF ? 0.0f : std::exp(m[r] - m_new);
      float* ar = acc + r * D;
      for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
      l[r] *= alpha;
      m[r] = m_new;
    }
    if (m_new == NEG_INF) {  // nothing finite so far: zero weights
      for (int64_t t = 0; t < T; ++t) sr[t] = 0.0f;
      continue;
    }
    int64_t t = 0;
    v8sf sum8 = v8sf{0, 0, 0, 0, 0, 0, 0, 0};
    for (; t + 8 <= T; t += 8) {
      const v8sf p = exp8_nonpos(load8(sr + t) - m_new);
      sum8 += p;
      store8(sr + t, p);
    }
    float sum = hsum8(sum8);
    if (t < T) {
      float tail[8];
      for (int e = 0; e < 8; ++e) tail[e] = t + e < T ? sr[t + e] - m_new : NEG_INF;
      const v8sf p = exp8_nonpos(load8(tail));
      for (int e = 0; t + e < T; ++e) {
        sr[t + e] = p[e];
        sum += p[e];
      }
    }
    l[r] += sum;
  }
  // weighted values, rows blocked by 4
  in_row_blocks<PvRows>(R, static_cast<const float*>(scores), D, vp, T, acc);
}

// The KV heads one item walks (see below): all of a sequence's when there are enough sequences
// for the threads, else one (more items).  Only the speed depends on it, never a row's bits.
inline int64_t heads_per_task(int64_t B, int64_t Hkv, int64_t threads) { return B >= threads ? Hkv : 1; }

// The splits of the keys (flash-decoding, Dao et al. 2023, with a fixed split size): a row's list
// of visible keys is cut at list positions SPLIT, 2 SPLIT, ...; each piece gets an online softmax
// of its own (its running maximum, sum and output, from nothing), and the pieces are combined in
// order at the end.  SPLIT is a constant (a multiple of CHUNK), so the pieces, and a row's bits,
// never depend on the threads, on N or on the other rows, while the pieces of one long sequence
// can run on different threads.
constexpr int64_t SPLIT = 2 * CHUNK;

// The kernel over items [i0, i1) of `a` (each writes its own states, nothing else).
template <typename scalar_t>
void attention_items(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
                     bool nhd, double sm_scale, AttentionSplits& a, int64_t i0, int64_t i1, int64_t offset = 0) {
  const int64_t N = a.N, D = a.D, G = a.G, R = a.R, HG = a.HG, groups = a.groups;
  const int64_t num_blocks = k_cache.size(0);
  const int64_t block_size = nhd ? k_cache.size(1) : k_cache.size(2);
  // pool strides (block, slot, head, head dim) and q's: every tensor is read in place, whatever
  // its strides (an expanded, stride-0 dimension included)
  const int64_t ksb = k_cache.stride(0), kss = nhd ? k_cache.stride(1) : k_cache.stride(2),
                ksh = nhd ? k_cache.stride(2) : k_cache.stride(1), ksd = k_cache.stride(3);
  const int64_t vsb = v_cache.stride(0), vss = nhd ? v_cache.stride(1) : v_cache.stride(2),
                vsh = nhd ? v_cache.stride(2) : v_cache.stride(1), vsd = v_cache.stride(3);
  const int64_t qsb = q.stride(0), qsn = q.stride(1), qsh = q.stride(2), qsd = q.stride(3);
  const int64_t max_blocks = table.size(1);
  // fp32 rows of adjacent elements are used in place; others are converted into a buffer
  const bool convert = !std::is_same<scalar_t, float>::value || ksd != 1 || vsd != 1;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kbase = k_cache.data_ptr<scalar_t>() + offset;  // another layer of a stacked cache
  const scalar_t* vbase = v_cache.data_ptr<scalar_t>() + offset;
  const int32_t* tbl = table.data_ptr<int32_t>();
  const float scale = static_cast<float>(sm_scale);
  if (i0 >= i1) return;

  std::vector<float> qbuf(HG * R * D), scores(R * CHUNK);
  // rows of the prefix chunks (kp, vp), of the slots after them (tk, tv: fewer than CHUNK + N),
  // and one node's list of visible ones among those (nk, nv); fp16/bf16 rows converted into *conv
  const int64_t tail_max = CHUNK + N;
  std::vector<float> kconv(convert ? CHUNK * D : 0), vconv(convert ? CHUNK * D : 0);
  std::vector<float> tkconv(convert ? tail_max * D : 0), tvconv(convert ? tail_max * D : 0);
  std::vector<const float*> kp(CHUNK), vp(CHUNK), tk(tail_max), tv(tail_max), nk(tail_max), nv(tail_max);
  int64_t b = static_cast<int64_t>(std::upper_bound(a.item0.begin(), a.item0.end(), i0) - a.item0.begin()) - 1;
  int64_t q_for = -1;  // the (b, group) whose rows qbuf holds
  for (int64_t item = i0; item < i1; ++item) {
    while (item >= a.item0[b + 1]) ++b;
    const int64_t ns = a.splits[b], group = (item - a.item0[b]) / ns, s = (item - a.item0[b]) % ns;
    const int64_t h0 = group * HG, len = a.len[b];
    const int32_t* row_table = tbl + b * max_blocks;
    if (q_for != b * groups + group) {
      q_for = b * groups + group;
      for (int64_t lh = 0; lh < HG; ++lh)
        for (int64_t i = 0; i < N; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const scalar_t* src = qp + b * qsb + i * qsn + ((h0 + lh) * G + g) * qsh;
            float* dst = qbuf.data() + (lh * R + i * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d * qsd]) * scale;
          }
    }
    // this split's states of the HG heads' rows, from nothing
    auto state = [&](int64_t lh, int64_t r) { return a.state0[b] + ((h0 + lh) * ns + s) * R + r; };
    for (int64_t lh = 0; lh < HG; ++lh) {
      const int64_t st = state(lh, 0);
      std::fill(a.acc + st * D, a.acc + (st + R) * D, 0.0f);
      std::fill(a.m.begin() + st, a.m.begin() + st + R, NEG_INF);
      std::fill(a.l.begin() + st, a.l.begin() + st + R, 0.0f);
      std::fill(a.bad.begin() + st, a.bad.begin() + st + R, 0);
    }
    // f(t, blk, off) for the logical slots s0 .. s0 + T - 1 of this sequence: slot s0 + t is
    // slot off of block blk (table entry col; s0 + t < len + N <= capacity: inside the table
    // row), stepped along without a division per slot
    auto for_slots = [&](int64_t s0, int64_t T, auto&& f) {
      if (T <= 0) return;
      int64_t col = s0 / block_size, off = s0 % block_size;
      int64_t blk = clamp64(row_table[col], 0, num_blocks - 1);
      for (int64_t t = 0; t < T; ++t, ++off) {
        if (off == block_size) {
          off = 0;
          blk = clamp64(row_table[++col], 0, num_blocks - 1);
        }
        f(t, blk, off);
      }
    };
    // point kd/vd at slots s0 .. s0 + T - 1 of this sequence, KV head h (fp32 data in place,
    // else converted into kc/vc, T * D floats each)
    auto load = [&](int64_t h, int64_t s0, int64_t T, const float** kd_out, const float** vd_out, float* kc,
                    float* vc) {
      for_slots(s0, T, [&](int64_t t, int64_t blk, int64_t off) {
        const scalar_t* k = kbase + blk * ksb + off * kss + h * ksh;
        const scalar_t* v = vbase + blk * vsb + off * vss + h * vsh;
        if (!convert) {
          kd_out[t] = reinterpret_cast<const float*>(k);
          vd_out[t] = reinterpret_cast<const float*>(v);
        } else {
          float* kd = kc + t * D;
          float* vd = vc + t * D;
          for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<float>(k[d * ksd]);
          for (int64_t d = 0; d < D; ++d) vd[d] = static_cast<float>(v[d * vsd]);
          kd_out[t] = kd;
          vd_out[t] = vd;
        }
      });
    };
    // software prefetch of the K/V rows (this item's heads) of the next chunk of logical slots
    // (prefix then tree, s < len + N), issued while this chunk is computed
    auto prefetch = [&](int64_t s0) {
      const int64_t bytes = D * static_cast<int64_t>(sizeof(scalar_t));
      for_slots(s0, std::min(s0 + CHUNK, len + N) - s0, [&](int64_t, int64_t blk, int64_t off) {
        for (int64_t h = h0; h < h0 + HG; ++h) {
          const char* k = reinterpret_cast<const char*>(kbase + blk * ksb + off * kss + h * ksh);
          const char* v = reinterpret_cast<const char*>(vbase + blk * vsb + off * vss + h * vsh);
          for (int64_t b0 = 0; b0 < bytes; b0 += 64) {
            __builtin_prefetch(k + b0);
            __builtin_prefetch(v + b0);
          }
        }
      });
    };
    const int64_t lo = s * SPLIT, hi = lo + SPLIT;  // this split's list positions
    // 1. the whole chunks of the prefix in this split, for all rows at once
    const int64_t P = len / CHUNK * CHUNK;
    for (int64_t s0 = lo; s0 < std::min(hi, P); s0 += CHUNK) {
      prefetch(s0 + CHUNK);
      for (int64_t lh = 0; lh < HG; ++lh) {
        const int64_t st = state(lh, 0);
        load(h0 + lh, s0, CHUNK, kp.data(), vp.data(), kconv.data(), vconv.data());
        attend_chunk(qbuf.data() + lh * R * D, R, D, kp.data(), vp.data(), CHUNK, a.m.data() + st, a.l.data() + st,
                     a.bad.data() + st, a.acc + st * D, scores.data());
      }
    }
    // 2. per node i (its G rows): the list of prefix slots P .. len - 1, then its visible tree
    //    slots in slot order; chunk c of the list holds the node's visible keys number
    //    P + c * CHUNK .. P + c * CHUNK + CHUNK - 1 (counted from slot 0), as a decode step
    //    with its ancestors in the prefix would chunk them; this split walks those chunks of
    //    the lists that start in lo .. hi - 1
    if (hi <= P) continue;
    const int64_t rest = len - P;  // prefix slots after the whole chunks, < CHUNK
    for (int64_t lh = 0; lh < HG; ++lh) {
      load(h0 + lh, P, rest + N, tk.data(), tv.data(), tkconv.data(), tvconv.data());
      for (int64_t i = 0; i < N; ++i) {
        // node i's list: rest prefix slots, then its visible tree slots; this split's window of it
        const int64_t v0 = a.visible0[b * N + i], n = rest + a.visible0[b * N + i + 1] - v0;
        const int64_t e0 = std::max<int64_t>(lo - P, 0), e1 = std::min(n, hi - P);
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t slot = e < rest ? e : rest + a.visible[v0 + e - rest];
          nk[e - e0] = tk[slot];
          nv[e - e0] = tv[slot];
        }
        const int64_t st = state(lh, i * G);
        for (int64_t c0 = e0; c0 < e1; c0 += CHUNK)
          attend_chunk(qbuf.data() + (lh * R + i * G) * D, G, D, nk.data() + (c0 - e0), nv.data() + (c0 - e0),
                       std::min(CHUNK, n - c0), a.m.data() + st, a.l.data() + st, a.bad.data() + st, a.acc + st * D,
                       scores.data());
      }
    }
  }
}

// The outputs of units u0 .. u1 - 1, unit u = (b N + i) H + h being query head h of node i of
// sequence b: the states of the splits that the row's list reaches (its length: the prefix and
// the visible tree slots), combined in split order (the max of their maxima M; the sum over
// splits of their outputs and sums, each times exp(its max - M)), then divided by that sum.  One
// split (a list of at most SPLIT keys): exactly that split's output over its sum.
template <typename scalar_t>
void attention_finish(const AttentionSplits& a, at::Tensor& out, int64_t u0, int64_t u1) {
  const int64_t N = a.N, H = a.H, D = a.D, G = a.G, R = a.R;
  scalar_t* op = out.data_ptr<scalar_t>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> acc(D);
  int64_t row = -1, used = 0;
  for (int64_t u = u0; u < u1; ++u) {
    if (u / H != row) {  // the length of node i's list, in splits
      row = u / H;
      const int64_t seen = a.len[row / N] + a.visible0[row + 1] - a.visible0[row];
      used = (seen + SPLIT - 1) / SPLIT;
    }
    const int64_t b = row / N, i = row % N, hq = u % H, h = hq / G;
    const int64_t s0 = a.state0[b] + h * a.splits[b] * R + i * G + hq % G;  // split s's state: s0 + s R
    float mx = NEG_INF, l = 0.0f;
    bool bad = false;
    for (int64_t s = 0; s < used; ++s) {
      mx = std::max(mx, a.m[s0 + s * R]);
      bad = bad || a.bad[s0 + s * R];
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (used == 1) {  // exp(m - m) = 1: the split's own output and sum
      std::copy(a.acc + s0 * D, a.acc + (s0 + 1) * D, acc.begin());
      l = a.l[s0];
    } else if (mx != NEG_INF) {
      for (int64_t s = 0; s < used; ++s) {
        const int64_t st = s0 + s * R;
        const float w = std::exp(a.m[st] - mx);  // 0 for a split without a finite score
        const float* as = a.acc + st * D;
        if (s == 0) {
          for (int64_t d = 0; d < D; ++d) acc[d] = as[d] * w;
          l = a.l[st] * w;
        } else {
          for (int64_t d = 0; d < D; ++d) acc[d] += as[d] * w;
          l += a.l[st] * w;
        }
      }
    }
    scalar_t* dst = op + u * D;
    float check = 0.0f;  // NaN when some accumulator element is not finite
    for (int64_t d = 0; d < D; ++d) check += acc[d] * 0.0f;
    if (bad || check != check) {
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(nan);
    } else {
      const float inv = 1.0f / l;  // l = 0 (no visible key): 0 * inf = NaN, as the reference
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
    }
  }
}

// The whole op: the items, then the rows' outputs, each over at::parallel_for.
template <typename scalar_t>
void paged_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& seqlens, const at::Tensor& mask, const at::Tensor& table, bool nhd,
                            double sm_scale, at::Tensor& out) {
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t block_size = nhd ? k_cache.size(1) : k_cache.size(2);
  const int64_t Hkv = nhd ? k_cache.size(2) : k_cache.size(1);
  AttentionSplits a(B, N, H, Hkv, D, seqlens.data_ptr<int64_t>(), table.size(1) * block_size,
                    heads_per_task(B, Hkv, at::get_num_threads()), mask);
  at::parallel_for(0, a.items, 1, [&](int64_t i0, int64_t i1) {
    attention_items<scalar_t>(q, k_cache, v_cache, table, nhd, sm_scale, a, i0, i1);
  });
  at::parallel_for(0, B * N * H, 1, [&](int64_t u0, int64_t u1) { attention_finish<scalar_t>(a, out, u0, u1); });
}

// paged_tree_attention's checks; returns the mask as the kernel reads it (undefined: a chain).
at::Tensor check_paged_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                 const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& tree_mask,
                                 const at::Tensor& block_table, bool nhd) {
  TORCH_CHECK_VALUE(q_in.dim() == 4, "q must be [B, N, H, D]");
  TORCH_CHECK_VALUE(k_in.dim() == 4 && v_in.dim() == 4, "k_cache and v_cache must be 4-D pools");
  TORCH_CHECK_VALUE(k_in.sizes() == v_in.sizes(), "v_cache must have k_cache's shape");
  TORCH_CHECK_TYPE(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
                   "k_cache and v_cache must have q's dtype");
  TORCH_CHECK_TYPE(
      q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kHalf || q_in.scalar_type() == at::kBFloat16,
      "q must be float32, float16 or bfloat16");
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &cache_seqlens, &block_table})
    TORCH_CHECK_VALUE(t->device().is_cpu(), "paged_tree_attention: every tensor must be on the CPU");
  const int64_t B = q_in.size(0), N = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  const int64_t num_blocks = k_in.size(0);
  const int64_t block_size = nhd ? k_in.size(1) : k_in.size(2);
  const int64_t Hkv = nhd ? k_in.size(2) : k_in.size(1);
  TORCH_CHECK_VALUE(k_in.size(3) == D, "k_cache's head dim must match q's");
  TORCH_CHECK_VALUE(D >= 16 && D <= 256 && D % 16 == 0, "head dim must be a multiple of 16 in 16..256");
  TORCH_CHECK_VALUE(num_blocks >= 1 && block_size >= 1, "k_cache must hold at least one block of one slot");
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, "q's heads must be a multiple of k_cache's heads");
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) == B, "block_table must be [B, max_blocks_per_seq]");
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, "block_table must be int32");
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B, "cache_seqlens must be [B]");
  TORCH_CHECK_TYPE(cache_seqlens.scalar_type() == at::kInt || cache_seqlens.scalar_type() == at::kLong,
                   "cache_seqlens must be int32 or int64");
  TORCH_CHECK_VALUE(N <= block_table.size(1) * block_size, "block_table's capacity is smaller than q's N new keys");
  at::Tensor mask;
  if (given(tree_mask)) {
    // a mask shared by the batch (a stride-0 batch dimension) is read as the one [N, N] mask
    mask = tree_mask->dim() == 3 && tree_mask->size(0) > 0 && tree_mask->stride(0) == 0
               ? tree_mask->select(0, 0).contiguous()
               : tree_mask->contiguous();
    TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, "tree_mask must be bool (unpack the int32 form first)");
    TORCH_CHECK_VALUE(mask.device().is_cpu(), "tree_mask must be on the CPU");
    TORCH_CHECK_VALUE((mask.dim() == 2 && mask.size(0) == N && mask.size(1) == N) ||
                          (mask.dim() == 3 && mask.size(0) == B && mask.size(1) == N && mask.size(2) == N),
                      "tree_mask must be [N, N] or [B, N, N]");
  }
  return mask;
}

at::Tensor paged_tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                    const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& tree_mask,
                                    const at::Tensor& block_table, c10::string_view kv_layout, double sm_scale) {
  TORCH_CHECK_VALUE(kv_layout == "NHD" || kv_layout == "HND", "kv_layout must be 'NHD' or 'HND'");
  const bool nhd = kv_layout == "NHD";
  const at::Tensor mask = check_paged_attention(q_in, k_in, v_in, cache_seqlens, tree_mask, block_table, nhd);
  const int64_t B = q_in.size(0), N = q_in.size(1);
  at::Tensor out = at::empty(q_in.sizes(), q_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (B == 0 || N == 0) return out;
  const at::Tensor& q = q_in;  // q, k and v are read in place through their strides
  const at::Tensor& k = k_in;
  const at::Tensor& v = v_in;
  const at::Tensor lens = cache_seqlens.to(at::kLong).contiguous();
  const at::Tensor table = block_table.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_tree_attention_cpu", [&] {
    paged_attention_kernel<scalar_t>(q, k, v, lens, mask, table, nhd, sm_scale, out);
  });
  return out;
}

// The dense cache [B, Hkv, S, D] is the "HND" pool of B blocks of S slots, sequence b owning
// block b: the same kernel with the table [[0], [1], ..., [B - 1]] (strided views are read in place).
at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& tree_mask,
                              double sm_scale) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k_cache.dim() == 4, "q must be [B, N, H, D] and k_cache [B, Hkv, S, D]");
  TORCH_CHECK_VALUE(k_cache.size(0) == q.size(0), "k_cache must have q's batch size");
  // no sequence or no query: nothing to attend (the pool view below needs a block of a slot)
  if (q.size(0) == 0 || q.size(1) == 0)
    return at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor table = at::arange(q.size(0), q.options().dtype(at::kInt)).view({q.size(0), 1});
  return paged_tree_attention_cpu(q, k_cache, v_cache, cache_seqlens, tree_mask, table, "HND", sm_scale);
}

}  // namespace

// The work of one call in thread-independent units.  Item (b, group, split) is the split of
// sequence b's rows for the `group`-th HG KV heads; state (b, h, split, r) that split's
// online-softmax state of row r = i * G + g (node i, query head h * G + g) of KV head h.
AttentionSplits::AttentionSplits(int64_t B, int64_t N, int64_t H, int64_t Hkv, int64_t D, const int64_t* raw_lens,
                                 int64_t capacity, int64_t heads_per_task, const at::Tensor& mask)
    : B(B), N(N), H(H), Hkv(Hkv), D(D), G(H / Hkv), R(H / Hkv * N), HG(heads_per_task), groups(Hkv / heads_per_task) {
  len.resize(B);
  splits.resize(B);
  item0.assign(B + 1, 0);
  state0.assign(B + 1, 0);
  weight0.assign(1, 0);
  for (int64_t b = 0; b < B; ++b) {
    len[b] = clamp64(raw_lens[b], 0, capacity - N);
    splits[b] = (len[b] + N + SPLIT - 1) / SPLIT;  // the longest list a row can have: len + N
    item0[b + 1] = item0[b] + groups * splits[b];
    state0[b + 1] = state0[b] + Hkv * splits[b] * R;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t s = 0; s < splits[b]; ++s)  // an item's cost: its keys (the last split: the rest and the tree)
        weight0.push_back(weight0.back() + std::min(SPLIT, len[b] + N - s * SPLIT) * HG);
  }
  items = item0[B];
  // node i of sequence b sees tree slot j where mask[b][i, j] (the chain: j <= i), listed once
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t mask_bstride = mp && mask.dim() == 3 ? N * N : 0;
  visible0.assign(1, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < N; ++j)
        if (mp ? mp[b * mask_bstride + i * N + j] : j <= i) visible.push_back(static_cast<int32_t>(j));
      visible0.push_back(static_cast<int64_t>(visible.size()));
    }
  const int64_t states = state0[B];
  acc_buffer.reset(new float[std::max<int64_t>(states * D, 1)]);  // written by the items before it is read
  acc = acc_buffer.get();
  m.resize(states);
  l.resize(states);
  bad.resize(states);
}

// Items [i0, i1) for thread tid of T: contiguous ranges of nearly equal keys (only the speed
// depends on the cut).
void AttentionSplits::range(int64_t tid, int64_t T, int64_t* i0, int64_t* i1) const {
  const int64_t W = weight0.back();
  auto first = [&](int64_t t) {  // the item whose start is nearest to t's share of the keys
    if (t >= T) return items;
    const int64_t w = W * t / T;
    int64_t i = static_cast<int64_t>(std::lower_bound(weight0.begin(), weight0.end(), w) - weight0.begin());
    if (i > 0 && w - weight0[i - 1] < weight0[i] - w) --i;
    return i;
  };
  *i0 = first(tid);
  *i1 = first(tid + 1);
}

DenseAttention dense_attention_prepare(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& tree_mask,
                                       int64_t threads) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k_cache.dim() == 4, "q must be [B, N, H, D] and k_cache [B, Hkv, S, D]");
  TORCH_CHECK_VALUE(k_cache.size(0) == q.size(0), "k_cache must have q's batch size");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat, "tree attention in a pass region: q must be float32");
  DenseAttention a;
  a.table = at::arange(std::max<int64_t>(q.size(0), 1), q.options().dtype(at::kInt)).view({-1, 1});
  if (q.size(0) > 0) a.mask = check_paged_attention(q, k_cache, v_cache, cache_seqlens, tree_mask, a.table, false);
  a.lens = cache_seqlens.to(at::kLong).contiguous();
  const int64_t Hkv = k_cache.size(1);
  a.splits =
      std::make_unique<AttentionSplits>(q.size(0), q.size(1), q.size(2), Hkv, q.size(3), a.lens.data_ptr<int64_t>(),
                                        k_cache.size(2), heads_per_task(q.size(0), Hkv, threads), a.mask);
  return a;
}

void dense_attention_items(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t offset,
                           DenseAttention& a, double sm_scale, int64_t i0, int64_t i1) {
  attention_items<float>(q, k_cache, v_cache, a.table, false, sm_scale, *a.splits, i0, i1, offset);
}

void dense_attention_finish(const DenseAttention& a, at::Tensor& out, int64_t u0, int64_t u1) {
  attention_finish<float>(*a.splits, out, u0, u1);
}
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec_native, CPU, m) {
  m.impl("paged_tree_attention", &specdec::paged_tree_attention_cpu);
  m.impl("tree_attention", &specdec::tree_attention_cpu);
}
