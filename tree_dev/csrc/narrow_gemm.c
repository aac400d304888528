/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for a few rows M, fp32, AVX2 + FMA.
 *
 * W is packed once into panels of 16 output columns, [ceil(N/16)][K][16] (zero
 * padded), so one pass over a panel streams 16 columns' weights contiguously while
 * up to ROWS rows of x accumulate in registers: the weights are read once per ROWS
 * rows, where a general GEMM tuned for large M re-reads or re-packs them. Each output
 * is one sequential FMA sum over k = 0..K-1, the same for a row whatever M is and
 * whichever rows share its block (batch invariant).
 *
 * Built by tree_dev/narrow_linear.py with `cc -O3 -mavx2 -mfma -shared -fPIC`.
 */
#include <immintrin.h>
#include <stdint.h>

#define ROWS 4 /* rows per register block */

/* R rows x P panels: 2*R*P accumulators, kept at 8-12 so that enough independent FMA
 * chains are in flight (an FMA's latency is 4-5 cycles at 2 per cycle); a row with
 * fewer companions takes more panels at once. Every output is still one sequential
 * sum over k. */
#define BLOCK(R, P)                                                                      \
  static void block##R##x##P(const float *x, int64_t K, const float *panel, float *y,    \
                             int64_t ldy, int64_t nv, const float *bias) {               \
    __m256 lo[R][P], hi[R][P];                                                           \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                               \
      _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                             \
        lo[r][p] = _mm256_setzero_ps();                                                  \
        hi[r][p] = _mm256_setzero_ps();                                                  \
      }                                                                                  \
    }                                                                                    \
    for (int64_t k = 0; k < K; ++k) {                                                    \
      __m256 xb[R];                                                                      \
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) xb[r] =                        \
          _mm256_broadcast_ss(x + r * K + k);                                            \
      _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                             \
        const float *w = panel + p * K * 16 + 16 * k;                                    \
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                           \
          lo[r][p] = _mm256_fmadd_ps(xb[r], w0, lo[r][p]);                               \
          hi[r][p] = _mm256_fmadd_ps(xb[r], w1, hi[r][p]);                               \
        }                                                                                \
      }                                                                                  \
    }                                                                                    \
    float tmp[16];                                                                       \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {                               \
      _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {                             \
        _mm256_storeu_ps(tmp, lo[r][p]);                                                 \
        _mm256_storeu_ps(tmp + 8, hi[r][p]);                                             \
        float *out = y + r * ldy + 16 * p;                                               \
        const float *bp = bias ? bias + 16 * p : 0;                                      \
        int64_t n = P == 1 ? nv : 16;                                                    \
        for (int64_t j = 0; j < n; ++j) out[j] = bp ? tmp[j] + bp[j] : tmp[j];           \
      }                                                                                  \
    }                                                                                    \
  }

BLOCK(1, 1)
BLOCK(2, 1)
BLOCK(3, 1)
BLOCK(4, 1)
BLOCK(1, 4)
BLOCK(2, 2)
BLOCK(3, 2)

/* rows [r, r + R) over panels [b, b + P): P > 1 only for full panels */
static void rows_block(int64_t R, const float *x, int64_t K, const float *panels, int64_t N,
                       const float *bias, float *y, int64_t r) {
  int64_t nb = (N + 15) / 16, full = N / 16, P = R == 1 ? 4 : (R <= 3 ? 2 : 1), b = 0;
  const float *xr = x + r * K;
  float *yr = y + r * N;
  for (; P > 1 && b + P <= full; b += P) {
    const float *bb = bias ? bias + 16 * b : 0;
    if (R == 1) block1x4(xr, K, panels + b * K * 16, yr + 16 * b, N, 16, bb);
    else if (R == 2) block2x2(xr, K, panels + b * K * 16, yr + 16 * b, N, 16, bb);
    else block3x2(xr, K, panels + b * K * 16, yr + 16 * b, N, 16, bb);
  }
  for (; b < nb; ++b) {
    int64_t n0 = 16 * b, nv = N - n0 < 16 ? N - n0 : 16;
    const float *bb = bias ? bias + n0 : 0, *pan = panels + b * K * 16;
    switch (R) {
      case 1: block1x1(xr, K, pan, yr + n0, N, nv, bb); break;
      case 2: block2x1(xr, K, pan, yr + n0, N, nv, bb); break;
      case 3: block3x1(xr, K, pan, yr + n0, N, nv, bb); break;
      default: block4x1(xr, K, pan, yr + n0, N, nv, bb); break;
    }
  }
}

/* M rows in ceil(M / ROWS) blocks of balanced sizes (5 = 3 + 2, 9 = 3 + 3 + 3): a
 * lone row would cost a whole pass over the weights at one row's FMA rate. */
void narrow_gemm(const float *x, int64_t M, int64_t K, const float *panels, int64_t N,
                 const float *bias, float *y) {
  int64_t blocks = (M + ROWS - 1) / ROWS, r = 0;
  for (int64_t i = 0; i < blocks; ++i) {
    int64_t rows = M / blocks + (i < M % blocks);
    rows_block(rows, x, K, panels, N, bias, y, r);
    r += rows;
  }
}
