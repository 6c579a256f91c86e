// Weight-only int8 matmul for a few rows (decode and verify), AVX-512, OpenMP over outputs.
//
// out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in fp32.
// Why not torch's _weight_int8pack_mm: on the 2-core AVX-512 machine it costs 2.4x more for
// 6 rows than for 1 (a verify pass of k = 5), this kernel 1.4x (measured in quant/native.py's
// docstring). Each weight vector is converted once and used for every input row.
#ifndef __AVX512F__
#error "specdecode's int8 kernel needs AVX-512 (the Python side falls back to torch's kernel)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include <type_traits>

static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

template <int M>
static void rows_int8(const float* x, int K, const int8_t* w, int n0, int n1, const float* scale,
                      const float* bias, void* out, int N, int out_bf16) {
  for (int n = n0; n < n1; ++n) {
    const int8_t* wr = w + (int64_t)n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + k))));
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (int64_t)m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[m]);
      for (int kk = k; kk < K; ++kk) s += x[(int64_t)m * K + kk] * (float)wr[kk];
      s *= scale[n];
      if (bias) s += bias[n];
      if (out_bf16)
        ((uint16_t*)out)[(int64_t)m * N + n] = f32_to_bf16(s);
      else
        ((float*)out)[(int64_t)m * N + n] = s;
    }
  }
}

// The fast path (AVX512-VNNI, K a multiple of XBLOCK): each row of x is rounded to int16 in
// blocks of XBLOCK inputs with one fp32 scale per block (max |x| in the block -> 32767), and
// vpdpwssd multiplies 32 int16 x int8 pairs per instruction into int32; each block's integer
// sum is scaled into an fp32 accumulator. Why: the fp32 loop spends two arithmetic
// instructions (int->float conversion, FMA) per 16 weights on the port both use, which capped
// it at ~8 GB/s of weights per core; this needs ~6 per 128. The rounding of x adds an error of
// at most max|x_block| / 65534 per element, 1/128 of the bf16 rounding x already carries at
// the block's largest element. Integer sums cannot overflow: 128 * 32767 * 127 < 2^31.
#define XBLOCK 128
#define PREFETCH_AHEAD 2048  // bytes; 512 gave 71 ms, 2048 61 ms, 4096 60 ms
#ifdef __AVX512VNNI__
template <int M>
static void rows_int8_vnni(const int16_t* xq, const float* xs, int K, const int8_t* w, int n0, int n1,
                           const float* scale, const float* bias, void* out, int N, int out_bf16) {
  const int blocks = K / XBLOCK;
  for (int n = n0; n < n1; ++n) {
    const int8_t* wr = w + (int64_t)n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b) {
      const int8_t* wb = wr + b * XBLOCK;
      // Software prefetch 2 KB ahead in the weight stream (across row ends too; a prefetch
      // past the buffer cannot fault). The hardware prefetcher alone left this loop at
      // 81 ms per forward's matmuls at 1 row; 2 KB ahead took it to 61 ms, 25 GB/s.
      _mm_prefetch((const char*)(wb + PREFETCH_AHEAD), _MM_HINT_T0);
      _mm_prefetch((const char*)(wb + PREFETCH_AHEAD + 64), _MM_HINT_T0);
      __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wb)));
      __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wb + 32)));
      __m512i w2 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wb + 64)));
      __m512i w3 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wb + 96)));
      for (int m = 0; m < M; ++m) {
        const int16_t* xb = xq + (int64_t)m * K + b * XBLOCK;
        __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xb), w0);
        s = _mm512_dpwssd_epi32(s, _mm512_loadu_si512(xb + 32), w1);
        s = _mm512_dpwssd_epi32(s, _mm512_loadu_si512(xb + 64), w2);
        s = _mm512_dpwssd_epi32(s, _mm512_loadu_si512(xb + 96), w3);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xs[(int64_t)m * blocks + b]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[m]) * scale[n];
      if (bias) s += bias[n];
      if (out_bf16)
        ((uint16_t*)out)[(int64_t)m * N + n] = f32_to_bf16(s);
      else
        ((float*)out)[(int64_t)m * N + n] = s;
    }
  }
}

static void quantize_x_int16(const float* xf, int M, int K, int16_t* xq, float* xs) {
  const int blocks = K / XBLOCK;
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < blocks; ++b) {
      const float* src = xf + (int64_t)m * K + b * XBLOCK;
      float amax = 0.f;
      for (int i = 0; i < XBLOCK; ++i) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
      float step = amax > 0.f ? amax / 32767.f : 1.f;
      float inv = 1.f / step;
      int16_t* dst = xq + (int64_t)m * K + b * XBLOCK;
      for (int i = 0; i < XBLOCK; ++i) dst[i] = (int16_t)lrintf(src[i] * inv);
      xs[(int64_t)m * blocks + b] = step;
    }
  }
}
#endif

// Calls body(std::integral_constant<int, M>{}) for the row count M (1..8): the row loops are
// templates on M so that their accumulators stay in registers.
template <typename Body>
static void with_rows(int M, Body&& body) {
  switch (M) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    case 3: body(std::integral_constant<int, 3>{}); break;
    case 4: body(std::integral_constant<int, 4>{}); break;
    case 5: body(std::integral_constant<int, 5>{}); break;
    case 6: body(std::integral_constant<int, 6>{}); break;
    case 7: body(std::integral_constant<int, 7>{}); break;
    default: body(std::integral_constant<int, 8>{}); break;
  }
}

// Runs body(n0, n1) on each thread's contiguous share [n0, n1) of the N outputs.
template <typename Body>
static void parallel_outputs(int N, int threads, Body&& body) {
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int chunk = (N + nt - 1) / nt;
    int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    if (n0 < n1) body(n0, n1);
  }
}

// x: (M, K) bf16 (x_bf16 = 1) or fp32; out: (M, N) of the same dtype; xbuf: M * K floats of scratch.
// Returns 0, or -1 when M is outside 1..SPECDECODE_MAX_ROWS.
extern "C" int specdecode_int8_gemm(const void* x, int x_bf16, int M, int K, const int8_t* w, int N,
                                    const float* scale, const float* bias, void* out, float* xbuf,
                                    int16_t* xq, int threads) {
  if (M < 1 || M > 8) return -1;
  const float* xf = (const float*)x;
  if (x_bf16) {
    for (int64_t i = 0; i < (int64_t)M * K; ++i) xbuf[i] = bf16_to_f32(((const uint16_t*)x)[i]);
    xf = xbuf;
  }
#ifdef __AVX512VNNI__
  if (xq && K % XBLOCK == 0) {
    // Scales go after the M * K int16 values in the same scratch buffer.
    float* xs = (float*)(xq + (int64_t)M * K);
    quantize_x_int16(xf, M, K, xq, xs);
    parallel_outputs(N, threads, [&](int n0, int n1) {
      with_rows(M, [&](auto rows) { rows_int8_vnni<decltype(rows)::value>(xq, xs, K, w, n0, n1, scale, bias, out, N, x_bf16); });
    });
    return 0;
  }
#endif
  parallel_outputs(N, threads, [&](int n0, int n1) {
    with_rows(M, [&](auto rows) { rows_int8<decltype(rows)::value>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); });
  });
  return 0;
}
