/* CRC-32 (zlib's: the reflected IEEE polynomial) for the compiled encoder (events/_speedups.c)
 * and reader (events/log/_sqlite.c), each of which includes this file and so keeps its own
 * table. zlib's own ``crc32`` is built for long buffers: on a log record of a hundred bytes or
 * so its set-up costs as much as the bytes (about 100 ns a record), and it was the encoder's
 * largest single cost in a logged simulation's profile (bench/simulate_bench.py).
 *
 * Two ways, the same CRC. Slicing by eight (eight table lookups per eight bytes) everywhere;
 * and where the CPU has carry-less multiplication (x86's PCLMULQDQ, with SSE4.1), a record of
 * 64 bytes or more is folded sixteen bytes at a time by multiplying with constant powers of x
 * modulo the polynomial, then reduced to 32 bits (Barrett), the tail of under sixteen bytes
 * by the tables: a 412-byte stored record in 22 ns where the tables take 137 (a loop timing
 * each over 2M records, 2-core Xeon VM). This is the method of Intel's white paper "Fast CRC
 * Computation for Generic Polynomials Using PCLMULQDQ Instruction" (Gopal et al., 2009),
 * whose constants for this polynomial are below. ``make_crc_table`` runs once, at import, and
 * asks the CPU which way this process takes. */
#ifndef KVLEDGER_CRC32_H
#define KVLEDGER_CRC32_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define CRC_FOLDS 1
static int crc_folds; /* this CPU has PCLMULQDQ and SSE4.1 (make_crc_table asks it) */

/* The CRC state after ``len`` bytes at ``p`` (64 or more, a multiple of 16), from ``crc``:
 * four 128-bit lanes folded 64 bytes at a time, then into one, then 16 bytes at a time, then
 * 128 bits to 64 and a Barrett reduction to 32. The constants are x^k mod P for the folding
 * distances (bit-reflected, shifted by one) and P with its quotient mu for the reduction. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_fold(const unsigned char *p,
                                                                  size_t len, uint32_t crc) {
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL); /* 4 lanes apart */
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL); /* 1 lane apart */
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);               /* 64 bits */
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL); /* mu, P */
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i a = _mm_loadu_si128((const __m128i *)p);
    __m128i b = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(p + 48));
    a = _mm_xor_si128(a, _mm_cvtsi32_si128((int)crc));
    for (p += 64, len -= 64; len >= 64; p += 64, len -= 64) {
        __m128i a0 = _mm_clmulepi64_si128(a, k1k2, 0x00), b0 = _mm_clmulepi64_si128(b, k1k2, 0x00);
        __m128i c0 = _mm_clmulepi64_si128(c, k1k2, 0x00), d0 = _mm_clmulepi64_si128(d, k1k2, 0x00);
        a = _mm_xor_si128(_mm_clmulepi64_si128(a, k1k2, 0x11), a0);
        b = _mm_xor_si128(_mm_clmulepi64_si128(b, k1k2, 0x11), b0);
        c = _mm_xor_si128(_mm_clmulepi64_si128(c, k1k2, 0x11), c0);
        d = _mm_xor_si128(_mm_clmulepi64_si128(d, k1k2, 0x11), d0);
        a = _mm_xor_si128(a, _mm_loadu_si128((const __m128i *)p));
        b = _mm_xor_si128(b, _mm_loadu_si128((const __m128i *)(p + 16)));
        c = _mm_xor_si128(c, _mm_loadu_si128((const __m128i *)(p + 32)));
        d = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    __m128i lanes[3] = {b, c, d};
    for (int i = 0; i < 3; i++) {
        __m128i low = _mm_clmulepi64_si128(a, k3k4, 0x00);
        a = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k3k4, 0x11), low), lanes[i]);
    }
    for (; len >= 16; p += 16, len -= 16) {
        __m128i low = _mm_clmulepi64_si128(a, k3k4, 0x00);
        a = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k3k4, 0x11), low),
                          _mm_loadu_si128((const __m128i *)p));
    }
    a = _mm_xor_si128(_mm_srli_si128(a, 8), _mm_clmulepi64_si128(a, k3k4, 0x10));
    a = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(a, mask32), k5k0, 0x00),
                      _mm_srli_si128(a, 4));
    __m128i q = _mm_clmulepi64_si128(_mm_and_si128(a, mask32), poly, 0x10);
    q = _mm_clmulepi64_si128(_mm_and_si128(q, mask32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(a, q), 1);
}
#endif

static uint32_t crc_table[8][256];
static void make_crc_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xFF];
#ifdef CRC_FOLDS
    __builtin_cpu_init();
    crc_folds = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
}

/* The CRC-32 of ``n`` bytes at ``p``. */
static uint32_t record_crc(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
#ifdef CRC_FOLDS
    if (crc_folds && n >= 64) {
        size_t body = n & ~(size_t)15;
        c = crc_fold(p, body, c);
        p += body;
        n -= body;
    }
#endif
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                           (uint32_t)p[3] << 24);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
            crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^ crc_table[3][p[4]] ^
            crc_table[2][p[5]] ^ crc_table[1][p[6]] ^ crc_table[0][p[7]];
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

#endif
