/*
 * kvstream.codec._tokens_native: the VARINT and DELTA_VARINT token encodings of schema v4 in C.
 *
 * kvstream/codec/tokens.py holds the numpy reference (same bytes, property-tested equal):
 *
 *   varint_encode(raw, delta) -> bytes
 *       raw: little-endian uint32 ids (a buffer, length a multiple of 4). Each value (the id,
 *       or with delta the zig-zag of the wrapping 32-bit difference to the previous id, the
 *       first against 0) as an unsigned LEB128 varint of 1..5 bytes.
 *   varint_sizes(raw) -> (max_id, varint_bytes, delta_varint_bytes)
 *       what the two encodings of `raw` would take, and the largest id, in one pass.
 *   varint_decode(data, count, delta) -> bytes
 *       exactly `count` canonical varints filling `data` -> little-endian uint32 ids.
 *       Raises ValueError naming the problem: too few/many bytes, a varint over 5 bytes or
 *       32 bits, a redundant trailing zero group.
 *
 * Both release the GIL on large inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define NOGIL_MIN 16384

static inline uint32_t
load_u32le(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static inline void
store_u32le(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static inline Py_ssize_t
varint_len(uint32_t v)
{
    return 1 + (v >= 0x80u) + (v >= 0x4000u) + (v >= 0x200000u) + (v >= 0x10000000u);
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define FAST_LE 1
#else
#define FAST_LE 0
#endif

/* `out` has 5 * n + 8 bytes: the fast path stores 8 bytes per id and advances by its length. */
static Py_ssize_t
encode_all(const unsigned char *in, Py_ssize_t n, int delta, unsigned char *out)
{
    unsigned char *o = out;
    uint32_t prev = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = load_u32le(in + 4 * i);
        if (delta) {
            int32_t d = (int32_t)(v - prev);
            prev = v;
            v = ((uint32_t)d << 1) ^ (uint32_t)(d >> 31);
        }
#if FAST_LE
        /* Branch-free: spread the 7-bit groups over bytes, set the continuation bits. */
        Py_ssize_t len = varint_len(v);
        uint64_t x = (uint64_t)(v & 0x7Fu) | ((uint64_t)(v & 0x3F80u) << 1) |
                     ((uint64_t)(v & 0x1FC000u) << 2) | ((uint64_t)(v & 0xFE00000u) << 3) |
                     ((uint64_t)(v & 0xF0000000u) << 4);
        x |= 0x80808080ull & ((1ull << (8 * (len - 1))) - 1);
        memcpy(o, &x, 8);
        o += len;
#else
        while (v >= 0x80) {
            *o++ = (unsigned char)(v | 0x80);
            v >>= 7;
        }
        *o++ = (unsigned char)v;
#endif
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

static PyObject *
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
    Py_ssize_t n = buf.len / 4, plain = 0, delta = 0;
    uint32_t prev = 0, max = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = load_u32le(in + 4 * i);
        int32_t d = (int32_t)(v - prev);
        prev = v;
        if (v > max)
            max = v;
        plain += varint_len(v);
        delta += varint_len(((uint32_t)d << 1) ^ (uint32_t)(d >> 31));
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

static PyMethodDef methods[] = {
    {"varint_encode", varint_encode, METH_VARARGS,
     "varint_encode(raw, delta) -> bytes: uint32 LE ids as LEB128 varints (delta: zig-zag "
     "differences)."},
    {"varint_sizes", varint_sizes, METH_O,
     "varint_sizes(raw) -> (max_id, varint_bytes, delta_varint_bytes) of uint32 LE ids."},
    {"varint_decode", varint_decode, METH_VARARGS,
     "varint_decode(data, count, delta) -> bytes: exactly count canonical varints -> uint32 LE "
     "ids; ValueError otherwise."},
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
    return PyModule_Create(&moduledef);
}
