// Intel AMX tiles (Sapphire Rapids and later), shared by the kernels that use them
// (lora_segments_amx.cpp, quant_gemm.cpp): the palette-1 tile configuration and the process's
// permission to use the tile data, which Linux grants on request (arch_prctl), once a process.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define BOXCAR_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace boxcar_amx {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;     // ... the tile data

// ldtilecfg's 64 bytes: a tile's rows and bytes a row, per tile register.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether this process may use the tiles (asked once; false where the kernel refuses).
inline bool permitted() {
  static const bool ready = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

}  // namespace boxcar_amx
#endif
