// Fused CPU dequantization of kvquant's packed min-max integer codes: one pass from packed bytes to the
// model's dtype (float32, bfloat16 or float16), where eager PyTorch needs four (unpack, convert, scale, shift).
//
// payload [BH, T, Dp] uint8, block layout: the code of channel j * Dp + i sits in byte i at bit j * bits.
// token axis:   scale/zero [BH, T, D / group] float32: channels c share the pair c / group (any group dividing D,
//               whether or not it tiles the packed width Dp).
// channel axis: scale/zero [BH, T / group, D] float32, group = tokens per scale.
// out [BH, T, D]: any strides for the first two dimensions, the last contiguous. Every element of out is written.
#include <torch/extension.h>

#include <algorithm>

static inline void store(const float* row, float* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = row[c];
}

// float -> bfloat16 with round-to-nearest-even, written as plain integer ops so the loop vectorizes
// (values are finite: the cache refuses NaN/Inf on write).
static inline void store(const float* row, at::BFloat16* out, int64_t n) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t u = bits[c];
    o[c] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// float -> float16, clamped to its finite range (a top level may round one step past 65504).
static inline void store(const float* row, at::Half* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = static_cast<at::Half>(std::min(std::max(row[c], -65504.0f), 65504.0f));
}

template <typename scalar_t>
static void run(const torch::Tensor& payload, const torch::Tensor& scale, const torch::Tensor& zero, int64_t bits,
                int64_t group, bool token_axis, torch::Tensor& out) {
  const int64_t BH = payload.size(0), T = payload.size(1), Dp = payload.size(2);
  const int64_t k = 8 / bits, D = Dp * k;
  const uint8_t mask = static_cast<uint8_t>((1 << bits) - 1);
  const uint8_t* p = payload.data_ptr<uint8_t>();
  const float* s = scale.data_ptr<float>();
  const float* z = zero.data_ptr<float>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ss0 = scale.stride(0), ss1 = scale.stride(1);
  const int64_t zs0 = zero.stride(0), zs1 = zero.stride(1);
  at::parallel_for(0, BH * T, 64, [&](int64_t begin, int64_t end) {
    float row[1024];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t bh = r / T, t = r % T;
      const uint8_t* pr = p + r * Dp;
      scalar_t* orow = o + bh * os0 + t * os1;
      const int64_t srow = token_axis ? t : t / group;
      const float* sr = s + bh * ss0 + srow * ss1;
      const float* zr = z + bh * zs0 + srow * zs1;
      for (int64_t j = 0; j < k; ++j) {
        const int shift = static_cast<int>(j * bits);
        float* rb = row + j * Dp;
        if (token_axis) {
          // block j holds channels [j * Dp, (j + 1) * Dp); walk it in runs that share one group
          int64_t i = 0;
          while (i < Dp) {
            const int64_t g = (j * Dp + i) / group;
            const int64_t run_end = std::min(Dp, (g + 1) * group - j * Dp);
            const float sc = sr[g], ze = zr[g];
            for (; i < run_end; ++i) rb[i] = ze + static_cast<float>((pr[i] >> shift) & mask) * sc;
          }
        } else {
          const float* sc = sr + j * Dp;
          const float* ze = zr + j * Dp;
          for (int64_t i = 0; i < Dp; ++i) rb[i] = ze[i] + static_cast<float>((pr[i] >> shift) & mask) * sc[i];
        }
      }
      store(row, orow, D);
    }
  });
}

void dequantize_into(const torch::Tensor& payload, const torch::Tensor& scale, const torch::Tensor& zero, int64_t bits,
                     int64_t group, bool token_axis, torch::Tensor out) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "kvquant kernel: bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(group >= 1, "kvquant kernel: group must be >= 1, got ", group);
  TORCH_CHECK(payload.dim() == 3 && payload.scalar_type() == torch::kByte && payload.is_contiguous(),
              "kvquant kernel: payload must be a contiguous uint8 [BH, T, Dp] tensor");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && zero.scalar_type() == torch::kFloat,
              "kvquant kernel: scale and zero must be float32");
  TORCH_CHECK(scale.dim() == 3 && zero.sizes() == scale.sizes() && scale.stride(2) == 1 && zero.stride(2) == 1,
              "kvquant kernel: scale and zero must be [BH, rows, n] with a contiguous last dimension");
  const int64_t BH = payload.size(0), T = payload.size(1), D = payload.size(2) * (8 / bits);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == BH && out.size(1) == T && out.size(2) == D && out.stride(2) == 1,
              "kvquant kernel: out must be [", BH, ", ", T, ", ", D, "] with a contiguous last dimension, got ",
              out.sizes(), " strides ", out.strides());
  TORCH_CHECK(D <= 1024, "kvquant kernel: head_dim ", D, " > 1024");
  if (token_axis) {
    TORCH_CHECK(D % group == 0 && scale.size(0) == BH && scale.size(1) == T && scale.size(2) == D / group,
                "kvquant kernel: token-axis scales must be [", BH, ", ", T, ", ", D / std::max<int64_t>(group, 1),
                "] with group dividing ", D, ", got ", scale.sizes(), " for group ", group);
  } else {
    TORCH_CHECK(T % group == 0 && scale.size(0) == BH && scale.size(1) == T / group && scale.size(2) == D,
                "kvquant kernel: channel-axis scales must be [", BH, ", ", T / group, ", ", D, "] with group dividing ",
                T, ", got ", scale.sizes(), " for group ", group);
  }
  if (out.scalar_type() == torch::kFloat) {
    run<float>(payload, scale, zero, bits, group, token_axis, out);
  } else if (out.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(payload, scale, zero, bits, group, token_axis, out);
  } else if (out.scalar_type() == torch::kHalf) {
    run<at::Half>(payload, scale, zero, bits, group, token_axis, out);
  } else {
    TORCH_CHECK(false, "kvquant kernel: unsupported output dtype ", out.scalar_type());
  }
}

// The same arithmetic through a table of pool slots (the batched cache's storage), with the scales in their stored
// dtype (float32, float16 or bfloat16): out[b, h, u * R + r] is row r of unit table[b, u].
// payload [N, H, R, Dp] uint8 (R rows per unit: 1 on the token axis, group on the channel axis);
// scale/zero [N, H, n] (n = D / group on the token axis, D on the channel axis); table [B, U] int64 (entries < 0
// read slot 0); out [B, H, U * R, D]: any strides for the first three dimensions, the last contiguous.
template <typename scalar_t, typename scale_t>
static void run_slots(const torch::Tensor& payload, const torch::Tensor& scale, const torch::Tensor& zero,
                      const torch::Tensor& table, int64_t bits, int64_t group, bool token_axis, torch::Tensor& out) {
  const int64_t H = payload.size(1), R = payload.size(2), Dp = payload.size(3);
  const int64_t B = table.size(0), U = table.size(1), n = scale.size(2);
  const int64_t k = 8 / bits, D = Dp * k;
  const uint8_t mask = static_cast<uint8_t>((1 << bits) - 1);
  const uint8_t* p = payload.data_ptr<uint8_t>();
  const scale_t* s = scale.data_ptr<scale_t>();
  const scale_t* z = zero.data_ptr<scale_t>();
  const int64_t* tb = table.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  // a work item is one unit: a token (token axis) or a group of tokens sharing per-channel scales
  at::parallel_for(0, B * H * U, std::max<int64_t>(1, 1024 / R), [&](int64_t begin, int64_t end) {
    float row[1024], sc[1024], ze[1024];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (H * U), h = (w / U) % H, u = w % U;
      const int64_t slot = std::max<int64_t>(tb[b * U + u], 0);
      const scale_t* sr = s + (slot * H + h) * n;
      const scale_t* zr = z + (slot * H + h) * n;
      scalar_t* orow = o + b * os0 + h * os1 + u * R * os2;
      if (token_axis) {  // one token: walk each block in runs of channels that share a group, as run() does
        const uint8_t* pr = p + (slot * H + h) * Dp;
        for (int64_t j = 0; j < k; ++j) {
          const int shift = static_cast<int>(j * bits);
          float* rb = row + j * Dp;
          int64_t i = 0;
          while (i < Dp) {
            const int64_t g = (j * Dp + i) / group;
            const int64_t run_end = std::min(Dp, (g + 1) * group - j * Dp);
            const float scv = static_cast<float>(sr[g]), zev = static_cast<float>(zr[g]);
            for (; i < run_end; ++i) rb[i] = zev + static_cast<float>((pr[i] >> shift) & mask) * scv;
          }
        }
        store(row, orow, D);
        continue;
      }
      for (int64_t c = 0; c < D; ++c) {  // channel axis: one scale per channel, for all R tokens of the unit
        sc[c] = static_cast<float>(sr[c]);
        ze[c] = static_cast<float>(zr[c]);
      }
      for (int64_t r = 0; r < R; ++r) {
        const uint8_t* pr = p + ((slot * H + h) * R + r) * Dp;
        for (int64_t j = 0; j < k; ++j) {
          const int shift = static_cast<int>(j * bits);
          float* rb = row + j * Dp;
          const float* scj = sc + j * Dp;
          const float* zej = ze + j * Dp;
          for (int64_t i = 0; i < Dp; ++i) rb[i] = zej[i] + static_cast<float>((pr[i] >> shift) & mask) * scj[i];
        }
        store(row, orow + r * os2, D);
      }
    }
  });
}

template <typename scalar_t>
static void run_slots_scaled(const torch::Tensor& payload, const torch::Tensor& scale, const torch::Tensor& zero,
                             const torch::Tensor& table, int64_t bits, int64_t group, bool token_axis,
                             torch::Tensor& out) {
  if (scale.scalar_type() == torch::kFloat) {
    run_slots<scalar_t, float>(payload, scale, zero, table, bits, group, token_axis, out);
  } else if (scale.scalar_type() == torch::kHalf) {
    run_slots<scalar_t, at::Half>(payload, scale, zero, table, bits, group, token_axis, out);
  } else if (scale.scalar_type() == torch::kBFloat16) {
    run_slots<scalar_t, at::BFloat16>(payload, scale, zero, table, bits, group, token_axis, out);
  } else {
    TORCH_CHECK(false, "kvquant kernel: unsupported scale dtype ", scale.scalar_type());
  }
}

void dequantize_slots_into(const torch::Tensor& payload, const torch::Tensor& scale, const torch::Tensor& zero,
                           const torch::Tensor& table, int64_t bits, int64_t group, bool token_axis,
                           torch::Tensor out) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "kvquant kernel: bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(group >= 1, "kvquant kernel: group must be >= 1, got ", group);
  TORCH_CHECK(payload.dim() == 4 && payload.scalar_type() == torch::kByte && payload.is_contiguous(),
              "kvquant kernel: payload must be a contiguous uint8 [N, H, R, Dp] tensor");
  TORCH_CHECK(scale.dim() == 3 && scale.is_contiguous() && zero.is_contiguous() && zero.sizes() == scale.sizes() &&
              zero.scalar_type() == scale.scalar_type(),
              "kvquant kernel: scale and zero must be contiguous [N, H, n] tensors of one dtype");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kLong && table.is_contiguous(),
              "kvquant kernel: table must be a contiguous int64 [B, U] tensor");
  const int64_t N = payload.size(0), H = payload.size(1), R = payload.size(2), D = payload.size(3) * (8 / bits);
  const int64_t n = token_axis ? D / group : D;
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == H && scale.size(2) == n && (!token_axis || D % group == 0) &&
              (token_axis ? R == 1 : R == group),
              "kvquant kernel: scales ", scale.sizes(), " do not fit payload ", payload.sizes(), " for group ", group);
  TORCH_CHECK(D <= 1024, "kvquant kernel: head_dim ", D, " > 1024");
  TORCH_CHECK(out.dim() == 4 && out.size(0) == table.size(0) && out.size(1) == H &&
              out.size(2) == table.size(1) * R && out.size(3) == D && out.stride(3) == 1,
              "kvquant kernel: out must be [", table.size(0), ", ", H, ", ", table.size(1) * R, ", ", D,
              "] with a contiguous last dimension, got ", out.sizes());
  if (table.numel() == 0) return;
  TORCH_CHECK(N > 0, "kvquant kernel: a table of ", table.numel(), " entries over an empty pool");
  const int64_t most = table.max().item<int64_t>();
  TORCH_CHECK(most < N, "kvquant kernel: table names slot ", most, " of a pool of ", N);
  if (out.scalar_type() == torch::kFloat) {
    run_slots_scaled<float>(payload, scale, zero, table, bits, group, token_axis, out);
  } else if (out.scalar_type() == torch::kBFloat16) {
    run_slots_scaled<at::BFloat16>(payload, scale, zero, table, bits, group, token_axis, out);
  } else if (out.scalar_type() == torch::kHalf) {
    run_slots_scaled<at::Half>(payload, scale, zero, table, bits, group, token_axis, out);
  } else {
    TORCH_CHECK(false, "kvquant kernel: unsupported output dtype ", out.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_into", &dequantize_into);
  m.def("dequantize_slots_into", &dequantize_slots_into);
}
