/*
 * kvstream.codec._tokens_native: the token encodings of schema v4 and the model batch
 * encoder in C.
 *
 * kvstream/codec/tokens.py holds the numpy references and kvstream/codec/encoder.py the
 * Python one of encode_body (same results, property-tested equal):
 *
 *   varint_encode(raw, delta) -> bytes
 *       raw: little-endian uint32 ids (a buffer, length a multiple of 4). Each value (the id,
 *       or with delta the zig-zag of the wrapping 32-bit difference to the previous id, the
 *       first against 0) as an unsigned LEB128 varint of 1..5 bytes.
 *   varint_sizes(raw) -> (max_id, varint_bytes, delta_varint_bytes)
 *       what the two encodings of `raw` would take, and the largest id.
 *   varint_decode(data, count, delta) -> bytes
 *       exactly `count` canonical varints filling `data` -> little-endian uint32 ids.
 *       Raises ValueError naming the problem: too few/many bytes, a varint over 5 bytes or
 *       32 bits, a redundant trailing zero group.
 *   planes_encode(raw) -> (high_bits, low16, high_planes)
 *       the bit-plane layout of every schema version (tokens.pack_tokens).
 *   body_setup(...), encode_body(prefix, batch, events, version, token_encoding)
 *       a model batch's whole Avro body in one call (_batch_body.h; encoder._encode_py is
 *       its Python twin).
 *
 * The varint coders release the GIL on large inputs. Their loops are written so that the
 * compiler vectorises them without target flags (uint32 lanes, no loop-carried state): the
 * size estimate and the first pass of the encoder. GCC does so from -O3 (CPython's default
 * flags); VECTORISE asks for it where a build uses -O2.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define NOGIL_MIN 16384

static inline uint32_t
load_u32le(const unsigned char *p)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
#endif
}

static inline void
store_u32le(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

#if defined(__GNUC__) && !defined(__clang__)
#define VECTORISE __attribute__((optimize("O3")))
#else
#define VECTORISE
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define FAST_LE 1
#else
#define FAST_LE 0
#endif

#define CHUNK 256

/* The zig-zag of the wrapping 32-bit difference v - prev. */
static inline uint32_t
zigzag(uint32_t v, uint32_t prev)
{
    uint32_t d = v - prev;
    return (d << 1) ^ (uint32_t)((int32_t)d >> 31);
}

/* `out` has 5 * n + 8 bytes: each varint is stored as 8 bytes and the pointer advances by its
 * length. Two passes per chunk of CHUNK ids: the first (vectorised by the compiler: uint32
 * lanes, no loop-carried state) spreads each value's 7-bit groups over the low 4 bytes with
 * their continuation bits, its fifth byte and its length; the second only stores. */
static VECTORISE Py_ssize_t
encode_all(const unsigned char *in, Py_ssize_t n, int delta, unsigned char *out)
{
    unsigned char *o = out;
    uint32_t lo[CHUNK], hi[CHUNK], len[CHUNK], z[CHUNK];
    uint32_t prev = 0;
    for (Py_ssize_t s = 0; s < n; s += CHUNK) {
        Py_ssize_t m = n - s < CHUNK ? n - s : CHUNK;
        const unsigned char *p = in + 4 * s;
        if (delta) {
            z[0] = zigzag(load_u32le(p), prev);
            for (Py_ssize_t j = 1; j < m; j++)
                z[j] = zigzag(load_u32le(p + 4 * j), load_u32le(p + 4 * j - 4));
            prev = load_u32le(p + 4 * m - 4);
        }
        else {
            for (Py_ssize_t j = 0; j < m; j++)
                z[j] = load_u32le(p + 4 * j);
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            uint32_t v = z[j];
            uint32_t c1 = 0u - (uint32_t)(v >= 0x80u), c2 = 0u - (uint32_t)(v >= 0x4000u),
                     c3 = 0u - (uint32_t)(v >= 0x200000u), c4 = 0u - (uint32_t)(v >= 0x10000000u);
            lo[j] = (v & 0x7Fu) | ((v << 1) & 0x7F00u) | ((v << 2) & 0x7F0000u) |
                    ((v << 3) & 0x7F000000u) | (c1 & 0x80u) | (c2 & 0x8000u) |
                    (c3 & 0x800000u) | (c4 & 0x80000000u);
            hi[j] = v >> 28;
            len[j] = 1u - c1 - c2 - c3 - c4;
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            uint64_t x = (uint64_t)lo[j] | ((uint64_t)hi[j] << 32);
#if FAST_LE
            memcpy(o, &x, 8);
#else
            for (int k = 0; k < 5; k++)
                o[k] = (unsigned char)(x >> (8 * k));
#endif
            o += len[j];
        }
    }
    return o - out;
}

static PyObject *
varint_encode(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf;
    int delta;
    if (!PyArg_ParseTuple(args, "y*p:varint_encode", &buf, &delta))
        return NULL;
    if (buf.len % 4) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "token buffer length is not a multiple of 4");
        return NULL;
    }
    Py_ssize_t n = buf.len / 4;
    unsigned char *tmp = PyMem_RawMalloc((size_t)(5 * n) + 8);
    if (tmp == NULL) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    Py_ssize_t len;
    if (n >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        len = encode_all(buf.buf, n, delta, tmp);
        Py_END_ALLOW_THREADS
    }
    else {
        len = encode_all(buf.buf, n, delta, tmp);
    }
    PyBuffer_Release(&buf);
    PyObject *res = PyBytes_FromStringAndSize((const char *)tmp, len);
    PyMem_RawFree(tmp);
    return res;
}

static VECTORISE PyObject *
varint_sizes(PyObject *self, PyObject *arg)
{
    Py_buffer buf;
    (void)self;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    if (buf.len % 4) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "token buffer length is not a multiple of 4");
        return NULL;
    }
    const unsigned char *in = buf.buf;
    Py_ssize_t n = buf.len / 4, plain = n, delta = n;
    uint32_t max = 0;
    /* Per chunk (uint32 counters cannot overflow), loops the compiler vectorises. */
    for (Py_ssize_t s = 0; s < n; s += 4096) {
        Py_ssize_t e = n - s < 4096 ? n : s + 4096, i = s;
        uint32_t p = 0, d = 0, m = 0;
        for (Py_ssize_t j = s; j < e; j++) {
            uint32_t v = load_u32le(in + 4 * j);
            m = v > m ? v : m;
            p += (v >= 0x80u) + (v >= 0x4000u) + (v >= 0x200000u) + (v >= 0x10000000u);
        }
        if (i == 0) {
            uint32_t z = zigzag(load_u32le(in), 0);
            d += (z >= 0x80u) + (z >= 0x4000u) + (z >= 0x200000u) + (z >= 0x10000000u);
            i = 1;
        }
        for (; i < e; i++) {
            uint32_t z = zigzag(load_u32le(in + 4 * i), load_u32le(in + 4 * i - 4));
            d += (z >= 0x80u) + (z >= 0x4000u) + (z >= 0x200000u) + (z >= 0x10000000u);
        }
        plain += p;
        delta += d;
        max = m > max ? m : max;
    }
    PyBuffer_Release(&buf);
    return Py_BuildValue("(knn)", (unsigned long)max, plain, delta);
}

/* One varint at in[pos] with at least 8 readable bytes: its value and length, or 0 on a
 * malformed varint (*err set). */
static inline Py_ssize_t
decode_fast(const unsigned char *p, uint32_t *value, const char **err)
{
    uint64_t x;
    memcpy(&x, p, 8);
    uint64_t stops = ~x & 0x8080808080ull; /* bytes without a continuation bit, first 5 */
    if (!stops) {
        *err = "a varint is longer than 5 bytes";
        return 0;
    }
    int len = (__builtin_ctzll(stops) >> 3) + 1;
    x &= len == 8 ? ~0ull : ((1ull << (8 * len)) - 1);
    if (len == 5 && (x >> 32) > 0x0F) {
        *err = "a varint exceeds 32 bits";
        return 0;
    }
    if (len > 1 && (x >> (8 * (len - 1))) == 0) {
        *err = "a varint has a redundant trailing zero group";
        return 0;
    }
    *value = (uint32_t)((x & 0x7F) | ((x >> 1) & 0x3F80) | ((x >> 2) & 0x1FC000) |
                        ((x >> 3) & 0xFE00000) | ((x >> 4) & 0xF0000000u));
    return len;
}

/* 0 on success, else a static message. */
static const char *
decode_all(const unsigned char *in, Py_ssize_t len, Py_ssize_t count, int delta,
           unsigned char *out)
{
    Py_ssize_t pos = 0;
    uint32_t prev = 0;
    const char *err = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint32_t v = 0;
#if FAST_LE && defined(__GNUC__)
        if (len - pos >= 8) {
            Py_ssize_t n = decode_fast(in + pos, &v, &err);
            if (!n)
                return err;
            pos += n;
        }
        else
#endif
        {
            int shift = 0;
            for (;;) {
                if (pos >= len)
                    return "data ends inside a varint or before the last id";
                unsigned char b = in[pos++];
                if (shift == 28 && b > 0x0F)
                    return b & 0x80 ? "a varint is longer than 5 bytes"
                                    : "a varint exceeds 32 bits";
                v |= (uint32_t)(b & 0x7F) << shift;
                if (!(b & 0x80)) {
                    if (b == 0 && shift)
                        return "a varint has a redundant trailing zero group";
                    break;
                }
                shift += 7;
            }
        }
        if (delta) {
            uint32_t d = (v >> 1) ^ (0u - (v & 1u));
            v = prev + d;
            prev = v;
        }
        store_u32le(out + 4 * i, v);
    }
    if (pos != len)
        return "bytes left over after the last id";
    return NULL;
}

static PyObject *
varint_decode(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer buf;
    Py_ssize_t count;
    int delta;
    if (!PyArg_ParseTuple(args, "y*np:varint_decode", &buf, &count, &delta))
        return NULL;
    if (count < 0 || count > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "%zd varint bytes cannot hold %zd ids", buf.len, count);
        return NULL;
    }
    PyObject *res = PyBytes_FromStringAndSize(NULL, 4 * count);
    if (res == NULL) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    const char *err;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(res);
    if (count >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        err = decode_all(buf.buf, buf.len, count, delta, out);
        Py_END_ALLOW_THREADS
    }
    else {
        err = decode_all(buf.buf, buf.len, count, delta, out);
    }
    PyBuffer_Release(&buf);
    if (err != NULL) {
        Py_DECREF(res);
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    return res;
}


/* ------------------------------------------------------------------------------ bit planes */

/* planes_encode(raw) -> (high_bits, low16, high_planes): tokens.pack_tokens in one pass. */
static VECTORISE PyObject *
planes_encode(PyObject *self, PyObject *arg)
{
    Py_buffer buf;
    (void)self;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    if (buf.len % 4) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "token buffer length is not a multiple of 4");
        return NULL;
    }
    const unsigned char *in = buf.buf;
    Py_ssize_t n = buf.len / 4, plane_len = (n + 7) >> 3;
    PyObject *low = PyBytes_FromStringAndSize(NULL, 2 * n);
    if (low == NULL) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    unsigned char *lo = (unsigned char *)PyBytes_AS_STRING(low);
    uint32_t high_or = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        lo[2 * i] = in[4 * i];
        lo[2 * i + 1] = in[4 * i + 1];
        high_or |= (uint32_t)in[4 * i + 2] | ((uint32_t)in[4 * i + 3] << 8);
    }
    int k = 0;
    while (high_or >> k)
        k++;
    PyObject *high = PyBytes_FromStringAndSize(NULL, k * plane_len);
    if (high == NULL) {
        PyBuffer_Release(&buf);
        Py_DECREF(low);
        return NULL;
    }
    unsigned char *hp = (unsigned char *)PyBytes_AS_STRING(high);
    for (int j = 0; j < k; j++) {
        unsigned char *plane = hp + (Py_ssize_t)j * plane_len;
        int shift = 16 + j;
        for (Py_ssize_t g = 0; g < plane_len; g++) {
            Py_ssize_t base = 8 * g, m = n - base < 8 ? n - base : 8;
            unsigned int byte = 0;
            for (Py_ssize_t b = 0; b < m; b++)
                byte |= ((load_u32le(in + 4 * (base + b)) >> shift) & 1u) << b;
            plane[g] = (unsigned char)byte;
        }
    }
    PyBuffer_Release(&buf);
    PyObject *res = Py_BuildValue("(iNN)", k, low, high);
    return res;
}

#include "_batch_body.h"
#include "_columns_body.h"

static PyMethodDef methods[] = {
    {"varint_encode", varint_encode, METH_VARARGS,
     "varint_encode(raw, delta) -> bytes: uint32 LE ids as LEB128 varints (delta: zig-zag "
     "differences)."},
    {"varint_sizes", varint_sizes, METH_O,
     "varint_sizes(raw) -> (max_id, varint_bytes, delta_varint_bytes) of uint32 LE ids."},
    {"varint_decode", varint_decode, METH_VARARGS,
     "varint_decode(data, count, delta) -> bytes: exactly count canonical varints -> uint32 LE "
     "ids; ValueError otherwise."},
    {"planes_encode", planes_encode, METH_O,
     "planes_encode(raw) -> (high_bits, low16, high_planes): uint32 LE ids as bit planes."},
    {"body_setup", body_setup, METH_VARARGS,
     "body_setup(types, attention, field_names, block_defaults, frames, tails, block_attrs, "
     "encode_tokens): what encode_body needs (see kvstream.codec.encoder)."},
    {"encode_body", encode_body, METH_VARARGS,
     "encode_body(prefix, batch, events, version, token_encoding) -> bytes | None: the Avro "
     "body of a model batch (kvstream.codec.encoder._encode_py), None where it declines."},
    {"columns_setup", columns_setup, METH_VARARGS,
     "columns_setup(attention_values, default_hash_algo, v1_kinds, attr_fields): what "
     "encode_columns needs (see kvstream.codec.column_encoder)."},
    {"encode_columns", encode_columns, METH_VARARGS,
     "encode_columns(prefix, cols, version, token_encoding, lossy) -> bytes | None: the Avro "
     "body of publisher columns (kvstream.codec.column_encoder._encode_columns_py), None "
     "where it declines."},
    {"deferred_rows", deferred_rows, METH_VARARGS,
     "deferred_rows(records, start, columns, raws, block_run, default_algo, default_group) -> "
     "int: deferred_columns' loop over the records it reads straight (see "
     "kvstream.events.deferred_columns); the index of the first record left to Python."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "kvstream.codec._tokens_native",
    "VARINT / DELTA_VARINT token encodings of kvstream's schema v4 (see kvstream.codec.tokens).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__tokens_native(void)
{
    if (body_intern() < 0 || columns_intern() < 0 || deferred_intern() < 0)
        return NULL;
    return PyModule_Create(&moduledef);
}
