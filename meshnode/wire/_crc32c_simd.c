/* CRC32C (Castagnoli) at about memcpy speed on x86-64 CPUs with AVX2 and VPCLMULQDQ.

Why: google-crc32c runs three interleaved crc32-instruction chains, which is as fast as
that instruction goes (8 bytes a cycle; 0.65x a memcpy on the development machine), and verifying the
checksum of a received tensor is most of what decoding it costs. This kernel keeps those
three chains busy and, in the same loop, folds a fourth region with carry-less multiplies
(which run on other execution units), then joins the four partial CRCs by shifting each
register over the bytes that follow it. Every constant is computed at import from the
polynomial; nothing is a magic number. Where the CPU or compiler lacks the instructions,
``available`` is false and meshnode.wire.crc32c uses google-crc32c.

Math: a CRC register r over message M is (r * x^(8|M|) + M * x^32) mod P, linear in both,
so crc(A || B) = shift(crc(A), |B|) xor crc_from_zero(B). In the reflected representation
the crc32 instruction and the folds use, the carry-less product of a 32-bit and a 64-bit
value lands with an extra factor x^33, which the constants absorb (x^(d-33), not x^d).
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MESHNODE_CRC_SIMD 1
#include <immintrin.h>

#define POLY_NORMAL 0x1EDC6F41u /* x^32 + ... Castagnoli, without the x^32 term */

static uint32_t reverse32(uint32_t v) {
    uint32_t r = 0;
    for (int i = 0; i < 32; i++) {
        r = (r << 1) | (v & 1);
        v >>= 1;
    }
    return r;
}

/* a * b mod P, polynomials in normal bit order (bit i = coefficient of x^i). */
static uint32_t mulmod(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 31; i >= 0; i--) {
        uint32_t carry = product & 0x80000000u;
        product <<= 1;
        if (carry) product ^= POLY_NORMAL;
        if ((b >> i) & 1) product ^= a;
    }
    return product;
}

/* The carry-less product of two reflected residues, reduced by the crc32 instruction,
   is a * b * x^33 mod P. Residues kept as x^(e-33) ("scaled") are closed under it:
   x^(a-33) * x^(b-33) * x^33 = x^(a+b-33). scaled_pow2[i] = x^(2^i - 33), reflected. */
static uint32_t scaled_pow2[64];

__attribute__((target("sse4.2,pclmul")))
static uint32_t mul_x33(uint32_t a, uint32_t b) {
    __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)a), _mm_cvtsi32_si128((int)b), 0);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(product));
}

static void init_tables(void) {
    /* x^-1 = (P - 1) / x, since P's constant term is 1. */
    uint32_t x_inverse = 0x80000000u | (POLY_NORMAL >> 1);
    uint32_t x_minus_33 = 1;
    for (int i = 0; i < 33; i++) x_minus_33 = mulmod(x_minus_33, x_inverse);
    uint32_t power = 2; /* x^(2^i), normal order */
    for (int i = 0; i < 64; i++) {
        scaled_pow2[i] = reverse32(mulmod(power, x_minus_33));
        power = mulmod(power, power);
    }
}

/* x^(e-33) mod P, reflected, for e > 0. */
__attribute__((target("sse4.2,pclmul")))
static uint32_t scaled_xpow(uint64_t e) {
    int i = __builtin_ctzll(e);
    uint32_t result = scaled_pow2[i];
    e >>= i; /* two steps: shifting a 64-bit value by 64 is undefined */
    for (e >>= 1, i++; e; e >>= 1, i++)
        if (e & 1) result = mul_x33(result, scaled_pow2[i]);
    return result;
}

__attribute__((target("sse4.2,pclmul")))
static uint32_t shift_register(uint32_t reg, uint64_t nbytes) {
    /* reg * x^(8n) mod P = mul_x33(reg, x^(8n-33)). */
    return nbytes ? mul_x33(reg, scaled_xpow(8 * nbytes)) : reg;
}

/* x^e mod P, reflected (the folding constants). */
static uint32_t xpow_reflected(uint64_t e) { return scaled_xpow(e + 33); }

__attribute__((target("sse4.2")))
static uint32_t crc_bytes(uint32_t reg, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        reg = (uint32_t)_mm_crc32_u64(reg, v);
        p += 8;
        n -= 8;
    }
    while (n--) reg = _mm_crc32_u8(reg, *p++);
    return reg;
}

static uint32_t fold_k1_128, fold_k2_128, fold_k1_1024, fold_k2_1024;

__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))
static inline __m256i fold256(__m256i lanes, __m256i k, __m256i next) {
    __m256i hi_part = _mm256_clmulepi64_epi128(lanes, k, 0x00); /* first 8 bytes x K1 */
    __m256i lo_part = _mm256_clmulepi64_epi128(lanes, k, 0x11); /* last 8 bytes x K2 */
    return _mm256_xor_si256(_mm256_xor_si256(hi_part, lo_part), next);
}

__attribute__((target("pclmul,sse4.2")))
static inline __m128i fold128(__m128i lane, __m128i k, __m128i next) {
    __m128i a = _mm_clmulepi64_si128(lane, k, 0x00);
    __m128i b = _mm_clmulepi64_si128(lane, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(a, b), next);
}

#define CHAIN_BYTES 32   /* per crc32 chain per iteration */
#define FOLD_BYTES 128   /* per iteration through the carry-less folds */
#define STEP_BYTES (3 * CHAIN_BYTES + FOLD_BYTES)

__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))
static uint32_t crc32c_fused(uint32_t crc, const uint8_t *p, size_t n) {
    uint32_t reg = ~crc;
    size_t iterations = n / STEP_BYTES;
    if (iterations < 2) return ~crc_bytes(reg, p, n);
    size_t chain_len = iterations * CHAIN_BYTES;
    const uint8_t *a = p, *b = p + chain_len, *c = p + 2 * chain_len, *f = p + 3 * chain_len;
    uint64_t ra = reg, rb = 0, rc = 0;
    __m256i k = _mm256_set_epi64x(fold_k2_1024, fold_k1_1024, fold_k2_1024, fold_k1_1024);
    __m256i x0 = _mm256_loadu_si256((const __m256i *)(f + 0));
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(f + 32));
    __m256i x2 = _mm256_loadu_si256((const __m256i *)(f + 64));
    __m256i x3 = _mm256_loadu_si256((const __m256i *)(f + 96));
    for (size_t i = 0; i < iterations; i++) {
        size_t o = i * CHAIN_BYTES;
        uint64_t va, vb, vc;
        for (int q = 0; q < CHAIN_BYTES; q += 8) {
            memcpy(&va, a + o + q, 8);
            memcpy(&vb, b + o + q, 8);
            memcpy(&vc, c + o + q, 8);
            ra = _mm_crc32_u64(ra, va);
            rb = _mm_crc32_u64(rb, vb);
            rc = _mm_crc32_u64(rc, vc);
        }
        if (i + 1 < iterations) {
            const uint8_t *next = f + (i + 1) * FOLD_BYTES;
            x0 = fold256(x0, k, _mm256_loadu_si256((const __m256i *)(next + 0)));
            x1 = fold256(x1, k, _mm256_loadu_si256((const __m256i *)(next + 32)));
            x2 = fold256(x2, k, _mm256_loadu_si256((const __m256i *)(next + 64)));
            x3 = fold256(x3, k, _mm256_loadu_si256((const __m256i *)(next + 96)));
        }
    }
    /* Eight 16-byte lanes of the last block: fold each into the next, 16 bytes apart. */
    __m128i k128 = _mm_set_epi64x(fold_k2_128, fold_k1_128);
    __m128i lanes[8] = {
        _mm256_castsi256_si128(x0), _mm256_extracti128_si256(x0, 1),
        _mm256_castsi256_si128(x1), _mm256_extracti128_si256(x1, 1),
        _mm256_castsi256_si128(x2), _mm256_extracti128_si256(x2, 1),
        _mm256_castsi256_si128(x3), _mm256_extracti128_si256(x3, 1),
    };
    __m128i acc = lanes[0];
    for (int l = 1; l < 8; l++) acc = fold128(acc, k128, lanes[l]);
    uint32_t rf = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(acc));
    rf = (uint32_t)_mm_crc32_u64(rf, (uint64_t)_mm_extract_epi64(acc, 1));
    size_t fold_len = iterations * FOLD_BYTES;
    reg = shift_register((uint32_t)ra, chain_len) ^ (uint32_t)rb;
    reg = shift_register(reg, chain_len) ^ (uint32_t)rc;
    reg = shift_register(reg, fold_len) ^ rf;
    size_t done = 3 * chain_len + fold_len;
    return ~crc_bytes(reg, p + done, n - done);
}

static void crc32c_init(void) {
    init_tables();
    /* Folding a 16-byte lane d bits forward: first 8 bytes x x^(d+31), last 8 x x^(d-33). */
    fold_k1_128 = xpow_reflected(128 + 31);
    fold_k2_128 = xpow_reflected(128 - 33);
    fold_k1_1024 = xpow_reflected(1024 + 31);
    fold_k2_1024 = xpow_reflected(1024 - 33);
}

static int cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
}
#endif /* MESHNODE_CRC_SIMD */

/* Below this the GIL is kept: releasing it costs more than the checksum. */
#define RELEASE_GIL_BYTES (64 * 1024)

static int simd_available = 0;

static PyObject *extend(PyObject *module, PyObject *args) {
    unsigned int crc;
    Py_buffer buffer;
    (void)module;
    if (!PyArg_ParseTuple(args, "Iy*:extend", &crc, &buffer)) return NULL;
    if (!simd_available) {
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_RuntimeError, "needs an x86-64 CPU with AVX2 and VPCLMULQDQ; use google-crc32c");
        return NULL;
    }
    uint32_t result = crc;
#ifdef MESHNODE_CRC_SIMD
    const uint8_t *data = (const uint8_t *)buffer.buf;
    size_t length = (size_t)buffer.len;
    if (length >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        result = crc32c_fused(crc, data, length);
        Py_END_ALLOW_THREADS
    } else {
        result = crc32c_fused(crc, data, length);
    }
#endif
    PyBuffer_Release(&buffer);
    return PyLong_FromUnsignedLong(result);
}

static PyMethodDef methods[] = {
    {"extend", extend, METH_VARARGS,
     "extend(crc, data) -> CRC32C of data continuing from crc (0 starts a new checksum)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_crc32c_simd",
    "CRC32C with AVX2 + VPCLMULQDQ; see meshnode.wire.crc32c.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crc32c_simd(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
#ifdef MESHNODE_CRC_SIMD
    simd_available = cpu_supported();
    if (simd_available) crc32c_init();
#endif
    if (PyModule_AddObject(module, "available", PyBool_FromLong(simd_available)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
