/*
 * kvstream.hashing._chainnative: SHA-256 and BLAKE3 block-hash chains in C.
 *
 * The algorithms are defined (and implemented in pure Python, the reference) in
 * kvstream/hashing/trtllm.py (v2_sha256), vllm.py (vllm_sha256_cbor), vllm_pickle.py
 * (vllm_sha256), native.py (blake3) and sglang.py (sglang_sha256_64).
 * This module hashes a whole request's chain in one call, so the per-block cost is the hash
 * compression itself instead of a Python-level hashlib call per block:
 *
 *   KIND_V2      key = SHA-256(parent (32) || each token as u32 little-endian)
 *   KIND_CBOR    key = SHA-256(83 58 20 || parent (32) || canonical CBOR array of the tokens
 *                              || tail)        tail: the block's CBOR extra keys (f6: None)
 *   KIND_BLAKE3  key = BLAKE3(parent (32) || each token as u32 little-endian)
 *   KIND_PICKLE  key = SHA-256(pickle protocol 5 of (parent, tuple(tokens), extra)), built as
 *                80 05 95 <frame length, u64 LE> 43 20 parent (32) 94, the token tuple (28
 *                items 74, or items 85/86/87 for 1-3 ids; each id K/M/J/LONG1 as pickle
 *                writes ints) 94, then tail: the pickle bytes of the extra keys (memo from
 *                2) and 87 94 2e (see vllm_pickle.py). The caller keeps the message
 *                below 64 KiB, pickle's frame size (one frame).
 *   KIND_SGLANG  key = SHA-256(parent (32) || each token as u32 little-endian), no parent
 *                for a first block whose given parent is empty; published from
 *                SHA-256(tail || key[0:8]) instead of the key when a tail (SGLang's
 *                namespace seed) is given
 *
 * SHA-256 uses the x86 SHA extensions when the CPU has them (checked once with cpuid) and a
 * portable implementation otherwise; BLAKE3 (inputs of any length, chunk tree included)
 * compresses on SSE4.1 registers when available, with the portable reference otherwise; the
 * CBOR and pickle token encodings take four ids per step with SSE4.1 (scalar otherwise).
 * A KIND_BLAKE3 chain hashes first, for all its blocks, the chunks that do not hold the
 * parent key (a 512-token block's message is 2080 bytes: chunks 1 and 2 of 3), eight chunks
 * at a time on AVX2 (one by one otherwise); only each block's first chunk and its tree nodes
 * stay on the chain's sequential path (b3_chain_split). Several requests' chains (chain_many)
 * are independent: on AVX2 their sequential paths run eight requests side by side.
 *
 * Entry points:
 *
 *   chain(kind, tokens, block_tokens, parent, start=0, width=32, offset=0,
 *         first_tail=None, tail=None, every=0) -> (published: list[bytes], keys: list[bytes])
 *       tokens: one buffer of u32 LE ids cut into blocks of block_tokens ids (only full blocks
 *       from block index ``start`` on are hashed), or a list/tuple of per-block buffers (then
 *       block_tokens and start are ignored). parent: the 32-byte key before the first hashed
 *       block (KIND_SGLANG: or empty, none). published[i] = key[offset:offset + width].
 *       tail: KIND_CBOR/KIND_PICKLE's per-block tail (required for KIND_PICKLE),
 *       KIND_SGLANG's namespace seed. first_tail (KIND_CBOR, KIND_PICKLE) replaces tail for
 *       the first hashed block (the caller passes it only at chain depth 0). keys
 *       holds the full 32-byte key after every block whose absolute index i has
 *       (i + 1) % every == 0 (every > 0).
 *   chain_many(kind, raws, block_tokens, parent, width=32, offset=0)
 *         -> list[(published: list[bytes], keys: list[bytes])]
 *       KIND_BLAKE3 only: chain(kind, raw, block_tokens, parent, width=width, offset=offset,
 *       every=n) of every raw in raws (n its full blocks; ([], []) for a raw without one, not
 *       validated), the requests hashed side by side on AVX2: eight requests a step, one
 *       per lane (b3_chain_many).
 *   pack(tokens, drop_last=False) -> bytes | None
 *       a list/tuple of ints as u32 LE bytes; None when an item is not an int in 0..2**32-1
 *       (the caller then takes its validating path). Exact ints are read from their digits.
 *   fingerprints(raw, stride) -> list[int]
 *       a 64-bit fingerprint of raw[:k * stride] for k = 1 .. len(raw) // stride (not a
 *       cryptographic hash: a candidate filter whose hits the caller verifies).
 *   same_prefix(a, b, n) -> bool      a[:n] == b[:n] (False if either is shorter).
 *   split(blob, width, count) -> list[bytes]   the first count width-byte pieces of blob.
 *   json_ids(text) -> bytes | None
 *       a JSON array of plain decimal u32 ids (the text of a request's token_ids) as u32 LE
 *       bytes; None for any other text (the caller's JSON decoder then decides).
 *   dynamo_keys(tokens, block_tokens, seed, parent, drop_last=False) -> list[bytes] | None
 *       the Dynamo-keyed index's 16-byte keys of a request's full blocks (key_mode="dynamo",
 *       kvstream/index/keys.py): per block local = XXH3-64(u32 LE tokens, seed) and
 *       key = XXH3-64(parent key || local) || local, all big-endian, chained from parent.
 *       tokens: a list/tuple of ints (None for a bad item: the caller's validating path then
 *       raises) or u32 LE bytes.
 *   dynamo_link(local_hashes, parent, signed) -> list[bytes] | None
 *       the keys of a chain of local hashes (8-byte items, or i64 ints when signed).
 *   XXH3 is xxHash's own code (xxhash.h, vendored, BSD-2-Clause; see NOTICE).
 *   sha256(data) -> bytes, blake3(data) -> bytes, has_sha_ni() -> bool,
 *   set_simd(on) -> bool      (primitives; set_simd(False) selects the portable code).
 *
 * Bad inputs raise kvstream.errors.HashingError (wrong call signatures raise TypeError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86_SHA 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#define KIND_V2 0
#define KIND_CBOR 1
#define KIND_BLAKE3 2
#define KIND_SGLANG 3
#define KIND_PICKLE 4
#define KEY_LEN 32
/* Release the GIL for flat requests with at least this many tokens. */
#define NOGIL_MIN_TOKENS 2048

static PyObject *HashingError = NULL; /* kvstream.errors.HashingError */

/* =============================================================================== SHA-256 */

static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static const uint32_t SHA_IV[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

static inline uint32_t
rotr32(uint32_t x, int n)
{
    return (x >> n) | (x << (32 - n));
}

static inline uint32_t
load_be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline void
store_be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static inline uint32_t
load_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static inline void
store_le32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static void
sha256_blocks_portable(uint32_t st[8], const unsigned char *data, size_t nblocks)
{
    uint32_t w[64];
    while (nblocks--) {
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3];
        uint32_t e = st[4], f = st[5], g = st[6], h = st[7];
        int t;
        for (t = 0; t < 16; t++)
            w[t] = load_be32(data + 4 * t);
        for (t = 16; t < 64; t++) {
            uint32_t s0 = rotr32(w[t - 15], 7) ^ rotr32(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = rotr32(w[t - 2], 17) ^ rotr32(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        for (t = 0; t < 64; t++) {
            uint32_t S1 = rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25);
            uint32_t ch = (e & f) ^ (~e & g);
            uint32_t t1 = h + S1 + ch + SHA_K[t] + w[t];
            uint32_t S0 = rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22);
            uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
            uint32_t t2 = S0 + maj;
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        st[0] += a;
        st[1] += b;
        st[2] += c;
        st[3] += d;
        st[4] += e;
        st[5] += f;
        st[6] += g;
        st[7] += h;
        data += 64;
    }
}

#ifdef HAVE_X86_SHA
/* The x86 SHA extensions: two rounds per sha256rnds2, the schedule by sha256msg1/msg2. */
__attribute__((target("sha,sse4.1,ssse3"))) static void
sha256_blocks_shani(uint32_t st[8], const unsigned char *data, size_t nblocks)
{
    const __m128i MASK = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i s0, s1, tmp, msg, abef, cdgh;
    __m128i w[16];
    int i;

    tmp = _mm_loadu_si128((const __m128i *)&st[0]);
    s1 = _mm_loadu_si128((const __m128i *)&st[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);       /* CDAB */
    s1 = _mm_shuffle_epi32(s1, 0x1B);         /* EFGH */
    s0 = _mm_alignr_epi8(tmp, s1, 8);         /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);      /* CDGH */

    while (nblocks--) {
        abef = s0;
        cdgh = s1;
        for (i = 0; i < 16; i++) {
            if (i < 4) {
                w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * i)), MASK);
            }
            else {
                tmp = _mm_add_epi32(_mm_sha256msg1_epu32(w[i - 4], w[i - 3]),
                                    _mm_alignr_epi8(w[i - 1], w[i - 2], 4));
                w[i] = _mm_sha256msg2_epu32(tmp, w[i - 1]);
            }
            msg = _mm_add_epi32(w[i], _mm_loadu_si128((const __m128i *)&SHA_K[4 * i]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, msg);
            msg = _mm_shuffle_epi32(msg, 0x0E);
            s0 = _mm_sha256rnds2_epu32(s0, s1, msg);
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
        data += 64;
    }

    tmp = _mm_shuffle_epi32(s0, 0x1B);        /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);         /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);      /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);         /* ABEF */
    _mm_storeu_si128((__m128i *)&st[0], s0);
    _mm_storeu_si128((__m128i *)&st[4], s1);
}

static int
cpu_has_sse41(void)
{
    unsigned int a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 1)
        return 0;
    __cpuid_count(1, 0, a, b, c, d);
    return (c & bit_SSE4_1) && (c & bit_SSSE3);
}

static int
cpu_has_sha_ni(void)
{
    unsigned int a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(1, 0, a, b, c, d);
    if (!(c & bit_SSE4_1) || !(c & bit_SSSE3))
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b & (1u << 29)) != 0; /* CPUID.7.0:EBX.SHA */
}
#endif

typedef void (*sha_blocks_fn)(uint32_t st[8], const unsigned char *data, size_t nblocks);
static sha_blocks_fn sha256_blocks = sha256_blocks_portable;
static int using_sha_ni = 0;

/* SHA-256 of msg[0:len]; msg must have room for len + 72 bytes (the padding is written in
 * place). */
static void
sha256_padded(unsigned char *msg, size_t len, unsigned char out[32])
{
    uint32_t st[8];
    size_t total = (len + 9 + 63) & ~(size_t)63;
    uint64_t bits = (uint64_t)len * 8;
    int i;

    memcpy(st, SHA_IV, sizeof st);
    msg[len] = 0x80;
    memset(msg + len + 1, 0, total - len - 9);
    for (i = 0; i < 8; i++)
        msg[total - 1 - i] = (unsigned char)(bits >> (8 * i));
    sha256_blocks(st, msg, total / 64);
    for (i = 0; i < 8; i++)
        store_be32(out + 4 * i, st[i]);
}

/* ================================================================================ BLAKE3 */

/* The compression (portable and SSE4.1), its rounds' macros and the one-state hash of any
 * length are shared with the index's token keys (kvstream/_native/src/blake3_portable.h);
 * this file adds the chains and the SIMD lanes. */
#include "../_native/src/blake3_portable.h"

#define B3_CHUNK_START B3P_CHUNK_START
#define B3_CHUNK_END B3P_CHUNK_END
#define B3_PARENT B3P_PARENT
#define B3_ROOT B3P_ROOT
#define B3_CHUNK_LEN B3P_CHUNK_LEN
#define b3_compress b3p_compress
#define b3_compress_sse41 b3p_compress_sse41
#define b3_compress_impl b3p_compress_impl
typedef b3p_output b3_output;

static inline void
b3_chunk(const unsigned char *p, size_t len, uint64_t counter, b3_output *o)
{
    b3p_chunk(B3P_IV, 0, p, len, counter, o);
}

static inline void
b3_parent(const uint32_t left[8], const uint32_t right[8], b3_output *o)
{
    b3p_parent(B3P_IV, 0, left, right, o);
}

static inline void
b3_hash(const unsigned char *p, size_t len, unsigned char out[32])
{
    b3p_hash(B3P_IV, 0, p, len, out, 32);
}

/* One block of a chain: n u32 LE token ids at tok. */
typedef struct {
    const unsigned char *tok;
    Py_ssize_t n; /* tokens */
} blk_t;

/* ---------------------------------------------------------------- BLAKE3 chunks in lanes
 *
 * A block's message is parent (32) || tokens: only its first 1024-byte chunk holds the parent,
 * so with more than one chunk the chaining values of all the other chunks of every block of a
 * request are computed first, several chunks side by side (one per SIMD lane), leaving the
 * first chunk and the parent nodes on the chain's sequential path (b3_chain_split). */

#define B3_MAX_LANES 8

/* Chaining values of n chunks of len bytes each (1..1024, the same for all; not root chunks:
 * the message has more than one chunk): chunk i at in[i] with chunk counter ctr[i], its
 * value to out + 8 * i. */
typedef void (*b3_chunks_fn)(const unsigned char *const *in, size_t len, const uint64_t *ctr,
                             size_t n, uint32_t *out);

static void
b3_chunks_one(const unsigned char *const *in, size_t len, const uint64_t *ctr, size_t n,
              uint32_t *out)
{
    size_t i;
    for (i = 0; i < n; i++) {
        b3_output o;
        b3_chunk(in[i], len, ctr[i], &o);
        b3_compress_impl(o.cv, o.block, o.block_len, o.counter, o.flags, out + 8 * i);
    }
}

static b3_chunks_fn b3_chunks_many = b3_chunks_one;

#ifdef HAVE_X86_SHA
static int
cpu_has_avx2(void)
{
    unsigned int a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(1, 0, a, b, c, d);
    if (!(c & bit_OSXSAVE) || !(c & bit_AVX))
        return 0;
    {
        /* the OS saves the YMM registers (XCR0 bits 1 and 2) */
        unsigned int lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & 6) != 6)
            return 0;
    }
    __cpuid_count(7, 0, a, b, c, d);
    return (b & bit_AVX2) != 0;
}

/* The last, partial block of each lane's chunk, zero-padded (lanes beyond n: lane 0's). */
static void
b3_last_blocks(const unsigned char *const *in, size_t off, size_t rest, size_t n, size_t lanes,
               unsigned char pad[][64], const unsigned char **src)
{
    size_t i;
    for (i = 0; i < lanes; i++) {
        memset(pad[i], 0, 64);
        memcpy(pad[i], in[i < n ? i : 0] + off, rest);
        src[i] = pad[i];
    }
}

#define X8_ROT16(x) _mm256_shuffle_epi8((x), rot16)
#define X8_ROT8(x) _mm256_shuffle_epi8((x), rot8)
#define X8_ROTR(x, k) _mm256_or_si256(_mm256_srli_epi32((x), (k)), _mm256_slli_epi32((x), 32 - (k)))
#define X8_G(a, b, c, d, x, y)                                            \
    do {                                                                  \
        v[a] = _mm256_add_epi32(_mm256_add_epi32(v[a], (x)), v[b]);       \
        v[d] = X8_ROT16(_mm256_xor_si256(v[d], v[a]));                    \
        v[c] = _mm256_add_epi32(v[c], v[d]);                              \
        v[b] = X8_ROTR(_mm256_xor_si256(v[b], v[c]), 12);                 \
        v[a] = _mm256_add_epi32(_mm256_add_epi32(v[a], (y)), v[b]);       \
        v[d] = X8_ROT8(_mm256_xor_si256(v[d], v[a]));                     \
        v[c] = _mm256_add_epi32(v[c], v[d]);                              \
        v[b] = X8_ROTR(_mm256_xor_si256(v[b], v[c]), 7);                  \
    } while (0)

/* r[i] (8 words each) transposed in place: afterwards r[j] holds word j of each input row. */
__attribute__((target("avx2"))) static inline void
x8_transpose(__m256i r[8])
{
    __m256i t[8], u[8];
    int i;
    for (i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);     /* words 0, 4 of 4 rows */
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]); /* words 1, 5 */
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* Eight chunks at once (AVX2): one chunk per 32-bit lane. */
__attribute__((target("avx2"))) static void
b3_chunks8_avx2(const unsigned char *const *in, size_t len, const uint64_t *ctr, size_t n,
                uint32_t *out)
{
    const __m256i rot16 = _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13,
                                           2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m256i rot8 = _mm256_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12,
                                          1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
    const size_t nblk = (len + 63) / 64;
    const size_t rest = len - 64 * (nblk - 1); /* bytes of the last block, 1..64 */
    unsigned char pad[8][64];
    size_t g;

    for (g = 0; g < n; g += 8) {
        const size_t k = n - g < 8 ? n - g : 8;
        const unsigned char *lane[8];
        uint32_t lo[8], hi[8];
        __m256i h[8], v[16], m[16], cnt_lo, cnt_hi;
        size_t i, blk;
        for (i = 0; i < 8; i++) {
            const size_t j = g + (i < k ? i : 0); /* idle lanes repeat the group's first */
            lane[i] = in[j];
            lo[i] = (uint32_t)ctr[j];
            hi[i] = (uint32_t)(ctr[j] >> 32);
        }
        cnt_lo = _mm256_loadu_si256((const __m256i *)lo);
        cnt_hi = _mm256_loadu_si256((const __m256i *)hi);
        for (i = 0; i < 8; i++)
            h[i] = _mm256_set1_epi32((int)SHA_IV[i]);
        for (blk = 0; blk < nblk; blk++) {
            const int last = blk + 1 == nblk;
            const unsigned char *src[8];
            const uint32_t flags = (blk == 0 ? B3_CHUNK_START : 0) | (last ? B3_CHUNK_END : 0);
            if (last && rest < 64)
                b3_last_blocks(lane, 64 * blk, rest, 8, 8, pad, src);
            else
                for (i = 0; i < 8; i++)
                    src[i] = lane[i] + 64 * blk;
            for (i = 0; i < 8; i++) {
                m[i] = _mm256_loadu_si256((const __m256i *)src[i]);
                m[i + 8] = _mm256_loadu_si256((const __m256i *)(src[i] + 32));
            }
            x8_transpose(m);
            x8_transpose(m + 8);
            for (i = 0; i < 8; i++)
                v[i] = h[i];
            for (i = 0; i < 4; i++)
                v[8 + i] = _mm256_set1_epi32((int)SHA_IV[i]);
            v[12] = cnt_lo;
            v[13] = cnt_hi;
            v[14] = _mm256_set1_epi32(last ? (int)rest : 64);
            v[15] = _mm256_set1_epi32((int)flags);
            B3_LROUNDS(X8_G);
            for (i = 0; i < 8; i++)
                h[i] = _mm256_xor_si256(v[i], v[i + 8]);
        }
        x8_transpose(h); /* h[i]: lane i's chaining value */
        for (i = 0; i < k; i++)
            _mm256_storeu_si256((__m256i *)(out + 8 * (g + i)), h[i]);
    }
}
#endif

/* The chaining value of a message's first chunk, 1024 bytes at counter 0 and not the root:
 * its first block is parent (32) || tok[0:32], then tok[32:992]. */
typedef void (*b3_first_fn)(const unsigned char *parent, const unsigned char *tok,
                            uint32_t out[8]);

static void
b3_first_chunk_one(const unsigned char *parent, const unsigned char *tok, uint32_t out[8])
{
    unsigned char first[64];
    int j;
    memcpy(first, parent, KEY_LEN);
    memcpy(first + KEY_LEN, tok, 64 - KEY_LEN);
    memcpy(out, SHA_IV, 8 * sizeof(uint32_t));
    b3_compress_impl(out, first, 64, 0, B3_CHUNK_START, out);
    for (j = 1; j < 15; j++)
        b3_compress_impl(out, tok + 64 * j - KEY_LEN, 64, 0, 0, out);
    b3_compress_impl(out, tok + 64 * 15 - KEY_LEN, 64, 0, B3_CHUNK_END, out);
}

#ifdef HAVE_X86_SHA
/* b3_first_chunk_one with b3_compress_sse41's rounds, the chaining value kept in registers
 * from block to block (this is the chain's sequential path) */
__attribute__((target("sse4.1,ssse3"))) static void
b3_first_chunk_sse41(const unsigned char *parent, const unsigned char *tok, uint32_t out[8])
{
    const __m128i rot16 = _mm_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m128i rot8 = _mm_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
    const __m128i iv0 = _mm_loadu_si128((const __m128i *)&SHA_IV[0]);
    const __m128i iv1 = _mm_loadu_si128((const __m128i *)&SHA_IV[4]);
    __m128i h0 = iv0, h1 = iv1, r0, r1, r2, r3;
    uint32_t m[16];
    int j;
    for (j = 0; j < 16; j++) {
        /* x86: the words are little-endian in memory already */
        if (j == 0) {
            memcpy(m, parent, KEY_LEN);
            memcpy(m + 8, tok, 64 - KEY_LEN);
        }
        else {
            memcpy(m, tok + 64 * j - KEY_LEN, 64);
        }
        r0 = h0;
        r1 = h1;
        r2 = iv0;
        r3 = _mm_setr_epi32(0, 0, 64,
                            j == 0 ? (int)B3_CHUNK_START : j == 15 ? (int)B3_CHUNK_END : 0);
        B3_SROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        B3_SROUND(2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8);
        B3_SROUND(3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1);
        B3_SROUND(10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6);
        B3_SROUND(12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4);
        B3_SROUND(9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7);
        B3_SROUND(11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13);
        h0 = _mm_xor_si128(r0, r2);
        h1 = _mm_xor_si128(r1, r3);
    }
    _mm_storeu_si128((__m128i *)&out[0], h0);
    _mm_storeu_si128((__m128i *)&out[4], h1);
}
#endif

static b3_first_fn b3_first_chunk = b3_first_chunk_one;

/* Parent node of two chaining values, compressed with extra flags (B3_ROOT or 0). */
static void
b3_parent_cv(const uint32_t left[8], const uint32_t right[8], uint32_t flags, uint32_t out[8])
{
    b3_output o;
    b3_parent(left, right, &o);
    b3_compress_impl(o.cv, o.block, o.block_len, o.counter, o.flags | flags, out);
}

/* BLAKE3(parent || tok[0:tlen]) of a message of more than one chunk whose chunks 1.. have
 * chaining values cvs[0..) already (cvs[j - 1] for chunk j): the first chunk, then the tree. */
static void
b3_hash_split(const unsigned char *parent, const unsigned char *tok, size_t tlen,
              const uint32_t *cvs, unsigned char out[32])
{
    const size_t nchunks = (KEY_LEN + tlen + B3_CHUNK_LEN - 1) / B3_CHUNK_LEN;
    uint32_t stack[64][8], cv[8], words[8];
    size_t j, depth = 0;
    int i;

    b3_first_chunk(parent, tok, cv);
    /* the tree as b3_hash builds it: merge on each trailing zero bit of the chunk count */
    for (j = 0; j + 1 < nchunks; j++) {
        uint64_t total;
        if (j > 0)
            memcpy(cv, cvs + 8 * (j - 1), sizeof cv);
        for (total = j + 1; (total & 1) == 0; total >>= 1)
            b3_parent_cv(stack[--depth], cv, 0, cv);
        memcpy(stack[depth++], cv, sizeof cv);
    }
    memcpy(cv, cvs + 8 * (nchunks - 2), sizeof cv); /* the last chunk's */
    while (depth > 1)
        b3_parent_cv(stack[--depth], cv, 0, cv);
    b3_parent_cv(stack[0], cv, B3_ROOT, words);
    for (i = 0; i < 8; i++)
        store_le32(out + 4 * i, words[i]);
}

/* Chaining values kept on the stack before b3_chain_split allocates. */
#define B3_SPLIT_STACK_CVS 256

/* Lanes waiting for b3_chunks_many: chunks of one length, and where their values go. */
typedef struct {
    const unsigned char *in[B3_MAX_LANES];
    uint64_t ctr[B3_MAX_LANES];
    uint32_t *dst[B3_MAX_LANES];
    size_t k;
} b3_group;

static void
b3_group_flush(b3_group *g, size_t len)
{
    uint32_t out[8 * B3_MAX_LANES];
    size_t i;
    if (g->k == 0)
        return;
    b3_chunks_many(g->in, len, g->ctr, g->k, out);
    for (i = 0; i < g->k; i++)
        memcpy(g->dst[i], out + 8 * i, 8 * sizeof(uint32_t));
    g->k = 0;
}

static void
b3_group_add(b3_group *g, size_t len, const unsigned char *in, uint64_t ctr, uint32_t *dst)
{
    g->in[g->k] = in;
    g->ctr[g->k] = ctr;
    g->dst[g->k++] = dst;
    if (g->k == B3_MAX_LANES)
        b3_group_flush(g, len);
}

/* The chaining values of the chunks of blocks[0..nb) that do not hold the parent key (all but
 * each block's first 1024 message bytes) to cvs, block by block, computed in lanes
 * (b3_chunks_many, grouped by chunk length: whole chunks, and the length of the first short
 * last chunk; any other length one by one). */
static void
b3_free_chunks(const blk_t *blocks, Py_ssize_t nb, uint32_t *cvs)
{
    size_t short_len = 0;
    b3_group full, part;
    uint32_t *at = cvs;
    Py_ssize_t b;

    full.k = part.k = 0;
    for (b = 0; b < nb; b++) {
        const size_t len = KEY_LEN + 4 * (size_t)blocks[b].n;
        size_t j;
        for (j = 1; len > B3_CHUNK_LEN && j * B3_CHUNK_LEN < len; j++, at += 8) {
            const unsigned char *in = blocks[b].tok + j * B3_CHUNK_LEN - KEY_LEN;
            const size_t left = len - j * B3_CHUNK_LEN;
            if (left >= B3_CHUNK_LEN) {
                b3_group_add(&full, B3_CHUNK_LEN, in, j, at);
                continue;
            }
            if (short_len == 0)
                short_len = left;
            if (left == short_len)
                b3_group_add(&part, left, in, j, at);
            else
                b3_chunks_one(&in, left, (const uint64_t[]){j}, 1, at);
        }
    }
    b3_group_flush(&full, B3_CHUNK_LEN);
    b3_group_flush(&part, short_len);
}

/* KIND_BLAKE3's chain of blocks[0..nb) from parent, keys to keys + 32 * i: blocks of more than
 * one chunk by b3_hash_split after the values of their parent-free chunks (b3_free_chunks);
 * shorter blocks as one message in msg (room for 32 + 1024 bytes). Returns -1 (nothing
 * written) when no block has more than one chunk (hash_chain's per-block loop then runs: there
 * is nothing to split) or the scratch for the chaining values cannot be allocated. */
static int
b3_chain_split(const blk_t *blocks, Py_ssize_t nb, const unsigned char *parent,
               unsigned char *keys, unsigned char *msg)
{
    uint32_t cv_stack[8 * B3_SPLIT_STACK_CVS];
    uint32_t *cvs = cv_stack, *at;
    size_t total = 0;
    Py_ssize_t b;
    const unsigned char *prev = parent;

    for (b = 0; b < nb; b++) {
        const size_t len = KEY_LEN + 4 * (size_t)blocks[b].n;
        if (len > B3_CHUNK_LEN)
            total += (len - 1) / B3_CHUNK_LEN;
    }
    if (total == 0)
        return -1;
    if (total > B3_SPLIT_STACK_CVS) {
        cvs = PyMem_RawMalloc(total * 8 * sizeof(uint32_t));
        if (cvs == NULL)
            return -1;
    }
    b3_free_chunks(blocks, nb, cvs);
    /* the sequential part: each block's first chunk and tree on its parent's key */
    at = cvs;
    for (b = 0; b < nb; b++) {
        const size_t tlen = 4 * (size_t)blocks[b].n;
        unsigned char *key = keys + (size_t)KEY_LEN * b;
        if (KEY_LEN + tlen > B3_CHUNK_LEN) {
            b3_hash_split(prev, blocks[b].tok, tlen, at, key);
            at += 8 * ((KEY_LEN + tlen - 1) / B3_CHUNK_LEN);
        }
        else {
            memcpy(msg, prev, KEY_LEN);
            memcpy(msg + KEY_LEN, blocks[b].tok, tlen);
            b3_hash(msg, KEY_LEN + tlen, key);
        }
        prev = key;
    }
    if (cvs != cv_stack)
        PyMem_RawFree(cvs);
    return 0;
}

/* ------------------------------------------- BLAKE3 chains of several requests side by side
 *
 * chain_many(): the requests' chains are independent and every block message has the same
 * length (32 + 4 * block_tokens bytes), BLAKE3's hash_many pattern. On AVX2 eight requests
 * advance together, one block each per step, one request per 32-bit lane, longest first; a
 * lane whose request ends takes the next one. While every lane is busy, each hashes its whole
 * message (the block is read once, while it is in cache). Once one idles (no request waits),
 * the parent-free chunks of what the last requests have left are hashed eight at a time
 * (b3_free_chunks), so the emptying lanes only run each block's first chunk (on its parent key)
 * and tree nodes; below B3_LANES_MIN live lanes, the rest goes one block at a time. Without
 * AVX2, one request after the other (b3_chain_split). */

/* Below this many live lanes an eight-wide step costs more than that many blocks one by one. */
#define B3_LANES_MIN 3

/* BLAKE3(parent[i] || tok[i][0:len - 32]) to out[i] for the eight lanes i (len > 32); with
 * cvs, the chaining values of chunks 1.. of lane i are read from cvs[i] (8 words per chunk)
 * instead of computed. */
typedef void (*b3_hash8_fn)(const unsigned char *const *parent, const unsigned char *const *tok,
                            size_t len, const uint32_t *const *cvs, unsigned char *const *out);

#ifdef HAVE_X86_SHA
/* The 64 message bytes at offset off (a multiple of 64) of parent || tok, len bytes long, as
 * two 32-byte halves: in place (the first block: the parent, then tok), or zero-padded in pad
 * (a block past the end of the message). */
static inline void
b3_lane_block(const unsigned char *parent, const unsigned char *tok, size_t len, size_t off,
              unsigned char pad[64], const unsigned char **lo, const unsigned char **hi)
{
    size_t n;
    if (off + 64 <= len) {
        *lo = off ? tok + off - KEY_LEN : parent;
        *hi = tok + off;
        return;
    }
    n = len - off;
    memset(pad, 0, 64);
    if (off == 0) {
        memcpy(pad, parent, KEY_LEN);
        memcpy(pad + KEY_LEN, tok, n - KEY_LEN);
    }
    else {
        memcpy(pad, tok + off - KEY_LEN, n);
    }
    *lo = pad;
    *hi = pad + 32;
}

/* One compression in each of eight lanes, lane-sliced: h[j], m[j] hold word j of every lane. */
__attribute__((target("avx2"))) static inline void
x8_compress(__m256i h[8], const __m256i m[16], __m256i cnt_lo, __m256i cnt_hi, uint32_t len,
            uint32_t flags)
{
    const __m256i rot16 = _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13,
                                           2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m256i rot8 = _mm256_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12,
                                          1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
    __m256i v[16];
    int i;
    for (i = 0; i < 8; i++)
        v[i] = h[i];
    for (i = 0; i < 4; i++)
        v[8 + i] = _mm256_set1_epi32((int)SHA_IV[i]);
    v[12] = cnt_lo;
    v[13] = cnt_hi;
    v[14] = _mm256_set1_epi32((int)len);
    v[15] = _mm256_set1_epi32((int)flags);
    B3_LROUNDS(X8_G);
    for (i = 0; i < 8; i++)
        h[i] = _mm256_xor_si256(v[i], v[i + 8]);
}

/* A parent node in each of eight lanes: left and right (h) chaining values, lane-sliced. */
__attribute__((target("avx2"))) static inline void
x8_parent(const __m256i left[8], __m256i h[8], uint32_t flags)
{
    __m256i m[16];
    const __m256i zero = _mm256_setzero_si256();
    int i;
    for (i = 0; i < 8; i++) {
        m[i] = left[i];
        m[8 + i] = h[i];
        h[i] = _mm256_set1_epi32((int)SHA_IV[i]);
    }
    x8_compress(h, m, zero, zero, 64, B3_PARENT | flags);
}

/* b3_hash8_fn on AVX2: the chunks in order, the tree merged as b3_hash merges it. */
__attribute__((target("avx2"))) static void
b3_hash8_avx2(const unsigned char *const *parent, const unsigned char *const *tok, size_t len,
              const uint32_t *const *cvs, unsigned char *const *out)
{
    const size_t nchunks = (len + B3_CHUNK_LEN - 1) / B3_CHUNK_LEN;
    __m256i stack[64][8], h[8], m[16];
    unsigned char pad[8][64];
    size_t c, depth = 0;
    int i;

    for (c = 0; c < nchunks; c++) {
        const size_t start = c * B3_CHUNK_LEN;
        const size_t clen = len - start < B3_CHUNK_LEN ? len - start : B3_CHUNK_LEN;
        const size_t nblk = (clen + 63) / 64;
        const __m256i cnt_lo = _mm256_set1_epi32((int)(uint32_t)c);
        const __m256i cnt_hi = _mm256_set1_epi32((int)(uint32_t)((uint64_t)c >> 32));
        size_t j;
        if (c > 0 && cvs != NULL) {
            for (i = 0; i < 8; i++)
                h[i] = _mm256_loadu_si256((const __m256i *)(cvs[i] + 8 * (c - 1)));
            x8_transpose(h);
        }
        else {
            for (i = 0; i < 8; i++)
                h[i] = _mm256_set1_epi32((int)SHA_IV[i]);
            for (j = 0; j < nblk; j++) {
                const size_t off = start + 64 * j;
                const int last = j + 1 == nblk;
                const uint32_t flags = (j == 0 ? B3_CHUNK_START : 0) |
                                       (last ? B3_CHUNK_END : 0) |
                                       (last && nchunks == 1 ? B3_ROOT : 0);
                for (i = 0; i < 8; i++) {
                    const unsigned char *lo, *hi;
                    b3_lane_block(parent[i], tok[i], len, off, pad[i], &lo, &hi);
                    m[i] = _mm256_loadu_si256((const __m256i *)lo);
                    m[i + 8] = _mm256_loadu_si256((const __m256i *)hi);
                }
                x8_transpose(m);
                x8_transpose(m + 8);
                x8_compress(h, m, cnt_lo, cnt_hi, (uint32_t)(len - off < 64 ? len - off : 64),
                            flags);
            }
        }
        if (nchunks == 1)
            break;
        if (c + 1 < nchunks) {
            uint64_t total;
            for (total = c + 1; (total & 1) == 0; total >>= 1)
                x8_parent(stack[--depth], h, 0);
            memcpy(stack[depth++], h, sizeof h);
        }
        else {
            while (depth > 0) {
                depth--;
                x8_parent(stack[depth], h, depth == 0 ? B3_ROOT : 0);
            }
        }
    }
    x8_transpose(h); /* h[i]: lane i's key */
    for (i = 0; i < 8; i++)
        _mm256_storeu_si256((__m256i *)out[i], h[i]);
}
#endif

/* The lane kernel, NULL where the CPU has none (or set_simd(False)): one chain at a time. */
static b3_hash8_fn b3_hash8 = NULL;

/* One request of chain_many: its nb full blocks and their keys. */
typedef struct {
    const blk_t *blk;
    Py_ssize_t nb;
    unsigned char *keys;
} b3_req;

static int
b3_req_longer(const void *a, const void *b)
{
    const Py_ssize_t x = (*(b3_req *const *)a)->nb, y = (*(b3_req *const *)b)->nb;
    return (x < y) - (x > y);
}

/* Blocks [b, nb) of request r one at a time: from their parent-free chunks' values where cv
 * holds them (block b's first, 8 words per chunk), else as whole messages (msg: room for 32 +
 * 4 * its block's ids). */
static void
b3_finish(const b3_req *r, Py_ssize_t b, const uint32_t *cv, size_t per_block,
          const unsigned char *parent, unsigned char *msg)
{
    for (; b < r->nb; b++) {
        const unsigned char *prev = b ? r->keys + (size_t)KEY_LEN * (b - 1) : parent;
        unsigned char *key = r->keys + (size_t)KEY_LEN * b;
        const size_t tlen = 4 * (size_t)r->blk[b].n;
        if (cv != NULL) {
            b3_hash_split(prev, r->blk[b].tok, tlen, cv, key);
            cv += 8 * per_block;
        }
        else {
            memcpy(msg, prev, KEY_LEN);
            memcpy(msg + KEY_LEN, r->blk[b].tok, tlen);
            b3_hash(msg, KEY_LEN + tlen, key);
        }
    }
}

/* The chains of reqs[0..n) (each with nb >= 1 blocks of tpb ids, total blocks together), all
 * from parent. Without a lane kernel (hash8 NULL): b3_chain_split per request. With one:
 * while all eight lanes are busy, they hash whole messages (each block read once); then the
 * parent-free chunks of what the last requests have left, eight at a time (cvs: room
 * for 8 words per parent-free chunk of total blocks, NULL for messages of one chunk; tail:
 * scratch for total blocks), and the lanes, then one chain at a time, on their first chunks
 * and tree nodes. order: scratch for n pointers; msg: room for 32 + max(4 * tpb, 1024) bytes. */
static void
b3_chain_many(b3_hash8_fn hash8, b3_req *reqs, Py_ssize_t n, Py_ssize_t tpb,
              const unsigned char *parent, uint32_t *cvs, blk_t *tail, b3_req **order,
              unsigned char *msg)
{
    const size_t tlen = 4 * (size_t)tpb;
    const size_t per_block = (KEY_LEN + tlen - 1) / B3_CHUNK_LEN;
    struct {
        const b3_req *r;
        Py_ssize_t b;       /* the block it hashes next */
        const uint32_t *cv; /* that block's parent-free chunk values, NULL: none computed */
    } lane[8];
    unsigned char spare[8][KEY_LEN]; /* where idle lanes' keys go */
    Py_ssize_t next = 0, i;
    int live = 0, k, split = cvs == NULL; /* split: the lanes' chunk values are computed */

    if (hash8 == NULL) {
        for (i = 0; i < n; i++)
            if (b3_chain_split(reqs[i].blk, reqs[i].nb, parent, reqs[i].keys, msg) < 0)
                b3_finish(&reqs[i], 0, NULL, per_block, parent, msg);
        return;
    }
    for (i = 0; i < n; i++)
        order[i] = &reqs[i];
    qsort(order, (size_t)n, sizeof *order, b3_req_longer);
    while (live < 8 && next < n) {
        lane[live].r = order[next++];
        lane[live].cv = NULL;
        lane[live++].b = 0;
    }
    for (;;) {
        const unsigned char *par[8], *tok[8];
        const uint32_t *cv[8];
        unsigned char *out[8];
        if (live < 8 && !split) {
            /* a lane idles (no request waits): the rest's parent-free chunks at once */
            Py_ssize_t m = 0;
            const uint32_t *at = cvs;
            for (k = 0; k < live; k++)
                for (i = lane[k].b; i < lane[k].r->nb; i++)
                    tail[m++] = lane[k].r->blk[i];
            b3_free_chunks(tail, m, cvs);
            for (k = 0; k < live; k++) {
                lane[k].cv = at;
                at += 8 * per_block * (size_t)(lane[k].r->nb - lane[k].b);
            }
            split = 1;
        }
        if (live < B3_LANES_MIN)
            break;
        for (k = 0; k < 8; k++) {
            const int j = k < live ? k : 0; /* idle lanes repeat lane 0 */
            const Py_ssize_t b = lane[j].b;
            par[k] = b ? lane[j].r->keys + (size_t)KEY_LEN * (b - 1) : parent;
            tok[k] = lane[j].r->blk[b].tok;
            cv[k] = lane[j].cv;
            out[k] = k < live ? lane[j].r->keys + (size_t)KEY_LEN * b : spare[k];
        }
        hash8(par, tok, KEY_LEN + tlen, cvs != NULL && split ? cv : NULL, out);
        for (k = 0; k < live; k++) {
            lane[k].b++;
            if (lane[k].cv != NULL)
                lane[k].cv += 8 * per_block;
        }
        for (k = 0; k < live;) {
            if (lane[k].b < lane[k].r->nb) {
                k++;
            }
            else if (next < n) {
                lane[k].r = order[next++];
                lane[k++].b = 0;
            }
            else {
                lane[k] = lane[--live]; /* the moved lane is looked at next */
            }
        }
    }
    for (k = 0; k < live; k++)
        b3_finish(lane[k].r, lane[k].b, lane[k].cv, per_block, parent, msg);
}

/* ================================================================================ chains */

/* Canonical CBOR head of major type `major` with argument v (< 2**32) at p; returns length. */
static inline size_t
cbor_head(unsigned char *p, unsigned major, uint32_t v)
{
    unsigned char mt = (unsigned char)(major << 5);
    if (v < 24) {
        p[0] = (unsigned char)(mt | v);
        return 1;
    }
    if (v < 0x100) {
        p[0] = mt | 24;
        p[1] = (unsigned char)v;
        return 2;
    }
    if (v < 0x10000) {
        p[0] = mt | 25;
        p[1] = (unsigned char)(v >> 8);
        p[2] = (unsigned char)v;
        return 3;
    }
    p[0] = mt | 26;
    store_be32(p + 1, v);
    return 5;
}

/* The CBOR items of n u32 LE token ids at q (each: head byte, then the argument's 0, 1, 2 or
 * 4 big-endian bytes); returns the end. May write up to 16 bytes past the end. */
static unsigned char *
cbor_tokens_scalar(unsigned char *q, const unsigned char *t, Py_ssize_t n)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        /* branchless (token sizes are unpredictable): head byte and the argument's
         * 0, 1, 2 or 4 big-endian bytes as one 8-byte store (the buffer has room),
         * whose garbage tail the next token overwrites */
        uint32_t v;
        uint64_t word;
        unsigned k1, k2, k3, extra, headb;
        memcpy(&v, t + 4 * i, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        v = __builtin_bswap32(v);
#endif
        k1 = v >= 24;
        k2 = v >= 0x100;
        k3 = v >= 0x10000;
        extra = k1 + k2 + 2 * k3;
        headb = k1 ? 0x17 + k1 + k2 + k3 : v;
        /* bytes in memory order: head, then the argument big-endian, left-aligned */
        word = (uint64_t)headb |
               ((uint64_t)__builtin_bswap32((uint32_t)((uint64_t)v << (32 - 8 * extra)))
                << 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        word = __builtin_bswap64(word);
#endif
        memcpy(q, &word, 8);
        q += 1 + extra;
    }
    return q;
}

#ifdef HAVE_X86_SHA
/* Token encodings four ids per step (SSE4.1): each id's size class (0..3) by three unsigned
 * compares, then each pair of ids by a table: the pshufb pattern taking the pair's 8 LE bytes
 * to its encoded bytes, the constant bytes (opcodes, heads) to OR in, and the length. */
typedef struct {
    unsigned char shuf[16], head[16];
    unsigned len;
} pair_entry;

/* A class's layout: constant bytes (< 0x100) and source bytes SRC(b) of the id, end -1. */
#define SRC(b) (0x100 + (b))
static const short CBOR_LAYOUT[4][8] = {
    {SRC(0), -1}, /* < 24: the value is its own head byte */
    {0x18, SRC(0), -1},
    {0x19, SRC(1), SRC(0), -1}, /* big-endian argument */
    {0x1a, SRC(3), SRC(2), SRC(1), SRC(0), -1},
};
static const short PICKLE_LAYOUT[4][8] = {
    {'K', SRC(0), -1}, /* BININT1 */
    {'M', SRC(0), SRC(1), -1}, /* BININT2, little-endian */
    {'J', SRC(0), SRC(1), SRC(2), SRC(3), -1}, /* BININT */
    {0x8a, 0x05, SRC(0), SRC(1), SRC(2), SRC(3), 0x00, -1}, /* LONG1, 5 bytes */
};
static pair_entry CBOR_PAIR[16], PICKLE_PAIR[16];

static void
fill_pairs(pair_entry *tab, const short layout[4][8])
{
    int idx, k, j;
    for (idx = 0; idx < 16; idx++) {
        unsigned pos = 0;
        memset(tab[idx].shuf, 0x80, 16);
        memset(tab[idx].head, 0, 16);
        for (k = 0; k < 2; k++) {
            const short *l = layout[(idx >> (2 * k)) & 3];
            /* pos stays below 15 (7 bytes per id at most); the mask tells the compiler so */
            for (j = 0; l[j] >= 0; j++, pos++) {
                if (l[j] >= 0x100)
                    tab[idx].shuf[pos & 15] = (unsigned char)(4 * k + l[j] - 0x100);
                else
                    tab[idx].head[pos & 15] = (unsigned char)l[j];
            }
        }
        tab[idx].len = pos;
    }
}

/* Encode ids t[0..n) (n a multiple of 4) at q with class thresholds t1 < t2 < t3; returns the
 * end. Writes up to 16 bytes past it. */
__attribute__((target("sse4.1,ssse3"))) static unsigned char *
pairs_sse41(unsigned char *q, const unsigned char *t, Py_ssize_t n, const pair_entry *tab,
            uint32_t t1, uint32_t t2, uint32_t t3)
{
    const __m128i l1 = _mm_set1_epi32((int)t1), l2 = _mm_set1_epi32((int)t2);
    const __m128i l3 = _mm_set1_epi32((int)t3);
    const __m128i weights = _mm_set1_epi16(0x0401); /* bytes 1, 4: c0 + 4 * c1 per pair */
    Py_ssize_t i;
    for (i = 0; i < n; i += 4) {
        __m128i v = _mm_loadu_si128((const __m128i *)(t + 4 * i));
        /* -1 per threshold reached (unsigned: max(v, l) == v) */
        __m128i c = _mm_add_epi32(_mm_add_epi32(_mm_cmpeq_epi32(_mm_max_epu32(v, l1), v),
                                                _mm_cmpeq_epi32(_mm_max_epu32(v, l2), v)),
                                  _mm_cmpeq_epi32(_mm_max_epu32(v, l3), v));
        __m128i cls = _mm_sub_epi32(_mm_setzero_si128(), c);
        __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(cls, cls), cls);
        uint32_t idx = (uint32_t)_mm_cvtsi128_si32(_mm_maddubs_epi16(bytes, weights));
        const pair_entry *a = &tab[idx & 15], *b = &tab[(idx >> 16) & 15];
        _mm_storeu_si128((__m128i *)q,
                         _mm_or_si128(_mm_shuffle_epi8(v, _mm_loadu_si128((const __m128i *)a->shuf)),
                                      _mm_loadu_si128((const __m128i *)a->head)));
        q += a->len;
        _mm_storeu_si128((__m128i *)q,
                         _mm_or_si128(_mm_shuffle_epi8(_mm_srli_si128(v, 8),
                                                       _mm_loadu_si128((const __m128i *)b->shuf)),
                                      _mm_loadu_si128((const __m128i *)b->head)));
        q += b->len;
    }
    return q;
}

/* cbor_tokens_scalar with the four-id steps */
static unsigned char *
cbor_tokens_sse41(unsigned char *q, const unsigned char *t, Py_ssize_t n)
{
    Py_ssize_t n4 = n & ~(Py_ssize_t)3;
    q = pairs_sse41(q, t, n4, CBOR_PAIR, 24, 0x100, 0x10000);
    return cbor_tokens_scalar(q, t + 4 * n4, n - n4);
}
#endif

typedef unsigned char *(*cbor_tokens_fn)(unsigned char *q, const unsigned char *t, Py_ssize_t n);
static cbor_tokens_fn cbor_tokens = cbor_tokens_scalar;

/* The pickle opcodes of n u32 LE ids at q, as pickle writes ints: K + 1 byte (< 2**8),
 * M + 2 (< 2**16), J + 4 (< 2**31, signed LE), else LONG1 8a 05 + 5 bytes (two's complement
 * LE); returns the end. May write up to 8 bytes past the end. */
static unsigned char *
pickle_tokens_scalar(unsigned char *q, const unsigned char *t, Py_ssize_t n)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        /* branchless, as the CBOR loop: opcode and argument as one 8-byte store */
        uint32_t v;
        uint64_t word;
        unsigned k1, k2, k3;
        memcpy(&v, t + 4 * i, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        v = __builtin_bswap32(v);
#endif
        k1 = v >= 0x100;
        k2 = v >= 0x10000;
        k3 = v >= 0x80000000u;
        word = k3 ? (0x058aull | ((uint64_t)v << 16))
                  : ((uint64_t)(k2 ? 'J' : k1 ? 'M' : 'K') | ((uint64_t)v << 8));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        word = __builtin_bswap64(word);
#endif
        memcpy(q, &word, 8);
        q += 2 + k1 + 2 * k2 + 2 * k3;
    }
    return q;
}

#ifdef HAVE_X86_SHA
/* pickle_tokens_scalar with the four-id steps */
static unsigned char *
pickle_tokens_sse41(unsigned char *q, const unsigned char *t, Py_ssize_t n)
{
    Py_ssize_t n4 = n & ~(Py_ssize_t)3;
    q = pairs_sse41(q, t, n4, PICKLE_PAIR, 0x100, 0x10000, 0x80000000u);
    return pickle_tokens_scalar(q, t + 4 * n4, n - n4);
}
#endif

static cbor_tokens_fn pickle_tokens = pickle_tokens_scalar;

typedef struct {
    int kind;
    const unsigned char *first_tail, *tail;
    Py_ssize_t first_tail_len, tail_len;
    /* KIND_SGLANG: the namespace seed (NULL: none), whether the first block has a parent */
    const unsigned char *seed;
    Py_ssize_t seed_len;
    int has_parent;
} chain_cfg;

/* Worst-case message length of a block of n tokens (before SHA padding). */
static size_t
msg_capacity(const chain_cfg *cfg, Py_ssize_t n)
{
    size_t tail = (size_t)(cfg->tail_len > cfg->first_tail_len ? cfg->tail_len
                                                                 : cfg->first_tail_len);
    /* CBOR: <= 5 bytes per id; pickle: <= 7; both with 16 bytes of store slack */
    return 3 + KEY_LEN + 9 + 7 * (size_t)n + 24 + tail + 72;
}

#define NO_PARENT ((size_t)-1)

/* Block b's message at m, but for its parent key (written by the caller at *poff; NO_PARENT:
 * none); returns its length. first: whether b is the first hashed block. */
static size_t
build_msg(const chain_cfg *cfg, const blk_t *blk, int first, unsigned char *m, size_t *poff)
{
    const unsigned char *t = blk->tok;
    const Py_ssize_t n = blk->n;
    const unsigned char *tail = first ? cfg->first_tail : cfg->tail;
    const Py_ssize_t tail_len = first ? cfg->first_tail_len : cfg->tail_len;
    unsigned char *q = m;
    if (cfg->kind == KIND_CBOR) {
        q[0] = 0x83;
        q[1] = 0x58;
        q[2] = 0x20;
        *poff = 3;
        q += 3 + KEY_LEN;
        q += cbor_head(q, 4, (uint32_t)n);
        q = cbor_tokens(q, t, n);
        memcpy(q, tail, (size_t)tail_len);
        return (size_t)(q + tail_len - m);
    }
    if (cfg->kind == KIND_PICKLE) {
        static const unsigned char closers[4] = {0x74, 0x85, 0x86, 0x87};
        uint64_t frame;
        size_t len;
        int k;
        q[0] = 0x80; /* PROTO 5 */
        q[1] = 0x05;
        q[2] = 0x95; /* FRAME, its length below */
        q[11] = 0x43; /* SHORT_BINBYTES 32 */
        q[12] = 0x20;
        *poff = 13;
        q[45] = 0x94; /* MEMOIZE */
        q += 46;
        if (n >= 4)
            *q++ = 0x28; /* MARK */
        q = pickle_tokens(q, t, n);
        *q++ = closers[n >= 4 ? 0 : n]; /* TUPLE, or TUPLE1..3 */
        *q++ = 0x94;
        memcpy(q, tail, (size_t)tail_len);
        len = (size_t)(q + tail_len - m);
        frame = (uint64_t)len - 11;
        for (k = 0; k < 8; k++)
            m[3 + k] = (unsigned char)(frame >> (8 * k));
        return len;
    }
    if (first && !cfg->has_parent) { /* KIND_SGLANG's unsalted first page */
        *poff = NO_PARENT;
        memcpy(m, t, 4 * (size_t)n);
        return 4 * (size_t)n;
    }
    *poff = 0;
    memcpy(m + KEY_LEN, t, 4 * (size_t)n);
    return KEY_LEN + 4 * (size_t)n;
}

/* SHA-256 padding of the len-byte message at m (room for 72 more bytes); returns the padded
 * length, a multiple of 64. */
static size_t
sha_pad(unsigned char *m, size_t len)
{
    size_t total = (len + 9 + 63) & ~(size_t)63;
    uint64_t bits = (uint64_t)len * 8;
    int i;
    m[len] = 0x80;
    memset(m + len + 1, 0, total - len - 9);
    for (i = 0; i < 8; i++)
        m[total - 1 - i] = (unsigned char)(bits >> (8 * i));
    return total;
}

/* Hash blocks[0..nb) chained from parent; key i goes to keys + 32 * i, and with a seed
 * (KIND_SGLANG) the digest published for it to pubs + 32 * i. msg: two scratch buffers of
 * msg_capacity(max block) bytes each, cap apart; seeded: another of seed_len + 8 + 72 at
 * pubmsg. */
/* chain_ints' source of token ids: the request's int objects, packed as u32 LE into raw
 * (where the blocks point) block by block inside the chain loop. */
typedef struct {
    PyObject *const *items;
    unsigned char *raw;
    Py_ssize_t n, block_tokens, start;
} pack_src;

static int pack_items(PyObject *const *items, Py_ssize_t n, unsigned char *p);

/* Packs hashed block b's ids (ps NULL: nothing to pack); -1 when an item is not a u32 int. */
static inline int
pack_block(const pack_src *ps, Py_ssize_t b)
{
    Py_ssize_t first;
    if (ps == NULL)
        return 0;
    first = ps->block_tokens * (ps->start + b);
#if defined(__GNUC__) || defined(__clang__)
    { /* pack_items prefetches within the block only: start fetching the next one's ints */
        Py_ssize_t i, end = first + 2 * ps->block_tokens;
        for (i = first + ps->block_tokens; i < end && i < ps->n; i++)
            __builtin_prefetch(ps->items[i]);
    }
#endif
    return pack_items(ps->items + first, ps->block_tokens, ps->raw + 4 * first);
}

static int
hash_chain(const chain_cfg *cfg, const blk_t *blocks, Py_ssize_t nb, const unsigned char *parent,
           unsigned char *keys, unsigned char *msg, size_t cap, unsigned char *pubs,
           unsigned char *pubmsg, const pack_src *ps)
{
    Py_ssize_t b;
    const unsigned char *prev = parent;
    unsigned char *buf[2];
    size_t len[2], poff[2];
    uint32_t st[8]; /* SHA-256 state; after a block, its key's words */
    int i;

    if (nb == 0)
        return 0;
    if (ps != NULL && cfg->kind == KIND_BLAKE3) { /* BLAKE3 hashes across blocks: pack first */
        for (b = 0; b < nb; b++)
            if (pack_block(ps, b) < 0)
                return -1;
        ps = NULL;
    }
    if (cfg->kind == KIND_BLAKE3 && b3_chain_split(blocks, nb, parent, keys, msg) == 0)
        return 0;
    buf[0] = msg;
    buf[1] = msg + cap;
    if (pack_block(ps, 0) < 0)
        return -1;
    len[0] = build_msg(cfg, &blocks[0], 1, buf[0], &poff[0]);
    for (b = 0; b < nb; b++) {
        const int c = (int)(b & 1);
        unsigned char *m = buf[c];
        unsigned char *key = keys + (size_t)KEY_LEN * b;
        if (cfg->kind == KIND_BLAKE3) {
            memcpy(m + poff[c], prev, KEY_LEN);
            b3_hash(m, len[c], key);
            if (b + 1 < nb)
                len[!c] = build_msg(cfg, &blocks[b + 1], 0, buf[!c], &poff[!c]);
        }
        else {
            /* The chain is latency-bound (each compression waits for the previous one):
             * the next block's message, which does not depend on this key, is built while
             * this message's first compression is in flight. */
            const size_t total = sha_pad(m, len[c]);
            if (poff[c] != NO_PARENT) {
                if (b == 0)
                    memcpy(m + poff[c], prev, KEY_LEN);
                else /* from the state words, not the key bytes just stored (no reload) */
                    for (i = 0; i < 8; i++)
                        store_be32(m + poff[c] + 4 * i, st[i]);
            }
            memcpy(st, SHA_IV, sizeof st);
            sha256_blocks(st, m, 1);
            if (b + 1 < nb) {
                /* chain_ints: the next block's int objects are read here too, their (often
                 * cold) loads overlapping this compression instead of a separate pass */
                if (pack_block(ps, b + 1) < 0)
                    return -1;
                len[!c] = build_msg(cfg, &blocks[b + 1], 0, buf[!c], &poff[!c]);
            }
            if (total > 64)
                sha256_blocks(st, m + 64, total / 64 - 1);
            for (i = 0; i < 8; i++)
                store_be32(key + 4 * i, st[i]);
        }
        if (cfg->seed != NULL) {
            /* off the chain's critical path: overlaps the next block's compressions */
            memcpy(pubmsg + cfg->seed_len, key, 8);
            sha256_padded(pubmsg, (size_t)cfg->seed_len + 8, pubs + (size_t)KEY_LEN * b);
        }
        prev = key;
    }
    return 0;
}

static int
get_buffer(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(HashingError, "%s must be a bytes-like object, got %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(chain_doc,
             "chain(kind, tokens, block_tokens, parent, start=0, width=32, offset=0, "
             "first_tail=None, tail=None, every=0) -> (published, keys)\n\n"
             "Hash a request's block chain (see the module docstring).");

PyDoc_STRVAR(chain_ints_doc,
             "chain_ints(kind, tokens, block_tokens, parent, start=0, width=32, offset=0, "
             "first_tail=None, tail=None, every=0, drop_last=False) -> "
             "(raw, (published, keys)) | None\n\n"
             "pack(tokens, drop_last) and chain(kind, raw, ...) of it in one pass (tokens a "
             "list or tuple of ints, each block's ids read while the previous block hashes); "
             "None when pack would return None.");

static PyObject *
chain_impl(PyObject *args, PyObject *kwargs, int ints)
{
    static char *kwlist[] = {"kind",  "tokens",     "block_tokens", "parent", "start",
                             "width", "offset",     "first_tail",   "tail",   "every",
                             "drop_last", NULL};
    static char *chain_kwlist[] = {"kind",   "tokens", "block_tokens", "parent",
                                   "start",  "width",  "offset",       "first_tail",
                                   "tail",   "every",  NULL};
    int kind, drop_last = 0, hashed;
    Py_ssize_t ints_full = 0; /* chain_ints: ids in the request's full blocks */
    PyObject *raw = NULL;
    pack_src ps;
    PyObject *tokens, *parent_obj, *first_tail_obj = Py_None, *tail_obj = Py_None;
    Py_ssize_t block_tokens, start = 0, width = 32, offset = 0, every = 0;
    Py_buffer parent = {0}, ftail = {0}, tail = {0}, flat = {0};
    Py_buffer *views = NULL;
    Py_ssize_t n_views = 0, nb = 0, max_n = 0, b;
    size_t cap;
    blk_t *blocks = NULL;
    unsigned char *keys = NULL, *msg = NULL, *pubs = NULL, *pubmsg = NULL;
    const unsigned char *pub_src = NULL;
    PyObject *published = NULL, *cps = NULL, *result = NULL;
    chain_cfg cfg;
    static const unsigned char NONE_TAIL[1] = {0xf6};

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, ints ? "iOnO|nnnOOnp" : "iOnO|nnnOOn",
                                     ints ? kwlist : chain_kwlist, &kind, &tokens, &block_tokens, &parent_obj,
                                     &start, &width, &offset, &first_tail_obj, &tail_obj,
                                     &every, &drop_last))
        return NULL;
    if (ints && !PyList_Check(tokens) && !PyTuple_Check(tokens)) {
        PyErr_Format(PyExc_TypeError, "chain_ints() takes a list or tuple, got %.100s",
                     Py_TYPE(tokens)->tp_name);
        return NULL;
    }
    if (kind < KIND_V2 || kind > KIND_PICKLE) {
        PyErr_Format(HashingError, "unknown chain kind %d", kind);
        return NULL;
    }
    if (width < 1 || offset < 0 || offset + width > KEY_LEN || every < 0 || start < 0) {
        PyErr_SetString(HashingError, "bad width/offset/every/start");
        return NULL;
    }
    if (get_buffer(parent_obj, &parent, "parent") < 0)
        return NULL;
    if (parent.len != KEY_LEN && !(kind == KIND_SGLANG && parent.len == 0)) {
        PyErr_Format(HashingError, "parent must be %d bytes, got %zd", KEY_LEN, parent.len);
        goto done;
    }
    if (kind == KIND_PICKLE && tail_obj == Py_None) {
        PyErr_SetString(HashingError, "KIND_PICKLE needs the tail (the pickled extra keys)");
        goto done;
    }
    cfg.kind = kind;
    cfg.has_parent = parent.len != 0;
    cfg.seed = NULL;
    cfg.seed_len = 0;
    cfg.first_tail = cfg.tail = NONE_TAIL;
    cfg.first_tail_len = cfg.tail_len = 1;
    if (tail_obj != Py_None) {
        if (get_buffer(tail_obj, &tail, "tail") < 0)
            goto done;
        cfg.tail = cfg.first_tail = tail.buf;
        cfg.tail_len = cfg.first_tail_len = tail.len;
        if (kind == KIND_SGLANG) {
            cfg.seed = tail.buf;
            cfg.seed_len = tail.len;
        }
    }
    if (first_tail_obj != Py_None) {
        if (get_buffer(first_tail_obj, &ftail, "first_tail") < 0)
            goto done;
        cfg.first_tail = ftail.buf;
        cfg.first_tail_len = ftail.len;
    }

    if (ints) {
        /* no Python code runs while packing (exact ints read, others via PyLong_Check and
         * PyLong_AsUnsignedLong), so the item array stays put */
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
        const Py_ssize_t used = drop_last && n > 0 ? n - 1 : n;
        Py_ssize_t total;
        if (block_tokens < 1) {
            PyErr_Format(HashingError, "block_tokens must be >= 1, got %zd", block_tokens);
            goto done;
        }
        /* the dropped last id is packed (validated) too; raw is cut to used ids at the end */
        raw = PyBytes_FromStringAndSize(NULL, 4 * n);
        if (raw == NULL)
            goto done;
        ps.items = PySequence_Fast_ITEMS(tokens);
        ps.raw = (unsigned char *)PyBytes_AS_STRING(raw);
        ps.n = n;
        ps.block_tokens = block_tokens;
        ps.start = start;
        total = used / block_tokens;
        ints_full = total * block_tokens;
        nb = total > start ? total - start : 0;
        blocks = PyMem_Malloc((nb ? (size_t)nb : 1) * sizeof(blk_t));
        if (blocks == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (b = 0; b < nb; b++) {
            blocks[b].tok = ps.raw + 4 * block_tokens * (start + b);
            blocks[b].n = block_tokens;
        }
        max_n = block_tokens;
        /* the ids before block start, then (after the chain) those after its last block */
        if (pack_items(ps.items, block_tokens * (start < total ? start : total), ps.raw) < 0)
            goto not_ints;
    }
    else if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        PyObject *seq = tokens;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        start = 0;
        views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
        blocks = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(blk_t));
        if (views == NULL || blocks == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (b = 0; b < n; b++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, b);
            if (get_buffer(item, &views[b], "a block") < 0)
                goto done;
            n_views = b + 1;
            if (views[b].len == 0) {
                PyErr_Format(HashingError, "blocks[%zd]: a block needs at least one token", b);
                goto done;
            }
            if (views[b].len % 4) {
                PyErr_Format(HashingError, "blocks[%zd]: %zd bytes are not whole u32 ids", b,
                             views[b].len);
                goto done;
            }
            blocks[b].tok = views[b].buf;
            blocks[b].n = views[b].len / 4;
            if (blocks[b].n > max_n)
                max_n = blocks[b].n;
        }
        nb = n;
    }
    else {
        Py_ssize_t total;
        if (block_tokens < 1) {
            PyErr_Format(HashingError, "block_tokens must be >= 1, got %zd", block_tokens);
            goto done;
        }
        if (get_buffer(tokens, &flat, "tokens") < 0)
            goto done;
        if (flat.len % 4) {
            PyErr_Format(HashingError, "tokens must hold whole u32 ids, got %zd bytes",
                         flat.len);
            goto done;
        }
        total = flat.len / 4 / block_tokens;
        nb = total > start ? total - start : 0;
        blocks = PyMem_Malloc((nb ? (size_t)nb : 1) * sizeof(blk_t));
        if (blocks == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (b = 0; b < nb; b++) {
            blocks[b].tok = (const unsigned char *)flat.buf + 4 * block_tokens * (start + b);
            blocks[b].n = block_tokens;
        }
        max_n = block_tokens;
    }

    keys = PyMem_Malloc((size_t)KEY_LEN * (nb ? (size_t)nb : 1));
    cap = msg_capacity(&cfg, max_n);
    msg = PyMem_Malloc(2 * cap);
    if (keys == NULL || msg == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    pub_src = keys;
    if (cfg.seed != NULL) {
        pubs = PyMem_Malloc((size_t)KEY_LEN * (nb ? (size_t)nb : 1));
        pubmsg = PyMem_Malloc((size_t)cfg.seed_len + 8 + 72);
        if (pubs == NULL || pubmsg == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(pubmsg, cfg.seed, (size_t)cfg.seed_len);
        pub_src = pubs;
    }
    if (ints) { /* reads Python objects: keeps the GIL */
        if (hash_chain(&cfg, blocks, nb, parent.buf, keys, msg, cap, pubs, pubmsg, &ps) < 0)
            goto not_ints;
        /* packed so far: the ids of the full blocks; then the rest */
        if (pack_items(ps.items + ints_full, ps.n - ints_full, ps.raw + 4 * ints_full) < 0)
            goto not_ints;
    }
    else if (views == NULL && nb * block_tokens >= NOGIL_MIN_TOKENS) {
        Py_BEGIN_ALLOW_THREADS
        hashed = hash_chain(&cfg, blocks, nb, parent.buf, keys, msg, cap, pubs, pubmsg, NULL);
        Py_END_ALLOW_THREADS
        (void)hashed;
    }
    else {
        (void)hash_chain(&cfg, blocks, nb, parent.buf, keys, msg, cap, pubs, pubmsg, NULL);
    }

    published = PyList_New(nb);
    cps = PyList_New(0);
    if (published == NULL || cps == NULL)
        goto done;
    for (b = 0; b < nb; b++) {
        PyObject *pb = PyBytes_FromStringAndSize((const char *)pub_src + KEY_LEN * b + offset,
                                                 width);
        if (pb == NULL)
            goto done;
        PyList_SET_ITEM(published, b, pb);
        if (every > 0 && (start + b + 1) % every == 0) {
            PyObject *k = PyBytes_FromStringAndSize((const char *)keys + KEY_LEN * b, KEY_LEN);
            if (k == NULL || PyList_Append(cps, k) < 0) {
                Py_XDECREF(k);
                goto done;
            }
            Py_DECREF(k);
        }
    }
    result = PyTuple_Pack(2, published, cps);
    if (ints && result != NULL) {
        PyObject *pair = result;
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
        result = NULL;
        if (!(drop_last && n > 0 && _PyBytes_Resize(&raw, 4 * (n - 1)) < 0))
            result = PyTuple_Pack(2, raw, pair);
        Py_DECREF(pair);
    }
    goto done;

not_ints:
    result = Py_None;
    Py_INCREF(result);

done:
    Py_XDECREF(raw);
    Py_XDECREF(published);
    Py_XDECREF(cps);
    PyMem_Free(keys);
    PyMem_Free(msg);
    PyMem_Free(pubs);
    PyMem_Free(pubmsg);
    PyMem_Free(blocks);
    if (views != NULL) {
        for (b = 0; b < n_views; b++)
            PyBuffer_Release(&views[b]);
        PyMem_Free(views);
    }
    if (flat.obj)
        PyBuffer_Release(&flat);
    if (parent.obj)
        PyBuffer_Release(&parent);
    if (tail.obj)
        PyBuffer_Release(&tail);
    if (ftail.obj)
        PyBuffer_Release(&ftail);
    return result;
}

static PyObject *
cn_chain(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return chain_impl(args, kwargs, 0);
}

static PyObject *
cn_chain_ints(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return chain_impl(args, kwargs, 1);
}

PyDoc_STRVAR(chain_many_doc,
             "chain_many(kind, raws, block_tokens, parent, width=32, offset=0) -> "
             "list[(published, keys)]\n\n"
             "The chains of several requests from one parent key (see the module docstring).");

static PyObject *
cn_chain_many(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"kind", "raws", "block_tokens", "parent", "width", "offset", NULL};
    int kind;
    PyObject *raws_obj, *parent_obj, *seq = NULL, *result = NULL;
    Py_ssize_t block_tokens, width = 32, offset = 0, n = 0, n_views = 0, n_reqs = 0, i, b;
    Py_ssize_t total = 0;
    Py_buffer parent = {0};
    Py_buffer *views = NULL;
    b3_req *reqs = NULL, **order = NULL;
    Py_ssize_t *req_of = NULL; /* raws[i]'s request, -1: no full block */
    blk_t *blocks = NULL, *tail = NULL;
    uint32_t *cvs = NULL;
    unsigned char *keys = NULL, *msg = NULL;
    size_t step, per_block;
    const b3_hash8_fn hash8 = b3_hash8; /* read once: set_simd may run while the GIL is out */

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOnO|nn", kwlist, &kind, &raws_obj,
                                     &block_tokens, &parent_obj, &width, &offset))
        return NULL;
    if (kind != KIND_BLAKE3) {
        PyErr_Format(HashingError, "chain_many hashes KIND_BLAKE3 chains only, got kind %d",
                     kind);
        return NULL;
    }
    if (width < 1 || offset < 0 || offset + width > KEY_LEN) {
        PyErr_SetString(HashingError, "bad width/offset");
        return NULL;
    }
    if (block_tokens < 1 || block_tokens > (PY_SSIZE_T_MAX - 2 * B3_CHUNK_LEN) / 4) {
        PyErr_Format(HashingError, "block_tokens must be >= 1, got %zd", block_tokens);
        return NULL;
    }
    step = 4 * (size_t)block_tokens;
    per_block = (KEY_LEN + step - 1) / B3_CHUNK_LEN;
    if (get_buffer(parent_obj, &parent, "parent") < 0)
        return NULL;
    if (parent.len != KEY_LEN) {
        PyErr_Format(HashingError, "parent must be %d bytes, got %zd", KEY_LEN, parent.len);
        goto done;
    }
    seq = PySequence_Fast(raws_obj, "raws must be a sequence of bytes-like objects");
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(HashingError, "raws must be a sequence of bytes-like objects");
        }
        goto done;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    reqs = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(b3_req));
    order = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(b3_req *));
    req_of = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(Py_ssize_t));
    if (views == NULL || reqs == NULL || order == NULL || req_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        Py_ssize_t nb;
        char what[48];
        PyOS_snprintf(what, sizeof what, "raws[%zd]", i);
        if (get_buffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], what) < 0)
            goto done;
        n_views = i + 1;
        nb = (Py_ssize_t)((size_t)views[i].len / step);
        req_of[i] = -1;
        if (nb == 0) /* nothing to hash: ([], []), as chain_raw_many's default */
            continue;
        if (views[i].len % 4) {
            PyErr_Format(HashingError, "raws[%zd] must hold whole u32 ids, got %zd bytes", i,
                         views[i].len);
            goto done;
        }
        req_of[i] = n_reqs;
        reqs[n_reqs++].nb = nb;
        total += nb;
    }
    keys = PyMem_Malloc((size_t)KEY_LEN * (total ? (size_t)total : 1));
    blocks = PyMem_Malloc((total ? (size_t)total : 1) * sizeof(blk_t));
    msg = PyMem_Malloc(KEY_LEN + (step > B3_CHUNK_LEN ? step : B3_CHUNK_LEN));
    if (hash8 != NULL && per_block > 0 && total > 0) {
        cvs = PyMem_Malloc((size_t)total * per_block * 8 * sizeof(uint32_t));
        tail = PyMem_Malloc((size_t)total * sizeof(blk_t));
    }
    if (keys == NULL || blocks == NULL || msg == NULL ||
        (hash8 != NULL && per_block > 0 && total > 0 && (cvs == NULL || tail == NULL))) {
        PyErr_NoMemory();
        goto done;
    }
    {
        unsigned char *key_at = keys;
        blk_t *blk_at = blocks;
        Py_ssize_t r = 0;
        for (i = 0; i < n; i++) {
            if (req_of[i] < 0)
                continue;
            reqs[r].blk = blk_at;
            reqs[r].keys = key_at;
            for (b = 0; b < reqs[r].nb; b++, blk_at++) {
                blk_at->tok = (const unsigned char *)views[i].buf + step * (size_t)b;
                blk_at->n = block_tokens;
            }
            key_at += (size_t)KEY_LEN * (size_t)reqs[r++].nb;
        }
    }
    if ((size_t)total * (size_t)block_tokens >= NOGIL_MIN_TOKENS) {
        Py_BEGIN_ALLOW_THREADS
        b3_chain_many(hash8, reqs, n_reqs, block_tokens, parent.buf, cvs, tail, order, msg);
        Py_END_ALLOW_THREADS
    }
    else {
        b3_chain_many(hash8, reqs, n_reqs, block_tokens, parent.buf, cvs, tail, order, msg);
    }

    result = PyList_New(n);
    if (result == NULL)
        goto done;
    for (i = 0; i < n; i++) {
        const b3_req *r = req_of[i] < 0 ? NULL : &reqs[req_of[i]];
        const Py_ssize_t nb = r == NULL ? 0 : r->nb;
        PyObject *published = PyList_New(nb), *last = PyList_New(0), *pair;
        if (published == NULL || last == NULL) {
            Py_XDECREF(published);
            Py_XDECREF(last);
            Py_CLEAR(result);
            goto done;
        }
        for (b = 0; b < nb; b++) {
            PyObject *pb = PyBytes_FromStringAndSize(
                (const char *)r->keys + (size_t)KEY_LEN * b + offset, width);
            if (pb == NULL)
                break;
            PyList_SET_ITEM(published, b, pb);
        }
        if (b == nb && nb > 0) {
            PyObject *k = PyBytes_FromStringAndSize(
                (const char *)r->keys + (size_t)KEY_LEN * (nb - 1), KEY_LEN);
            if (k == NULL || PyList_Append(last, k) < 0)
                b = -1;
            Py_XDECREF(k);
        }
        pair = b == nb ? PyTuple_Pack(2, published, last) : NULL;
        Py_DECREF(published);
        Py_DECREF(last);
        if (pair == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, pair);
    }

done:
    PyMem_Free(keys);
    PyMem_Free(blocks);
    PyMem_Free(cvs);
    PyMem_Free(tail);
    PyMem_Free(msg);
    PyMem_Free(order);
    PyMem_Free(reqs);
    PyMem_Free(req_of);
    if (views != NULL) {
        for (i = 0; i < n_views; i++)
            PyBuffer_Release(&views[i]);
        PyMem_Free(views);
    }
    Py_XDECREF(seq);
    if (parent.obj)
        PyBuffer_Release(&parent);
    return result;
}

/* ================================================================================= pack */

PyDoc_STRVAR(pack_doc,
             "pack(tokens, drop_last=False) -> bytes | None\n\n"
             "A list/tuple of ints as u32 little-endian bytes (the last one left out with "
             "drop_last, which is validated all the same); None when an item is not an int in "
             "0..2**32-1.");

/* How many items ahead pack() prefetches an int object. */
#define PACK_PREFETCH 32

/* store_le32 as one store where the host is little-endian */
static inline void
put_le32(unsigned char *p, uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 4);
#else
    store_le32(p, v);
#endif
}

/* The value of an exact int in 0..2**32-1 read from its digits; -1 when it is negative, larger,
 * or its layout is not one this reads (the caller then asks the C API). */
static inline int64_t
small_int_value(PyObject *item)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        return v >= 0 ? (int64_t)v : -1;
    }
    return -1;
#elif PY_VERSION_HEX >= 0x030B0000 && PyLong_SHIFT == 30
    /* 3.11: ob_size is the signed digit count, digits of 30 bits */
    const Py_ssize_t size = Py_SIZE(item);
    const digit *d = ((PyLongObject *)item)->ob_digit;
    if (size == 1)
        return (int64_t)d[0];
    if (size == 0)
        return 0;
    if (size == 2 && d[1] < 4)
        return (int64_t)d[0] | ((int64_t)d[1] << 30);
    return -1;
#else
    (void)item;
    return -1;
#endif
}

static PyObject *
cn_pack(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"tokens", "drop_last", NULL};
    PyObject *tokens, *out, **items;
    int drop_last = 0;
    Py_ssize_t n;
    unsigned char *p;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", kwlist, &tokens, &drop_last))
        return NULL;
    if (!PyList_Check(tokens) && !PyTuple_Check(tokens)) {
        PyErr_Format(PyExc_TypeError, "pack() takes a list or tuple, got %.100s",
                     Py_TYPE(tokens)->tp_name);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(tokens);
    /* the dropped last id is validated too (bad input is rejected whether or not hashed) */
    out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL)
        return NULL;
    p = (unsigned char *)PyBytes_AS_STRING(out);
    /* no Python code runs in the loop (ints only, no __index__), so the item array stays put */
    items = PySequence_Fast_ITEMS(tokens);
    if (pack_items(items, n, p) < 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    if (drop_last && n > 0 && _PyBytes_Resize(&out, 4 * (n - 1)) < 0)
        return NULL;
    return out;
}

/* Packs n int objects as u32 LE at p; -1 (no exception set) when an item is not an int in
 * 0..2**32-1. Runs no Python code, so the item array stays put. */
static int
pack_items(PyObject *const *items, Py_ssize_t n, unsigned char *p)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        PyObject *item = items[i];
        unsigned long v;
        /* the int objects are scattered over the heap and often cold: start fetching one
         * a few dozen items ahead (the list's own array is prefetched by the hardware) */
#if defined(__GNUC__) || defined(__clang__)
        if (i + PACK_PREFETCH < n)
            __builtin_prefetch(items[i + PACK_PREFETCH]);
#endif
        if (Py_IS_TYPE(item, &PyLong_Type)) {
            /* exact ints read from their digits: PyLong_AsUnsignedLong costs more than the
             * rest of the loop; bool and other subclasses take the generic path below */
            int64_t fast = small_int_value(item);
            if (fast >= 0) {
                put_le32(p + 4 * i, (uint32_t)fast);
                continue;
            }
        }
        if (!PyLong_Check(item))
            return -1;
        v = PyLong_AsUnsignedLong(item);
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        if (v > 0xFFFFFFFFul)
            return -1;
        put_le32(p + 4 * i, (uint32_t)v);
    }
    return 0;
}

/* ========================================================================= fingerprints */

#define FP_P1 0x9E3779B97F4A7C15ull
#define FP_P2 0xC2B2AE3D27D4EB4Full
#define FP_P3 0x165667B19E3779F9ull

static inline uint64_t
rotl64(uint64_t x, int n)
{
    return (x << n) | (x >> (64 - n));
}

static inline uint64_t
load_le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t
fp_avalanche(uint64_t h)
{
    h ^= h >> 33;
    h *= FP_P2;
    h ^= h >> 29;
    h *= FP_P3;
    h ^= h >> 32;
    return h;
}

/* Fingerprint of one segment (a multiple of 4 bytes) folded into the running value h. */
static uint64_t
fp_segment(uint64_t h, const unsigned char *p, size_t len)
{
    uint64_t l0 = h ^ FP_P1, l1 = h + FP_P2, l2 = rotl64(h, 17) ^ FP_P3, l3 = h * FP_P1 + 1;
    size_t i = 0;
    /* one multiply per 8 bytes and lane (a candidate filter: hits are verified by bytes) */
    for (; i + 32 <= len; i += 32) {
        l0 = rotl64(l0 ^ load_le64(p + i), 29) * FP_P1;
        l1 = rotl64(l1 ^ load_le64(p + i + 8), 29) * FP_P1;
        l2 = rotl64(l2 ^ load_le64(p + i + 16), 29) * FP_P1;
        l3 = rotl64(l3 ^ load_le64(p + i + 24), 29) * FP_P1;
    }
    for (; i + 4 <= len; i += 4)
        l0 = rotl64(l0 ^ ((uint64_t)load_le32(p + i) * FP_P3), 23) * FP_P2;
    h = rotl64(l0, 1) + rotl64(l1, 7) + rotl64(l2, 12) + rotl64(l3, 18);
    return fp_avalanche(h ^ (uint64_t)len);
}

PyDoc_STRVAR(fingerprints_doc,
             "fingerprints(raw, stride, whole=False) -> list[int]\n\n"
             "64-bit fingerprints of raw[:k * stride] for k = 1 .. len(raw) // stride "
             "(stride a positive multiple of 4), then, with whole and a partial last stride, "
             "the fingerprint of all of raw (a multiple of 4 bytes).");

static PyObject *
cn_fingerprints(PyObject *self, PyObject *args)
{
    Py_buffer raw;
    Py_ssize_t stride, k, n, rest;
    int whole = 0;
    PyObject *out;
    uint64_t h = 0;

    if (!PyArg_ParseTuple(args, "y*n|p", &raw, &stride, &whole))
        return NULL;
    if (stride < 4 || stride % 4 || raw.len % 4) {
        PyBuffer_Release(&raw);
        PyErr_Format(HashingError,
                     "stride must be a positive multiple of 4 (got %zd), raw whole u32 ids", stride);
        return NULL;
    }
    n = raw.len / stride;
    rest = raw.len - n * stride;
    out = PyList_New(n + (whole && rest ? 1 : 0));
    if (out == NULL) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    for (k = 0; k < n; k++) {
        PyObject *v;
        h = fp_segment(h, (const unsigned char *)raw.buf + stride * k, (size_t)stride);
        v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&raw);
            return NULL;
        }
        PyList_SET_ITEM(out, k, v);
    }
    if (whole && rest) {
        PyObject *v;
        h = fp_segment(h, (const unsigned char *)raw.buf + stride * n, (size_t)rest);
        v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&raw);
            return NULL;
        }
        PyList_SET_ITEM(out, n, v);
    }
    PyBuffer_Release(&raw);
    return out;
}

PyDoc_STRVAR(same_prefix_doc,
             "same_prefix(a, b, n) -> bool\n\na[:n] == b[:n] (False when either is shorter).");

static PyObject *
cn_same_prefix(PyObject *self, PyObject *args)
{
    Py_buffer a, b;
    Py_ssize_t n;
    int same;
    if (!PyArg_ParseTuple(args, "y*y*n", &a, &b, &n))
        return NULL;
    same = n >= 0 && a.len >= n && b.len >= n && memcmp(a.buf, b.buf, (size_t)n) == 0;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyBool_FromLong(same);
}

PyDoc_STRVAR(split_doc,
             "split(blob, width, count) -> list[bytes]\n\n"
             "The first count width-byte pieces of blob as new bytes objects.");

static PyObject *
cn_split(PyObject *self, PyObject *args)
{
    Py_buffer blob;
    Py_ssize_t width, count, i;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*nn", &blob, &width, &count))
        return NULL;
    if (width < 1 || count < 0 || count > blob.len / width) {
        PyBuffer_Release(&blob);
        PyErr_Format(HashingError, "cannot split %zd bytes into %zd pieces of %zd", blob.len,
                     count, width);
        return NULL;
    }
    out = PyList_New(count);
    for (i = 0; out != NULL && i < count; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)blob.buf + width * i, width);
        if (b == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, b);
    }
    PyBuffer_Release(&blob);
    return out;
}

/* ======================================================================== JSON token ids */

PyDoc_STRVAR(json_ids_doc,
             "json_ids(text, /) -> bytes | None\n\n"
             "A JSON array of token ids as u32 little-endian bytes, read straight from the JSON "
             "text (a bytes-like object): None unless it is exactly '[' ws (id (ws ',' ws id)*)? "
             "ws ']' with each id plain decimal digits (no sign, fraction, exponent or leading "
             "zero) of a value in 0..2**32-1, ws being JSON whitespace.");

static inline int
json_ws(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static PyObject *
cn_json_ids(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    const unsigned char *p, *end;
    unsigned char *out;
    Py_ssize_t n = 0, cap;
    PyObject *res;

    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    p = (const unsigned char *)view.buf;
    end = p + view.len;
    /* at most one id per two bytes of text ("1,"), plus one */
    cap = view.len / 2 + 1;
    res = PyBytes_FromStringAndSize(NULL, 4 * cap);
    if (res == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    out = (unsigned char *)PyBytes_AS_STRING(res);
    /* the text must end in ']' (after whitespace): a non-digit, non-whitespace byte that stops
     * every scan below inside the buffer, so they need no bounds checks */
    while (end > p && json_ws(end[-1]))
        end--;
    if (end == p || end[-1] != ']')
        goto no;
    while (json_ws(*p))
        p++;
    if (*p++ != '[')
        goto no;
    while (json_ws(*p))
        p++;
    if (*p == ']') {
        p++;
        goto done;
    }
    for (;;) {
        uint64_t v;
        unsigned d = (unsigned)(*p - '0');
        if (d > 9)
            goto no;
        if (d == 0 && (unsigned)(p[1] - '0') <= 9)
            goto no; /* a leading zero: not JSON */
        v = d;
        p++;
        while ((d = (unsigned)(*p - '0')) <= 9) {
            v = v * 10 + d;
            if (v > 0xFFFFFFFFull)
                goto no;
            p++;
        }
        if (n == cap)
            goto no; /* cannot happen (cap bounds the ids the text can hold) */
        put_le32(out + 4 * n++, (uint32_t)v);
        while (json_ws(*p))
            p++;
        if (*p == ',') {
            p++;
            while (json_ws(*p))
                p++;
            continue;
        }
        if (*p++ != ']')
            goto no;
        break;
    }
done:
    if (p != end)
        goto no; /* text after the array's ']' */
    PyBuffer_Release(&view);
    if (_PyBytes_Resize(&res, 4 * n) < 0)
        return NULL;
    return res;
no:
    PyBuffer_Release(&view);
    Py_DECREF(res);
    Py_RETURN_NONE;
}

/* ========================================================================== Dynamo keys */

/* Dynamo-keyed index keys (kvstream/index/keys.py, key_mode="dynamo"):
 *
 *   local = XXH3-64(block's u32 LE tokens, seed)                  8 bytes big-endian
 *   key   = XXH3-64(parent_key (16) || local (8), seed 0) || local  16 bytes, big-endian halves
 *
 * xxhash.h (xxHash 0.8, BSD-2-Clause, vendored beside this file) is compiled in whole. */
#define XXH_INLINE_ALL
#include "xxhash.h"

#define DYN_KEY 16
#define DYN_LOCAL 8

static inline void
put_be64(unsigned char *p, uint64_t v)
{
    int i;
    for (i = 7; i >= 0; i--) {
        p[i] = (unsigned char)v;
        v >>= 8;
    }
}

/* key = link(parent, local) || local, written to key (parent and key may not overlap) */
static inline void
dyn_link(const unsigned char *parent, const unsigned char *local, unsigned char *key)
{
    unsigned char msg[DYN_KEY + DYN_LOCAL];
    memcpy(msg, parent, DYN_KEY);
    memcpy(msg + DYN_KEY, local, DYN_LOCAL);
    put_be64(key, XXH3_64bits(msg, sizeof msg));
    memcpy(key + DYN_LOCAL, local, DYN_LOCAL);
}

static int
dyn_parent(PyObject *obj, unsigned char *out)
{
    if (!PyBytes_Check(obj) || PyBytes_GET_SIZE(obj) != DYN_KEY) {
        PyErr_Format(HashingError, "parent must be %d bytes, got %.100s", DYN_KEY,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(obj), DYN_KEY);
    return 0;
}

/* The list of the keys of nb blocks of step bytes at raw, chained from parent. */
static PyObject *
dyn_keys_of(const unsigned char *raw, Py_ssize_t nb, Py_ssize_t step, uint64_t seed,
            const unsigned char *parent)
{
    unsigned char key[2][DYN_KEY], local[DYN_LOCAL];
    const unsigned char *prev = parent;
    Py_ssize_t b;
    PyObject *out = PyList_New(nb);
    if (out == NULL)
        return NULL;
    for (b = 0; b < nb; b++) {
        unsigned char *k = key[b & 1];
        PyObject *o;
        put_be64(local, XXH3_64bits_withSeed(raw + step * b, (size_t)step, seed));
        dyn_link(prev, local, k);
        o = PyBytes_FromStringAndSize((const char *)k, DYN_KEY);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, o);
        prev = k;
    }
    return out;
}

PyDoc_STRVAR(dynamo_keys_doc,
             "dynamo_keys(tokens, block_tokens, seed, parent, drop_last=False, /) -> "
             "list[bytes] | None\n\n"
             "The Dynamo keys (16 bytes each) of the full blocks of a request, chained from the "
             "16-byte parent key. tokens: a list/tuple of ints (None when an item is not an int "
             "in 0..2**32-1: the caller's validating path then raises) or a bytes-like object of "
             "u32 LE ids (HashingError unless whole ids); None for any other type. drop_last "
             "leaves the last id out (it is validated all the same).");

static PyObject *
cn_dynamo_keys(PyObject *self, PyObject *args)
{
    PyObject *tokens, *parent_obj, *out;
    Py_ssize_t block_tokens, n, step;
    unsigned long long seed;
    int drop_last = 0;
    unsigned char parent[DYN_KEY];

    if (!PyArg_ParseTuple(args, "OnKO|p", &tokens, &block_tokens, &seed, &parent_obj,
                          &drop_last))
        return NULL;
    if (block_tokens < 1) {
        PyErr_Format(HashingError, "tokens_per_block must be positive, got %zd", block_tokens);
        return NULL;
    }
    if (dyn_parent(parent_obj, parent) < 0)
        return NULL;
    step = 4 * block_tokens;
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        unsigned char *raw;
        n = PySequence_Fast_GET_SIZE(tokens);
        raw = PyMem_Malloc(n > 0 ? (size_t)(4 * n) : 1);
        if (raw == NULL)
            return PyErr_NoMemory();
        if (pack_items(PySequence_Fast_ITEMS(tokens), n, raw) < 0) {
            PyMem_Free(raw);
            Py_RETURN_NONE;
        }
        if (drop_last && n > 0)
            n--;
        out = dyn_keys_of(raw, 4 * n / step, step, (uint64_t)seed, parent);
        PyMem_Free(raw);
        return out;
    }
    if (PyObject_CheckBuffer(tokens) && !PyUnicode_Check(tokens)) {
        Py_buffer view;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0)
            return NULL;
        if (view.len % 4) {
            PyErr_Format(HashingError,
                         "tokens: packed token ids must be whole u32 values, got %zd bytes",
                         view.len);
            PyBuffer_Release(&view);
            return NULL;
        }
        n = view.len / 4;
        if (drop_last && n > 0)
            n--;
        out = dyn_keys_of((const unsigned char *)view.buf, 4 * n / step, step, (uint64_t)seed,
                          parent);
        PyBuffer_Release(&view);
        return out;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dynamo_link_doc,
             "dynamo_link(local_hashes, parent, signed, /) -> list[bytes] | None\n\n"
             "The Dynamo keys of a chain of local hashes from the 16-byte parent key: each "
             "item 8 bytes (big-endian) when not signed, an int in -2**63..2**63-1 (its two's "
             "complement) when signed. None when an item is not of that form (the caller's "
             "path then decides).");

static PyObject *
cn_dynamo_link(PyObject *self, PyObject *args)
{
    PyObject *items_obj, *parent_obj, *out, **items;
    int is_signed;
    Py_ssize_t n, i;
    unsigned char key[2][DYN_KEY], local[DYN_LOCAL], parent[DYN_KEY];
    const unsigned char *prev = parent;

    if (!PyArg_ParseTuple(args, "OOp", &items_obj, &parent_obj, &is_signed))
        return NULL;
    if (dyn_parent(parent_obj, parent) < 0)
        return NULL;
    if (!PyList_CheckExact(items_obj) && !PyTuple_CheckExact(items_obj))
        Py_RETURN_NONE;
    n = PySequence_Fast_GET_SIZE(items_obj);
    items = PySequence_Fast_ITEMS(items_obj);
    out = PyList_New(n);
    if (out == NULL)
        return NULL;
    /* no Python code runs in the loop (exact bytes and ints only), so items stay put */
    for (i = 0; i < n; i++) {
        PyObject *item = items[i], *o;
        unsigned char *k = key[i & 1];
        if (is_signed) {
            int overflow;
            long long v;
            if (!PyLong_CheckExact(item))
                goto bad;
            v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || (v == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                goto bad;
            }
            put_be64(local, (uint64_t)v);
        }
        else {
            if (!PyBytes_CheckExact(item) || PyBytes_GET_SIZE(item) != DYN_LOCAL)
                goto bad;
            memcpy(local, PyBytes_AS_STRING(item), DYN_LOCAL);
        }
        dyn_link(prev, local, k);
        o = PyBytes_FromStringAndSize((const char *)k, DYN_KEY);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, o);
        prev = k;
    }
    return out;
bad:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* ============================================================================ primitives */

static PyObject *
one_shot(PyObject *args, int blake)
{
    Py_buffer data;
    unsigned char *msg, out[32];
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    msg = PyMem_Malloc((size_t)data.len + 72);
    if (msg == NULL) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    if (data.len)
        memcpy(msg, data.buf, (size_t)data.len);
    if (blake)
        b3_hash(msg, (size_t)data.len, out);
    else
        sha256_padded(msg, (size_t)data.len, out);
    PyMem_Free(msg);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

static PyObject *
cn_sha256(PyObject *self, PyObject *args)
{
    return one_shot(args, 0);
}

static PyObject *
cn_blake3(PyObject *self, PyObject *args)
{
    return one_shot(args, 1);
}

static PyObject *
cn_has_sha_ni(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(using_sha_ni);
}

static PyObject *
cn_set_simd(PyObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
#ifdef HAVE_X86_SHA
    if (on && cpu_has_sha_ni()) {
        sha256_blocks = sha256_blocks_shani;
        using_sha_ni = 1;
    }
    else {
        sha256_blocks = sha256_blocks_portable;
        using_sha_ni = 0;
    }
    b3_compress_impl = on && cpu_has_sse41() ? b3_compress_sse41 : b3_compress;
    b3_chunks_many = on && cpu_has_avx2() ? b3_chunks8_avx2 : b3_chunks_one;
    b3_hash8 = on && cpu_has_avx2() ? b3_hash8_avx2 : NULL;
    b3_first_chunk = on && cpu_has_sse41() ? b3_first_chunk_sse41 : b3_first_chunk_one;
    cbor_tokens = on && cpu_has_sse41() ? cbor_tokens_sse41 : cbor_tokens_scalar;
    pickle_tokens = on && cpu_has_sse41() ? pickle_tokens_sse41 : pickle_tokens_scalar;
#else
    (void)on;
#endif
    return PyBool_FromLong(using_sha_ni);
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))cn_chain, METH_VARARGS | METH_KEYWORDS, chain_doc},
    {"chain_ints", (PyCFunction)(void (*)(void))cn_chain_ints, METH_VARARGS | METH_KEYWORDS,
     chain_ints_doc},
    {"chain_many", (PyCFunction)(void (*)(void))cn_chain_many, METH_VARARGS | METH_KEYWORDS,
     chain_many_doc},
    {"pack", (PyCFunction)(void (*)(void))cn_pack, METH_VARARGS | METH_KEYWORDS, pack_doc},
    {"fingerprints", cn_fingerprints, METH_VARARGS, fingerprints_doc},
    {"same_prefix", cn_same_prefix, METH_VARARGS, same_prefix_doc},
    {"split", cn_split, METH_VARARGS, split_doc},
    {"json_ids", cn_json_ids, METH_O, json_ids_doc},
    {"dynamo_keys", cn_dynamo_keys, METH_VARARGS, dynamo_keys_doc},
    {"dynamo_link", cn_dynamo_link, METH_VARARGS, dynamo_link_doc},
    {"sha256", cn_sha256, METH_VARARGS, "sha256(data) -> bytes: the SHA-256 digest."},
    {"blake3", cn_blake3, METH_VARARGS, "blake3(data) -> bytes: the 32-byte BLAKE3 hash."},
    {"has_sha_ni", cn_has_sha_ni, METH_NOARGS,
     "has_sha_ni() -> bool: whether SHA-256 runs on the x86 SHA extensions."},
    {"set_simd", cn_set_simd, METH_O,
     "set_simd(on) -> bool: use the x86 SHA extensions, the SSE4.1 BLAKE3 compression and "
     "the AVX2 eight-chunk BLAKE3 lanes when on and available, the portable C otherwise (tests "
     "exercise both); returns whether the SHA extensions are used."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
             "SHA-256 and BLAKE3 block-hash chains in C (v2_sha256, vllm_sha256_cbor, blake3, "
             "sglang_sha256_64); see kvstream.hashing.trtllm, .vllm, .native and .sglang for the "
             "pure-Python references.");

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvstream.hashing._chainnative", module_doc, -1, methods,
    NULL,                  NULL,                            NULL,       NULL,
};

PyMODINIT_FUNC
PyInit__chainnative(void)
{
    PyObject *m, *errors;

    errors = PyImport_ImportModule("kvstream.errors");
    if (errors == NULL)
        return NULL;
    Py_XDECREF(HashingError);
    HashingError = PyObject_GetAttrString(errors, "HashingError");
    Py_DECREF(errors);
    if (HashingError == NULL)
        return NULL;
#ifdef HAVE_X86_SHA
    if (cpu_has_sha_ni()) {
        sha256_blocks = sha256_blocks_shani;
        using_sha_ni = 1;
    }
    fill_pairs(CBOR_PAIR, CBOR_LAYOUT);
    fill_pairs(PICKLE_PAIR, PICKLE_LAYOUT);
    if (cpu_has_sse41()) {
        b3_compress_impl = b3_compress_sse41;
        cbor_tokens = cbor_tokens_sse41;
        pickle_tokens = pickle_tokens_sse41;
    }
    if (cpu_has_sse41())
        b3_first_chunk = b3_first_chunk_sse41;
    if (cpu_has_avx2()) {
        b3_chunks_many = b3_chunks8_avx2;
        b3_hash8 = b3_hash8_avx2;
    }
#endif
    m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "KIND_V2", KIND_V2) < 0 ||
        PyModule_AddIntConstant(m, "KIND_CBOR", KIND_CBOR) < 0 ||
        PyModule_AddIntConstant(m, "KIND_BLAKE3", KIND_BLAKE3) < 0 ||
        PyModule_AddIntConstant(m, "KIND_SGLANG", KIND_SGLANG) < 0 ||
        PyModule_AddIntConstant(m, "KIND_PICKLE", KIND_PICKLE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
