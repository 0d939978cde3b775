/*
 * kvstream.codec._tokens_native: the token encodings of schema v4 and the encoder's block
 * gathering in C.
 *
 * kvstream/codec/tokens.py holds the numpy references and kvstream/codec/encoder.py the
 * Python one of gather_blocks (same results, property-tested equal):
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
 *   gather_blocks(block_tuples) -> (raw, heads, plain) or None
 *       a batch's stored blocks read in one pass (encoder._gather_py; see below).
 *
 * The varint coders release the GIL on large inputs. Their loops are written so that the
 * compiler vectorises them without target flags (uint32 lanes, no loop-carried state): the
 * size estimate and the first pass of the encoder. GCC does so from -O3 (CPython's default
 * flags); VECTORISE asks for it where a build uses -O2.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

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

/* ------------------------------------------------------------------------------ gathering */

static PyObject *s_block_hash, *s_token_ids, *s_raw, *s_fields_set;

/* Where gather_blocks reads a type's attributes: per block type, whether block_hash and
 * token_ids come from the instance __dict__ (no class attribute can shadow them: pydantic
 * keeps fields there and none in the class) and the offset of its __pydantic_fields_set__
 * slot; per token type, the offset of its _raw slot. -1: use the generic lookup. Looked up
 * once per type met in a call, not per block. */
typedef struct {
    PyTypeObject *blk_type, *tok_type;
    int dict_fields;
    Py_ssize_t fields_set_off, raw_off;
} Layout;

/* The offset of the object slot (a __slots__ member) `name` of `type`, or -1. */
static Py_ssize_t
slot_offset(PyTypeObject *type, PyObject *name)
{
    PyObject *d = _PyType_Lookup(type, name);
    if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type)
        return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    return m->type == T_OBJECT_EX && !(m->flags & READONLY) ? m->offset : -1;
}

/* The value of slot `off` of `obj` (a new reference), or of obj.name when off < 0. */
static inline PyObject *
slot(PyObject *obj, Py_ssize_t off, PyObject *name)
{
    if (off < 0)
        return PyObject_GetAttr(obj, name);
    PyObject *v = *(PyObject **)((char *)obj + off);
    if (v == NULL) {
        PyErr_SetObject(PyExc_AttributeError, name);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

/* obj.name (a new reference), from the instance __dict__ when `from_dict`. */
static inline PyObject *
field(PyObject *obj, PyObject *name, int from_dict)
{
    if (from_dict) {
        PyObject *dict = PyObject_GenericGetDict(obj, NULL);
        if (dict == NULL) {
            PyErr_Clear(); /* no __dict__: the generic lookup says what is wrong */
        }
        else {
            PyObject *v = PyDict_GetItemWithError(dict, name);
            Py_XINCREF(v);
            Py_DECREF(dict);
            if (v != NULL)
                return v;
            if (PyErr_Occurred())
                return NULL;
        }
    }
    return PyObject_GetAttr(obj, name);
}

static void
layout_block(Layout *lay, PyTypeObject *type)
{
    lay->blk_type = type;
    lay->dict_fields = _PyType_Lookup(type, s_block_hash) == NULL &&
                       _PyType_Lookup(type, s_token_ids) == NULL;
    lay->fields_set_off = slot_offset(type, s_fields_set);
}

/* Append the Avro long `v` (>= 0: zig-zag 2v) at o; returns the new end. */
static inline char *
put_long(char *o, Py_ssize_t v)
{
    uint64_t z = (uint64_t)v << 1;
    while (z >= 0x80) {
        *o++ = (char)(z | 0x80);
        z >>= 7;
    }
    *o++ = (char)z;
    return o;
}

/* gather_blocks(block_tuples) -> (raw, heads, plain) or None.
 *
 * block_tuples: a list of tuples of StoredBlock (each stored event's blocks). raw: all token
 * ids (TokenIds._raw) concatenated. heads: per tuple, the StoredData fields from block_count
 * to block_sizes as Avro binary: block_count, block_hashes (the hashes joined, length-prefixed),
 * then block_size, last_block_size and a null block_sizes when every block but the last has
 * the first one's token count, else 0, 0 and the counts as an array. plain: per tuple, whether
 * every block's pydantic fields set is within {"block_hash", "token_ids"} (then every other
 * block attribute is its default). None when anything is not as expected (the caller's Python
 * path, encoder._gather_py, then does the same work and raises what it raises). */
static PyObject *
gather_blocks(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyList_CheckExact(arg))
        Py_RETURN_NONE;
    Py_ssize_t events = PyList_GET_SIZE(arg), total = 0;
    for (Py_ssize_t e = 0; e < events; e++) {
        PyObject *t = PyList_GET_ITEM(arg, e);
        if (!PyTuple_CheckExact(t))
            Py_RETURN_NONE;
        total += PyTuple_GET_SIZE(t);
    }
    PyObject **refs = PyMem_Calloc((size_t)(2 * total) + 1, sizeof(PyObject *));
    Py_ssize_t *counts = PyMem_Malloc(sizeof(Py_ssize_t) * ((size_t)total + 1));
    if (refs == NULL || counts == NULL) {
        PyMem_Free(refs);
        PyMem_Free(counts);
        return PyErr_NoMemory();
    }
    PyObject **hashes_of = refs, **raws_of = refs + total;
    PyObject *res = NULL, *raw = NULL, *heads = NULL, *plain = NULL;
    Py_ssize_t raw_len = 0, b = 0;
    int ok = 1;
    Layout lay = {NULL, NULL, 0, -1, -1};
    if ((heads = PyList_New(events)) == NULL || (plain = PyList_New(events)) == NULL)
        goto done;
    for (Py_ssize_t e = 0; e < events && ok; e++) {
        PyObject *t = PyList_GET_ITEM(arg, e);
        Py_ssize_t n = PyTuple_GET_SIZE(t), hash_len = 0;
        int is_plain = 1;
        if (n == 0) { /* not a valid Stored: the Python path reports it */
            ok = 0;
            break;
        }
        for (Py_ssize_t i = 0; i < n; i++, b++) {
            PyObject *blk = PyTuple_GET_ITEM(t, i);
            if (Py_TYPE(blk) != lay.blk_type)
                layout_block(&lay, Py_TYPE(blk));
            PyObject *h = field(blk, s_block_hash, lay.dict_fields);
            if (h == NULL || !PyBytes_CheckExact(h)) {
                Py_XDECREF(h);
                ok = 0;
                break;
            }
            hashes_of[b] = h;
            hash_len += PyBytes_GET_SIZE(h);
            PyObject *tok = field(blk, s_token_ids, lay.dict_fields);
            if (tok != NULL && Py_TYPE(tok) != lay.tok_type) {
                lay.tok_type = Py_TYPE(tok);
                lay.raw_off = slot_offset(lay.tok_type, s_raw);
            }
            PyObject *r = tok == NULL ? NULL : slot(tok, lay.raw_off, s_raw);
            Py_XDECREF(tok);
            if (r == NULL || !PyBytes_CheckExact(r) || PyBytes_GET_SIZE(r) % 4) {
                Py_XDECREF(r);
                ok = 0;
                break;
            }
            raws_of[b] = r;
            counts[b] = PyBytes_GET_SIZE(r) / 4;
            raw_len += PyBytes_GET_SIZE(r);
            if (is_plain) {
                PyObject *fs = slot(blk, lay.fields_set_off, s_fields_set);
                if (fs == NULL || !PyAnySet_Check(fs)) {
                    Py_XDECREF(fs);
                    ok = 0;
                    break;
                }
                int x = PySet_Contains(fs, s_block_hash), y = PySet_Contains(fs, s_token_ids);
                Py_ssize_t size = PySet_GET_SIZE(fs);
                Py_DECREF(fs);
                if (x < 0 || y < 0)
                    goto done;
                is_plain = x + y == size;
            }
        }
        if (!ok)
            break;
        const Py_ssize_t *c = counts + b - n;
        int regular = 1; /* every block but the last has the first one's count */
        for (Py_ssize_t i = 1; i < n - 1 && regular; i++)
            regular = c[i] == c[0];
        /* longs take at most 10 bytes: count, hash length, two sizes, array (n + 2 longs) */
        Py_ssize_t cap = hash_len + 10 * (n + 8);
        PyObject *head = PyBytes_FromStringAndSize(NULL, cap);
        if (head == NULL)
            goto done;
        char *start = PyBytes_AS_STRING(head), *o = start;
        o = put_long(o, n);
        o = put_long(o, hash_len);
        for (Py_ssize_t i = b - n; i < b; i++) {
            memcpy(o, PyBytes_AS_STRING(hashes_of[i]), PyBytes_GET_SIZE(hashes_of[i]));
            o += PyBytes_GET_SIZE(hashes_of[i]);
        }
        if (regular) {
            o = put_long(o, c[0]);
            o = put_long(o, c[n - 1]);
            *o++ = 0; /* block_sizes: null */
        }
        else {
            *o++ = 0;
            *o++ = 0;
            *o++ = 2; /* block_sizes: union branch 1, an array of n longs */
            o = put_long(o, n);
            for (Py_ssize_t i = 0; i < n; i++)
                o = put_long(o, c[i]);
            *o++ = 0;
        }
        if (_PyBytes_Resize(&head, o - start) < 0)
            goto done;
        PyList_SET_ITEM(heads, e, head);
        PyObject *flag = is_plain ? Py_True : Py_False;
        Py_INCREF(flag);
        PyList_SET_ITEM(plain, e, flag);
    }
    if (!ok) {
        PyErr_Clear();
        res = Py_None;
        Py_INCREF(res);
        goto done;
    }
    if ((raw = PyBytes_FromStringAndSize(NULL, raw_len)) == NULL)
        goto done;
    char *o = PyBytes_AS_STRING(raw);
    for (Py_ssize_t i = 0; i < total; i++) {
        memcpy(o, PyBytes_AS_STRING(raws_of[i]), PyBytes_GET_SIZE(raws_of[i]));
        o += PyBytes_GET_SIZE(raws_of[i]);
    }
    res = PyTuple_Pack(3, raw, heads, plain);
done:
    for (Py_ssize_t i = 0; i < 2 * total; i++)
        Py_XDECREF(refs[i]);
    PyMem_Free(refs);
    PyMem_Free(counts);
    Py_XDECREF(raw);
    Py_XDECREF(heads);
    Py_XDECREF(plain);
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
    {"planes_encode", planes_encode, METH_O,
     "planes_encode(raw) -> (high_bits, low16, high_planes): uint32 LE ids as bit planes."},
    {"gather_blocks", gather_blocks, METH_O,
     "gather_blocks(block_tuples) -> (raw, heads, plain) or None: a batch's stored blocks "
     "for the encoder (see kvstream.codec.encoder._gather_py)."},
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
    if ((s_block_hash = PyUnicode_InternFromString("block_hash")) == NULL ||
        (s_token_ids = PyUnicode_InternFromString("token_ids")) == NULL ||
        (s_raw = PyUnicode_InternFromString("_raw")) == NULL ||
        (s_fields_set = PyUnicode_InternFromString("__pydantic_fields_set__")) == NULL)
        return NULL;
    return PyModule_Create(&moduledef);
}
