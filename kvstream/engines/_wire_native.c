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

static PyMethodDef methods[] = {
    {"removed_run", (PyCFunction)(void (*)(void))removed_run, METH_FASTCALL,
     "removed_run(events, start, removed_type, levels): a run of removal events of one group "
     "and level as (end, hashes, group, level), or None."},
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
