/*
 * kvstream.engines._wire_native: the vLLM-family decoder's array loops in C.
 *
 * The fast path of kvstream/engines/vllm.py leaves a stored event's ``token_ids`` and the
 * ``block_hashes`` of every event as msgpack bytes (msgspec.Raw) and reads them here, without
 * a Python int per element:
 *
 *   u32_array(buf) -> bytes            a msgpack array of ints in 0..2**32-1 as packed uint32
 *                                      little-endian (the TokenIds layout)
 *   be64_array(buf) -> tuple[bytes]    a msgpack array of ints in 0..2**64-1, each as 8 bytes
 *                                      big-endian (64-bit block hashes)
 *   removed_run(events, start, type, levels)   a run of msgspec-decoded BlockRemoved structs
 *                                      of one group and tier: their hashes (see below)
 *   peek_rank(payload) -> int | None   a batch's data_parallel_rank, events skipped
 *   batch_columns(payload, ...)        a whole batch straight to EngineStream's columns, for
 *                                      the payloads every current engine sends (see below)
 *
 * ``buf`` is any contiguous buffer holding exactly one msgpack array (what msgspec.Raw holds).
 * Anything else (another type, a negative or too large int, a nested array, trailing bytes)
 * raises ValueError; the caller then decodes generically, which names the problem.
 * vllm.py holds the pure-Python equivalents (the reference, and the fallback).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *p, *end;
} Reader;

static inline int
need(Reader *r, Py_ssize_t n)
{
    return r->end - r->p >= n;
}

static inline uint64_t
be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    int i;

    for (i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* An array header: its length, or -1. */
static Py_ssize_t
array_header(Reader *r)
{
    unsigned char b;

    if (!need(r, 1))
        return -1;
    b = *r->p++;
    if ((b & 0xF0) == 0x90)
        return b & 0x0F;
    if (b == 0xDC && need(r, 2)) {
        r->p += 2;
        return (Py_ssize_t)be(r->p - 2, 2);
    }
    if (b == 0xDD && need(r, 4)) {
        r->p += 4;
        return (Py_ssize_t)be(r->p - 4, 4);
    }
    return -1;
}

/* A non-negative int (any msgpack int encoding); 0 on success, -1 otherwise. */
static inline int
read_uint(Reader *r, uint64_t *v)
{
    unsigned char b;
    int n;

    if (!need(r, 1))
        return -1;
    b = *r->p++;
    if (b < 0x80) {
        *v = b;
        return 0;
    }
    switch (b) {
    case 0xCC: case 0xD0: n = 1; break;
    case 0xCD: case 0xD1: n = 2; break;
    case 0xCE: case 0xD2: n = 4; break;
    case 0xCF: case 0xD3: n = 8; break;
    default: return -1;
    }
    if (!need(r, n))
        return -1;
    if (b >= 0xD0 && (r->p[0] & 0x80)) /* a negative signed int */
        return -1;
    *v = be(r->p, n);
    r->p += n;
    return 0;
}

static int
open_buffer(PyObject *obj, Py_buffer *view, Reader *r)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    r->p = (const unsigned char *)view->buf;
    r->end = r->p + view->len;
    return 0;
}

static PyObject *
not_an_array(Py_buffer *view, const char *what)
{
    PyBuffer_Release(view);
    PyErr_Format(PyExc_ValueError, "not a msgpack array of %s", what);
    return NULL;
}

static PyObject *
u32_array(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    Reader r;
    Py_ssize_t n, i;
    PyObject *out;
    unsigned char *q;

    if (open_buffer(arg, &view, &r) < 0)
        return NULL;
    n = array_header(&r);
    /* every element takes at least one byte: a length beyond the buffer is malformed */
    if (n < 0 || n > r.end - r.p)
        return not_an_array(&view, "uint32");
    out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    q = (unsigned char *)PyBytes_AS_STRING(out);
    for (i = 0; i < n; i++) {
        uint64_t v;

        if (read_uint(&r, &v) < 0 || v > 0xFFFFFFFFu) {
            Py_DECREF(out);
            return not_an_array(&view, "uint32");
        }
        q[0] = (unsigned char)v;
        q[1] = (unsigned char)(v >> 8);
        q[2] = (unsigned char)(v >> 16);
        q[3] = (unsigned char)(v >> 24);
        q += 4;
    }
    if (r.p != r.end) {
        Py_DECREF(out);
        return not_an_array(&view, "uint32");
    }
    PyBuffer_Release(&view);
    return out;
}

static inline PyObject *
be8(uint64_t v)
{
    unsigned char buf[8];
    int k;

    for (k = 7; k >= 0; k--) {
        buf[k] = (unsigned char)v;
        v >>= 8;
    }
    return PyBytes_FromStringAndSize((const char *)buf, 8);
}

static PyObject *
be64_array(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    Reader r;
    Py_ssize_t n, i;
    PyObject *out;

    if (open_buffer(arg, &view, &r) < 0)
        return NULL;
    n = array_header(&r);
    if (n < 0 || n > r.end - r.p)
        return not_an_array(&view, "uint64");
    out = PyTuple_New(n);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    for (i = 0; i < n; i++) {
        uint64_t v;
        PyObject *b;

        if (read_uint(&r, &v) < 0) {
            Py_DECREF(out);
            return not_an_array(&view, "uint64");
        }
        b = be8(v);
        if (b == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, b);
    }
    if (r.p != r.end) {
        Py_DECREF(out);
        return not_an_array(&view, "uint64");
    }
    PyBuffer_Release(&view);
    return out;
}

/* removed_run(events, start, removed_type, levels) -> (end, hashes, group, level) | None
 *
 * The longest run of events[start:] that are ``removed_type`` structs with the same layer
 * group and cache level, read as EngineStream._fast_columns reads them: ``group_idx`` None or
 * an int in 0..2**31-1, ``medium`` None or a key of ``levels`` (exact case), ``locality``
 * None, ``block_hashes`` a non-empty msgpack array of uint64s. The run stops before the
 * first event that is anything else (the caller reads that one itself); None when it would be
 * empty. ``hashes`` is a new list of every hash, 8 bytes big-endian, in order. */
static PyObject *
removed_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static PyObject *s_group = NULL, *s_medium, *s_locality, *s_hashes;
    PyObject *events, *type, *levels, *hashes = NULL, *first_level = NULL;
    Py_ssize_t start, i, n;
    long group0 = -1;

    if (nargs != 4 || !PyList_Check(args[0]) || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "removed_run(events: list, start, type, levels: dict)");
        return NULL;
    }
    if (s_group == NULL) {
        s_group = PyUnicode_InternFromString("group_idx");
        s_medium = PyUnicode_InternFromString("medium");
        s_locality = PyUnicode_InternFromString("locality");
        s_hashes = PyUnicode_InternFromString("block_hashes");
        if (!s_group || !s_medium || !s_locality || !s_hashes)
            return NULL;
    }
    events = args[0];
    type = args[2];
    levels = args[3];
    start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    n = PyList_GET_SIZE(events);
    for (i = start < 0 ? n : start; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i), *v, *level, *raw;
        long group;
        Py_buffer view;
        Reader r;
        Py_ssize_t k, count;
        int bad = 0;

        if ((PyObject *)Py_TYPE(ev) != type)
            break;
        v = PyObject_GetAttr(ev, s_locality);
        if (v == NULL)
            goto error;
        Py_DECREF(v);
        if (v != Py_None)
            break;
        v = PyObject_GetAttr(ev, s_group);
        if (v == NULL)
            goto error;
        if (v == Py_None)
            group = 0;
        else if (PyLong_CheckExact(v)) {
            int overflow;

            group = PyLong_AsLongAndOverflow(v, &overflow);
            if (overflow || group < 0 || group >= (1L << 31))
                bad = 1;
        } else
            bad = 1;
        Py_DECREF(v);
        if (bad)
            break;
        v = PyObject_GetAttr(ev, s_medium);
        if (v == NULL)
            goto error;
        if (v == Py_None)
            level = Py_None;
        else {
            level = PyUnicode_CheckExact(v) ? PyDict_GetItemWithError(levels, v) : NULL;
            if (level == NULL && PyErr_Occurred()) {
                Py_DECREF(v);
                goto error;
            }
        }
        Py_DECREF(v);
        if (level == NULL)
            break;
        if (first_level == NULL) {
            group0 = group;
            first_level = level;
        } else if (group != group0
                   || (level != first_level
                       && (level == Py_None || first_level == Py_None
                           || PyObject_RichCompareBool(level, first_level, Py_EQ) != 1)))
            break;
        raw = PyObject_GetAttr(ev, s_hashes);
        if (raw == NULL)
            goto error;
        if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) {
            Py_DECREF(raw);
            PyErr_Clear();
            break;
        }
        r.p = (const unsigned char *)view.buf;
        r.end = r.p + view.len;
        count = array_header(&r);
        if (count <= 0 || count > r.end - r.p)
            bad = 1;
        if (!bad && hashes == NULL && (hashes = PyList_New(0)) == NULL) {
            PyBuffer_Release(&view);
            Py_DECREF(raw);
            goto error;
        }
        {
            Py_ssize_t before = bad ? 0 : PyList_GET_SIZE(hashes);

            for (k = 0; !bad && k < count; k++) {
                uint64_t h;
                PyObject *b;

                if (read_uint(&r, &h) < 0) {
                    bad = 1;
                    break;
                }
                b = be8(h);
                if (b == NULL || PyList_Append(hashes, b) < 0) {
                    Py_XDECREF(b);
                    PyBuffer_Release(&view);
                    Py_DECREF(raw);
                    goto error;
                }
                Py_DECREF(b);
            }
            if (!bad && r.p != r.end)
                bad = 1;
            if (bad && hashes != NULL
                && PyList_SetSlice(hashes, before, PyList_GET_SIZE(hashes), NULL) < 0) {
                PyBuffer_Release(&view);
                Py_DECREF(raw);
                goto error;
            }
        }
        PyBuffer_Release(&view);
        Py_DECREF(raw);
        if (bad)
            break;
    }
    if (hashes == NULL || i == start) {
        Py_XDECREF(hashes);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(nNlO)", i, hashes, group0, first_level);
error:
    Py_XDECREF(hashes);
    return NULL;
}


/* ------------------------------------------------------------------ whole payloads
 *
 * batch_columns(payload, next_id, windows, levels, external, unbounded) -> tuple | None
 *
 * One vLLM-family ``KVEventBatch`` payload read straight into the columns
 * EngineStream._fast_columns builds from msgspec's structs, for the payloads every current
 * engine sends: ``[ts (float), events, data_parallel_rank (None or an int >= 0)?]`` whose
 * events are maps of ASCII keys, each a BlockStored / BlockRemoved / AllBlocksCleared with
 * only the fields its struct declares (kvstream/engines/_wire_structs.py), uint64 hashes,
 * uint32 token ids, ASCII strings, and none of the optional values that need Python's rules
 * (lora id/name, cache salt, non-empty extra keys, the ``Any`` fields not nil, a hash as
 * bytes or a negative int). Anything else gives None, before any state changed: the caller
 * then decodes through msgspec's structs, which names the problem or takes the value.
 *
 * ``windows`` (layer group -> window) is updated in place, as _fast_columns updates its copy;
 * ``levels`` maps upper-case ``medium`` names to cache levels; ``external`` is the level of
 * ``locality: "REMOTE"``; ``unbounded`` the window of a group that named none. Returns
 * ``(ts, rank, event_ids, kinds, group_ids, window_sizes, payloads, stored_extra, tokens,
 * next_id, token_layout)`` with the same values and shapes _fast_columns gives them, and each
 * stored event's (first token's index in tokens, block sizes): every one is plain.
 *
 * ``into`` (optional): ``[ids, kinds, groups, windows, payloads, extra, layout, tokens]``, 7
 * lists and a bytearray holding earlier payloads' columns of the same stream: this payload's
 * columns are appended to them (token indexes in the layout counting from the bytearray's
 * start) and ``(ts, rank, next_id)`` returned. On None or an error, the lists, the bytearray
 * and ``windows`` are as they were before the call: one burst of payloads becomes one batch,
 * and a payload outside the subset ends it. ``rank`` (optional, after ``into``): the payload
 * must name that ``data_parallel_rank`` (None: none), else None as for a payload outside
 * the subset. */

enum { K_STORED = 1, K_REMOVED = 2, K_CLEARED = 4 };

/* The fields of the three structs, as bits. */
enum {
    F_TYPE = 0, F_HASHES, F_TOKENS, F_PARENT, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA_KEYS, F_GROUP, F_SPEC_KIND, F_WINDOW, F_LOCALITY, F_SALT, F_OWNERSHIP, F_SESSION,
    F_LOOKAHEAD, F_COUNT
};
static const char *const field_names[F_COUNT] = {
    "type", "block_hashes", "token_ids", "parent_block_hash", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "cache_salt", "ownership", "session_id",
    "lookahead_token_ids",
};
static const Py_ssize_t field_lens[F_COUNT] = {4, 12, 9, 17, 10, 7, 6, 9, 10, 9, 18, 28, 8, 10, 9, 10, 19};
#define BIT(f) (1u << (f))
#define STORED_FIELDS (BIT(F_COUNT) - 1u)
#define REMOVED_FIELDS                                                                       \
    (BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP) | BIT(F_LOCALITY)             \
     | BIT(F_OWNERSHIP))

/* A msgspec str (ASCII only here: a non-ASCII one goes the msgspec way, which checks UTF-8). */
static int
read_ascii(Reader *r, const unsigned char **s, Py_ssize_t *n)
{
    unsigned char b;
    Py_ssize_t len, i;

    if (!need(r, 1))
        return -1;
    b = *r->p++;
    if ((b & 0xE0) == 0xA0)
        len = b & 0x1F;
    else if (b == 0xD9 && need(r, 1))
        len = (Py_ssize_t)be(r->p++, 1);
    else if (b == 0xDA && need(r, 2)) {
        len = (Py_ssize_t)be(r->p, 2);
        r->p += 2;
    } else if (b == 0xDB && need(r, 4)) {
        len = (Py_ssize_t)be(r->p, 4);
        r->p += 4;
    } else
        return -1;
    if (!need(r, len))
        return -1;
    for (i = 0; i < len; i++)
        if (r->p[i] & 0x80)
            return -1;
    *s = r->p;
    *n = len;
    r->p += len;
    return 0;
}

static inline int
is_nil(Reader *r)
{
    if (need(r, 1) && *r->p == 0xC0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* A map header: its length, or -1. */
static Py_ssize_t
map_header(Reader *r)
{
    unsigned char b;

    if (!need(r, 1))
        return -1;
    b = *r->p++;
    if ((b & 0xF0) == 0x80)
        return b & 0x0F;
    if (b == 0xDE && need(r, 2)) {
        r->p += 2;
        return (Py_ssize_t)be(r->p - 2, 2);
    }
    if (b == 0xDF && need(r, 4)) {
        r->p += 4;
        return (Py_ssize_t)be(r->p - 4, 4);
    }
    return -1;
}

/* Skip one msgpack value (for peek_rank); 0, or -1 when malformed or nested too deep. */
static int
skip_value(Reader *r, int depth)
{
    unsigned char b;
    Py_ssize_t n = 0, i;
    int items = 0; /* 1: n values follow, 2: n key/value pairs follow */

    if (depth > 64 || !need(r, 1))
        return -1;
    b = *r->p++;
    if (b < 0x80 || b >= 0xE0 || b == 0xC0 || b == 0xC2 || b == 0xC3)
        return 0;
    if ((b & 0xF0) == 0x80) {
        n = b & 0x0F;
        items = 2;
    } else if ((b & 0xF0) == 0x90) {
        n = b & 0x0F;
        items = 1;
    } else if ((b & 0xE0) == 0xA0) {
        n = b & 0x1F;
    } else {
        switch (b) {
        case 0xCC: case 0xD0: n = 1; break;
        case 0xCD: case 0xD1: n = 2; break;
        case 0xCA: case 0xCE: case 0xD2: n = 4; break;
        case 0xCB: case 0xCF: case 0xD3: n = 8; break;
        case 0xD4: n = 2; break;
        case 0xD5: n = 3; break;
        case 0xD6: n = 5; break;
        case 0xD7: n = 9; break;
        case 0xD8: n = 17; break;
        case 0xC4: case 0xD9:
            if (!need(r, 1)) return -1;
            n = (Py_ssize_t)be(r->p, 1); r->p += 1; break;
        case 0xC5: case 0xDA:
            if (!need(r, 2)) return -1;
            n = (Py_ssize_t)be(r->p, 2); r->p += 2; break;
        case 0xC6: case 0xDB:
            if (!need(r, 4)) return -1;
            n = (Py_ssize_t)be(r->p, 4); r->p += 4; break;
        case 0xC7:
            if (!need(r, 1)) return -1;
            n = (Py_ssize_t)be(r->p, 1) + 1; r->p += 1; break;
        case 0xC8:
            if (!need(r, 2)) return -1;
            n = (Py_ssize_t)be(r->p, 2) + 1; r->p += 2; break;
        case 0xC9:
            if (!need(r, 4)) return -1;
            n = (Py_ssize_t)be(r->p, 4) + 1; r->p += 4; break;
        case 0xDC: case 0xDE:
            if (!need(r, 2)) return -1;
            n = (Py_ssize_t)be(r->p, 2); r->p += 2; items = b == 0xDC ? 1 : 2; break;
        case 0xDD: case 0xDF:
            if (!need(r, 4)) return -1;
            n = (Py_ssize_t)be(r->p, 4); r->p += 4; items = b == 0xDD ? 1 : 2; break;
        default: return -1; /* 0xC1, never used */
        }
    }
    if (!items) {
        if (!need(r, n))
            return -1;
        r->p += n;
        return 0;
    }
    if (n > r->end - r->p) /* every value takes a byte at least */
        return -1;
    for (i = 0; i < n * items; i++) {
        /* scalars inline (token and hash arrays are long runs of ints) */
        unsigned char c;

        if (!need(r, 1))
            return -1;
        c = *r->p;
        if (c < 0x80 || c >= 0xE0 || c == 0xC0 || c == 0xC2 || c == 0xC3) {
            r->p++;
            continue;
        }
        if ((c >= 0xCC && c <= 0xCF) || (c >= 0xD0 && c <= 0xD3)) {
            Py_ssize_t k = (Py_ssize_t)1 << (c & 3);

            if (!need(r, 1 + k))
                return -1;
            r->p += 1 + k;
            continue;
        }
        if (skip_value(r, depth + 1) < 0)
            return -1;
    }
    return 0;
}

/* Any msgpack int as int64 (uint64 above INT64_MAX refused); 0, or -1. */
static int
read_int(Reader *r, int64_t *v)
{
    unsigned char b;
    uint64_t u;

    if (!need(r, 1))
        return -1;
    b = *r->p;
    if (b >= 0xE0) {
        r->p++;
        *v = (int64_t)(int8_t)b;
        return 0;
    }
    if (b >= 0xD0 && b <= 0xD3) {
        int n = 1 << (b - 0xD0);

        if (!need(r, 1 + n))
            return -1;
        u = be(r->p + 1, n);
        r->p += 1 + n;
        if (n < 8 && (u >> (8 * n - 1)) & 1) /* sign-extend */
            u |= ~(uint64_t)0 << (8 * n);
        *v = (int64_t)u;
        return 0;
    }
    if (read_uint(r, &u) < 0 || u > (uint64_t)INT64_MAX)
        return -1;
    *v = (int64_t)u;
    return 0;
}

/* peek_rank(payload) -> int | None: a batch's data_parallel_rank (None when it has none),
 * read without decoding the events; ValueError when the payload is not a 2- or 3-array or
 * the rank is not None or an int >= 0 (the decoder then says why). */
static PyObject *
peek_rank(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    Reader r;
    Py_ssize_t n;
    int64_t rank;

    if (open_buffer(arg, &view, &r) < 0)
        return NULL;
    n = array_header(&r);
    if ((n != 2 && n != 3) || skip_value(&r, 0) < 0 || skip_value(&r, 0) < 0)
        goto bad;
    if (n == 2 || is_nil(&r)) {
        if (r.p != r.end)
            goto bad;
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    if (read_int(&r, &rank) < 0 || rank < 0 || r.p != r.end)
        goto bad;
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(rank);
bad:
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "not a [ts, events, data_parallel_rank] batch");
    return NULL;
}

typedef struct {
    /* where each field's value starts, 0 when absent */
    const unsigned char *at[F_COUNT];
    int kind;
} EventFields;

/* One event map's fields by name; 0, or -1 when it is outside the fast subset. */
static int
read_fields(Reader *r, EventFields *ev)
{
    Py_ssize_t n = map_header(r), i;
    unsigned int seen = 0, allowed;
    int f;

    if (n < 1 || n > F_COUNT)
        return -1;
    memset(ev, 0, sizeof(*ev));
    for (i = 0; i < n; i++) {
        const unsigned char *key;
        Py_ssize_t len;

        if (read_ascii(r, &key, &len) < 0)
            return -1;
        for (f = 0; f < F_COUNT; f++)
            if (field_lens[f] == len && key[0] == (unsigned char)field_names[f][0]
                && memcmp(field_names[f], key, len) == 0)
                break;
        if (f == F_COUNT || (seen & BIT(f)))
            return -1;
        seen |= BIT(f);
        ev->at[f] = r->p;
        if (skip_value(r, 1) < 0)
            return -1;
    }
    if (!ev->at[F_TYPE])
        return -1;
    {
        Reader t = {ev->at[F_TYPE], r->end};
        const unsigned char *s;
        Py_ssize_t len;

        if (read_ascii(&t, &s, &len) < 0)
            return -1;
        if (len == 11 && memcmp(s, "BlockStored", 11) == 0) {
            ev->kind = K_STORED;
            allowed = STORED_FIELDS;
            if (!ev->at[F_TOKENS])
                return -1;
        } else if (len == 12 && memcmp(s, "BlockRemoved", 12) == 0) {
            ev->kind = K_REMOVED;
            allowed = REMOVED_FIELDS;
        } else if (len == 16 && memcmp(s, "AllBlocksCleared", 16) == 0) {
            ev->kind = K_CLEARED;
            allowed = BIT(F_TYPE);
        } else
            return -1;
    }
    if ((seen & ~allowed) || (ev->kind != K_CLEARED && !ev->at[F_HASHES]))
        return -1;
    return 0;
}

/* A value of an ``Any`` field that msgspec takes without a question: nil, a bool, an int, a
 * float, an ASCII string, bytes, or an array of such (no maps, no extension types). */
static int
plain_value(Reader *r, int depth)
{
    unsigned char b;
    Py_ssize_t n, i;
    const unsigned char *s;

    if (depth > 8 || !need(r, 1))
        return -1;
    b = *r->p;
    if (b == 0xC0 || b == 0xC2 || b == 0xC3) {
        r->p++;
        return 0;
    }
    if (b < 0x80 || b >= 0xE0 || (b >= 0xC4 && b <= 0xC6) || (b >= 0xCA && b <= 0xD3))
        return skip_value(r, 0); /* ints, floats, bytes */
    if ((b & 0xE0) == 0xA0 || (b >= 0xD9 && b <= 0xDB))
        return read_ascii(r, &s, &n);
    n = array_header(r);
    if (n < 0 || n > r->end - r->p)
        return -1;
    for (i = 0; i < n; i++)
        if (plain_value(r, depth + 1) < 0)
            return -1;
    return 0;
}

/* An ``Any`` field, absent or plain. */
static int
plain_or_absent(const EventFields *ev, int f, const unsigned char *end)
{
    Reader t;

    if (!ev->at[f])
        return 1;
    t.p = ev->at[f];
    t.end = end;
    return plain_value(&t, 0) == 0;
}

/* A field that must be nil when present (the values that need Python's rules). */
static int
nil_or_absent(const EventFields *ev, int f, const unsigned char *end)
{
    return !ev->at[f] || (ev->at[f] < end && *ev->at[f] == 0xC0);
}

/* An optional int field: 1 and *v when set, 0 when nil or absent, -1 when not an int. */
static int
opt_int(const EventFields *ev, int f, const unsigned char *end, int64_t *v)
{
    Reader t;

    if (nil_or_absent(ev, f, end))
        return 0;
    t.p = ev->at[f];
    t.end = end;
    return read_int(&t, v) < 0 ? -1 : 1;
}

/* The cache level of an event (Py_None or a borrowed level from ``levels``); NULL with no
 * error set when outside the subset, NULL with an error on failure. */
static PyObject *
event_level(const EventFields *ev, const unsigned char *end, PyObject *levels,
            PyObject *external)
{
    PyObject *level = Py_None;

    if (!nil_or_absent(ev, F_MEDIUM, end)) {
        Reader t = {ev->at[F_MEDIUM], end};
        const unsigned char *s;
        Py_ssize_t len, i;
        char up[32];
        PyObject *name;

        if (read_ascii(&t, &s, &len) < 0 || len >= (Py_ssize_t)sizeof(up))
            return NULL;
        for (i = 0; i < len; i++)
            up[i] = (char)(s[i] >= 'a' && s[i] <= 'z' ? s[i] - 32 : s[i]);
        name = PyUnicode_FromStringAndSize(up, len);
        if (name == NULL)
            return NULL;
        level = PyDict_GetItemWithError(levels, name);
        Py_DECREF(name);
        if (level == NULL)
            return NULL;
    }
    if (!nil_or_absent(ev, F_LOCALITY, end)) {
        Reader t = {ev->at[F_LOCALITY], end};
        const unsigned char *s;
        Py_ssize_t len;

        if (read_ascii(&t, &s, &len) < 0)
            return NULL;
        if (len == 6 && PyOS_strnicmp((const char *)s, "REMOTE", 6) == 0)
            level = external;
    }
    return level;
}

/* The hashes of an event as a new list of 8-byte big-endian bytes; NULL with no error when
 * they are not a non-empty array of uint64s. */
static PyObject *
event_hashes(const unsigned char *at, const unsigned char *end)
{
    Reader t = {at, end};
    Py_ssize_t n = array_header(&t), i;
    PyObject *out;

    if (n <= 0 || n > t.end - t.p)
        return NULL;
    out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        uint64_t v;
        PyObject *b;

        if (read_uint(&t, &v) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        b = be8(v);
        if (b == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, b);
    }
    return out;
}

typedef struct {
    PyObject *ids, *kinds, *groups, *windows, *payloads, *extra, *layout;
    PyObject *known, *unbounded;
    long long next_id;
} Columns;

static int
append_new(PyObject *list, PyObject *item)
{
    int rc;

    if (item == NULL)
        return -1;
    rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* ids, kinds, groups for one event; the window is appended by the caller. */
static int
add_event(Columns *c, int kind, long group)
{
    if (append_new(c->ids, PyLong_FromLongLong(c->next_id++)) < 0
        || append_new(c->kinds, PyLong_FromLong(kind)) < 0
        || append_new(c->groups, PyLong_FromLong(group)) < 0)
        return -1;
    return 0;
}

/* known.setdefault(group, unbounded), appended to windows. */
static int
add_window_default(Columns *c, long group)
{
    PyObject *g = PyLong_FromLong(group), *w;
    int rc;

    if (g == NULL)
        return -1;
    w = PyDict_SetDefault(c->known, g, c->unbounded);
    Py_DECREF(g);
    if (w == NULL)
        return -1;
    Py_INCREF(w);
    rc = PyList_Append(c->windows, w);
    Py_DECREF(w);
    return rc;
}

/* The removal run collected so far becomes one event. */
static int
flush_run(Columns *c, PyObject **run, long group, PyObject *level)
{
    PyObject *payload;

    if (*run == NULL)
        return 0;
    if (add_event(c, K_REMOVED, group) < 0 || add_window_default(c, group) < 0)
        return -1;
    payload = PyTuple_Pack(2, *run, level);
    Py_CLEAR(*run);
    return append_new(c->payloads, payload);
}

static PyObject *
batch_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Reader r;
    Py_ssize_t n_top, n_events, e;
    double ts;
    PyObject *rank = NULL, *levels, *external, *result = NULL, *run = NULL, *tokens = NULL;
    PyObject *run_level = NULL;
    long run_group = -1;
    Columns c = {0};
    char *tok = NULL;
    Py_ssize_t tok_len = 0, tok_cap = 0, tok_base = 0, i0;
    /* with ``into``: the lists appended to, their lengths before, the windows before */
    PyObject *into_lists[7] = {NULL}, *tok_out = NULL, *known0 = NULL;
    Py_ssize_t into_len[7] = {0}, tok_out_len = 0;
    int ok = 0;

    if (nargs < 6 || nargs > 8 || !PyDict_Check(args[2]) || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "batch_columns(payload, next_id, windows: dict, "
                                         "levels: dict, external, unbounded[, into[, rank]])");
        return NULL;
    }
    if (nargs >= 7 && args[6] != Py_None) {
        PyObject *into = args[6];

        if (!PyList_CheckExact(into) || PyList_GET_SIZE(into) != 8
            || !PyByteArray_CheckExact(PyList_GET_ITEM(into, 7))) {
            PyErr_SetString(PyExc_TypeError, "batch_columns: into must be a list of 7 lists "
                                             "and a bytearray");
            return NULL;
        }
        for (i0 = 0; i0 < 7; i0++) {
            if (!PyList_CheckExact(PyList_GET_ITEM(into, i0))) {
                PyErr_SetString(PyExc_TypeError, "batch_columns: into must be a list of 7 "
                                                 "lists and a bytearray");
                return NULL;
            }
            into_lists[i0] = PyList_GET_ITEM(into, i0);
            into_len[i0] = PyList_GET_SIZE(into_lists[i0]);
        }
        tok_out = PyList_GET_ITEM(into, 7);
        tok_out_len = PyByteArray_GET_SIZE(tok_out);
        if (tok_out_len % 4 != 0) {
            PyErr_SetString(PyExc_ValueError, "batch_columns: into's tokens are not uint32s");
            return NULL;
        }
        tok_base = tok_out_len / 4;
    }
    c.next_id = PyLong_AsLongLong(args[1]);
    if (c.next_id == -1 && PyErr_Occurred())
        return NULL;
    c.known = args[2];
    levels = args[3];
    external = args[4];
    c.unbounded = args[5];
    if (tok_out != NULL && (known0 = PyDict_Copy(c.known)) == NULL)
        return NULL;
    if (open_buffer(args[0], &view, &r) < 0) {
        Py_XDECREF(known0);
        return NULL;
    }
    n_top = array_header(&r);
    if (n_top != 2 && n_top != 3)
        goto done;
    if (!need(&r, 1))
        goto done;
    if (*r.p == 0xCB && need(&r, 9)) {
        uint64_t bits = be(r.p + 1, 8);

        memcpy(&ts, &bits, 8);
        r.p += 9;
    } else if (*r.p == 0xCA && need(&r, 5)) {
        uint32_t bits = (uint32_t)be(r.p + 1, 4);
        float f;

        memcpy(&f, &bits, 4);
        ts = f;
        r.p += 5;
    } else
        goto done;
    n_events = array_header(&r);
    if (n_events < 0 || n_events > r.end - r.p)
        goto done;
    if (tok_out != NULL) {
        c.ids = Py_NewRef(into_lists[0]);
        c.kinds = Py_NewRef(into_lists[1]);
        c.groups = Py_NewRef(into_lists[2]);
        c.windows = Py_NewRef(into_lists[3]);
        c.payloads = Py_NewRef(into_lists[4]);
        c.extra = Py_NewRef(into_lists[5]);
        c.layout = Py_NewRef(into_lists[6]);
    } else if (!(c.ids = PyList_New(0)) || !(c.kinds = PyList_New(0))
               || !(c.groups = PyList_New(0)) || !(c.windows = PyList_New(0))
               || !(c.payloads = PyList_New(0)) || !(c.extra = PyList_New(0))
               || !(c.layout = PyList_New(0)))
        goto error;
    for (e = 0; e < n_events; e++) {
        EventFields ev;
        int64_t group = 0;
        PyObject *level, *hashes;
        int got;

        if (read_fields(&r, &ev) < 0)
            goto done;
        if (ev.kind == K_CLEARED) {
            PyObject *groups;
            Py_ssize_t i, ng;

            if (flush_run(&c, &run, run_group, run_level) < 0)
                goto error;
            groups = PyDict_Keys(c.known);
            if (groups == NULL || PyList_Sort(groups) < 0) {
                Py_XDECREF(groups);
                goto error;
            }
            ng = PyList_GET_SIZE(groups);
            for (i = 0; i < (ng ? ng : 1); i++) {
                long g = ng ? PyLong_AsLong(PyList_GET_ITEM(groups, i)) : 0;
                PyObject *w;

                if ((g == -1 && PyErr_Occurred()) || add_event(&c, K_CLEARED, g) < 0) {
                    Py_DECREF(groups);
                    goto error;
                }
                w = ng ? PyDict_GetItemWithError(c.known, PyList_GET_ITEM(groups, i)) : NULL;
                if (w == NULL && PyErr_Occurred()) {
                    Py_DECREF(groups);
                    goto error;
                }
                if (PyList_Append(c.windows, w ? w : c.unbounded) < 0
                    || PyList_Append(c.payloads, Py_None) < 0) {
                    Py_DECREF(groups);
                    goto error;
                }
            }
            Py_DECREF(groups);
            continue;
        }
        got = opt_int(&ev, F_GROUP, r.end, &group);
        if (got < 0 || group < 0 || group >= (1LL << 31))
            goto done;
        if (!plain_or_absent(&ev, F_OWNERSHIP, r.end))
            goto done;
        level = event_level(&ev, r.end, levels, external);
        if (level == NULL) {
            if (PyErr_Occurred())
                goto error;
            goto done;
        }
        if (ev.kind == K_REMOVED) {
            int same = run != NULL && run_group == group
                       && (run_level == level
                           || (run_level != Py_None && level != Py_None
                               && PyObject_RichCompareBool(run_level, level, Py_EQ) == 1));

            hashes = event_hashes(ev.at[F_HASHES], r.end);
            if (hashes == NULL) {
                if (PyErr_Occurred())
                    goto error;
                goto done;
            }
            if (same) {
                Py_ssize_t at = PyList_GET_SIZE(run);
                int rc = PyList_SetSlice(run, at, at, hashes);

                Py_DECREF(hashes);
                if (rc < 0)
                    goto error;
            } else {
                if (flush_run(&c, &run, run_group, run_level) < 0) {
                    Py_DECREF(hashes);
                    goto error;
                }
                run = hashes;
                run_group = (long)group;
                run_level = level;
            }
            continue;
        }
        /* BlockStored */
        {
            int64_t block_size = 0, window = 0;
            int has_window;
            PyObject *parent = Py_None, *sizes = NULL, *payload, *first_obj, *lv;
            Py_ssize_t n, n_tok, i;
            long long first, last = 0;
            Reader t;

            if (!nil_or_absent(&ev, F_LORA_ID, r.end) || !nil_or_absent(&ev, F_LORA_NAME, r.end)
                || !nil_or_absent(&ev, F_SALT, r.end) || !plain_or_absent(&ev, F_SESSION, r.end)
                || !plain_or_absent(&ev, F_LOOKAHEAD, r.end))
                goto done;
            if (!nil_or_absent(&ev, F_SPEC_KIND, r.end)) {
                const unsigned char *s;
                Py_ssize_t len;

                t.p = ev.at[F_SPEC_KIND];
                t.end = r.end;
                if (read_ascii(&t, &s, &len) < 0)
                    goto done;
            }
            has_window = opt_int(&ev, F_WINDOW, r.end, &window);
            if (has_window < 0 || (has_window && window < 1))
                goto done;
            if (opt_int(&ev, F_BLOCK_SIZE, r.end, &block_size) < 0 || block_size < 0)
                goto done;
            if (ev.at[F_BLOCK_SIZE] && *ev.at[F_BLOCK_SIZE] == 0xC0)
                goto done; /* block_size: int, never None */
            hashes = event_hashes(ev.at[F_HASHES], r.end);
            if (hashes == NULL) {
                if (PyErr_Occurred())
                    goto error;
                goto done;
            }
            n = PyList_GET_SIZE(hashes);
            if (!nil_or_absent(&ev, F_EXTRA_KEYS, r.end)) { /* n nils: no extra keys */
                Py_ssize_t k;

                t.p = ev.at[F_EXTRA_KEYS];
                t.end = r.end;
                if (array_header(&t) != n) {
                    Py_DECREF(hashes);
                    goto done;
                }
                for (k = 0; k < n; k++)
                    if (!is_nil(&t)) {
                        Py_DECREF(hashes);
                        goto done;
                    }
            }
            if (!nil_or_absent(&ev, F_PARENT, r.end)) {
                uint64_t ph;

                t.p = ev.at[F_PARENT];
                t.end = r.end;
                if (read_uint(&t, &ph) < 0) {
                    Py_DECREF(hashes);
                    goto done;
                }
                if ((parent = be8(ph)) == NULL) {
                    Py_DECREF(hashes);
                    goto error;
                }
            } else
                Py_INCREF(parent);
            /* token ids: packed uint32 little-endian, appended to the batch's tokens */
            t.p = ev.at[F_TOKENS];
            t.end = r.end;
            n_tok = array_header(&t);
            if (n_tok < 0 || n_tok > t.end - t.p
                || (n_tok > 0 && (block_size == 0 || (last = n_tok - (n - 1) * block_size) <= 0
                                  || last > block_size))) {
                Py_DECREF(hashes);
                Py_DECREF(parent);
                goto done;
            }
            if (tok_len + 4 * n_tok > tok_cap) {
                Py_ssize_t cap = (tok_cap ? tok_cap * 2 : 4096);
                char *grown;

                while (cap < tok_len + 4 * n_tok)
                    cap *= 2;
                grown = PyMem_Realloc(tok, cap);
                if (grown == NULL) {
                    Py_DECREF(hashes);
                    Py_DECREF(parent);
                    PyErr_NoMemory();
                    goto error;
                }
                tok = grown;
                tok_cap = cap;
            }
            for (i = 0; i < n_tok; i++) {
                uint64_t v32;
                unsigned char *q = (unsigned char *)tok + tok_len + 4 * i;

                if (read_uint(&t, &v32) < 0 || v32 > 0xFFFFFFFFu) {
                    Py_DECREF(hashes);
                    Py_DECREF(parent);
                    goto done;
                }
                q[0] = (unsigned char)v32;
                q[1] = (unsigned char)(v32 >> 8);
                q[2] = (unsigned char)(v32 >> 16);
                q[3] = (unsigned char)(v32 >> 24);
            }
            tok_len += 4 * n_tok;
            /* from here on the event is taken */
            if (flush_run(&c, &run, run_group, run_level) < 0)
                goto stored_error;
            sizes = PyList_New(n);
            if (sizes == NULL)
                goto stored_error;
            for (i = 0; i < n; i++) {
                PyObject *sz = PyLong_FromLongLong(
                    n_tok == 0 ? 0 : (i == n - 1 ? last : block_size));

                if (sz == NULL)
                    goto stored_error;
                PyList_SET_ITEM(sizes, i, sz);
            }
            first = n_tok == 0 ? 0 : (n > 1 ? block_size : last);
            if (add_event(&c, K_STORED, (long)group) < 0)
                goto stored_error;
            {
                PyObject *g = PyLong_FromLong((long)group);

                if (g == NULL)
                    goto stored_error;
                if (has_window) {
                    PyObject *w = PyLong_FromLongLong(window);

                    if (w == NULL || PyDict_SetItem(c.known, g, w) < 0
                        || PyList_Append(c.windows, w) < 0) {
                        Py_XDECREF(w);
                        Py_DECREF(g);
                        goto stored_error;
                    }
                    Py_DECREF(w);
                    Py_DECREF(g);
                } else {
                    Py_DECREF(g);
                    if (add_window_default(&c, (long)group) < 0)
                        goto stored_error;
                }
            }
            lv = level == Py_None ? PyLong_FromLong(0) : Py_NewRef(level);
            first_obj = PyLong_FromLongLong(first);
            payload = (lv && first_obj) ? PyTuple_Pack(4, parent, hashes, lv, first_obj) : NULL;
            Py_XDECREF(lv);
            Py_XDECREF(first_obj);
            if (append_new(c.payloads, payload) < 0)
                goto stored_error;
            if (append_new(c.extra, PyTuple_Pack(2, sizes, Py_None)) < 0)
                goto stored_error;
            {
                PyObject *at = PyLong_FromSsize_t(tok_base + tok_len / 4 - n_tok);

                if (at == NULL || append_new(c.layout, PyTuple_Pack(2, at, sizes)) < 0) {
                    Py_XDECREF(at);
                    goto stored_error;
                }
                Py_DECREF(at);
            }
            Py_DECREF(sizes);
            Py_DECREF(hashes);
            Py_DECREF(parent);
            continue;
        stored_error:
            Py_XDECREF(sizes);
            Py_DECREF(hashes);
            Py_DECREF(parent);
            goto error;
        }
    }
    if (n_top == 2 || is_nil(&r))
        rank = Py_NewRef(Py_None);
    else {
        int64_t v;

        if (read_int(&r, &v) < 0 || v < 0)
            goto done;
        if ((rank = PyLong_FromLongLong(v)) == NULL)
            goto error;
    }
    if (r.p != r.end)
        goto done;
    if (nargs == 8) { /* the rank the caller's burst names: another one ends it */
        int same = PyObject_RichCompareBool(rank, args[7], Py_EQ);

        if (same < 0)
            goto error;
        if (!same)
            goto done;
    }
    if (flush_run(&c, &run, run_group, run_level) < 0)
        goto error;
    if (tok_out != NULL) {
        if (PyByteArray_Resize(tok_out, tok_out_len + tok_len) < 0)
            goto error;
        if (tok_len)
            memcpy(PyByteArray_AS_STRING(tok_out) + tok_out_len, tok, tok_len);
        result = Py_BuildValue("(dOL)", ts, rank, c.next_id);
        ok = result != NULL;
        goto cleanup;
    }
    tokens = PyBytes_FromStringAndSize(tok, tok_len);
    if (tokens == NULL)
        goto error;
    result = Py_BuildValue("(dOOOOOOONLO)", ts, rank, c.ids, c.kinds, c.groups, c.windows,
                           c.payloads, c.extra, tokens, c.next_id, c.layout);
    ok = result != NULL;
    goto cleanup;
done: /* outside the subset: None */
    ok = 1;
    result = Py_NewRef(Py_None);
    goto cleanup;
error:
    result = NULL;
cleanup:
    (void)ok;
    if (tok_out != NULL && (result == NULL || result == Py_None)) {
        /* nothing of this payload stays in ``into`` nor in the windows */
        PyObject *exc_type, *exc_value, *exc_tb;

        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        for (i0 = 0; i0 < 7; i0++)
            if (PyList_GET_SIZE(into_lists[i0]) > into_len[i0]
                && PyList_SetSlice(into_lists[i0], into_len[i0],
                                   PyList_GET_SIZE(into_lists[i0]), NULL) < 0)
                PyErr_Clear();
        if (PyByteArray_GET_SIZE(tok_out) != tok_out_len
            && PyByteArray_Resize(tok_out, tok_out_len) < 0)
            PyErr_Clear();
        PyDict_Clear(c.known);
        if (PyDict_Update(c.known, known0) < 0)
            PyErr_Clear();
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    Py_XDECREF(known0);
    PyBuffer_Release(&view);
    PyMem_Free(tok);
    Py_XDECREF(run);
    Py_XDECREF(rank);
    Py_XDECREF(c.ids);
    Py_XDECREF(c.kinds);
    Py_XDECREF(c.groups);
    Py_XDECREF(c.windows);
    Py_XDECREF(c.payloads);
    Py_XDECREF(c.extra);
    Py_XDECREF(c.layout);
    return result;
}

static PyMethodDef methods[] = {
    {"removed_run", (PyCFunction)(void (*)(void))removed_run, METH_FASTCALL,
     "removed_run(events, start, removed_type, levels): a run of removal events of one group "
     "and level as (end, hashes, group, level), or None."},
    {"batch_columns", (PyCFunction)(void (*)(void))batch_columns, METH_FASTCALL,
     "batch_columns(payload, next_id, windows, levels, external, unbounded[, into[, rank]]): a "
     "batch's columns (appended to into's), or None outside the fast subset."},
    {"peek_rank", (PyCFunction)peek_rank, METH_O,
     "peek_rank(payload): a batch's data_parallel_rank (None when it has none)."},
    {"u32_array", (PyCFunction)u32_array, METH_O,
     "u32_array(buf): a msgpack array of uint32 ints as packed little-endian bytes."},
    {"be64_array", (PyCFunction)be64_array, METH_O,
     "be64_array(buf): a msgpack array of uint64 ints as a tuple of 8-byte big-endian bytes."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc, "vLLM-family wire arrays in C (see kvstream.engines.vllm).");

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvstream.engines._wire_native", module_doc, -1, methods,
    NULL,                  NULL,                            NULL,       NULL,
};

PyMODINIT_FUNC
PyInit__wire_native(void)
{
    return PyModule_Create(&moduledef);
}
