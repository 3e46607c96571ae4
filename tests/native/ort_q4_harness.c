/* kernels/ort_q4.c's arithmetic on raw buffers, for CPUs this machine can only emulate (tests/test_ort_q4_aarch64.py
 * builds it for AArch64 and runs it under qemu-user; the same file built for the host gives the reference).
 * Cases come on stdin, one after another, little-endian, each answered on stdout:
 *   int32 kind (0 matmul, 1 attention), int32 threads, then
 *   matmul:    int32 m, k, n, group, glu, int8, bits; float x[m k]; uint32 codes[n k / 64 (bits == 8 ? 16 : 8)];
 *              uint16 scales[n k / group], mins[n k / group]             -> float y[m (glu ? n / 2 : n)]
 *   attention: int32 b, t, h, kv, hd, s, positions, rot; float scale; float qkv[b t (h + 2 kv) hd];
 *              float k[b kv s hd], v[b kv s hd]; int32 seqlens[b]; float cos[positions rot / 2], sin[same]
 *              -> int32 rc; float out[b t h hd], k, v
 */
#include "../../kernels/ort_q4.c"

#include <stdio.h>

static void *take(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p || fread(p, 1, bytes, stdin) != bytes) exit(2);
  return p;
}

static int take_int(void) {
  int32_t v;
  if (fread(&v, 4, 1, stdin) != 1) exit(2);
  return v;
}

static void give(const void *p, size_t bytes) {
  if (fwrite(p, 1, bytes, stdout) != bytes) exit(3);
}

int main(void) {
  int32_t kind;
  while (fread(&kind, 4, 1, stdin) == 1) {
    orin_q4_set_threads(take_int());
    if (kind == 0) {
      const int m = take_int(), k = take_int(), n = take_int(), group = take_int(), glu = take_int(),
                int8 = take_int(), bits = take_int(), gk = k / group;
      float *x = take(sizeof(float) * (size_t)m * k);
      uint32_t *codes = take(sizeof(uint32_t) * (size_t)n * (k / 64) * (bits == 8 ? 16 : 8));
      uint16_t *scales = take(2 * (size_t)n * gk), *mins = take(2 * (size_t)n * gk);
      const size_t outs = (size_t)m * (glu ? n / 2 : n);
      float *y = malloc(sizeof(float) * outs);
      orin_q4_matmul(x, m, k, n, codes, scales, mins, group, glu, int8, bits, y);
      give(y, sizeof(float) * outs);
      free(x), free(codes), free(scales), free(mins), free(y);
    } else {
      const int b = take_int(), t = take_int(), h = take_int(), kv = take_int(), hd = take_int(), s = take_int(),
                positions = take_int(), rot = take_int();
      float scale;
      if (fread(&scale, 4, 1, stdin) != 1) exit(2);
      const size_t cache = (size_t)b * kv * s * hd, outs = (size_t)b * t * h * hd;
      float *qkv = take(sizeof(float) * (size_t)b * t * (h + 2 * kv) * hd), *kc = take(sizeof(float) * cache),
            *vc = take(sizeof(float) * cache);
      int32_t *seqlens = take(4 * (size_t)b);
      float *cos = take(sizeof(float) * (size_t)positions * (rot / 2)), *sin = take(sizeof(float) * (size_t)positions * (rot / 2));
      float *out = calloc(outs, sizeof(float));
      const int32_t rc = orin_q4_attention(qkv, b, t, h, kv, hd, kc, vc, s, seqlens, cos, sin, positions, rot, scale, out);
      give(&rc, 4);
      give(out, sizeof(float) * outs);
      give(kc, sizeof(float) * cache);
      give(vc, sizeof(float) * cache);
      free(qkv), free(kc), free(vc), free(seqlens), free(cos), free(sin), free(out);
    }
    fflush(stdout);
  }
  return 0;
}
