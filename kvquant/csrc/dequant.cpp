// Fused CPU dequantization of kvquant's packed min-max integer codes: one pass from packed bytes to the
// model's dtype (float32 or bfloat16), where eager PyTorch needs four (unpack, convert, scale, shift).
//
// payload [BH, T, Dp] uint8, block layout: the code of channel j * Dp + i sits in byte i at bit j * bits.
// token axis:   scale/zero [BH, T, ng] float32, group = D / ng channels.
// channel axis: scale/zero [BH, T / group, D] float32, group = tokens per scale.
// out [BH, T, D]: any strides for the first two dimensions, the last contiguous.
#include <torch/extension.h>

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
  at::parallel_for(0, BH * T, 64, [&](int64_t begin, int64_t end) {
    float row[1024];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t bh = r / T, t = r % T;
      const uint8_t* pr = p + r * Dp;
      scalar_t* orow = o + bh * os0 + t * os1;
      const float* sr = token_axis ? s + bh * ss0 + t * ss1 : s + bh * ss0 + (t / group) * ss1;
      const float* zr = token_axis ? z + bh * ss0 + t * ss1 : z + bh * ss0 + (t / group) * ss1;
      for (int64_t j = 0; j < k; ++j) {
        const int shift = static_cast<int>(j * bits);
        float* rb = row + j * Dp;
        if (token_axis) {
          for (int64_t c0 = 0; c0 < Dp; c0 += group < Dp ? group : Dp) {
            const int64_t len = group < Dp ? group : Dp;
            const float sc = sr[(j * Dp + c0) / group], ze = zr[(j * Dp + c0) / group];
            for (int64_t i = c0; i < c0 + len; ++i) rb[i] = ze + static_cast<float>((pr[i] >> shift) & mask) * sc;
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
  TORCH_CHECK(payload.is_contiguous() && scale.scalar_type() == torch::kFloat && zero.scalar_type() == torch::kFloat);
  TORCH_CHECK(out.stride(2) == 1 && payload.size(2) * (8 / bits) <= 1024, "unsupported layout");
  if (out.scalar_type() == torch::kFloat) {
    run<float>(payload, scale, zero, bits, group, token_axis, out);
  } else if (out.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(payload, scale, zero, bits, group, token_axis, out);
  } else {
    TORCH_CHECK(false, "unsupported output dtype");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dequantize_into", &dequantize_into); }
