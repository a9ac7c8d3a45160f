// What engine/layers/lora.py hands the CPU LoRA kernels for one segment (lora_segments.cpp,
// lora_segments_amx.cpp): rows [start, end) under one adapter, its At, the pieces' Bt with their
// scalings folded in, and [col_offset, col_size, rank_offset, rank] a piece.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

using Segment = std::tuple<int64_t, int64_t, at::Tensor, std::vector<at::Tensor>,
                           std::vector<int64_t>>;

// The AMX path for bf16 segments in the pair layout (lora_segments_amx.cpp); false when this
// build or this process cannot use AMX (then nothing was written).
bool lora_segments_amx(const at::Tensor& x, at::Tensor& out, const std::vector<Segment>& segments);

// Whether lora_segments_amx can run here (the build has AMX and the kernel granted its state).
bool lora_amx_available();
