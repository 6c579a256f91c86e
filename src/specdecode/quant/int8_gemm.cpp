// Weight-only int8 matmul for a few rows (decode and verify), AVX-512, OpenMP over outputs.
//
// out[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in fp32.
// Why not torch's _weight_int8pack_mm: on the 2-core AVX-512 machine it costs 2.3x more for
// 6 rows than for 1 (a verify pass of k = 5), this loop 1.4x (measured in quant/native.py's
// docstring). Each weight row is converted once and used for every input row.
#ifndef __AVX512F__
#error "specdecode's int8 kernel needs AVX-512 (the Python side falls back to torch's kernel)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

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

// x: (M, K) bf16 (x_bf16 = 1) or fp32; out: (M, N) of the same dtype; xbuf: M * K floats of scratch.
// Returns 0, or -1 when M is outside 1..SPECDECODE_MAX_ROWS.
extern "C" int specdecode_int8_gemm(const void* x, int x_bf16, int M, int K, const int8_t* w, int N,
                                    const float* scale, const float* bias, void* out, float* xbuf,
                                    int threads) {
  if (M < 1 || M > 8) return -1;
  const float* xf = (const float*)x;
  if (x_bf16) {
    for (int64_t i = 0; i < (int64_t)M * K; ++i) xbuf[i] = bf16_to_f32(((const uint16_t*)x)[i]);
    xf = xbuf;
  }
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int chunk = (N + nt - 1) / nt;
    int n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    if (n0 < n1) {
      switch (M) {
        case 1: rows_int8<1>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
        case 2: rows_int8<2>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
        case 3: rows_int8<3>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
        case 4: rows_int8<4>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
        case 5: rows_int8<5>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
        case 6: rows_int8<6>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
        case 7: rows_int8<7>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
        default: rows_int8<8>(xf, K, w, n0, n1, scale, bias, out, N, x_bf16); break;
      }
    }
  }
  return 0;
}
