/* Portable BLAKE3 (https://github.com/BLAKE3-team/BLAKE3, spec §2): the hash, keyed-hash and
 * derive-key modes of inputs of any length, output up to 32 bytes. For the index's
 * token-derived block keys (kvstream/index/keys.py), a few hundred bytes per key, where one
 * portable compression per 64 bytes is all the work; kvstream/hashing/_chainnative.c keeps
 * its SIMD lanes for the request-side chains. Every function is static: include this file in
 * one translation unit. Tested against the reference implementation (the blake3 package) in
 * tests/test_index_native_tokens.py. */
#ifndef KVSTREAM_BLAKE3_PORTABLE_H
#define KVSTREAM_BLAKE3_PORTABLE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define B3P_X86 1
#include <immintrin.h>
#endif

#define B3P_CHUNK_START 1u
#define B3P_CHUNK_END 2u
#define B3P_PARENT 4u
#define B3P_ROOT 8u
#define B3P_KEYED_HASH 16u
#define B3P_DERIVE_KEY_CONTEXT 32u
#define B3P_DERIVE_KEY_MATERIAL 64u
#define B3P_CHUNK_LEN 1024

static const uint32_t B3P_IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                                   0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

static inline uint32_t
b3p_rotr(uint32_t x, int n)
{
    return (x >> n) | (x << (32 - n));
}

static inline uint32_t
b3p_load(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void
b3p_store(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

#define B3_G(a, b, c, d, x, y)                 \
    do {                                       \
        v[a] = v[a] + v[b] + (x);              \
        v[d] = b3p_rotr(v[d] ^ v[a], 16);        \
        v[c] = v[c] + v[d];                    \
        v[b] = b3p_rotr(v[b] ^ v[c], 12);        \
        v[a] = v[a] + v[b] + (y);              \
        v[d] = b3p_rotr(v[d] ^ v[a], 8);         \
        v[c] = v[c] + v[d];                    \
        v[b] = b3p_rotr(v[b] ^ v[c], 7);         \
    } while (0)

/* One round with the message words in the order of that round's schedule row (the
 * permutation 2,6,3,10,7,0,4,13,1,11,12,5,9,14,15,8 applied r times), as constants so
 * that the unrolled rounds keep the message in registers; G is B3_G for one state, or a
 * lane-sliced G (v[i]: word i of every lane) for the SIMD kernels. */
#define B3_LROUND(G, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                                 \
        G(0, 4, 8, 12, m[s0], m[s1]);                                                    \
        G(1, 5, 9, 13, m[s2], m[s3]);                                                    \
        G(2, 6, 10, 14, m[s4], m[s5]);                                                   \
        G(3, 7, 11, 15, m[s6], m[s7]);                                                   \
        G(0, 5, 10, 15, m[s8], m[s9]);                                                   \
        G(1, 6, 11, 12, m[s10], m[s11]);                                                 \
        G(2, 7, 8, 13, m[s12], m[s13]);                                                  \
        G(3, 4, 9, 14, m[s14], m[s15]);                                                  \
    } while (0)
#define B3_LROUNDS(G)                                                         \
    do {                                                                      \
        B3_LROUND(G, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);   \
        B3_LROUND(G, 2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8);   \
        B3_LROUND(G, 3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1);   \
        B3_LROUND(G, 10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6);   \
        B3_LROUND(G, 12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4);   \
        B3_LROUND(G, 9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7);   \
        B3_LROUND(G, 11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13);   \
    } while (0)

/* The first 8 words of the compression of one 64-byte block (a chaining value, or the first
 * 32 bytes of a root output). */
static void
b3p_compress(const uint32_t cv[8], const uint8_t block[64], uint32_t block_len, uint64_t counter,
             uint32_t flags, uint32_t out[8])
{
    uint32_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = b3p_load(block + 4 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = cv[i];
        v[i + 8] = i < 4 ? B3P_IV[i] : 0;
    }
    v[12] = (uint32_t)counter;
    v[13] = (uint32_t)(counter >> 32);
    v[14] = block_len;
    v[15] = flags;
    B3_LROUNDS(B3_G);
    for (int i = 0; i < 8; i++)
        out[i] = v[i] ^ v[i + 8];
}

#ifdef B3P_X86
/* The same compression on SSE4.1 registers: the four columns (then, rotated, the four
 * diagonals) of the state as four row vectors, so each G step runs on four lanes at once. */
#define B3_ROT16(x) _mm_shuffle_epi8((x), rot16)
#define B3_ROT8(x) _mm_shuffle_epi8((x), rot8)
#define B3_ROTR(x, n) _mm_or_si128(_mm_srli_epi32((x), (n)), _mm_slli_epi32((x), 32 - (n)))
/* a + m first: a is ready before b, so only one add waits on b (the chain of one block's
 * compressions is latency-bound) */
#define B3_HALF(mx, my)                                  \
    do {                                                 \
        r0 = _mm_add_epi32(_mm_add_epi32(r0, (mx)), r1); \
        r3 = B3_ROT16(_mm_xor_si128(r3, r0));            \
        r2 = _mm_add_epi32(r2, r3);                      \
        r1 = B3_ROTR(_mm_xor_si128(r1, r2), 12);         \
        r0 = _mm_add_epi32(_mm_add_epi32(r0, (my)), r1); \
        r3 = B3_ROT8(_mm_xor_si128(r3, r0));             \
        r2 = _mm_add_epi32(r2, r3);                      \
        r1 = B3_ROTR(_mm_xor_si128(r1, r2), 7);          \
    } while (0)
#define B3_SROUND(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                              \
        B3_HALF(_mm_set_epi32(m[s6], m[s4], m[s2], m[s0]),                            \
                _mm_set_epi32(m[s7], m[s5], m[s3], m[s1]));                           \
        r1 = _mm_shuffle_epi32(r1, 0x39); /* lanes 1,2,3,0: the diagonals */         \
        r2 = _mm_shuffle_epi32(r2, 0x4E);                                             \
        r3 = _mm_shuffle_epi32(r3, 0x93);                                             \
        B3_HALF(_mm_set_epi32(m[s14], m[s12], m[s10], m[s8]),                         \
                _mm_set_epi32(m[s15], m[s13], m[s11], m[s9]));                        \
        r1 = _mm_shuffle_epi32(r1, 0x93);                                             \
        r2 = _mm_shuffle_epi32(r2, 0x4E);                                             \
        r3 = _mm_shuffle_epi32(r3, 0x39);                                             \
    } while (0)

__attribute__((target("sse4.1,ssse3"))) static void
b3p_compress_sse41(const uint32_t cv[8], const uint8_t block[64], uint32_t block_len,
                   uint64_t counter, uint32_t flags, uint32_t out[8])
{
    const __m128i rot16 = _mm_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m128i rot8 = _mm_setr_epi8(1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12);
    uint32_t m[16];
    __m128i r0, r1, r2, r3;
    int i;
    for (i = 0; i < 16; i++)
        m[i] = b3p_load(block + 4 * i);
    r0 = _mm_loadu_si128((const __m128i *)&cv[0]);
    r1 = _mm_loadu_si128((const __m128i *)&cv[4]);
    r2 = _mm_loadu_si128((const __m128i *)&B3P_IV[0]);
    r3 = _mm_setr_epi32((int)(uint32_t)counter, (int)(uint32_t)(counter >> 32), block_len,
                        (int)flags);
    B3_SROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    B3_SROUND(2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8);
    B3_SROUND(3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1);
    B3_SROUND(10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6);
    B3_SROUND(12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4);
    B3_SROUND(9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7);
    B3_SROUND(11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13);
    _mm_storeu_si128((__m128i *)&out[0], _mm_xor_si128(r0, r2));
    _mm_storeu_si128((__m128i *)&out[4], _mm_xor_si128(r1, r3));
}
#endif

typedef void (*b3p_compress_fn)(const uint32_t cv[8], const uint8_t block[64], uint32_t block_len,
                                uint64_t counter, uint32_t flags, uint32_t out[8]);
/* The compression the functions below use (b3p_use_simd() picks SSE4.1 where the CPU has it). */
static b3p_compress_fn b3p_compress_impl = b3p_compress;

/* Use the SSE4.1 compression when ``on`` and the CPU has SSE4.1, else the portable one. */
static inline void
b3p_use_simd(int on)
{
#ifdef B3P_X86
    b3p_compress_impl = on && __builtin_cpu_supports("sse4.1") ? b3p_compress_sse41 : b3p_compress;
#else
    (void)on;
    b3p_compress_impl = b3p_compress;
#endif
}

/* A compression whose flags are not final yet (ROOT goes on the last one only). */
typedef struct {
    uint32_t cv[8];
    uint8_t block[64];
    uint32_t block_len;
    uint64_t counter;
    uint32_t flags;
} b3p_output;

/* One chunk (0..1024 bytes) up to its last block, under key with the mode's flags. */
static void
b3p_chunk(const uint32_t key[8], uint32_t mode, const uint8_t *p, size_t len, uint64_t counter,
          b3p_output *o)
{
    uint32_t cv[8];
    uint32_t flags = mode | B3P_CHUNK_START;
    memcpy(cv, key, sizeof cv);
    while (len > 64) {
        b3p_compress_impl(cv, p, 64, counter, flags, cv);
        flags = mode;
        p += 64;
        len -= 64;
    }
    memcpy(o->cv, cv, sizeof cv);
    memset(o->block, 0, 64);
    if (len)
        memcpy(o->block, p, len);
    o->block_len = (uint32_t)len;
    o->counter = counter;
    o->flags = flags | B3P_CHUNK_END;
}

static void
b3p_parent(const uint32_t key[8], uint32_t mode, const uint32_t left[8], const uint32_t right[8],
           b3p_output *o)
{
    memcpy(o->cv, key, sizeof o->cv);
    for (int i = 0; i < 8; i++) {
        b3p_store(o->block + 4 * i, left[i]);
        b3p_store(o->block + 32 + 4 * i, right[i]);
    }
    o->block_len = 64;
    o->counter = 0;
    o->flags = mode | B3P_PARENT;
}

/* The first outlen (<= 32) bytes of BLAKE3 of p[0:len] under key (B3P_IV for the plain hash)
 * with mode (0, B3P_KEYED_HASH, or a derive-key flag). Not specialised per call site: GCC's
 * clone for the short constant context string warns about the (unreachable) multi-chunk
 * branch. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((noipa))
#endif
static void
b3p_hash(const uint32_t key[8], uint32_t mode, const uint8_t *p, size_t len, uint8_t *out,
         size_t outlen)
{
    b3p_output o;
    uint32_t words[8];
    uint8_t full[32];
    if (len <= B3P_CHUNK_LEN)
        b3p_chunk(key, mode, p, len, 0, &o);
    else {
        uint32_t stack[54][8]; /* one entry per bit of the chunk count: 2**54 chunks */
        int depth = 0;
        uint64_t chunk = 0;
        while (len > B3P_CHUNK_LEN) {
            uint32_t cv[8];
            b3p_chunk(key, mode, p, B3P_CHUNK_LEN, chunk, &o);
            b3p_compress_impl(o.cv, o.block, o.block_len, o.counter, o.flags, cv);
            chunk++;
            /* merge completed subtrees: one per trailing zero bit of the chunk count */
            for (uint64_t total = chunk; (total & 1) == 0; total >>= 1) {
                b3p_parent(key, mode, stack[--depth], cv, &o);
                b3p_compress_impl(o.cv, o.block, o.block_len, o.counter, o.flags, cv);
            }
            memcpy(stack[depth++], cv, sizeof cv);
            p += B3P_CHUNK_LEN;
            len -= B3P_CHUNK_LEN;
        }
        b3p_chunk(key, mode, p, len, chunk, &o);
        while (depth > 0) {
            uint32_t cv[8];
            b3p_compress_impl(o.cv, o.block, o.block_len, o.counter, o.flags, cv);
            b3p_parent(key, mode, stack[--depth], cv, &o);
        }
    }
    b3p_compress_impl(o.cv, o.block, o.block_len, o.counter, o.flags | B3P_ROOT, words);
    for (int i = 0; i < 8; i++)
        b3p_store(full + 4 * i, words[i]);
    memcpy(out, full, outlen);
}

/* The first 16 bytes of BLAKE3 (under key, with mode) of prefix[0:16] || p[0:len], for a
 * message of one chunk (16 + len <= B3P_CHUNK_LEN), without assembling it: the first block is
 * the prefix and p's first 48 bytes, later full blocks are read from p where they lie.
 * (inline: not every includer uses it, e.g. the hashing role's chains) */
static inline void
b3p_hash_prefixed16(const uint32_t key[8], uint32_t mode, const uint8_t prefix[16],
                    const uint8_t *p, size_t len, uint8_t out[16])
{
    uint32_t cv[8], words[8];
    uint8_t block[64];
    uint32_t flags = mode | B3P_CHUNK_START;
    size_t first = len < 48 ? len : 48;
    memcpy(cv, key, sizeof cv);
    memcpy(block, prefix, 16);
    memcpy(block + 16, p, first);
    if (len <= 48) {
        memset(block + 16 + first, 0, 48 - first);
        b3p_compress_impl(cv, block, (uint32_t)(16 + len), 0, flags | B3P_CHUNK_END | B3P_ROOT,
                          words);
    }
    else {
        b3p_compress_impl(cv, block, 64, 0, flags, cv);
        flags = mode;
        p += 48;
        len -= 48;
        while (len > 64) {
            b3p_compress_impl(cv, p, 64, 0, flags, cv);
            p += 64;
            len -= 64;
        }
        const uint8_t *last = p;
        if (len < 64) {
            memcpy(block, p, len);
            memset(block + len, 0, 64 - len);
            last = block;
        }
        b3p_compress_impl(cv, last, (uint32_t)len, 0, flags | B3P_CHUNK_END | B3P_ROOT, words);
    }
    for (int i = 0; i < 4; i++)
        b3p_store(out + 4 * i, words[i]);
}

/* The key words of BLAKE3's derive-key mode for context (hash the context string once). */
static inline void
b3p_context_key(const char *context, uint32_t key[8])
{
    uint8_t k[32];
    b3p_hash(B3P_IV, B3P_DERIVE_KEY_CONTEXT, (const uint8_t *)context, strlen(context), k, 32);
    for (int i = 0; i < 8; i++)
        key[i] = b3p_load(k + 4 * i);
}

#endif
