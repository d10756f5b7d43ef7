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
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// Calls f(T{}) with T the C++ type of `dtype`: float, bfloat16 or float16; any other dtype is refused, naming `what`.
template <typename F>
static void with_float_type(torch::ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case torch::kFloat: return f(float{});
    case torch::kBFloat16: return f(at::BFloat16{});
    case torch::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, "kvquant kernel: unsupported ", what, " dtype ", dtype);
  }
}

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

// One packed row of Dp bytes -> row[D = Dp * 8 / bits] floats, z + code * s. Block j of the bytes holds channels
// [j * Dp, (j + 1) * Dp) at bit j * bits. Token axis: sr/zr hold one pair per group of channels, and each block is
// walked in runs of channels that share one; channel axis: sr/zr hold a pair per channel.
template <typename scale_t>
static inline void decode_row(const uint8_t* pr, const scale_t* sr, const scale_t* zr, int64_t Dp, int64_t bits,
                              int64_t group, bool token_axis, float* row) {
  const uint8_t mask = static_cast<uint8_t>((1 << bits) - 1);
  for (int64_t j = 0; j < 8 / bits; ++j) {
    const int shift = static_cast<int>(j * bits);
    float* rb = row + j * Dp;
    if (token_axis) {
      int64_t i = 0;
      while (i < Dp) {
        const int64_t g = (j * Dp + i) / group;
        const int64_t run_end = std::min(Dp, (g + 1) * group - j * Dp);
        const float sc = static_cast<float>(sr[g]), ze = static_cast<float>(zr[g]);
        for (; i < run_end; ++i) rb[i] = ze + static_cast<float>((pr[i] >> shift) & mask) * sc;
      }
    } else {
      const scale_t* sc = sr + j * Dp;
      const scale_t* ze = zr + j * Dp;
      for (int64_t i = 0; i < Dp; ++i) rb[i] = ze[i] + static_cast<float>((pr[i] >> shift) & mask) * sc[i];
    }
  }
}

template <typename scalar_t>
static void run(const torch::Tensor& payload, const torch::Tensor& scale, const torch::Tensor& zero, int64_t bits,
                int64_t group, bool token_axis, torch::Tensor& out) {
  const int64_t BH = payload.size(0), T = payload.size(1), Dp = payload.size(2);
  const int64_t D = Dp * (8 / bits);
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
      decode_row(pr, sr, zr, Dp, bits, group, token_axis, row);
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
  with_float_type(out.scalar_type(), "output", [&](auto t) {
    run<decltype(t)>(payload, scale, zero, bits, group, token_axis, out);
  });
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
  const int64_t D = Dp * (8 / bits);
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
      if (token_axis) {  // one token
        decode_row(p + (slot * H + h) * Dp, sr, zr, Dp, bits, group, true, row);
        store(row, orow, D);
        continue;
      }
      for (int64_t c = 0; c < D; ++c) {  // channel axis: one scale per channel, for all R tokens of the unit
        sc[c] = static_cast<float>(sr[c]);
        ze[c] = static_cast<float>(zr[c]);
      }
      for (int64_t r = 0; r < R; ++r) {
        decode_row(p + ((slot * H + h) * R + r) * Dp, sc, ze, Dp, bits, group, false, row);
        store(row, orow + r * os2, D);
      }
    }
  });
}

template <typename scalar_t>
static void run_slots_scaled(const torch::Tensor& payload, const torch::Tensor& scale, const torch::Tensor& zero,
                             const torch::Tensor& table, int64_t bits, int64_t group, bool token_axis,
                             torch::Tensor& out) {
  with_float_type(scale.scalar_type(), "scale", [&](auto t) {
    run_slots<scalar_t, decltype(t)>(payload, scale, zero, table, bits, group, token_axis, out);
  });
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
  with_float_type(out.scalar_type(), "output", [&](auto t) {
    run_slots_scaled<decltype(t)>(payload, scale, zero, table, bits, group, token_axis, out);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Fused decode attention over the stored codes (kvquant/cache/streams.py describes the layout; this is its CPU
// reader). For each row b and KV head h, the G query heads of h and the n queries of the step score every read
// key straight from its unit (decoded into a stack buffer of R x D floats, rounded to the model's dtype as the
// dequantized copy is), softmax in fp32 over each query's first hi[b, i] read tokens, then accumulate the values
// the same way: the dequantized history is never materialized.

// The stream kinds, numbered by kvquant/formats/roles.py StreamKind (Python passes its values; the numbers here must
// be the same: tests/test_storage_roles.py reads this line).
enum Kind : int64_t { KIND_INT = 0, KIND_FP8_E4M3 = 1, KIND_FP8_E5M2 = 2, KIND_FULL = 3 };

template <typename scalar_t>
static inline float to_model(float x) {  // round through the model's dtype, as the dequantized copy does
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    return static_cast<float>(static_cast<at::Half>(std::min(std::max(x, -65504.0f), 65504.0f)));
  } else {  // bfloat16, rounded to nearest even as store() does
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    float r;
    std::memcpy(&r, &u, 4);
    return r;
  }
}

static void scales_to_float(const torch::Tensor& t, int64_t offset, int64_t n, float* out) {
  with_float_type(t.scalar_type(), "scale", [&](auto tag) {
    const auto* p = t.data_ptr<decltype(tag)>() + offset;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
  });
}

// One stream (keys or values) of one layer: see streams.py.
struct StreamView {
  int64_t kind, bits, group, R, Dp, H, D;
  bool token_axis;
  torch::Tensor payload, scale, zero;
  const int64_t *table, *n_sinks, *skip, *units, *n_tail;
  int64_t U;
  torch::Tensor sinks, tail;

  int64_t count(int64_t b) const { return n_sinks[b] + units[b] * R + n_tail[b] - skip[b]; }

  // unit `slot`, head h: R rows of D floats into rows (rounded to the model dtype)
  template <typename scalar_t>
  void decode_unit(int64_t slot, int64_t h, float* rows, float* sc, float* ze) const {
    if (kind == KIND_FULL) {
      const scalar_t* p = payload.data_ptr<scalar_t>() + (slot * H + h) * D;
      for (int64_t c = 0; c < D; ++c) rows[c] = static_cast<float>(p[c]);
      return;
    }
    if (kind == KIND_FP8_E4M3 || kind == KIND_FP8_E5M2) {
      float s;  // one scale per token and head, or per token for all heads (tensor granularity)
      const int64_t hs = scale.size(1);
      scales_to_float(scale, slot * hs + (hs == 1 ? 0 : h), 1, &s);
      if (kind == KIND_FP8_E4M3) {
        const c10::Float8_e4m3fn* p = payload.data_ptr<c10::Float8_e4m3fn>() + (slot * H + h) * D;
        for (int64_t c = 0; c < D; ++c) rows[c] = to_model<scalar_t>(static_cast<float>(p[c]) * s);
      } else {
        const c10::Float8_e5m2* p = payload.data_ptr<c10::Float8_e5m2>() + (slot * H + h) * D;
        for (int64_t c = 0; c < D; ++c) rows[c] = to_model<scalar_t>(static_cast<float>(p[c]) * s);
      }
      return;
    }
    const int64_t n = token_axis ? D / group : D;
    scales_to_float(scale, (slot * H + h) * n, n, sc);
    scales_to_float(zero, (slot * H + h) * n, n, ze);
    const uint8_t* base = payload.data_ptr<uint8_t>() + (slot * H + h) * R * Dp;
    for (int64_t r = 0; r < R; ++r) {
      float* row = rows + r * D;
      decode_row(base + r * Dp, sc, ze, Dp, bits, group, token_axis, row);
      for (int64_t c = 0; c < D; ++c) row[c] = to_model<scalar_t>(row[c]);
    }
  }

  // Call f(j, row) for the read tokens j = 0 .. count(b) - 1 of row b, head h, in order (row: D floats).
  template <typename scalar_t, typename F>
  void walk(int64_t b, int64_t h, std::vector<float>& buf, F&& f) const {
    const int64_t s = n_sinks[b], q = units[b] * R, t = n_tail[b];
    std::vector<float> sc(D), ze(D);
    int64_t j = 0;
    const auto full_row = [&](const torch::Tensor& x, int64_t pos) {
      const scalar_t* p = x.data_ptr<scalar_t>() + b * x.stride(0) + h * x.stride(1) + pos * x.stride(2);
      for (int64_t c = 0; c < D; ++c) buf[c] = static_cast<float>(p[c]);
      f(j++, buf.data());
    };
    for (int64_t i = 0; i < s; ++i) full_row(sinks, i);
    int64_t p = skip[b];
    while (p < q) {
      const int64_t u = p / R;
      decode_unit<scalar_t>(table[b * U + u], h, buf.data() + D, sc.data(), ze.data());
      for (int64_t r = p % R; r < R; ++r, ++p) f(j++, buf.data() + D + r * D);
    }
    for (; p < q + t; ++p) full_row(tail, p - q);
  }
};

static StreamView view_of(const std::vector<torch::Tensor>& t, const std::vector<int64_t>& opts) {
  // t: payload, scale, zero, table, sinks, tail, n_sinks, skip, units, n_tail; opts: kind, bits, group, token_axis
  TORCH_CHECK(t.size() == 10 && opts.size() == 4, "kvquant kernel: a stream is 10 tensors and 4 options");
  StreamView v;
  v.kind = opts[0];
  v.bits = opts[1];
  v.group = opts[2];
  v.token_axis = opts[3] != 0;
  v.payload = t[0];
  v.scale = t[1];
  v.zero = t[2];
  v.sinks = t[4];
  v.tail = t[5];
  TORCH_CHECK(v.payload.dim() == 4 && v.payload.is_contiguous(), "kvquant kernel: payload must be [N, H, R, Dp]");
  TORCH_CHECK(v.sinks.dim() == 4, "kvquant kernel: sinks must be [B, H, S, D]");
  TORCH_CHECK(v.group >= 1 && v.payload.size(1) >= 1 && v.payload.size(2) >= 1,
              "kvquant kernel: group, heads and tokens per unit must be >= 1");
  v.H = v.payload.size(1);
  v.R = v.payload.size(2);
  v.Dp = v.payload.size(3);
  v.D = v.sinks.size(3);
  TORCH_CHECK(v.D <= 1024, "kvquant kernel: head_dim ", v.D, " > 1024");
  const int64_t N = v.payload.size(0);
  if (v.kind == KIND_INT) {
    TORCH_CHECK(v.bits == 2 || v.bits == 4 || v.bits == 8, "kvquant kernel: bits must be 2, 4 or 8");
    TORCH_CHECK(v.payload.scalar_type() == torch::kByte && v.Dp * (8 / v.bits) == v.D,
                "kvquant kernel: int payload must be uint8 [N, H, R, D * bits / 8]");
    const int64_t n = v.token_axis ? v.D / v.group : v.D;
    TORCH_CHECK(v.group >= 1 && (!v.token_axis || (v.D % v.group == 0 && v.R == 1)) &&
                (v.token_axis || v.R == v.group), "kvquant kernel: group ", v.group, " does not fit the payload");
    TORCH_CHECK(v.scale.is_contiguous() && v.zero.is_contiguous() && v.scale.dim() == 3 &&
                v.scale.size(0) == N && v.scale.size(1) == v.H && v.scale.size(2) == n &&
                v.zero.sizes() == v.scale.sizes() && v.zero.scalar_type() == v.scale.scalar_type(),
                "kvquant kernel: int scales must be contiguous [N, H, ", n, "]");
  } else if (v.kind == KIND_FP8_E4M3 || v.kind == KIND_FP8_E5M2) {
    TORCH_CHECK(v.payload.scalar_type() == (v.kind == KIND_FP8_E4M3 ? torch::kFloat8_e4m3fn : torch::kFloat8_e5m2) &&
                v.R == 1 && v.Dp == v.D, "kvquant kernel: fp8 payload must be [N, H, 1, D] of its fp8 dtype");
    TORCH_CHECK(v.scale.is_contiguous() && v.scale.dim() == 3 && v.scale.size(0) == N && v.scale.size(2) == 1 &&
                (v.scale.size(1) == v.H || v.scale.size(1) == 1), "kvquant kernel: fp8 scales must be [N, H or 1, 1]");
  } else {
    TORCH_CHECK(v.kind == KIND_FULL && v.R == 1 && v.Dp == v.D && v.payload.scalar_type() == v.sinks.scalar_type(),
                "kvquant kernel: unknown stream kind ", v.kind);
  }
  if (v.kind != KIND_INT && v.kind != KIND_FULL) {
    TORCH_CHECK(v.scale.scalar_type() == torch::kFloat || v.scale.scalar_type() == torch::kHalf ||
                v.scale.scalar_type() == torch::kBFloat16, "kvquant kernel: unsupported scale dtype");
  }
  const int64_t B = t[6].dim() == 1 ? t[6].size(0) : -1;
  for (int i = 6; i < 10; ++i)
    TORCH_CHECK(t[i].scalar_type() == torch::kLong && t[i].is_contiguous() && t[i].dim() == 1 && t[i].size(0) == B,
                "kvquant kernel: per-row counts must be four int64 [B] tensors");
  TORCH_CHECK(t[3].scalar_type() == torch::kLong && t[3].dim() == 2 && t[3].is_contiguous() && t[3].size(0) == B,
              "kvquant kernel: table must be a contiguous int64 [B, U]");
  TORCH_CHECK(v.sinks.dim() == 4 && v.tail.dim() == 4 && v.sinks.size(0) == B && v.tail.size(0) == B &&
              v.sinks.size(1) == v.H && v.tail.size(1) == v.H && v.tail.size(3) == v.D &&
              v.sinks.stride(3) == 1 && v.tail.stride(3) == 1 && v.tail.scalar_type() == v.sinks.scalar_type(),
              "kvquant kernel: sinks and tail must be [B, H, *, D] of the model's dtype");
  v.table = t[3].data_ptr<int64_t>();
  v.U = t[3].size(1);
  v.n_sinks = t[6].data_ptr<int64_t>();
  v.skip = t[7].data_ptr<int64_t>();
  v.units = t[8].data_ptr<int64_t>();
  v.n_tail = t[9].data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(v.n_sinks[b] >= 0 && v.n_sinks[b] <= v.sinks.size(2) && v.n_tail[b] >= 0 &&
                v.n_tail[b] <= v.tail.size(2) && v.units[b] >= 0 && v.units[b] <= v.U && v.skip[b] >= 0 &&
                v.skip[b] <= v.units[b] * v.R + v.n_tail[b], "kvquant kernel: row ", b, "'s counts do not fit");
    for (int64_t u = 0; u < v.units[b]; ++u) {
      const int64_t slot = v.table[b * v.U + u];
      TORCH_CHECK(slot >= 0 && slot < N, "kvquant kernel: row ", b, " names slot ", slot, " of a pool of ", N);
    }
  }
  return v;
}

// sum of a[c] * b[c] in 16 interleaved partial sums (a loop the compiler vectorizes), then the rest
static inline float dot_product(const float* a, const float* b, int64_t n) {
  float part[16] = {0.f};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    for (int t = 0; t < 16; ++t) part[t] += a[c + t] * b[c + t];
  float sum = 0.f;
  for (int t = 0; t < 16; ++t) sum += part[t];
  for (; c < n; ++c) sum += a[c] * b[c];
  return sum;
}

template <typename scalar_t>
static void run_attend(const torch::Tensor& query, const StreamView& k, const StreamView& v, const torch::Tensor& lo,
                       const torch::Tensor& hi, double scaling, torch::Tensor& out) {
  const int64_t B = query.size(0), Hq = query.size(1), n = query.size(2), D = query.size(3), H = k.H;
  const int64_t G = Hq / H, Q = G * n;
  const int64_t *lp = lo.data_ptr<int64_t>(), *hp = hi.data_ptr<int64_t>();
  const scalar_t* qp = query.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf((1 + std::max(k.R, v.R)) * D), qf(Q * D), acc(Q * D), m(Q), l(Q);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / H, h = w % H, count = k.count(b);
      std::vector<int64_t> first(Q), last(Q);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* src = qp + ((b * Hq + h * G + g) * n + i) * D;
          for (int64_t c = 0; c < D; ++c) qf[(g * n + i) * D + c] = static_cast<float>(src[c]) * scale;
          first[g * n + i] = lp[b * n + i];
          last[g * n + i] = hp[b * n + i];
        }
      }
      std::vector<float> score(Q * std::max<int64_t>(count, 1));
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      k.walk<scalar_t>(b, h, buf, [&](int64_t j, const float* key) {
        for (int64_t x = 0; x < Q; ++x) {
          if (j < first[x] || j >= last[x]) continue;
          const float dot = dot_product(qf.data() + x * D, key, D);
          score[x * count + j] = dot;
          m[x] = std::max(m[x], dot);
        }
      });
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t x = 0; x < Q; ++x) {
        for (int64_t j = first[x]; j < last[x]; ++j) {
          const float e = std::exp(score[x * count + j] - m[x]);
          score[x * count + j] = e;
          l[x] += e;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      v.walk<scalar_t>(b, h, buf, [&](int64_t j, const float* value) {
        for (int64_t x = 0; x < Q; ++x) {
          if (j < first[x] || j >= last[x]) continue;
          const float p = score[x * count + j];
          float* a = acc.data() + x * D;
          for (int64_t c = 0; c < D; ++c) a[c] += p * value[c];
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t x = g * n + i;
          const float inv = l[x] > 0.f ? 1.f / l[x] : 0.f;
          for (int64_t c = 0; c < D; ++c) acc[x * D + c] *= inv;
          store(acc.data() + x * D, op + ((b * Hq + h * G + g) * n + i) * D, D);
        }
      }
    }
  });
}

// query [B, Hq, n, D] contiguous; lo, hi [B, n] int64: query i of row b reads its read tokens [lo, hi) (none:
// zeros); out like query. Keys and values: see view_of.
void attend_into(const torch::Tensor& query, const std::vector<torch::Tensor>& key, const std::vector<int64_t>& key_opts,
                 const std::vector<torch::Tensor>& value, const std::vector<int64_t>& value_opts,
                 const torch::Tensor& lo, const torch::Tensor& hi, double scaling, torch::Tensor out) {
  const StreamView k = view_of(key, key_opts), v = view_of(value, value_opts);
  TORCH_CHECK(query.dim() == 4 && query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes() &&
              out.scalar_type() == query.scalar_type(), "kvquant kernel: query and out must be contiguous [B, Hq, n, D]");
  const int64_t B = query.size(0), Hq = query.size(1), n = query.size(2), D = query.size(3);
  TORCH_CHECK(k.H >= 1 && k.D == D && v.D == D && k.H == v.H && Hq % k.H == 0 && k.sinks.size(0) == B && v.sinks.size(0) == B,
              "kvquant kernel: query ", query.sizes(), " does not fit the streams");
  TORCH_CHECK(query.scalar_type() == k.sinks.scalar_type() && query.scalar_type() == v.sinks.scalar_type(),
              "kvquant kernel: query and stored tokens must have one dtype");
  for (const auto& t : {lo, hi})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous() && t.dim() == 2 && t.size(0) == B &&
                t.size(1) == n, "kvquant kernel: lo and hi must be contiguous int64 [B, n]");
  const int64_t *lp = lo.data_ptr<int64_t>(), *hp = hi.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(k.count(b) == v.count(b), "kvquant kernel: row ", b, " reads ", k.count(b), " keys and ", v.count(b),
                " values");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(lp[b * n + i] >= 0 && lp[b * n + i] <= hp[b * n + i] && hp[b * n + i] <= k.count(b),
                  "kvquant kernel: row ", b, " query ", i, " reads [", lp[b * n + i], ", ", hp[b * n + i],
                  ") of ", k.count(b), " tokens");
  }
  with_float_type(query.scalar_type(), "query", [&](auto t) {
    run_attend<decltype(t)>(query, k, v, lo, hi, scaling, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_into", &dequantize_into);
  m.def("dequantize_slots_into", &dequantize_slots_into);
  m.def("attend_into", &attend_into);
}
