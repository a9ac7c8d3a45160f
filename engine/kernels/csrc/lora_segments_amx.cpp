// The CPU LoRA delta in bf16 on Intel's AMX tile units, for CPUs that have them (Sapphire Rapids
// and later): the same work as lora_segments.cpp's bf16 pair path, on the same weights (pairs of
// depth, [blocks, pairs, 16, 2], which is what a tile of B is), but each `tdpbf16ps` multiplies a
// 16-row x 32-deep tile of inputs by a 32-deep x 16-column tile of weights: 8,192 multiply-adds
// an instruction where `vdpbf16ps` does 512. A decode step's segments (8 rows) then cost what
// reading their adapters' weights costs, and a prompt chunk's long segments run here too.
//
// A work item is (segment, 16-row chunk, one or two 16-column blocks); tiles 0-1 hold C, 2 the
// inputs, 3-4 the blocks' weights, 5-7 the same for a depth's last pairs when it is not a
// multiple of 16 (configured per item: a tile's rows and bytes are fixed by its configuration).
// Rows past a segment's end are computed and dropped (a decode's 8 rows fill half a tile: the
// step is bound by reading weights, not by the tile unit), read from the batch's next rows or,
// past the batch, from a zero-padded copy.
#include "lora_segment.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "amx.h"

#if defined(BOXCAR_AMX)
#define BOXCAR_LORA_AMX 1
#endif

#if defined(BOXCAR_LORA_AMX)
namespace {

constexpr int kTile = 16;  // rows of a tile; pairs of depth in a B tile; columns of C
// How far ahead of a weight tile the cache is asked for the next ones. A piece's (or an A's)
// blocks lie one after another and its items run in that order, so its weights are one stream,
// read once a step from memory: without these hints a decode step's short items (a rank-8 piece's
// block is 512 bytes) each waited on memory (a decode step's LoRA 5-13% faster with them, over noisy runs).
constexpr int64_t kAheadBytes = 4096;
using boxcar_amx::TileConfig;

// Tiles 0-4 full (16 rows, 64 bytes a row); 5-7 for the last `rem` pairs of depth: inputs of
// rem * 4 bytes a row, weights of rem rows. Loaded only when `configured` (this thread's) differs:
// the items of one piece, or of one shrink, share theirs.
void configure(int rem, int& configured) {
  if (rem == configured) return;
  configured = rem;
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  if (rem > 0) {
    cfg.rows[5] = kTile;
    cfg.colsb[5] = static_cast<uint16_t>(rem * 4);
    for (int t = 6; t < 8; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(rem);
      cfg.colsb[t] = 64;
    }
  }
  _tile_loadconfig(&cfg);
}

inline __m512 widen16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void narrow16(uint16_t* p, __m512 v, __mmask16 m) {  // round to nearest even
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

// The 1 KB (a tile of weights) kAheadBytes past p, a line at a time (past the end: no fault).
inline void prefetch_ahead(const uint16_t* p) {
  const char* ahead = reinterpret_cast<const char*>(p) + kAheadBytes;
  for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
}

// C[0..nb) = v[16 rows, 2 * pairs] @ w blocks (each [pairs, 16, 2], w_step apart), into c as
// [nb][16][16] fp32. Needs configure(pairs % 16) on this thread.
void tiles(int nb, const uint16_t* v, int64_t ldv, const uint16_t* w, int64_t w_step,
           int64_t pairs, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  const int64_t full = pairs / kTile, rem = pairs % kTile;
  const int64_t v_stride = ldv * 2, chunk = 2 * kTile;  // bytes a row; elements a chunk
  for (int64_t k = 0; k < full; ++k) {
    _tile_loadd(2, v + k * chunk, v_stride);
    prefetch_ahead(w + k * kTile * chunk);
    _tile_loadd(3, w + k * kTile * chunk, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (nb == 2) {
      prefetch_ahead(w + w_step + k * kTile * chunk);
      _tile_loadd(4, w + w_step + k * kTile * chunk, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  if (rem > 0) {
    _tile_loadd(5, v + full * chunk, v_stride);
    prefetch_ahead(w + full * kTile * chunk);
    _tile_loadd(6, w + full * kTile * chunk, 64);
    _tile_dpbf16ps(0, 5, 6);
    if (nb == 2) {
      prefetch_ahead(w + w_step + full * kTile * chunk);
      _tile_loadd(7, w + w_step + full * kTile * chunk, 64);
      _tile_dpbf16ps(1, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if (nb == 2) _tile_stored(1, c + kTile * kTile, 64);
}

struct Item {
  int64_t segment;
  int64_t piece;  // -1: shrink
  int64_t row;    // the chunk's first row, from the segment's start
  int64_t block;
  int blocks;     // 1 or 2
};

}  // namespace

bool lora_amx_available() { return boxcar_amx::permitted(); }

bool lora_segments_amx(const at::Tensor& x, at::Tensor& out,
                       const std::vector<Segment>& segments) {
  if (!lora_amx_available()) return false;
  const int64_t in = x.size(1), ldx = x.stride(0), ldo = out.stride(0), rows_x = x.size(0);
  const int64_t in_pairs = (in + 1) / 2, ld_pad = 2 * in_pairs;
  const auto count = static_cast<int64_t>(segments.size());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Per segment: its y ([rows rounded up to 16, R padded to 16] bf16) and, where its last chunk
  // would read past the batch or x's width is odd, a zero-padded copy of its rows.
  std::vector<int64_t> y_at(count + 1, 0), pad_at(count + 1, 0);
  std::vector<Item> shrink, expand;
  for (int64_t s = 0; s < count; ++s) {
    const auto& [start, end, at_, bts, meta] = segments[s];
    const int64_t rows = end - start, chunks = (rows + kTile - 1) / kTile;
    const bool copy = in % 2 != 0 || start + chunks * kTile > rows_x;
    y_at[s + 1] = y_at[s] + chunks * kTile * at_.size(0) * kTile;
    pad_at[s + 1] = pad_at[s] + (copy ? chunks * kTile * ld_pad : 0);
    for (int64_t b = 0; b < at_.size(0); b += 2)
      for (int64_t r = 0; r < rows; r += kTile)
        shrink.push_back({s, -1, r, b, static_cast<int>(std::min<int64_t>(2, at_.size(0) - b))});
    for (size_t p = 0; p < bts.size(); ++p)
      for (int64_t b = 0; b < bts[p].size(0); b += 2)
        for (int64_t r = 0; r < rows; r += kTile)
          expand.push_back({s, static_cast<int64_t>(p), r, b,
                            static_cast<int>(std::min<int64_t>(2, bts[p].size(0) - b))});
  }
  // y has 32 spare elements: a last chunk of ranks reads up to a tile past its piece's ranks
  // (rows of zero weights multiply them)
  std::vector<uint16_t> y(y_at[count] + 2 * kTile, 0), padded(pad_at[count], 0);
  for (int64_t s = 0; s < count; ++s) {
    if (pad_at[s + 1] == pad_at[s]) continue;
    const int64_t start = std::get<0>(segments[s]), end = std::get<1>(segments[s]);
    for (int64_t r = start; r < end; ++r)
      std::memcpy(padded.data() + pad_at[s] + (r - start) * ld_pad, xp + r * ldx,
                  in * sizeof(uint16_t));
  }
  auto do_shrink = [&](const Item& it, float* c, int& configured) {
    const auto& [start, end, at_, bts, meta] = segments[it.segment];
    const int64_t ld_y = at_.size(0) * kTile;
    const bool copied = pad_at[it.segment + 1] != pad_at[it.segment];
    const uint16_t* v = copied ? padded.data() + pad_at[it.segment] + it.row * ld_pad
                               : xp + (start + it.row) * ldx;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(at_.data_ptr());
    const int64_t w_step = in_pairs * 2 * kTile;
    configure(static_cast<int>(in_pairs % kTile), configured);
    tiles(it.blocks, v, copied ? ld_pad : ldx, w + it.block * w_step, w_step, in_pairs, c);
    uint16_t* dst = y.data() + y_at[it.segment] + it.row * ld_y + it.block * kTile;
    for (int j = 0; j < it.blocks; ++j)
      for (int i = 0; i < kTile; ++i)
        narrow16(dst + i * ld_y + j * kTile, _mm512_loadu_ps(c + (j * kTile + i) * kTile),
                 0xFFFF);
  };
  auto do_expand = [&](const Item& it, float* c, int& configured) {
    const auto& [start, end, at_, bts, meta] = segments[it.segment];
    const int64_t ld_y = at_.size(0) * kTile;
    const int64_t col_offset = meta[4 * it.piece], col_size = meta[4 * it.piece + 1];
    const int64_t rank_offset = meta[4 * it.piece + 2], pairs = (meta[4 * it.piece + 3] + 1) / 2;
    const int64_t w_step = pairs * 2 * kTile;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(bts[it.piece].data_ptr());
    configure(static_cast<int>(pairs % kTile), configured);
    tiles(it.blocks, y.data() + y_at[it.segment] + it.row * ld_y + rank_offset, ld_y,
          w + it.block * w_step, w_step, pairs, c);
    const int64_t rows = std::min<int64_t>(kTile, end - start - it.row);
    for (int j = 0; j < it.blocks; ++j) {
      const int64_t col = (it.block + j) * kTile;
      const int64_t lanes = std::min<int64_t>(kTile, col_size - col);
      const __mmask16 mask = lanes >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << lanes) - 1);
      for (int64_t i = 0; i < rows; ++i) {
        uint16_t* o = op + (start + it.row + i) * ldo + col_offset + col;
        narrow16(o, _mm512_add_ps(widen16(o, mask), _mm512_loadu_ps(c + (j * kTile + i) * kTile)),
                 mask);
      }
    }
  };
  auto each = [](const std::vector<Item>& items, auto&& fn) {
    auto range = [&](int64_t begin, int64_t finish) {
      alignas(64) float c[2 * kTile * kTile];
      int configured = -1;  // this thread's tiles' `rem` (-1: none yet)
      for (int64_t i = begin; i < finish; ++i) fn(items[i], c, configured);
      _tile_release();
    };
    const auto n = static_cast<int64_t>(items.size());
    if (at::get_num_threads() > 1 && n > 1) {
      at::parallel_for(0, n, 1, range);
    } else if (n > 0) {
      range(0, n);
    }
  };
  each(shrink, do_shrink);
  each(expand, do_expand);
  return true;
}

#else

bool lora_amx_available() { return false; }

bool lora_segments_amx(const at::Tensor&, at::Tensor&, const std::vector<Segment>&) {
  return false;
}

#endif
