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

static const uint8_t B3P_SCHEDULE[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13},
};

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

#define B3P_G(a, b, c, d, x, y)                  \
    do {                                         \
        v[a] = v[a] + v[b] + (x);                \
        v[d] = b3p_rotr(v[d] ^ v[a], 16);        \
        v[c] = v[c] + v[d];                      \
        v[b] = b3p_rotr(v[b] ^ v[c], 12);        \
        v[a] = v[a] + v[b] + (y);                \
        v[d] = b3p_rotr(v[d] ^ v[a], 8);         \
        v[c] = v[c] + v[d];                      \
        v[b] = b3p_rotr(v[b] ^ v[c], 7);         \
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
    for (int r = 0; r < 7; r++) {
        const uint8_t *s = B3P_SCHEDULE[r];
        B3P_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        B3P_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        B3P_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        B3P_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        B3P_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        B3P_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        B3P_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        B3P_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        out[i] = v[i] ^ v[i + 8];
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
        b3p_compress(cv, p, 64, counter, flags, cv);
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
            b3p_compress(o.cv, o.block, o.block_len, o.counter, o.flags, cv);
            chunk++;
            /* merge completed subtrees: one per trailing zero bit of the chunk count */
            for (uint64_t total = chunk; (total & 1) == 0; total >>= 1) {
                b3p_parent(key, mode, stack[--depth], cv, &o);
                b3p_compress(o.cv, o.block, o.block_len, o.counter, o.flags, cv);
            }
            memcpy(stack[depth++], cv, sizeof cv);
            p += B3P_CHUNK_LEN;
            len -= B3P_CHUNK_LEN;
        }
        b3p_chunk(key, mode, p, len, chunk, &o);
        while (depth > 0) {
            uint32_t cv[8];
            b3p_compress(o.cv, o.block, o.block_len, o.counter, o.flags, cv);
            b3p_parent(key, mode, stack[--depth], cv, &o);
        }
    }
    b3p_compress(o.cv, o.block, o.block_len, o.counter, o.flags | B3P_ROOT, words);
    for (int i = 0; i < 8; i++)
        b3p_store(full + 4 * i, words[i]);
    memcpy(out, full, outlen);
}

/* The key words of BLAKE3's derive-key mode for context (hash the context string once). */
static void
b3p_context_key(const char *context, uint32_t key[8])
{
    uint8_t k[32];
    b3p_hash(B3P_IV, B3P_DERIVE_KEY_CONTEXT, (const uint8_t *)context, strlen(context), k, 32);
    for (int i = 0; i < 8; i++)
        key[i] = b3p_load(k + 4 * i);
}

#endif
