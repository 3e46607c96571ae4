/* orin-agent's exact 4- and 8-bit weight-only matmul as an ONNX Runtime custom operator (kernels/ort_q4.py builds and
 * loads this file; partition/build/ort_decoder.py emits the nodes).
 *
 *   orin_agent.Q4MatMul(X float (..., K), codes uint32 (N, K / 64, 8), scales, mins float16 (N, K / G))
 *       (codes uint32 (N, K / 64, 16): 8-bit codes, one byte a weight in column order, GGUF's Q8_0 as q + 128 with
 *       minimum -128 d; the same arithmetic on bytes widened to 8 lanes)
 *       -> Y float (..., N)               Y = X @ (scales * q + mins)^T, per group of G columns (G a multiple of 32)
 *   attribute glu = 1: the rows come in tiles of 8 (4 gate rows, then the 4 up rows of the same outputs) and
 *       Y (..., N / 2) = silu(gate) * up, the MLP's gate/up projection and its activation in one node.
 *   orin_agent.Q4MatMulSkipNorm(X, codes, scales, mins, skip float (..., N), gamma float (N,)) -> Y, S float (..., N):
 *       the product, then onnxruntime's SkipSimplifiedLayerNormalization on it: S = X W^T + skip, Y = RMSNorm(S) *
 *       gamma (attribute epsilon), the residual stream's add and the next norm in the projection's node.
 *   attribute int8 = 1: codes in byte order and x rounded to int8 per 64 columns, for one to three rows of x (more
 *       dequantise as above): NOT exact, for the output head's candidates only, whose top logits the decoder
 *       recomputes exactly (partition/build/ort_decoder.py, _rescored_head).
 *   orin_agent.CacheAttention(qkv, past_key, past_value, seqlens_k, total_sequence_length, cos, sin)
 *       -> out, present_key, present_value: com.microsoft GroupQueryAttention as the decoder graph runs it (packed
 *       qkv, do_rotary = 1, rotary_interleaved = 0, each present bound to its past's buffer), on the team below;
 *       attn_compute's comment has the details.
 *
 * Codes are in "lanes" order: per row, 64 columns at a time as 8 uint32 words, nibble j of word l = column 8 j + l,
 * so one shift and one mask give 8 consecutive columns' codes in 8 SIMD lanes. Arithmetic is fp32 throughout:
 * one row of X at a time, per 32 columns sum(q * x) in fp32, times the group's scale, plus the group's minimum
 * times the sum of those 32 x; several rows of X at a time (prefill) dequantise 4 weight rows once into fp32 and
 * take fp32 dot products. Either is the dequantised float model's product to fp32 rounding (no int8 activations).
 * The loops come in three forms: AVX2 + FMA + F16C (x86), NEON (AArch64: an Orin's Cortex-A78AE; the decode loops,
 * the prefill's dot products and the attention's value sums; tested under qemu-user, never run on an Orin), and
 * plain C for the rest and for any other CPU (-DQ4_PORTABLE forces it).
 *
 * Threads: a team of this library's own (orin_q4_set_threads), the caller plus threads - 1 workers that spin
 * for a while after each call and then sleep on a condition variable, taking chunks of weight rows from a shared
 * counter. ONNX Runtime's own pool is not reachable from a custom operator of this API version; the decoder's
 * session runs ONNX Runtime on one thread beside the team (partition/runners/ort_decoder_runner.py).
 *
 * The ONNX Runtime C API is used through its function table (OrtApi), whose order is append-only and stable
 * across releases; only entries of its first version (onnxruntime 1.2) are used, at the positions that
 * onnxruntime's include/onnxruntime/core/session/onnxruntime_c_api.h gives them, and the OrtCustomOp structure is
 * filled in its version-8 layout (onnxruntime 1.8), which every later release accepts. No header of
 * ONNX Runtime is needed to build this file: none ships in the packages this project can install.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(Q4_PORTABLE)
#include <immintrin.h>
#define Q4_AVX2 1
#else
#define Q4_AVX2 0 /* the plain C loops (any CPU; -DQ4_PORTABLE forces them, as the tests do on x86) */
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(Q4_PORTABLE)
#include <arm_neon.h>
#define Q4_NEON 1 /* an Orin's Cortex-A78AE and any AArch64 CPU: 128-bit NEON forms of the decode loops */
#else
#define Q4_NEON 0
#endif

/* ---- the part of ONNX Runtime's C API used here ---- */
typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtTensorTypeAndShapeInfo OrtShape;
typedef void *const *OrtApiTable;
typedef struct {
  OrtApiTable (*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

enum { /* positions in OrtApi (version 1 of the API) */
  API_CREATE_CUSTOM_OP_DOMAIN = 26, API_CUSTOM_OP_DOMAIN_ADD = 27, API_ADD_CUSTOM_OP_DOMAIN = 28,
  API_GET_TENSOR_MUTABLE_DATA = 51, API_GET_DIMENSIONS_COUNT = 61, API_GET_DIMENSIONS = 62,
  API_GET_TENSOR_TYPE_AND_SHAPE = 65, API_KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
  API_KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
  API_KERNEL_CONTEXT_GET_INPUT = 90, API_KERNEL_CONTEXT_GET_OUTPUT = 91, API_RELEASE_STATUS = 93,
  API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99
};
enum { TYPE_FLOAT = 1, TYPE_INT32 = 6, TYPE_FLOAT16 = 10, TYPE_UINT32 = 12 };
#define CUSTOM_OP_VERSION 8

typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info);
  const char *(*GetName)(const struct OrtCustomOp *op);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
  int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
  int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
  void (*KernelCompute)(void *kernel, OrtKernelContext *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
} OrtCustomOp;

typedef void (*ReleaseStatusFn)(OrtStatus *);
typedef OrtStatus *(*CreateCustomOpDomainFn)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*CustomOpDomainAddFn)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
typedef OrtStatus *(*AddCustomOpDomainFn)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *ctx, size_t index, const OrtValue **out);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *ctx, size_t index, const int64_t *dims, size_t n, OrtValue **out);
typedef OrtStatus *(*GetDataFn)(OrtValue *value, void **out);
typedef OrtStatus *(*GetShapeFn)(const OrtValue *value, OrtShape **out);
typedef OrtStatus *(*GetDimsCountFn)(const OrtShape *info, size_t *out);
typedef OrtStatus *(*GetDimsFn)(const OrtShape *info, int64_t *dims, size_t n);
typedef void (*ReleaseShapeFn)(OrtShape *);
typedef OrtStatus *(*GetAttrIntFn)(const OrtKernelInfo *info, const char *name, int64_t *out);
typedef OrtStatus *(*GetAttrFloatFn)(const OrtKernelInfo *info, const char *name, float *out);

static OrtApiTable api;
#define API(type, index) ((type)api[index])

/* ---- the thread team ---- */
#define MAX_THREADS 64
#define SPIN_NS 2000000L /* a worker spins this long after a call before it sleeps (a decode step's calls come
                            every few tens of microseconds; a pause between requests lets it sleep) */
typedef void (*task_fn)(void *arg, int part, int parts);
/* rows4 prefetches the codes this many rows ahead: 4 (the next row group) streamed SmolLM2's 120 projections (66 MB,
   2 threads, from memory) in 4.94 ms against 5.70 without, 5.03 at 8 rows and 5.26 at 16 (the fastest of 9 rounds of
   5, interleaved; the loop that is now scripts/bench_weight_only.py --stream, with the 64-row chunks of then) */
#define PREFETCH_ROWS 4
#define CHUNK_ROWS 64 /* a thread's grab of rows is worked in pieces of at most this many (a multiple of 8) */
static struct {
  pthread_mutex_t lock;
  pthread_cond_t wake;
  atomic_uint gen;
  atomic_int sleepers, done;
  task_fn fn;
  void *arg;
  int threads, started;
  pthread_t ids[MAX_THREADS];
} team = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL, NULL, 1, 1, {0}};
static pthread_mutex_t team_setup = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

typedef struct {
  int part;
  unsigned gen; /* the call count when the worker was made: it answers every later call */
} start_args;

static void *worker(void *p) {
  start_args a = *(start_args *)p;
  free(p);
  int part = a.part;
  unsigned seen = a.gen;
  for (;;) {
    long until = now_ns() + SPIN_NS;
    int n = 0;
    while (atomic_load_explicit(&team.gen, memory_order_acquire) == seen) {
      cpu_relax();
      if (++n % 1024 == 0 && now_ns() > until) {
        pthread_mutex_lock(&team.lock);
        atomic_fetch_add(&team.sleepers, 1);
        while (atomic_load(&team.gen) == seen) pthread_cond_wait(&team.wake, &team.lock);
        atomic_fetch_sub(&team.sleepers, 1);
        pthread_mutex_unlock(&team.lock);
      }
    }
    seen = atomic_load(&team.gen);
    if (part < team.threads) team.fn(team.arg, part, team.threads);
    atomic_fetch_add_explicit(&team.done, 1, memory_order_acq_rel);
  }
  return NULL;
}

static void forget_team(void);
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_team); }

/* A forked child has none of the workers (fork copies only the calling thread): it starts again with no team. */
static void forget_team(void) {
  pthread_mutex_init(&team_setup, NULL);
  pthread_mutex_init(&team.lock, NULL);
  pthread_cond_init(&team.wake, NULL);
  atomic_store(&team.sleepers, 0);
  team.started = team.threads = 1;
}

/* Threads for every later call, the caller included (1: no workers). Workers are started once and kept. */
int orin_q4_set_threads(int threads) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, register_fork_handler);
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  pthread_mutex_lock(&team_setup);
  for (; team.started < threads; team.started++) {
    start_args *a = malloc(sizeof(start_args));
    if (!a) break;
    a->part = team.started;
    a->gen = atomic_load(&team.gen); /* no call runs meanwhile: run_team holds team_setup too */
    if (pthread_create(&team.ids[team.started], NULL, worker, a) != 0) {
      free(a);
      break;
    }
  }
  team.threads = team.started < threads ? team.started : threads;
  pthread_mutex_unlock(&team_setup);
  return team.threads;
}

int orin_q4_threads(void) { return team.threads; }

static void run_team(task_fn fn, void *arg) {
  int workers = team.started - 1; /* every started worker answers each call; those past `threads` do nothing */
  if (team.threads == 1 || workers == 0) {
    fn(arg, 0, 1);
    return;
  }
  pthread_mutex_lock(&team_setup); /* one call at a time: sessions on several Python threads share the team */
  team.fn = fn;
  team.arg = arg;
  atomic_store(&team.done, 0);
  atomic_fetch_add(&team.gen, 1);
  if (atomic_load(&team.sleepers) > 0) {
    pthread_mutex_lock(&team.lock);
    pthread_cond_broadcast(&team.wake);
    pthread_mutex_unlock(&team.lock);
  }
  fn(arg, 0, team.threads);
  while (atomic_load_explicit(&team.done, memory_order_acquire) < workers) cpu_relax();
  pthread_mutex_unlock(&team_setup);
}

/* ---- the arithmetic ---- */
typedef struct {
  const float *x;     /* (m, k) */
  const float *xg;    /* (m, k / group): sums of x over each group of columns (the minimums' term) */
  const float *xs;    /* (m, k): x scaled per nibble for the AVX2 and NEON rows4 (scale_nibbles), or NULL */
  const uint32_t *codes;
  const uint16_t *scales, *mins; /* IEEE half precision: GGUF's own d and m, exactly */
  float *y;           /* (m, n) or (m, n / 2) with glu */
  int m, k, n, group, glu;
  int shift;          /* log2(group / 32): the group of a 32-column block b is b >> shift */
  int chunk;          /* a thread's grab takes 1 / chunk of the weight rows left */
  atomic_int next;    /* the next chunk of weight rows a thread takes */
  /* int8 = 1 (candidates only: not exact): codes in byte order, x rounded to int8 per 64 columns */
  int int8;
  int bits;           /* 4, or 8: codes one byte a weight in column order (GGUF's Q8_0 as q + 128, zero point 128) */
  const int8_t *xq;   /* (m, k) */
  const float *xqs;   /* (m, k / 64): the 64 columns' max |x| / 127 */
  const float *xt;    /* AVX2, m >= 4: x as transposed blocks of 16 rows (transpose_x), or NULL */
} problem;

#if Q4_AVX2
/* the sum of a vector's 8 lanes */
static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_hadd_ps(a, a);
  return _mm_cvtss_f32(_mm_hadd_ps(a, a));
}

/* exp(x) for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial), within a few
   ulp of expf over its range; the MLP's silu over a whole row without a libm call per element */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u */
static void silu_mul(const float *g, const float *u, float *out, int count) {
  int i = 0;
#if Q4_AVX2
  for (; i + 8 <= count; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < count; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* an IEEE half as a float (exact: every half is a float) */
static inline float h2f(uint16_t h) {
#if Q4_AVX2
  return _cvtsh_ss(h);
#elif Q4_NEON
  __fp16 f;
  memcpy(&f, &h, 2);
  return (float)f;
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, f = h & 1023;
  uint32_t bits;
  if (e == 31) {
    bits = sign | 0x7F800000u | (f << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (f << 13);
  } else { /* zero or subnormal: f * 2^-24 */
    float v = (float)f * 5.9604644775390625e-8f;
    memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
#endif
}

/* the sum of n floats, n a multiple of 32 */
static inline float vsum(const float *a, int n) {
#if Q4_AVX2
  __m256 s0 = _mm256_loadu_ps(a), s1 = _mm256_loadu_ps(a + 8), s2 = _mm256_loadu_ps(a + 16),
         s3 = _mm256_loadu_ps(a + 24);
  for (int i = 32; i < n; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(a + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(a + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(a + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(a + i + 24));
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#elif Q4_NEON
  float32x4_t s0 = vld1q_f32(a), s1 = vld1q_f32(a + 4), s2 = vld1q_f32(a + 8), s3 = vld1q_f32(a + 12);
  for (int i = 16; i < n; i += 16) {
    s0 = vaddq_f32(s0, vld1q_f32(a + i));
    s1 = vaddq_f32(s1, vld1q_f32(a + i + 4));
    s2 = vaddq_f32(s2, vld1q_f32(a + i + 8));
    s3 = vaddq_f32(s3, vld1q_f32(a + i + 12));
  }
  return vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
#else
  float s = 0;
  for (int i = 0; i < n; i++) s += a[i];
  return s;
#endif
}

static inline float dot(const float *a, const float *b, int k) {
#if Q4_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= k; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < k; i++) s += a[i] * b[i];
  return s;
#elif Q4_NEON
  float32x4_t s0 = vdupq_n_f32(0), s1 = vdupq_n_f32(0);
  int i = 0;
  for (; i + 8 <= k; i += 8) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
    s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
  }
  float s = vaddvq_f32(vaddq_f32(s0, s1));
  for (; i < k; i++) s += a[i] * b[i];
  return s;
#else
  float s = 0;
  for (int i = 0; i < k; i++) s += a[i] * b[i];
  return s;
#endif
}

/* sum of h[i] * b[i], h in half precision */
static inline float dot_h(const uint16_t *h, const float *b, int k) {
  int i = 0;
  float s = 0;
#if Q4_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#elif Q4_NEON
  float32x4_t acc = vdupq_n_f32(0);
  for (; i + 4 <= k; i += 4) acc = vfmaq_f32(acc, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))), vld1q_f32(b + i));
  s = vaddvq_f32(acc);
#endif
  for (; i < k; i++) s += h2f(h[i]) * b[i];
  return s;
}

/* Contracting a dequantised weight's product and sum into one FMA would round it unlike the float model: off for
   that function. (GCC's own vectoriser rewrites the intrinsic loops below for the worse, 1.4x slower here; the
   build turns it off on x86, kernels/ort_q4.py FLAGS, where these loops are the AVX2 ones.) */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACT
#endif

/* Four weight rows against one row of x (each load of x serves the four): per 32 columns s = sum(q * x) in fp32,
   acc += scale * s; the codes of the rows after these are prefetched meanwhile. The AVX2 and NEON loops take x
   pre-scaled (`scale_nibbles`): nibble n of a word is masked in place, its value q 16^n converted exactly, and multiplied by
   x 16^-n, the same fp32 product q x; an AND, a convert and an FMA per 8 weights instead of a shift too (nibble 7,
   whose value would set the sign bit, is shifted down instead, against x as it is). The plain C loop takes x as it
   is. */
static void rows4(const float *x, const uint32_t *c0, int words, const uint16_t *d0, int gk, int k, int shift,
                  float *res) {
#if Q4_AVX2
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const char *next = (const char *)(c0 + (size_t)PREFETCH_ROWS * words);
  for (int i = 0; i < k / 64; i++) {
    __m256i v[4];
    for (int r = 0; r < 4; r++) v[r] = _mm256_loadu_si256((const __m256i *)(c0 + (size_t)r * words + 8 * i));
    if (i % 2 == 0)
      for (int r = 0; r < 4; r++) _mm_prefetch(next + 4 * ((size_t)r * words + 8 * i), _MM_HINT_T0);
    for (int h = 0; h < 2; h++) {
      __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int j = 0; j < 4; j++) {
        const int nib = 4 * h + j;
        __m256 xv = _mm256_loadu_ps(x + 64 * i + 8 * nib);
        for (int r = 0; r < 4; r++)
          s[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(nib == 7 ? _mm256_srli_epi32(v[r], 28)
                                                             : _mm256_and_si256(v[r], _mm256_set1_epi32(15 << 4 * nib))),
                                 xv, s[r]);
      }
      const int gi = (2 * i + h) >> shift;
      for (int r = 0; r < 4; r++) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(d0[(size_t)r * gk + gi])), s[r], acc[r]);
    }
  }
  for (int r = 0; r < 4; r++) res[r] = hsum(acc[r]);
#elif Q4_NEON
  /* the same form in two 4-lane halves: words 0-3 of each 64 columns hold columns 8 n + 0..3, words 4-7 8 n + 4..7 */
  float32x4_t acc[4][2];
  for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = vdupq_n_f32(0);
  const uint32_t *next = c0 + (size_t)PREFETCH_ROWS * words;
  for (int i = 0; i < k / 64; i++) {
    uint32x4_t v[4][2];
    for (int r = 0; r < 4; r++) {
      v[r][0] = vld1q_u32(c0 + (size_t)r * words + 8 * i);
      v[r][1] = vld1q_u32(c0 + (size_t)r * words + 8 * i + 4);
      if (i % 2 == 0) __builtin_prefetch(next + (size_t)r * words + 8 * i);
    }
    for (int h = 0; h < 2; h++) {
      float32x4_t sm[4][2];
      for (int r = 0; r < 4; r++) sm[r][0] = sm[r][1] = vdupq_n_f32(0);
      for (int j = 0; j < 4; j++) {
        const int nib = 4 * h + j;
        const float32x4_t x0 = vld1q_f32(x + 64 * i + 8 * nib), x1 = vld1q_f32(x + 64 * i + 8 * nib + 4);
        for (int r = 0; r < 4; r++)
          for (int half = 0; half < 2; half++) {
            const uint32x4_t q = nib == 7 ? vshrq_n_u32(v[r][half], 28) : vandq_u32(v[r][half], vdupq_n_u32(15u << 4 * nib));
            sm[r][half] = vfmaq_f32(sm[r][half], vcvtq_f32_u32(q), half ? x1 : x0);
          }
      }
      const int gi = (2 * i + h) >> shift;
      for (int r = 0; r < 4; r++) {
        const float d = h2f(d0[(size_t)r * gk + gi]);
        acc[r][0] = vfmaq_n_f32(acc[r][0], sm[r][0], d);
        acc[r][1] = vfmaq_n_f32(acc[r][1], sm[r][1], d);
      }
    }
  }
  for (int r = 0; r < 4; r++) res[r] = vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1]));
#else
  for (int r = 0; r < 4; r++) {
    const uint32_t *c = c0 + (size_t)r * words;
    float acc = 0;
    for (int b = 0; b < k / 32; b++) {
      float lanes[8] = {0};
      const int i = b / 2, h = b % 2;
      for (int j = 0; j < 4; j++)
        for (int l = 0; l < 8; l++)
          lanes[l] += (float)((c[8 * i + l] >> (16 * h + 4 * j)) & 15) * x[32 * b + 8 * j + l];
      float sum = 0;
      for (int l = 0; l < 8; l++) sum += lanes[l];
      acc += h2f(d0[(size_t)r * gk + (b >> shift)]) * sum;
    }
    res[r] = acc;
  }
#endif
}

/* The int8 form, for a head's candidates (whose top logits are recomputed exactly after): codes in byte order (per
   64 columns 32 bytes, byte b = column b in its low nibble, column 32 + b in its high one) against x rounded to
   int8 per 64 columns; per 64 columns two maddubs and one madd, against the fp32 form's 32 operations. */
static void rows4_i8(const int8_t *xq, const float *xqs, const uint8_t *c0, int bytes, const uint16_t *d0, int gk,
                     int k, int shift, float *res) {
#if Q4_AVX2
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int i = 0; i < k / 64; i++) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * i)),
                  x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * i + 32));
    const int g = (2 * i) >> shift;
    for (int r = 0; r < 4; r++) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(c0 + (size_t)r * bytes + 32 * i));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      /* |q x| <= 15 * 127 a product, 4 products a 16-bit lane: no saturation */
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
      const __m256i sum = _mm256_madd_epi16(pairs, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(h2f(d0[(size_t)r * gk + g]) * xqs[i]), acc[r]);
    }
  }
  for (int r = 0; r < 4; r++) res[r] = hsum(acc[r]);
#else
  for (int r = 0; r < 4; r++) {
    float acc = 0;
    for (int i = 0; i < k / 64; i++) {
      int32_t dot = 0;
      for (int b = 0; b < 32; b++) {
        const uint8_t byte = c0[(size_t)r * bytes + 32 * i + b];
        dot += (byte & 15) * xq[64 * i + b] + (byte >> 4) * xq[64 * i + 32 + b];
      }
      acc += (float)dot * (h2f(d0[(size_t)r * gk + ((2 * i) >> shift)]) * xqs[i]);
    }
    res[r] = acc;
  }
#endif
}

/* 8-bit codes: per 32 columns sum(q * x) in fp32 (each 8 bytes widened to 8 lanes), times the scale; 4 rows share x */
static void rows4_q8(const float *x, const uint8_t *c0, int k, const uint16_t *d0, int gk, int shift, float *res) {
#if Q4_AVX2
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int b = 0; b < k / 32; b++) {
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < 4; j++) {
      const __m256 xv = _mm256_loadu_ps(x + 32 * b + 8 * j);
      for (int r = 0; r < 4; r++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(c0 + (size_t)r * k + 32 * b + 8 * j));
        s[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), xv, s[r]);
      }
    }
    for (int r = 0; r < 4; r++)
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(d0[(size_t)r * gk + (b >> shift)])), s[r], acc[r]);
  }
  for (int r = 0; r < 4; r++) res[r] = hsum(acc[r]);
#elif Q4_NEON
  float32x4_t acc[4];
  for (int r = 0; r < 4; r++) acc[r] = vdupq_n_f32(0);
  for (int b = 0; b < k / 32; b++) {
    float32x4_t sm[4][2];
    for (int r = 0; r < 4; r++) sm[r][0] = sm[r][1] = vdupq_n_f32(0);
    for (int j = 0; j < 4; j++) {
      const float32x4_t x0 = vld1q_f32(x + 32 * b + 8 * j), x1 = vld1q_f32(x + 32 * b + 8 * j + 4);
      for (int r = 0; r < 4; r++) {
        const uint16x8_t q = vmovl_u8(vld1_u8(c0 + (size_t)r * k + 32 * b + 8 * j));
        sm[r][0] = vfmaq_f32(sm[r][0], vcvtq_f32_u32(vmovl_u16(vget_low_u16(q))), x0);
        sm[r][1] = vfmaq_f32(sm[r][1], vcvtq_f32_u32(vmovl_u16(vget_high_u16(q))), x1);
      }
    }
    for (int r = 0; r < 4; r++)
      acc[r] = vfmaq_n_f32(acc[r], vaddq_f32(sm[r][0], sm[r][1]), h2f(d0[(size_t)r * gk + (b >> shift)]));
  }
  for (int r = 0; r < 4; r++) res[r] = vaddvq_f32(acc[r]);
#else
  for (int r = 0; r < 4; r++) {
    float acc = 0;
    for (int b = 0; b < k / 32; b++) {
      float s = 0;
      for (int j = 0; j < 32; j++) s += (float)c0[(size_t)r * k + 32 * b + j] * x[32 * b + j];
      acc += h2f(d0[(size_t)r * gk + (b >> shift)]) * s;
    }
    res[r] = acc;
  }
#endif
}

/* Rows [n0, n1) of the weight (a multiple of 4 apart) against row `row` of x: the codes' term by the form the weight
   is in, then + sum over groups of min * sum(x) */
static void gemv_rows(const problem *p, int row, int n0, int n1, float *out) {
  const int words = p->k / 64 * 8, gk = p->k / p->group;
  const float *x = p->x + (size_t)row * p->k, *xg = p->xg + (size_t)row * gk;
  for (int n = n0; n < n1; n += 4) {
    float res[4];
    const uint16_t *d0 = p->scales + (size_t)n * gk;
    if (p->bits == 8)
      rows4_q8(x, (const uint8_t *)p->codes + (size_t)n * p->k, p->k, d0, gk, p->shift, res);
    else if (p->int8)
      rows4_i8(p->xq + (size_t)row * p->k, p->xqs + (size_t)row * (p->k / 64),
               (const uint8_t *)(p->codes + (size_t)n * words), 4 * words, d0, gk, p->k, p->shift, res);
    else
      rows4(p->xs ? p->xs + (size_t)row * p->k : x, p->codes + (size_t)n * words, words, d0, gk, p->k, p->shift, res);
    for (int r = 0; r < 4; r++) out[n - n0 + r] = res[r] + dot_h(p->mins + (size_t)(n + r) * gk, xg, gk);
  }
}

/* Weight rows n .. n + 3 as fp32 (4, k): scale * q + min, rounded as the float model's dequantisation is (the file
   is built without FP contraction, NO_CONTRACT: the product and the sum round separately). */
NO_CONTRACT static void dequant4(const problem *p, int n, float *w) {
  const int words = p->k / 64 * 8, gk = p->k / p->group;
  for (int r = 0; r < 4; r++) {
    const uint32_t *c = p->codes + (size_t)(n + r) * words;
    const uint16_t *sc = p->scales + (size_t)(n + r) * gk, *mn = p->mins + (size_t)(n + r) * gk;
    float *wr = w + (size_t)r * p->k;
    if (p->bits == 8) {
      const uint8_t *cb = (const uint8_t *)p->codes + (size_t)(n + r) * p->k;
      for (int g = 0; g < gk; g++) {
        const float s = h2f(sc[g]), m = h2f(mn[g]);
        const int c0 = g * p->group;
        int col = c0;
#if Q4_AVX2
        for (; col + 8 <= c0 + p->group; col += 8) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cb + col))));
          _mm256_storeu_ps(wr + col, _mm256_add_ps(_mm256_mul_ps(q, _mm256_set1_ps(s)), _mm256_set1_ps(m)));
        }
#endif
        for (; col < c0 + p->group; col++) wr[col] = (float)cb[col] * s + m;
      }
      continue;
    }
    if (p->int8) { /* byte order */
      const uint8_t *cb = (const uint8_t *)c;
      for (int col = 0; col < p->k; col++) {
        const int byte = cb[col / 64 * 32 + col % 32], g = col / p->group;
        wr[col] = (float)((col % 64) < 32 ? (byte & 15) : (byte >> 4)) * h2f(sc[g]) + h2f(mn[g]);
      }
      continue;
    }
#if Q4_AVX2
    const __m256i mask = _mm256_set1_epi32(15);
    for (int i = 0; i < p->k / 64; i++) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 8 * i));
      for (int j = 0; j < 8; j++) {
        const int g = (64 * i + 8 * j) / p->group;
        const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(4 * j)), mask));
        _mm256_storeu_ps(wr + 64 * i + 8 * j, _mm256_add_ps(_mm256_mul_ps(q, _mm256_set1_ps(h2f(sc[g]))),
                                                            _mm256_set1_ps(h2f(mn[g]))));
      }
    }
    continue;
#endif
    for (int i = 0; i < p->k / 64; i++)
      for (int j = 0; j < 8; j++) {
        const int col = 64 * i + 8 * j, g = col / p->group;
        const float s = h2f(sc[g]), m = h2f(mn[g]);
        for (int l = 0; l < 8; l++) wr[col + l] = (float)((c[8 * i + l] >> (4 * j)) & 15) * s + m;
      }
  }
}

#if Q4_AVX2
/* The prefill's product on AVX2: out[r][i] = w_r . x_{m0 + i} for the 4 rows of w (4, k) and 16 rows of x, from
   x's block of 16 rows transposed (xt: k columns of 16, `transpose_x`): each step broadcasts one weight of each row
   and multiplies two vectors of 8 rows of x, 8 FMAs for 6 loads and 8 accumulators. The dot-product form (both
   operands along k, dots4x2) compiled to 12 loads for 8 FMAs, and a 4 x 3 block of it to 16 for 12: GCC folds the
   x loads into every FMA. One core, the shipped model's 8-bit layer at 63 rows: 4 x 2 dots 40 GFLOP/s, 4 x 3
   42, this 74, of the core's 99-101 (docs/BENCHMARKS.md, twentieth session). */
static void dots4x16t(const float *w, int k, const float *xt, float out[4][16]) {
  __m256 acc[4][2];
  for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int c = 0; c < k; c++) {
    __m256 x0 = _mm256_loadu_ps(xt + 16 * (size_t)c), x1 = _mm256_loadu_ps(xt + 16 * (size_t)c + 8);
    __asm__("" : "+x"(x0), "+x"(x1)); /* in registers: GCC would fold each load into every FMA that uses it */
    for (int r = 0; r < 4; r++) {
      const __m256 b = _mm256_broadcast_ss(w + (size_t)r * k + c);
      acc[r][0] = _mm256_fmadd_ps(b, x0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
    }
  }
  for (int r = 0; r < 4; r++) {
    _mm256_storeu_ps(out[r], acc[r][0]);
    _mm256_storeu_ps(out[r] + 8, acc[r][1]);
  }
}

/* x (m, k) as blocks of 16 rows, each transposed (k columns of 16 values; rows past m zero): dots4x16t's operand */
static float *transpose_x(const float *x, int m, int k) {
  const int blocks = (m + 15) / 16;
  float *xt = calloc((size_t)blocks * 16 * k, sizeof(float));
  if (!xt) return NULL;
  for (int row = 0; row < m; row++) {
    float *dst = xt + (size_t)(row / 16) * 16 * k + row % 16;
    const float *src = x + (size_t)row * k;
    for (int c = 0; c < k; c++) dst[16 * (size_t)c] = src[c];
  }
  return xt;
}
#endif

#if Q4_AVX2 || Q4_NEON
/* dots4x2's columns i..k that fill no vector, added one at a time to the vector sums out_a / out_b */
static void dots4x2_tail(const float *w, int k, int i, const float *xa, const float *xb, float *out_a, float *out_b) {
  for (int r = 0; r < 4; r++)
    for (int t = i; t < k; t++) {
      out_a[r] += w[(size_t)r * k + t] * xa[t];
      out_b[r] += w[(size_t)r * k + t] * xb[t];
    }
}
#endif

/* out_a[r] = w_r . xa and out_b[r] = w_r . xb for the 4 rows of w (4, k): each weight load serves two rows of x (on
   AVX2 only the last 1-7 rows of x, after dots4x16t's blocks) */
static void dots4x2(const float *w, int k, const float *xa, const float *xb, float *out_a, float *out_b) {
#if Q4_AVX2
  __m256 a[4], b[4];
  for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 va = _mm256_loadu_ps(xa + i), vb = _mm256_loadu_ps(xb + i);
    for (int r = 0; r < 4; r++) {
      const __m256 wv = _mm256_loadu_ps(w + (size_t)r * k + i);
      a[r] = _mm256_fmadd_ps(wv, va, a[r]);
      b[r] = _mm256_fmadd_ps(wv, vb, b[r]);
    }
  }
  for (int r = 0; r < 4; r++) {
    out_a[r] = hsum(a[r]);
    out_b[r] = hsum(b[r]);
  }
  dots4x2_tail(w, k, i, xa, xb, out_a, out_b);
#elif Q4_NEON
  float32x4_t a[4], b[4];
  for (int r = 0; r < 4; r++) a[r] = b[r] = vdupq_n_f32(0);
  int i = 0;
  for (; i + 4 <= k; i += 4) {
    const float32x4_t va = vld1q_f32(xa + i), vb = vld1q_f32(xb + i);
    for (int r = 0; r < 4; r++) {
      const float32x4_t wv = vld1q_f32(w + (size_t)r * k + i);
      a[r] = vfmaq_f32(a[r], wv, va);
      b[r] = vfmaq_f32(b[r], wv, vb);
    }
  }
  for (int r = 0; r < 4; r++) {
    out_a[r] = vaddvq_f32(a[r]);
    out_b[r] = vaddvq_f32(b[r]);
  }
  dots4x2_tail(w, k, i, xa, xb, out_a, out_b);
#else
  for (int r = 0; r < 4; r++) {
    out_a[r] = dot(w + (size_t)r * k, xa, k);
    out_b[r] = dot(w + (size_t)r * k, xb, k);
  }
#endif
}

static void store(const problem *p, float *yrow, int n, const float *v, int count) {
  /* count results for weight rows n ..: with glu, tiles of 8 rows (4 gate, 4 up) give 4 outputs each */
  if (!p->glu) {
    memcpy(yrow + n, v, sizeof(float) * count);
    return;
  }
  float g[CHUNK_ROWS / 2], u[CHUNK_ROWS / 2];
  for (int t = 0; t < count / 8; t++)
    for (int r = 0; r < 4; r++) {
      g[4 * t + r] = v[8 * t + r];
      u[4 * t + r] = v[8 * t + 4 + r];
    }
  silu_mul(g, u, yrow + n / 2, count / 2);
}

/* Threads take runs of weight rows from a shared counter, guided: a grab is 1 / threads of the rows left, at least
   64. Long runs stream best (a SmolLM2 step, 2 threads, 11 interleaved rounds: 7.85 ms in 64-row chunks, 6.45 in
   4 runs, 6.13 in an even split, 6.42 guided), and the shorter tail lets a thread on a slower or busier core take
   less (2 vCPUs of one cloud machine here ran this kernel 1.65x apart, where an even split waits for the slow one). */
static void task_rows(problem *p, int n0, int n1, float *w, float *vals);

static void task(void *arg, int part, int parts) {
  problem *p = arg;
  (void)part;
  (void)parts;
  float *w = NULL, *vals = NULL;
  if (p->m >= 4) { /* 8 weight rows dequantised, and the chunk's results for every row of x */
    w = malloc(sizeof(float) * 8 * (size_t)p->k);
    vals = malloc(sizeof(float) * (size_t)p->m * CHUNK_ROWS);
    if (!w || !vals) {
      free(w);
      free(vals);
      return;
    }
  }
  for (;;) {
    /* guided: a grab takes 1 / p->chunk of the rows left (a multiple of 8, at least 64), so a thread streams long runs
       first and the shorter ones at the end go to whoever is free */
    int g0 = atomic_load(&p->next), g1 = g0;
    while (g0 < p->n) {
      const int size = (p->n - g0) / p->chunk / 8 * 8;
      g1 = g0 + (size < 64 ? 64 : size) < p->n ? g0 + (size < 64 ? 64 : size) : p->n;
      if (atomic_compare_exchange_weak(&p->next, &g0, g1)) break;
    }
    if (g0 >= p->n) break;
    for (int n0 = g0; n0 < g1; n0 += CHUNK_ROWS) task_rows(p, n0, n0 + CHUNK_ROWS < g1 ? n0 + CHUNK_ROWS : g1, w, vals);
  }
  free(vals);
  free(w);
}

/* Weight rows [n0, n1), at most CHUNK_ROWS, against every row of x */
static void task_rows(problem *p, int n0, int n1, float *w, float *vals) {
  const int tile = p->glu ? 8 : 4, out_n = p->glu ? p->n / 2 : p->n;
  float scratch[8];
  if (p->m < 4) {
    float buf[CHUNK_ROWS];
    for (int row = 0; row < p->m; row++) {
      gemv_rows(p, row, n0, n1, buf);
      store(p, p->y + (size_t)row * out_n, n0, buf, n1 - n0);
    }
    return;
  }
  for (int n = n0; n < n1; n += tile) {
    dequant4(p, n, w);
    if (tile == 8) dequant4(p, n + 4, w + 4 * (size_t)p->k);
#if Q4_AVX2
    for (int r = 0; r < tile; r += 4) {
      int m0 = 0;
      for (; p->m - m0 >= 8; m0 += 16) { /* 16 rows of x a pass, from their transposed block (at least 8 of them) */
        float o[4][16];
        dots4x16t(w + (size_t)r * p->k, p->k, p->xt + (size_t)m0 * p->k, o);
        for (int i = 0; i < 16 && m0 + i < p->m; i++)
          for (int j = 0; j < 4; j++) vals[(size_t)(m0 + i) * CHUNK_ROWS + (n - n0) + r + j] = o[j][i];
      }
      for (int row = m0; row < p->m; row += 2) { /* the last 1-7: two a pass, an odd last row with itself */
        const float *xa = p->x + (size_t)row * p->k, *xb = row + 1 < p->m ? xa + p->k : xa;
        float *va = vals + (size_t)row * CHUNK_ROWS + (n - n0) + r, *vb = row + 1 < p->m ? va + CHUNK_ROWS : scratch;
        dots4x2(w + (size_t)r * p->k, p->k, xa, xb, va, vb);
      }
    }
    continue;
#endif
    for (int row = 0; row < p->m; row += 2) { /* two rows of x a pass; an odd last row pairs with itself */
      const float *xa = p->x + (size_t)row * p->k, *xb = row + 1 < p->m ? xa + p->k : xa;
      float *va = vals + (size_t)row * CHUNK_ROWS + (n - n0), *vb = row + 1 < p->m ? va + CHUNK_ROWS : scratch;
      for (int r = 0; r < tile; r += 4) dots4x2(w + (size_t)r * p->k, p->k, xa, xb, va + r, vb + r);
    }
  }
  for (int row = 0; row < p->m; row++) /* the chunk's outputs a row at a time: glu's silu over 32 at once */
    store(p, p->y + (size_t)row * out_n, n0, vals + (size_t)row * CHUNK_ROWS, n1 - n0);
}

/* out[c] = x[c] 16^-n, n = c % 64 / 8 (the nibble of a lanes-order word that column c's code is in), except nibble 7,
   which rows4 shifts down instead: exact, a power of two (x below ~2^-98 would become subnormal; activations are
   not). count a multiple of 64. */
static void scale_nibbles(const float *x, size_t count, float *out) {
  static const float factor[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
#if Q4_AVX2
  for (size_t c = 0; c < count; c += 8)
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(x + c), _mm256_set1_ps(factor[c % 64 / 8])));
#else
  for (size_t c = 0; c < count; c++) out[c] = x[c] * factor[c % 64 / 8];
#endif
}

/* y = x @ w^T on plain pointers (the tests and scripts/bench_weight_only.py call this through ctypes) */
void orin_q4_matmul(const float *x, int m, int k, int n, const uint32_t *codes, const uint16_t *scales,
                    const uint16_t *mins,
                    int group, int glu, int int8, int bits, float *y) {
  const int gk = k / group;
  float *xg = malloc(sizeof(float) * (size_t)m * gk + 1);
  for (int row = 0; row < m; row++)
    for (int g = 0; g < gk; g++) xg[(size_t)row * gk + g] = vsum(x + (size_t)row * k + (size_t)g * group, group);
  int shift = 0;
  while ((32 << shift) < group) shift++;
  int8_t *xq = NULL;
  float *xqs = NULL;
  if (int8 && m < 4) {
    xq = malloc((size_t)m * k);
    xqs = malloc(sizeof(float) * (size_t)m * (k / 64) + 1);
    for (int row = 0; row < m; row++)
      for (int b = 0; b < k / 64; b++) {
        const float *v = x + (size_t)row * k + 64 * b;
        float amax = 0;
        for (int j = 0; j < 64; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        for (int j = 0; j < 64; j++) xq[(size_t)row * k + 64 * b + j] = (int8_t)nearbyintf(v[j] * inv);
        xqs[(size_t)row * (k / 64) + b] = amax / 127.0f;
      }
  }
  float *xs = NULL;
  if ((Q4_AVX2 || Q4_NEON) && bits == 4 && !int8 && m < 4) { /* rows4's form of x: column 8 n + l of each 64 times 16^-n */
    xs = malloc(sizeof(float) * (size_t)m * k);
    if (!xs) {
      for (size_t i = 0; i < (size_t)m * (glu ? n / 2 : n); i++) y[i] = NAN;
      free(xg);
      return;
    }
    scale_nibbles(x, (size_t)m * k, xs);
  }
  float *xt = NULL;
#if Q4_AVX2
  if (m >= 4 && !(xt = transpose_x(x, m, k))) {
    for (size_t i = 0; i < (size_t)m * (glu ? n / 2 : n); i++) y[i] = NAN;
    free(xs);
    free(xg);
    free(xq);
    free(xqs);
    return;
  }
#endif
  const int chunk = team.threads; /* a grab takes 1 / chunk of the rows left: the first, a thread's even share */
  problem p = {x, xg, xs, codes, scales, mins, y, m, k, n, group, glu, shift, chunk, 0, int8 && bits == 4, bits, xq, xqs,
               xt};
  run_team(task, &p);
  free(xt);
  free(xs);
  free(xg);
  free(xq);
  free(xqs);
}

/* ---- attention over the KV-cache (orin_agent.CacheAttention) ---- */
typedef struct {
  const float *qkv;       /* (B, T, (H + 2 KV) hd): each token's q heads, then its k heads, then its v heads */
  const float *k, *v;     /* the caches (B, KV, S, hd), the T new tokens' K (rotated) and V already in them */
  const int32_t *seqlens; /* (B,) each row's last new position */
  const float *cos, *sin; /* (positions, rot / 2) */
  float *out;             /* (B, T, H hd) */
  int b, t, h, kv, hd, s, rot;
  float scale;
  int chunks;             /* pieces of each token's slots: a unit is (row, token, KV group, piece) */
  float *parts;           /* chunks > 1: per unit and query head of its group, (max, sum, hd partial outputs) */
  float *scratch;         /* per thread: the group's q rotated (G hd), their scores (G s), their sums (G hd) */
  atomic_int next;        /* the next unit a thread takes */
} attn_problem;

/* x's first rot dimensions rotated as position p's (cos, sin) give (rotate-half form: dimension i pairs with
   i + rot / 2, as GroupQueryAttention's rotary_interleaved = 0), the rest copied */
static void rope(const float *x, const float *cos, const float *sin, int hd, int rot, float *out) {
  const int half = rot / 2;
  for (int i = 0; i < half; i++) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
  }
  for (int i = rot; i < hd; i++) out[i] = x[i];
}

/* scores[j] = scale * q . k_j for j in [0, n) (rows of hd floats) */
static void qk_scores(const float *q, const float *k, int hd, int n, float scale, float *scores) {
  int j = 0;
#if Q4_AVX2
  if (hd % 8 == 0) /* 8 keys at a time: 8 independent FMA chains, their sums transposed into one vector */
    for (; j + 8 <= n; j += 8) {
      __m256 a[8];
      for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
      for (int c = 0; c < hd; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + (size_t)(j + r) * hd + c), a[r]);
      }
      const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
      const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
      const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20), _mm256_permute2f128_ps(s03, s47, 0x31));
      _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }
#endif
  for (; j < n; j++) scores[j] = dot(q, k + (size_t)j * hd, hd) * scale;
}

/* scores[j] = exp(scores[j] - max) for j in [0, n), max = the largest score (*largest); returns their sum */
static float softmax_weights(float *scores, int n, float *largest) {
  float mx = -INFINITY, sum = 0;
  int j = 0;
#if Q4_AVX2
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
  for (; j < n; j++) mx = scores[j] > mx ? scores[j] : mx; /* (not fmaxf: a libm call a score here) */
  j = 0;
#if Q4_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(scores + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; j < n; j++) {
    scores[j] = expf(scores[j] - mx);
    sum += scores[j];
  }
  *largest = mx;
  return sum;
}

/* acc += sum_j w[j] v_j for j in [0, n) (rows of hd floats) */
static void accumulate_values(const float *w, const float *v, int hd, int n, float *acc) {
#if Q4_AVX2
  if (hd % 64 == 0) { /* 64 dimensions a pass: 8 accumulators in registers, so the FMAs' latency is hidden */
    for (int d = 0; d < hd; d += 64) {
      __m256 a[8];
      for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(acc + d + 8 * c);
      for (int j = 0; j < n; j++) {
        const __m256 wj = _mm256_set1_ps(w[j]);
        const float *vj = v + (size_t)j * hd + d;
        for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * c), a[c]);
      }
      for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + d + 8 * c, a[c]);
    }
    return;
  }
  if (hd % 8 == 0) {
    for (int d = 0; d < hd; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + d);
      for (int j = 0; j < n; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + (size_t)j * hd + d), a);
      _mm256_storeu_ps(acc + d, a);
    }
    return;
  }
#elif Q4_NEON
  if (hd % 32 == 0) { /* 32 dimensions a pass, 8 accumulators */
    for (int d = 0; d < hd; d += 32) {
      float32x4_t a[8];
      for (int c = 0; c < 8; c++) a[c] = vld1q_f32(acc + d + 4 * c);
      for (int j = 0; j < n; j++) {
        const float *vj = v + (size_t)j * hd + d;
        for (int c = 0; c < 8; c++) a[c] = vfmaq_n_f32(a[c], vld1q_f32(vj + 4 * c), w[j]);
      }
      for (int c = 0; c < 8; c++) vst1q_f32(acc + d + 4 * c, a[c]);
    }
    return;
  }
#endif
  for (int j = 0; j < n; j++)
    for (int i = 0; i < hd; i++) acc[i] += w[j] * v[(size_t)j * hd + i];
}

#define ATTN_BLOCK 32 /* slots a block: a group's K (or V) rows of a block, 8 KB at head size 64, stay in L1 while
                        each of its query heads takes them */

/* Threads take a unit at a time: one KV group of one token (of one row), over one piece of its slots [0, position].
   The group's query heads go together, a block of slots at a time, so each K and V row is read once a unit (from
   memory: the caches of a 30-layer step are larger than the L3 the weights pass through) however many query heads
   share it: scores for every head, their softmax in fp32, then the values' weighted sums. With one piece the unit
   writes the outputs; with several (a decode step has too few groups to keep the team busy) it leaves each head's
   (max, sum, partial outputs) for attn_merge. */
static void attn_task(void *arg, int part, int parts) {
  attn_problem *p = arg;
  (void)parts;
  const int group = p->h / p->kv, width = (p->h + 2 * p->kv) * p->hd, units = p->b * p->t * p->kv * p->chunks;
  float *q = p->scratch + (size_t)part * group * (2 * p->hd + p->s), *scores = q + (size_t)group * p->hd,
        *acc = scores + (size_t)group * p->s;
  for (int u; (u = atomic_fetch_add(&p->next, 1)) < units;) {
    const int piece = u % p->chunks, g = u / p->chunks % p->kv, t = u / p->chunks / p->kv % p->t,
              row = u / p->chunks / p->kv / p->t;
    const int pos = p->seqlens[row] + 1 - p->t + t, n = pos + 1;
    const int len = (n + p->chunks - 1) / p->chunks, j0 = piece * len < n ? piece * len : n,
              j1 = j0 + len < n ? j0 + len : n;
    const size_t cache = ((size_t)row * p->kv + g) * p->s * p->hd;
    const float *tok = p->qkv + ((size_t)row * p->t + t) * width;
    for (int i = 0; i < group; i++)
      rope(tok + (size_t)(g * group + i) * p->hd, p->cos + (size_t)pos * (p->rot / 2),
           p->sin + (size_t)pos * (p->rot / 2), p->hd, p->rot, q + (size_t)i * p->hd);
    for (int j = j0; j < j1; j += ATTN_BLOCK) {
      const int m = j + ATTN_BLOCK < j1 ? ATTN_BLOCK : j1 - j;
      for (int i = 0; i < group; i++)
        qk_scores(q + (size_t)i * p->hd, p->k + cache + (size_t)j * p->hd, p->hd, m, p->scale,
                  scores + (size_t)i * p->s + (j - j0));
    }
    float top[64], total[64]; /* (a group of up to 64 query heads: orin_q4_attention refuses more) */
    for (int i = 0; i < group; i++) {
      total[i] = j1 > j0 ? softmax_weights(scores + (size_t)i * p->s, j1 - j0, &top[i]) : 0.0f;
      if (j1 == j0) top[i] = -INFINITY;
      memset(acc + (size_t)i * p->hd, 0, sizeof(float) * (size_t)p->hd);
    }
    for (int j = j0; j < j1; j += ATTN_BLOCK) {
      const int m = j + ATTN_BLOCK < j1 ? ATTN_BLOCK : j1 - j;
      for (int i = 0; i < group; i++)
        accumulate_values(scores + (size_t)i * p->s + (j - j0), p->v + cache + (size_t)j * p->hd, p->hd, m,
                          acc + (size_t)i * p->hd);
    }
    for (int i = 0; i < group; i++) {
      const int head = g * group + i;
      if (p->chunks == 1) {
        float *o = p->out + ((size_t)row * p->t + t) * p->h * p->hd + (size_t)head * p->hd;
        for (int d = 0; d < p->hd; d++) o[d] = acc[(size_t)i * p->hd + d] / total[i];
      } else {
        float *r = p->parts + ((size_t)u * group + i) * (p->hd + 2);
        r[0] = top[i];
        r[1] = total[i];
        memcpy(r + 2, acc + (size_t)i * p->hd, sizeof(float) * (size_t)p->hd);
      }
    }
  }
}

/* The pieces of each (row, token, query head) into its output: max M over the pieces, each piece's sums and
   outputs times exp(max - M), the outputs over the sums */
static void attn_merge(const attn_problem *p) {
  const int group = p->h / p->kv;
  for (int u0 = 0; u0 < p->b * p->t * p->kv * p->chunks; u0 += p->chunks) {
    const int g = u0 / p->chunks % p->kv, t = u0 / p->chunks / p->kv % p->t, row = u0 / p->chunks / p->kv / p->t;
    for (int i = 0; i < group; i++) {
      float mx = -INFINITY, total = 0;
      for (int c = 0; c < p->chunks; c++) {
        const float m = p->parts[((size_t)(u0 + c) * group + i) * (p->hd + 2)];
        mx = m > mx ? m : mx;
      }
      float *o = p->out + ((size_t)row * p->t + t) * p->h * p->hd + (size_t)(g * group + i) * p->hd;
      memset(o, 0, sizeof(float) * (size_t)p->hd);
      for (int c = 0; c < p->chunks; c++) {
        const float *r = p->parts + ((size_t)(u0 + c) * group + i) * (p->hd + 2);
        if (r[1] == 0) continue; /* an empty piece */
        const float f = expf(r[0] - mx);
        total += f * r[1];
        for (int d = 0; d < p->hd; d++) o[d] += f * r[2 + d];
      }
      for (int d = 0; d < p->hd; d++) o[d] /= total;
    }
  }
}

/* GroupQueryAttention's arithmetic (com.microsoft, do_rotary = 1, rotary_interleaved = 0, the caches shared with
   the outputs) on plain pointers: row r's T new tokens sit at positions seqlens[r] + 1 - T .. seqlens[r]; their K
   (rotated) and V go into slots of the caches k, v (B, KV, S, hd) by position, then each token attends to slots
   [0, its position]. Returns 0, or -1 when a position falls outside the caches or the rotary tables, or memory ran
   out (nothing written then). */
int orin_q4_attention(const float *qkv, int b, int t, int h, int kv, int hd, float *k, float *v, int s,
                      const int32_t *seqlens, const float *cos, const float *sin, int positions, int rot, float scale,
                      float *out) {
  if (b < 1 || t < 1 || kv < 1 || h % kv || h / kv > 64 || rot < 2 || rot % 2 || rot > hd) return -1;
  for (int r = 0; r < b; r++)
    if (seqlens[r] + 1 - t < 0 || seqlens[r] >= s || seqlens[r] >= positions) return -1;
  const int group = h / kv;
  /* pieces of the slots: enough units for two a thread where the groups alone are fewer, each piece at least
     4 blocks long */
  int chunks = 1, longest = 0;
  for (int r = 0; r < b; r++) longest = seqlens[r] + 1 > longest ? seqlens[r] + 1 : longest;
  if (b * t * kv < 2 * team.threads) {
    chunks = (2 * team.threads + b * t * kv - 1) / (b * t * kv);
    const int most = (longest + 4 * ATTN_BLOCK - 1) / (4 * ATTN_BLOCK);
    chunks = chunks < most ? chunks : most;
  }
  float *scratch = malloc(sizeof(float) * (size_t)group * (2 * (size_t)hd + s) * (size_t)team.threads);
  float *parts = chunks > 1 ? malloc(sizeof(float) * (size_t)b * t * kv * chunks * group * (hd + 2)) : NULL;
  if (!scratch || (chunks > 1 && !parts)) {
    free(scratch);
    free(parts);
    return -1;
  }
  const int width = (h + 2 * kv) * hd;
  for (int r = 0; r < b; r++)
    for (int i = 0; i < t; i++) {
      const int pos = seqlens[r] + 1 - t + i;
      const float *tok = qkv + ((size_t)r * t + i) * width;
      for (int g = 0; g < kv; g++) {
        const size_t slot = (((size_t)r * kv + g) * s + pos) * hd;
        rope(tok + (size_t)(h + g) * hd, cos + (size_t)pos * (rot / 2), sin + (size_t)pos * (rot / 2), hd, rot,
             k + slot);
        memcpy(v + slot, tok + (size_t)(h + kv + g) * hd, sizeof(float) * (size_t)hd);
      }
    }
  attn_problem p = {qkv, k, v, seqlens, cos, sin, out, b, t, h, kv, hd, s, rot, scale, chunks, parts, scratch, 0};
  run_team(attn_task, &p);
  if (chunks > 1) attn_merge(&p);
  free(scratch);
  free(parts);
  return 0;
}

/* ---- the operator ---- */

/* SkipSimplifiedLayerNormalization after the product (onnxruntime's contrib operator, which the decoder graph
   otherwise runs as a node of its own): sum = y + skip, in place; out = sum / sqrt(mean(sum^2) + epsilon) * gamma */
static void skip_rms_norm(float *sum, const float *skip, const float *gamma, float epsilon, int m, int n, float *out) {
  for (int row = 0; row < m; row++) {
    float *s = sum + (size_t)row * n, *o = out + (size_t)row * n;
    const float *k = skip + (size_t)row * n;
    double ss = 0;
    for (int i = 0; i < n; i++) {
      s[i] += k[i];
      ss += (double)s[i] * s[i];
    }
    const float inv = (float)(1.0 / sqrt(ss / n + epsilon));
    for (int i = 0; i < n; i++) o[i] = s[i] * inv * gamma[i];
  }
}
typedef struct {
  int glu, int8, skip_norm; /* skip_norm: the Q4MatMulSkipNorm operator */
  float epsilon;
} kernel;

static int64_t dims_of(const OrtValue *v, int64_t *dims, size_t cap) {
  OrtShape *info = NULL;
  size_t nd = 0;
  if (API(GetShapeFn, API_GET_TENSOR_TYPE_AND_SHAPE)(v, &info)) return -1;
  API(GetDimsCountFn, API_GET_DIMENSIONS_COUNT)(info, &nd);
  if (nd > cap) nd = cap;
  API(GetDimsFn, API_GET_DIMENSIONS)(info, dims, nd);
  API(ReleaseShapeFn, API_RELEASE_TENSOR_TYPE_AND_SHAPE_INFO)(info);
  return (int64_t)nd;
}

static void *data_of(const OrtValue *v) {
  void *d = NULL;
  API(GetDataFn, API_GET_TENSOR_MUTABLE_DATA)((OrtValue *)v, &d);
  return d;
}

static void compute(void *kp, OrtKernelContext *ctx) {
  const kernel *kn = kp;
  const OrtValue *in[6];
  int64_t xd[8], cd[8], sd[8], md[8], kd[8], gd[8];
  for (size_t i = 0; i < (kn->skip_norm ? 6u : 4u); i++) API(GetInputFn, API_KERNEL_CONTEXT_GET_INPUT)(ctx, i, &in[i]);
  int64_t xr = dims_of(in[0], xd, 8), cr = dims_of(in[1], cd, 8);
  int64_t sr = dims_of(in[2], sd, 8), mr = dims_of(in[3], md, 8);
  int64_t k = xr > 0 ? xd[xr - 1] : 0, n = cr == 3 ? cd[0] : 0, m = 1;
  for (int64_t i = 0; i + 1 < xr; i++) m *= xd[i];
  int64_t gk = sr == 2 ? sd[1] : 0;
  const int bits = cr == 3 && cd[2] == 16 ? 8 : 4; /* 8 uint32 words per 64 columns: 4 bits; 16: 8 bits */
  int ok = xr >= 1 && cr == 3 && sr == 2 && mr == 2 && k > 0 && k % 64 == 0 && cd[1] == k / 64 &&
           (cd[2] == 8 || (cd[2] == 16 && !kn->int8)) &&
           sd[0] == n && gk > 0 && k % gk == 0 && (k / gk) % 32 == 0 && (((k / gk) / 32) & ((k / gk) / 32 - 1)) == 0 &&
           md[0] == n && md[1] == gk &&
           n % (kn->glu ? 8 : 4) == 0;
  if (kn->skip_norm) { /* skip: the shape of Y; gamma: (N,) */
    int64_t kr = dims_of(in[4], kd, 8), gr = dims_of(in[5], gd, 8);
    ok = ok && !kn->glu && kr == xr && gr == 1 && gd[0] == n;
    for (int64_t i = 0; ok && i < kr; i++) ok = kd[i] == (i + 1 < kr ? xd[i] : n);
  }
  int64_t od[8];
  memcpy(od, xd, sizeof(int64_t) * (size_t)(xr > 0 ? xr : 1));
  od[xr > 0 ? xr - 1 : 0] = kn->glu ? n / 2 : n;
  OrtValue *out = NULL, *out_sum = NULL;
  API(GetOutputFn, API_KERNEL_CONTEXT_GET_OUTPUT)(ctx, 0, od, (size_t)(xr > 0 ? xr : 1), &out);
  float *y = data_of(out), *sum = NULL;
  if (kn->skip_norm) {
    API(GetOutputFn, API_KERNEL_CONTEXT_GET_OUTPUT)(ctx, 1, od, (size_t)(xr > 0 ? xr : 1), &out_sum);
    sum = data_of(out_sum);
  }
  if (!ok) { /* shapes the Python side never writes: NaN, so the caller's result cannot pass as a number */
    int64_t total = m * (kn->glu ? n / 2 : n);
    for (int64_t i = 0; i < total; i++) {
      y[i] = NAN;
      if (sum) sum[i] = NAN;
    }
    return;
  }
  orin_q4_matmul(data_of(in[0]), (int)m, (int)k, (int)n, data_of(in[1]), data_of(in[2]), data_of(in[3]),
                 (int)(k / gk), kn->glu, kn->int8, bits, kn->skip_norm ? sum : y);
  if (kn->skip_norm) skip_rms_norm(sum, data_of(in[4]), data_of(in[5]), kn->epsilon, (int)m, (int)n, y);
}

static void *create_kernel(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info) {
  (void)table;
  kernel *k = calloc(1, sizeof(kernel));
  int64_t glu = 0;
  OrtStatus *st = API(GetAttrIntFn, API_KERNEL_INFO_GET_ATTRIBUTE_INT64)(info, "glu", &glu);
  if (st) API(ReleaseStatusFn, API_RELEASE_STATUS)(st); /* absent: 0 */
  int64_t int8 = 0;
  st = API(GetAttrIntFn, API_KERNEL_INFO_GET_ATTRIBUTE_INT64)(info, "int8", &int8);
  if (st) API(ReleaseStatusFn, API_RELEASE_STATUS)(st);
  if (k) {
    k->glu = glu != 0;
    k->int8 = int8 != 0;
    k->skip_norm = op->GetInputTypeCount(op) == 6;
    k->epsilon = 1e-5f;
    if (k->skip_norm) {
      st = API(GetAttrFloatFn, API_KERNEL_INFO_GET_ATTRIBUTE_FLOAT)(info, "epsilon", &k->epsilon);
      if (st) API(ReleaseStatusFn, API_RELEASE_STATUS)(st);
    }
  }
  return k;
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "Q4MatMul"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 0 ? TYPE_FLOAT : i == 1 ? TYPE_UINT32 : TYPE_FLOAT16;
}
static size_t input_count(const OrtCustomOp *op) { (void)op; return 4; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }
static void destroy(void *k) { free(k); }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }

static const char *skip_name(const OrtCustomOp *op) { (void)op; return "Q4MatMulSkipNorm"; }
static int skip_input_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 1 ? TYPE_UINT32 : i == 2 || i == 3 ? TYPE_FLOAT16 : TYPE_FLOAT;
}
static size_t skip_input_count(const OrtCustomOp *op) { (void)op; return 6; }
static size_t skip_output_count(const OrtCustomOp *op) { (void)op; return 2; }

static const OrtCustomOp q4_op = {CUSTOM_OP_VERSION, create_kernel, op_name, op_provider, input_type, input_count,
                                  output_type, output_count, compute, destroy, required, required};
static const OrtCustomOp skip_op = {CUSTOM_OP_VERSION, create_kernel, skip_name, op_provider, skip_input_type,
                                    skip_input_count, output_type, skip_output_count, compute, destroy, required,
                                    required};

/* orin_agent.CacheAttention(qkv float (B, T, (H + 2 KV) hd), past_key, past_value float (B, KV, S, hd),
   seqlens_k int32 (B,), total_sequence_length int32 (), cos, sin float (positions, rot / 2))
   -> out float (B, T, H hd), present_key, present_value float (B, KV, S, hd); attributes num_heads, kv_num_heads,
   scale (absent: 1 / sqrt(hd)). GroupQueryAttention's inputs and outputs as the decoder graph uses them (no separate
   key / value inputs, do_rotary = 1, rotary_interleaved = 0), run by orin_q4_attention on the team. The decoder binds
   each present to its past's buffer and the new K/V are written in place; a present of its own gets a copy of the
   past first. total_sequence_length is not read (each row's length is its seqlens_k + 1). */
typedef struct {
  int heads, kv_heads;
  float scale;
} attn_kernel;

static void attn_compute(void *kp, OrtKernelContext *ctx) {
  const attn_kernel *kn = kp;
  const OrtValue *in[7];
  for (size_t i = 0; i < 7; i++) API(GetInputFn, API_KERNEL_CONTEXT_GET_INPUT)(ctx, i, &in[i]);
  int64_t qd[8], kd[8], vd[8], ld[8], cd[8], sd[8];
  const int64_t qr = dims_of(in[0], qd, 8), kr = dims_of(in[1], kd, 8), vr = dims_of(in[2], vd, 8);
  const int64_t lr = dims_of(in[3], ld, 8), cr = dims_of(in[5], cd, 8), sr = dims_of(in[6], sd, 8);
  int ok = qr == 3 && kr == 4 && vr == 4 && lr == 1 && cr == 2 && sr == 2 && kn->kv_heads > 0 &&
           kn->heads % kn->kv_heads == 0 && kd[0] == qd[0] && kd[1] == kn->kv_heads && kd[3] > 0 &&
           ld[0] == qd[0] && qd[2] == (kn->heads + 2 * (int64_t)kn->kv_heads) * kd[3] && cd[0] == sd[0] &&
           cd[1] == sd[1] && cd[1] > 0 && 2 * cd[1] <= kd[3];
  for (int i = 0; ok && i < 4; i++) ok = vd[i] == kd[i];
  const int64_t hd = kr == 4 && kd[3] > 0 ? kd[3] : 1;
  int64_t od[3] = {qr == 3 ? qd[0] : 1, qr == 3 ? qd[1] : 1, kn->heads * hd}, one[4] = {1, 1, 1, 1};
  OrtValue *out = NULL, *present[2] = {NULL, NULL};
  API(GetOutputFn, API_KERNEL_CONTEXT_GET_OUTPUT)(ctx, 0, od, 3, &out);
  for (size_t i = 0; i < 2; i++)
    API(GetOutputFn, API_KERNEL_CONTEXT_GET_OUTPUT)(ctx, 1 + i, kr == 4 ? kd : one, 4, &present[i]);
  float *y = data_of(out), *pk = data_of(present[0]), *pv = data_of(present[1]);
  if (ok) {
    const size_t cache = (size_t)(kd[0] * kd[1] * kd[2] * kd[3]);
    const float *past_k = data_of(in[1]), *past_v = data_of(in[2]);
    if (pk != past_k) memcpy(pk, past_k, sizeof(float) * cache);
    if (pv != past_v) memcpy(pv, past_v, sizeof(float) * cache);
    ok = orin_q4_attention(data_of(in[0]), (int)qd[0], (int)qd[1], kn->heads, kn->kv_heads, (int)hd, pk, pv,
                           (int)kd[2], data_of(in[3]), data_of(in[5]), data_of(in[6]), (int)cd[0], (int)(2 * cd[1]),
                           kn->scale > 0 ? kn->scale : 1.0f / sqrtf((float)hd), y) == 0;
  }
  if (!ok) /* shapes the Python side never writes, or positions past the caches: NaN, never a number */
    for (int64_t i = 0; i < od[0] * od[1] * od[2]; i++) y[i] = NAN;
}

static void *attn_create_kernel(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info) {
  (void)op;
  (void)table;
  attn_kernel *k = calloc(1, sizeof(attn_kernel));
  int64_t heads = 0, kv_heads = 0;
  OrtStatus *st = API(GetAttrIntFn, API_KERNEL_INFO_GET_ATTRIBUTE_INT64)(info, "num_heads", &heads);
  if (st) API(ReleaseStatusFn, API_RELEASE_STATUS)(st); /* absent: 0, and every call is refused */
  st = API(GetAttrIntFn, API_KERNEL_INFO_GET_ATTRIBUTE_INT64)(info, "kv_num_heads", &kv_heads);
  if (st) API(ReleaseStatusFn, API_RELEASE_STATUS)(st);
  if (k) {
    k->heads = (int)heads;
    k->kv_heads = (int)kv_heads;
    st = API(GetAttrFloatFn, API_KERNEL_INFO_GET_ATTRIBUTE_FLOAT)(info, "scale", &k->scale);
    if (st) API(ReleaseStatusFn, API_RELEASE_STATUS)(st); /* absent: 0, read as 1 / sqrt(hd) */
  }
  return k;
}

static const char *attn_name(const OrtCustomOp *op) { (void)op; return "CacheAttention"; }
static int attn_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 3 || i == 4 ? TYPE_INT32 : TYPE_FLOAT; }
static size_t attn_input_count(const OrtCustomOp *op) { (void)op; return 7; }
static size_t attn_output_count(const OrtCustomOp *op) { (void)op; return 3; }

static const OrtCustomOp attn_op = {CUSTOM_OP_VERSION, attn_create_kernel, attn_name, op_provider, attn_input_type,
                                    attn_input_count, output_type, attn_output_count, attn_compute, destroy, required,
                                    required};

/* The entry point ONNX Runtime's SessionOptions.register_custom_ops_library calls. */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  api = base->GetApi(1);
  if (!api) return NULL;
  OrtCustomOpDomain *domain = NULL;
  OrtStatus *st = API(CreateCustomOpDomainFn, API_CREATE_CUSTOM_OP_DOMAIN)("orin_agent", &domain);
  if (st) return st;
  if ((st = API(CustomOpDomainAddFn, API_CUSTOM_OP_DOMAIN_ADD)(domain, &q4_op))) return st;
  if ((st = API(CustomOpDomainAddFn, API_CUSTOM_OP_DOMAIN_ADD)(domain, &skip_op))) return st;
  if ((st = API(CustomOpDomainAddFn, API_CUSTOM_OP_DOMAIN_ADD)(domain, &attn_op))) return st;
  return API(AddCustomOpDomainFn, API_ADD_CUSTOM_OP_DOMAIN)(options, domain);
}
