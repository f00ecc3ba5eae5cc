// int_matmul.cpp's row dots for a CPU with neither AVX-512 nor AVX2 + FMA: the same 32-lane order in plain C++
// (included inside its anonymous namespace, after ScaleKind, kE2M1 and scale_at).
#pragma once

inline float lanes_sum(const float* a) {
  float v[8];
  for (int j = 0; j < 8; ++j) v[j] = (a[j] + a[8 + j]) + (a[16 + j] + a[24 + j]);
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

float dot8(const int8_t* q, const float* x, int64_t K, int64_t group, const void* s, ScaleKind sk, int64_t s0) {
  float a[32] = {0}, rest = 0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    float t[32] = {0}, tail = 0;
    int64_t k = g0;
    for (; k + 32 <= g0 + group; k += 32)
      for (int j = 0; j < 32; ++j) t[j] += float(q[k + j]) * x[k + j];
    for (; k < g0 + group; ++k) tail += float(q[k]) * x[k];
    float sc = scale_at(s, sk, gi);
    rest += sc * tail;
    for (int j = 0; j < 32; ++j) a[j] += sc * t[j];
  }
  return lanes_sum(a) + rest;
}

float dot4(const uint8_t* q, const float* xp, int64_t K, int64_t group, const void* s, ScaleKind sk, int64_t s0) {
  float a[32] = {0};
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    float t[32] = {0};
    for (int64_t k = g0; k < g0 + group; k += 32)
      for (int j = 0; j < 16; ++j) {
        uint8_t b = q[k / 2 + j];
        int lane = j < 8 ? j : 8 + (j - 8);  // even elements fill lanes 0..15, odd ones 16..31
        t[lane] += (sk == kE8M0 ? kE2M1[b & 15] : float(int(b & 15) - 8)) * xp[k + j];
        t[16 + lane] += (sk == kE8M0 ? kE2M1[b >> 4] : float(int(b >> 4) - 8)) * xp[k + 16 + j];
      }
    float sc = scale_at(s, sk, gi);
    for (int j = 0; j < 32; ++j) a[j] += sc * t[j];
  }
  return lanes_sum(a);
}
