/*
 * kvstream.index._table_native: the Python twin's helpers and the search over this module's
 * MaskMap (the index core itself, which owns its state, is kvstream._native._index).
 *
 *   Column(values=(), *, unsigned=False)
 *
 * The type of the pure-Python GroupTable's integer columns (parent, refs (unsigned: packed
 * counts), kid, free) when this extension is built: 64-bit ints in one C array with the list
 * operations table.py uses on them (no int object per node, never walked by the cyclic GC);
 * untrack_atoms(list) takes a table's hashes list (bytes only) out of the GC's walks too.
 *
 *   MaskMap()
 *
 * kvstream.index.domain.MaskMap's contract in one C hash table (the fallback of the index
 * core's MaskMap).
 *
 *   prefix_depths(masks, hashes, allowed) -> [(workers mask, depth), ...]
 *
 * kvstream.index.domain.prefix_depths over a MaskMap: the bisection for where each worker's
 * rooted prefix of ``hashes`` ends, with the masks compared and and-ed as bytes. ``allowed``
 * is None (every worker) or ``width`` bytes of allowed bits.
 *
 *   slot_depths(masks, hashes, allowed) -> [(slot, depth), ...]
 *
 * The same search, reported per worker slot (its deepest depth; slots without one left out).
 *
 * table.py and domain.py are the reference and the fallback (KVSTREAM_NO_NATIVE=1 or no C
 * compiler); tests/test_index_fastpath.py and tests/test_index_native.py check both give
 * identical tables, masks and depths.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../_native/src/py_pairs.h"

/* ------------------------------------------------------------------ Column */

/* A growable vector of 64-bit integers (signed, or unsigned for packed reference counts)
 * with the list operations GroupTable uses. Not tracked by the cyclic GC (it holds no
 * objects) and no int object per element: a table's parent/refs/kid/free columns cost
 * 8 bytes per node, the C loops read and write them in place, and the GC never walks them. */
typedef struct {
    PyObject_HEAD
    int64_t *v;
    Py_ssize_t n, cap;
    int unsig;
} Column;

static PyTypeObject ColumnType;

static int
column_reserve(Column *c, Py_ssize_t need)
{
    if (need <= c->cap)
        return 0;
    Py_ssize_t cap = c->cap < 8 ? 8 : c->cap;
    while (cap < need) {
        if (cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(int64_t)) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    int64_t *v = PyMem_Realloc(c->v, (size_t)cap * sizeof(int64_t));
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->v = v;
    c->cap = cap;
    return 0;
}

static inline int
column_push(Column *c, int64_t x)
{
    if (c->n == c->cap && column_reserve(c, c->n + 1) < 0)
        return -1;
    c->v[c->n++] = x;
    return 0;
}

/* An int as the column stores it: OverflowError outside int64 (uint64 when unsigned). */
static int
column_value(Column *c, PyObject *o, int64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "Column: an int is required, not %.100s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    if (c->unsig) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        *out = (int64_t)u;
        return 0;
    }
    long long s = PyLong_AsLongLong(o);
    if (s == -1 && PyErr_Occurred())
        return -1;
    *out = s;
    return 0;
}

static PyObject *
column_int(Column *c, int64_t x)
{
    return c->unsig ? PyLong_FromUnsignedLongLong((unsigned long long)x)
                    : PyLong_FromLongLong(x);
}

static int
column_extend_from(Column *c, PyObject *it)
{
    PyObject *seq = PySequence_Fast(it, "Column: values must be iterable");
    if (seq == NULL)
        return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    int rc = column_reserve(c, c->n + k);
    /* converted past the end first: a bad value leaves the column as it was */
    for (Py_ssize_t i = 0; rc == 0 && i < k; i++)
        rc = column_value(c, PySequence_Fast_GET_ITEM(seq, i), &c->v[c->n + i]);
    if (rc == 0)
        c->n += k;
    Py_DECREF(seq);
    return rc;
}

static PyObject *
column_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"values", "unsigned", NULL};
    PyObject *values = NULL;
    int unsig = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$p:Column", kwlist, &values, &unsig))
        return NULL;
    Column *c = (Column *)type->tp_alloc(type, 0);
    if (c == NULL)
        return NULL;
    c->unsig = unsig;
    if (values != NULL && column_extend_from(c, values) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static void
column_dealloc(Column *c)
{
    PyMem_Free(c->v);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static Py_ssize_t
column_len(Column *c)
{
    return c->n;
}

static PyObject *
column_item(Column *c, Py_ssize_t i)
{
    if (i < 0 || i >= c->n) {
        PyErr_SetString(PyExc_IndexError, "Column index out of range");
        return NULL;
    }
    return column_int(c, c->v[i]);
}

static int
column_ass_item(Column *c, Py_ssize_t i, PyObject *o)
{
    if (o == NULL) {
        PyErr_SetString(PyExc_TypeError, "Column items cannot be deleted (pop the last one)");
        return -1;
    }
    if (i < 0 || i >= c->n) {
        PyErr_SetString(PyExc_IndexError, "Column assignment index out of range");
        return -1;
    }
    return column_value(c, o, &c->v[i]);
}

static PyObject *
column_append(Column *c, PyObject *o)
{
    int64_t x;
    if (column_value(c, o, &x) < 0 || column_push(c, x) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
column_extend(Column *c, PyObject *o)
{
    if (column_extend_from(c, o) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
column_pop(Column *c, PyObject *unused)
{
    if (!c->n) {
        PyErr_SetString(PyExc_IndexError, "pop from empty Column");
        return NULL;
    }
    return column_int(c, c->v[--c->n]);
}

static PyObject *
column_tolist(Column *c, PyObject *unused)
{
    PyObject *out = PyList_New(c->n);
    for (Py_ssize_t i = 0; out != NULL && i < c->n; i++) {
        PyObject *x = column_int(c, c->v[i]);
        if (x == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *
column_reduce(Column *c, PyObject *unused)
{
    PyObject *values = column_tolist(c, NULL);
    if (values == NULL)
        return NULL;
    PyObject *kw = Py_BuildValue("{sO}", "unsigned", c->unsig ? Py_True : Py_False);
    PyObject *args = kw == NULL ? NULL : Py_BuildValue("(O)", values);
    Py_DECREF(values);
    if (args == NULL) {
        Py_XDECREF(kw);
        return NULL;
    }
    /* copy/pickle: functools.partial-free form, Column(values, unsigned=...) via _column_of */
    PyObject *mod = PyImport_ImportModule("kvstream.index._table_native");
    PyObject *fn = mod == NULL ? NULL : PyObject_GetAttrString(mod, "_column_of");
    Py_XDECREF(mod);
    PyObject *out = fn == NULL ? NULL : Py_BuildValue("(O(OO))", fn, PyTuple_GET_ITEM(args, 0), kw);
    Py_XDECREF(fn);
    Py_DECREF(args);
    Py_DECREF(kw);
    return out;
}

static PyObject *
column_repr(Column *c)
{
    PyObject *values = column_tolist(c, NULL);
    if (values == NULL)
        return NULL;
    PyObject *out = PyUnicode_FromFormat("Column(%R%s)", values, c->unsig ? ", unsigned=True" : "");
    Py_DECREF(values);
    return out;
}

static PyObject *
column_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(a, &ColumnType))
        Py_RETURN_NOTIMPLEMENTED;
    if (!PyObject_TypeCheck(b, &ColumnType) && !PyList_Check(b))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *la = column_tolist((Column *)a, NULL);
    PyObject *lb = PyList_Check(b) ? Py_NewRef(b) : column_tolist((Column *)b, NULL);
    PyObject *out = la == NULL || lb == NULL ? NULL : PyObject_RichCompare(la, lb, op);
    Py_XDECREF(la);
    Py_XDECREF(lb);
    return out;
}

static PyObject *
column_of(PyObject *module, PyObject *args)
{
    PyObject *values, *kw;
    if (!PyArg_ParseTuple(args, "OO!", &values, &PyDict_Type, &kw))
        return NULL;
    PyObject *a = PyTuple_Pack(1, values);
    if (a == NULL)
        return NULL;
    PyObject *out = PyObject_Call((PyObject *)&ColumnType, a, kw);
    Py_DECREF(a);
    return out;
}

static PySequenceMethods column_as_sequence = {
    .sq_length = (lenfunc)column_len,
    .sq_item = (ssizeargfunc)column_item,
    .sq_ass_item = (ssizeobjargproc)column_ass_item,
};

static PyMethodDef column_methods[] = {
    {"append", (PyCFunction)column_append, METH_O, "Append an int."},
    {"extend", (PyCFunction)column_extend, METH_O, "Append the ints of an iterable."},
    {"pop", (PyCFunction)column_pop, METH_NOARGS, "Remove and return the last int."},
    {"tolist", (PyCFunction)column_tolist, METH_NOARGS, "The values as a list of ints."},
    {"__reduce__", (PyCFunction)column_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ColumnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream.index._table_native.Column",
    .tp_basicsize = sizeof(Column),
    .tp_dealloc = (destructor)column_dealloc,
    .tp_repr = (reprfunc)column_repr,
    .tp_as_sequence = &column_as_sequence,
    .tp_richcompare = column_richcompare,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Column(values=(), *, unsigned=False): a vector of 64-bit ints with the list "
              "operations a GroupTable uses (len, [i], [i] = x, append, extend, pop(), tolist); "
              "not tracked by the GC, no int object per element.",
    .tp_methods = column_methods,
    .tp_new = column_new,
};

/* untrack_atoms(list) -> list: the same list, taken out of the cyclic GC when it holds only
 * bytes and ints (a table's hashes: it can never be part of a reference cycle while only
 * such atoms are put in it, which GroupTable guarantees). */
static PyObject *
untrack_atoms(PyObject *module, PyObject *o)
{
    if (!PyList_CheckExact(o)) {
        PyErr_SetString(PyExc_TypeError, "untrack_atoms: a list is required");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); i++) {
        PyObject *x = PyList_GET_ITEM(o, i);
        if (!PyBytes_CheckExact(x) && !PyLong_CheckExact(x))
            return Py_NewRef(o); /* not atoms only: leave it to the GC */
    }
    if (PyObject_GC_IsTracked(o))
        PyObject_GC_UnTrack(o);
    return Py_NewRef(o);
}

/* ------------------------------------------------------------------ MaskMap */

/* kvstream.index.domain.MaskMap's contract in one open-addressing table: a slot holds the
 * key's hash, the key (a bytes object, owned), its first 8 bytes and length (keys of up to 8
 * bytes compare without reading the key object) and its ``width`` bytes of worker bits inline,
 * so an update costs one probe sequence and no int object (the Python MaskMap needs a dict
 * probe, the entry's int and a separate word array). Linear probing; deleted keys leave a
 * tombstone until the next rebuild. Not tracked by the GC: it holds only bytes. */
typedef struct {
    PyObject_HEAD
    char *slots;            /* cap slots of ``stride`` bytes: hash, key, width bytes of bits */
    Py_ssize_t cap;         /* a power of two (0 before the first key) */
    Py_ssize_t used, fill;  /* keys; keys + tombstones */
    Py_ssize_t width, stride;
} NMap;

static PyTypeObject NMapType;
static char nmap_dummy_obj;
#define NMAP_DUMMY ((PyObject *)&nmap_dummy_obj)
/* slot layout: hash, key, the key's first 8 bytes (zero-padded), its length, the bits */
#define NMAP_HDR 32
#define NMAP_SLOT(m, i) ((m)->slots + (i) * (m)->stride)
#define NMAP_HASH(m, i) (*(Py_hash_t *)NMAP_SLOT(m, i))
#define NMAP_KEY(m, i) (*(PyObject **)(NMAP_SLOT(m, i) + 8))
#define NMAP_HEAD(m, i) (*(uint64_t *)(NMAP_SLOT(m, i) + 16))
#define NMAP_LEN(m, i) (*(Py_ssize_t *)(NMAP_SLOT(m, i) + 24))
#define NMAP_BITS(m, i) ((unsigned char *)(NMAP_SLOT(m, i) + NMAP_HDR))

static inline Py_hash_t
nmap_hash(PyObject *key)
{
    if (!PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "MaskMap keys are bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    return PyObject_Hash(key);
}

/* A bytes key's first 8 bytes, zero-padded. */
static inline uint64_t
nmap_head(PyObject *key)
{
    uint64_t v = 0;
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    memcpy(&v, PyBytes_AS_STRING(key), (size_t)(n < 8 ? n : 8));
    return v;
}

/* True when slot i holds ``key`` (hash h, head, length n). Keys of up to 8 bytes (engines'
 * 64-bit hashes) are compared in the slot, without reading the stored key object. */
static inline int
nmap_match(NMap *m, Py_ssize_t i, PyObject *key, Py_hash_t h, uint64_t head, Py_ssize_t n)
{
    PyObject *k = NMAP_KEY(m, i);
    if (k == NMAP_DUMMY || NMAP_HASH(m, i) != h || NMAP_LEN(m, i) != n || NMAP_HEAD(m, i) != head)
        return 0;
    return k == key || n <= 8
           || !memcmp(PyBytes_AS_STRING(k) + 8, PyBytes_AS_STRING(key) + 8, (size_t)(n - 8));
}

/* The slot of ``key`` (-1 when absent). */
static Py_ssize_t
nmap_find(NMap *m, PyObject *key, Py_hash_t h)
{
    if (!m->cap)
        return -1;
    size_t mask = (size_t)m->cap - 1;
    uint64_t head = nmap_head(key);
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        if (NMAP_KEY(m, (Py_ssize_t)i) == NULL)
            return -1;
        if (nmap_match(m, (Py_ssize_t)i, key, h, head, n))
            return (Py_ssize_t)i;
    }
}

/* Rebuild with ``cap`` slots of ``width`` bytes of bits (dropping tombstones). */
static int
nmap_rebuild(NMap *m, Py_ssize_t cap, Py_ssize_t width)
{
    Py_ssize_t stride = NMAP_HDR + width;
    char *slots = PyMem_Calloc((size_t)cap, (size_t)stride);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    NMap old = *m;
    m->slots = slots;
    m->cap = cap;
    m->stride = stride;
    m->width = width;
    m->fill = m->used;
    size_t mask = (size_t)cap - 1;
    for (Py_ssize_t j = 0; j < old.cap; j++) {
        PyObject *k = NMAP_KEY(&old, j);
        if (k == NULL || k == NMAP_DUMMY)
            continue;
        Py_hash_t h = NMAP_HASH(&old, j);
        size_t i = (size_t)h & mask;
        while (NMAP_KEY(m, (Py_ssize_t)i) != NULL)
            i = (i + 1) & mask;
        memcpy(NMAP_SLOT(m, (Py_ssize_t)i), NMAP_SLOT(&old, j), (size_t)(NMAP_HDR + old.width));
    }
    PyMem_Free(old.slots);
    return 0;
}

/* Set bit ``slot`` of ``key``'s mask (MaskMap.add; the slot must be reserved). */
static int
nmap_add(NMap *m, PyObject *key, Py_ssize_t slot)
{
    if ((slot >> 3) >= m->width || slot < 0) {
        PyErr_SetString(PyExc_ValueError, "MaskMap.add: the slot is not reserved");
        return -1;
    }
    Py_hash_t h = nmap_hash(key);
    if (h == -1 && PyErr_Occurred())
        return -1;
    if ((m->fill + 1) * 10 > m->cap * 7) { /* at most 70% full, tombstones included */
        Py_ssize_t cap = 8;
        while ((m->used + 1) * 20 > cap * 7) /* at most 35% full after the rebuild */
            cap *= 2;
        if (nmap_rebuild(m, cap, m->width) < 0)
            return -1;
    }
    size_t mask = (size_t)m->cap - 1;
    Py_ssize_t free_at = -1;
    uint64_t head = nmap_head(key);
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    size_t i = (size_t)h & mask;
    for (;; i = (i + 1) & mask) {
        PyObject *k = NMAP_KEY(m, (Py_ssize_t)i);
        if (k == NULL)
            break;
        if (k == NMAP_DUMMY) {
            if (free_at < 0)
                free_at = (Py_ssize_t)i;
            continue;
        }
        if (nmap_match(m, (Py_ssize_t)i, key, h, head, n)) {
            NMAP_BITS(m, (Py_ssize_t)i)[slot >> 3] |= (unsigned char)(1 << (slot & 7));
            return 0;
        }
    }
    Py_ssize_t at = (Py_ssize_t)i;
    if (free_at >= 0)
        at = free_at; /* reuse a tombstone: fill unchanged */
    else
        m->fill++;
    m->used++;
    NMAP_HASH(m, at) = h;
    NMAP_KEY(m, at) = Py_NewRef(key);
    NMAP_HEAD(m, at) = head;
    NMAP_LEN(m, at) = n;
    unsigned char *bits = NMAP_BITS(m, at);
    memset(bits, 0, (size_t)m->width);
    bits[slot >> 3] = (unsigned char)(1 << (slot & 7));
    return 0;
}

/* Clear bit ``slot`` of ``key``'s mask, dropping a key left without bits (MaskMap.discard). */
static int
nmap_discard(NMap *m, PyObject *key, Py_ssize_t slot)
{
    Py_hash_t h = nmap_hash(key);
    if (h == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t i = nmap_find(m, key, h);
    if (i < 0 || slot < 0 || (slot >> 3) >= m->width)
        return 0;
    unsigned char *bits = NMAP_BITS(m, i);
    bits[slot >> 3] &= (unsigned char)~(1 << (slot & 7));
    for (Py_ssize_t k = 0; k < m->width; k++)
        if (bits[k])
            return 0;
    PyObject *k = NMAP_KEY(m, i);
    NMAP_KEY(m, i) = NMAP_DUMMY;
    m->used--;
    Py_DECREF(k);
    return 0;
}

/* Start loading the slot where ``key``'s probe begins (a hint: the loops touch keys a few
 * positions ahead, so the table's cache misses overlap instead of queueing). */
static inline void
nmap_prefetch(NMap *m, PyObject *key)
{
    if (m->cap && PyBytes_CheckExact(key)) {
        Py_hash_t h = PyObject_Hash(key); /* cached in the bytes object after the first call */
        if (h != -1)
            __builtin_prefetch(m->slots + (Py_ssize_t)((size_t)h & ((size_t)m->cap - 1)) * m->stride);
        else
            PyErr_Clear(); /* the real lookup raises it */
    }
}

/* How far ahead of the current key the loops prefetch. */
#define PREFETCH_AHEAD 6

/* The bits of ``key`` (NULL when absent, with no error set unless one occurred). */
static const unsigned char *
nmap_bits(NMap *m, PyObject *key)
{
    Py_hash_t h = nmap_hash(key);
    if (h == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t i = nmap_find(m, key, h);
    return i < 0 ? NULL : NMAP_BITS(m, i);
}

static PyObject *mask_int(const unsigned char *b, Py_ssize_t width);

static PyObject *
nmap_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "MaskMap() takes no arguments");
        return NULL;
    }
    NMap *m = (NMap *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    m->width = 8;
    m->stride = NMAP_HDR + 8;
    return (PyObject *)m;
}

static void
nmap_dealloc(NMap *m)
{
    for (Py_ssize_t i = 0; i < m->cap; i++) {
        PyObject *k = NMAP_KEY(m, i);
        if (k != NULL && k != NMAP_DUMMY)
            Py_DECREF(k);
    }
    PyMem_Free(m->slots);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *
nmap_py_reserve(NMap *m, PyObject *arg)
{
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (slot < 0) {
        PyErr_SetString(PyExc_ValueError, "MaskMap.reserve: a slot is >= 0");
        return NULL;
    }
    if (slot >= 8 * m->width) {
        Py_ssize_t width = ((slot >> 6) + 1) * 8;
        if (m->cap) {
            if (nmap_rebuild(m, m->cap, width) < 0)
                return NULL;
        }
        else {
            m->width = width;
            m->stride = NMAP_HDR + width;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
nmap_py_add(NMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "MaskMap.add(key, slot)");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[1]);
    if ((slot == -1 && PyErr_Occurred()) || nmap_add(m, args[0], slot) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
nmap_py_discard(NMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "MaskMap.discard(key, slot)");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[1]);
    if ((slot == -1 && PyErr_Occurred()) || nmap_discard(m, args[0], slot) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
nmap_py_get(NMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "MaskMap.get(key, default=0)");
        return NULL;
    }
    if (!PyBytes_CheckExact(args[0])) /* never added: absent */
        return nargs == 2 ? Py_NewRef(args[1]) : PyLong_FromLong(0);
    const unsigned char *b = nmap_bits(m, args[0]);
    if (b == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return nargs == 2 ? Py_NewRef(args[1]) : PyLong_FromLong(0);
    }
    return mask_int(b, m->width);
}

static PyObject *
nmap_py_as_dict(NMap *m, PyObject *unused)
{
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out != NULL && i < m->cap; i++) {
        PyObject *k = NMAP_KEY(m, i);
        if (k == NULL || k == NMAP_DUMMY)
            continue;
        PyObject *v = mask_int(NMAP_BITS(m, i), m->width);
        if (v == NULL || PyDict_SetItem(out, k, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static Py_ssize_t
nmap_len(NMap *m)
{
    return m->used;
}

static int
nmap_contains(NMap *m, PyObject *key)
{
    if (!PyBytes_CheckExact(key))
        return 0;
    const unsigned char *b = nmap_bits(m, key);
    return b != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
}

static PyObject *
nmap_repr(NMap *m)
{
    return PyUnicode_FromFormat("<MaskMap keys=%zd width=%zd>", m->used, m->width);
}

static PyObject *
nmap_get_width(NMap *m, void *unused)
{
    return PyLong_FromSsize_t(m->width);
}

static PySequenceMethods nmap_as_sequence = {
    .sq_length = (lenfunc)nmap_len,
    .sq_contains = (objobjproc)nmap_contains,
};

static PyMethodDef nmap_methods[] = {
    {"reserve", (PyCFunction)nmap_py_reserve, METH_O,
     "Make room for bit ``slot`` in every entry."},
    {"add", (PyCFunction)(void (*)(void))nmap_py_add, METH_FASTCALL,
     "Set bit ``slot`` of ``key``'s mask (``slot`` must be reserved)."},
    {"discard", (PyCFunction)(void (*)(void))nmap_py_discard, METH_FASTCALL,
     "Clear bit ``slot`` of ``key``'s mask; a key left without bits is dropped."},
    {"get", (PyCFunction)(void (*)(void))nmap_py_get, METH_FASTCALL,
     "The mask of ``key`` as an int (``default`` when no bit is set)."},
    {"as_dict", (PyCFunction)nmap_py_as_dict, METH_NOARGS, "Every key's mask as an int."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef nmap_getset[] = {
    {"width", (getter)nmap_get_width, NULL, "Bytes of bits per key (8 per 64 worker slots).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream.index._table_native.MaskMap",
    .tp_basicsize = sizeof(NMap),
    .tp_dealloc = (destructor)nmap_dealloc,
    .tp_repr = (reprfunc)nmap_repr,
    .tp_as_sequence = &nmap_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "MaskMap(): kvstream.index.domain.MaskMap in one C hash table (bytes keys, the "
              "worker bits inline); the same methods and contract.",
    .tp_methods = nmap_methods,
    .tp_getset = nmap_getset,
    .tp_new = nmap_new,
};

/* ------------------------------------------------------------------ prefix_depths */

typedef struct {
    PyObject *hashes, *index, *out;
    const unsigned char *words, *allowed;
    Py_ssize_t width;
    unsigned char *scratch; /* width bytes per recursion level */
    Py_ssize_t *depth_of;   /* slot_depths: the deepest depth per slot (else pairs to out) */
    NMap *nm;               /* the C MaskMap (index and words unused), or NULL */
} Search;

/* The mask of hashes[i] (and-ed with allowed) into dst; 1 when non-zero. */
static int
search_get(Search *s, Py_ssize_t i, unsigned char *dst)
{
    Py_ssize_t w = s->width;
    if (s->nm != NULL) {
        PyObject *key = PyList_GET_ITEM(s->hashes, i);
        const unsigned char *b = PyBytes_CheckExact(key) ? nmap_bits(s->nm, key) : NULL;
        if (b == NULL) {
            if (PyErr_Occurred())
                return -1;
            memset(dst, 0, (size_t)w);
            return 0;
        }
        memcpy(dst, b, (size_t)w);
    }
    else {
        PyObject *eobj = PyDict_GetItemWithError(s->index, PyList_GET_ITEM(s->hashes, i));
        if (eobj == NULL) {
            if (PyErr_Occurred())
                return -1;
            memset(dst, 0, (size_t)w);
            return 0;
        }
        Py_ssize_t e = PyLong_AsSsize_t(eobj);
        if (e == -1 && PyErr_Occurred())
            return -1;
        memcpy(dst, s->words + e * w, (size_t)w);
    }
    int any = 0;
    for (Py_ssize_t k = 0; k < w; k++) {
        if (s->allowed != NULL)
            dst[k] &= s->allowed[k];
        any |= dst[k];
    }
    return any != 0;
}

/* The tuple (a, b) of two ints. */
static PyObject *
pair_new(Py_ssize_t a, Py_ssize_t b)
{
    return pair_steal(PyLong_FromSsize_t(a), PyLong_FromSsize_t(b));
}

/* An int of ``width`` little-endian bytes. */
static PyObject *
mask_int(const unsigned char *b, Py_ssize_t width)
{
    PyObject *out = NULL;
    for (Py_ssize_t k = width - 8; k >= 0; k -= 8) {
        unsigned long long v = 0;
        for (int j = 7; j >= 0; j--)
            v = (v << 8) | b[k + j];
        PyObject *word = PyLong_FromUnsignedLongLong(v);
        if (word == NULL) {
            Py_XDECREF(out);
            return NULL;
        }
        if (out == NULL) {
            out = word;
            continue;
        }
        PyObject *sixty4 = PyLong_FromLong(64);
        PyObject *shifted = sixty4 == NULL ? NULL : PyNumber_Lshift(out, sixty4);
        Py_XDECREF(sixty4);
        Py_DECREF(out);
        out = shifted == NULL ? NULL : PyNumber_Or(shifted, word);
        Py_XDECREF(shifted);
        Py_DECREF(word);
        if (out == NULL)
            return NULL;
    }
    return out;
}

static int
search_emit(Search *s, const unsigned char *mlo, const unsigned char *mhi, Py_ssize_t depth)
{
    unsigned char *b = s->scratch; /* level 0 of the scratch is free once split runs */
    for (Py_ssize_t k = 0; k < s->width; k++)
        b[k] = mlo[k] & (unsigned char)~mhi[k];
    if (s->depth_of != NULL) {
        for (Py_ssize_t k = 0; k < s->width; k++)
            for (int j = 0; b[k] >> j; j++)
                if ((b[k] >> j) & 1 && s->depth_of[8 * k + j] < depth)
                    s->depth_of[8 * k + j] = depth;
        return 0;
    }
    PyObject *m = mask_int(b, s->width);
    if (m == NULL)
        return -1;
    PyObject *d = PyLong_FromSsize_t(depth);
    PyObject *pair = d == NULL ? NULL : PyTuple_New(2);
    if (pair == NULL) {
        Py_DECREF(m);
        Py_XDECREF(d);
        return -1;
    }
    PyTuple_SET_ITEM(pair, 0, m);
    PyTuple_SET_ITEM(pair, 1, d);
    int rc = PyList_Append(s->out, pair);
    Py_DECREF(pair);
    return rc;
}

/* domain.py's split(): masks only shrink along the chain, so equal masks at both ends of a
 * range mean no change inside it. ``level`` picks this call's scratch mask. */
static int
search_split(Search *s, Py_ssize_t lo, const unsigned char *mlo, Py_ssize_t hi,
             const unsigned char *mhi, int level)
{
    Py_ssize_t mid = (lo + hi) >> 1;
    if (mid == lo)
        return search_emit(s, mlo, mhi, hi);
    unsigned char *mm = s->scratch + (Py_ssize_t)level * s->width;
    if (search_get(s, mid, mm) < 0)
        return -1;
    if (memcmp(mm, mlo, (size_t)s->width) && search_split(s, lo, mlo, mid, mm, level + 1) < 0)
        return -1;
    if (memcmp(mm, mhi, (size_t)s->width) && search_split(s, mid, mm, hi, mhi, level + 1) < 0)
        return -1;
    return 0;
}

static PyObject *
run_search(PyObject *args, int per_slot)
{
    PyObject *obj, *hashes, *allowed;
    if (!PyArg_ParseTuple(args, "OO!O", &obj, &PyList_Type, &hashes, &allowed))
        return NULL;
    if (!PyObject_TypeCheck(obj, &NMapType)) {
        PyErr_SetString(PyExc_TypeError, "prefix_depths: masks must be this module's MaskMap");
        return NULL;
    }
    NMap *nm = (NMap *)obj;
    struct {
        Py_ssize_t width;
    } m = {nm->width};
    Search s = {hashes, NULL, NULL, NULL, NULL, m.width, NULL, NULL, nm};
    PyObject *out = NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (allowed != Py_None) {
        if (!PyBytes_Check(allowed) || PyBytes_GET_SIZE(allowed) != m.width) {
            PyErr_SetString(PyExc_ValueError, "prefix_depths: allowed must be width bytes");
            goto done;
        }
        s.allowed = (const unsigned char *)PyBytes_AS_STRING(allowed);
    }
    if (!(out = PyList_New(0)))
        goto done;
    s.out = out;
    if (!n)
        goto done;
    /* levels: 0 for emit, 1 and 2 for both ends, then one per bisection level */
    int levels = 4;
    for (Py_ssize_t k = n; k; k >>= 1)
        levels++;
    s.scratch = PyMem_Malloc((size_t)(levels * m.width));
    if (s.scratch == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    unsigned char *first = s.scratch + m.width, *last = s.scratch + 2 * m.width;
    int rc = search_get(&s, 0, first);
    if (rc <= 0) {
        if (rc < 0)
            Py_CLEAR(out);
        goto done;
    }
    rc = search_get(&s, n - 1, last);
    if (rc < 0) {
        Py_CLEAR(out);
        goto done;
    }
    if (per_slot) {
        s.depth_of = PyMem_Calloc((size_t)(8 * m.width), sizeof(Py_ssize_t));
        if (s.depth_of == NULL) {
            PyErr_NoMemory();
            Py_CLEAR(out);
            goto done;
        }
    }
    if (rc > 0) {
        unsigned char *zero = s.scratch + 3 * m.width;
        memset(zero, 0, (size_t)m.width);
        if (search_emit(&s, last, zero, n) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    if (memcmp(first, last, (size_t)m.width) && search_split(&s, 0, first, n - 1, last, 3) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    if (per_slot) {
        for (Py_ssize_t k = 0; k < 8 * m.width; k++) {
            if (!s.depth_of[k])
                continue;
            PyObject *pair = pair_new(k, s.depth_of[k]);
            int bad = pair == NULL || PyList_Append(out, pair) < 0;
            Py_XDECREF(pair);
            if (bad) {
                Py_CLEAR(out);
                goto done;
            }
        }
    }
done:
    PyMem_Free(s.depth_of);
    PyMem_Free(s.scratch);
    return out;
}

static PyObject *
prefix_depths(PyObject *module, PyObject *args)
{
    return run_search(args, 0);
}

static PyObject *
slot_depths(PyObject *module, PyObject *args)
{
    return run_search(args, 1);
}


static PyMethodDef methods[] = {
    {"_column_of", column_of, METH_VARARGS,
     "_column_of(values, kwargs) -> Column(values, **kwargs) (what a Column pickles to)."},
    {"untrack_atoms", untrack_atoms, METH_O,
     "untrack_atoms(list) -> the list, untracked by the cyclic GC when it holds only bytes and "
     "ints (see the module source)."},
    {"prefix_depths", prefix_depths, METH_VARARGS,
     "prefix_depths(masks, hashes, allowed) -> [(mask, depth), ...]: domain.prefix_depths "
     "over a MaskMap (see the module source)."},
    {"slot_depths", slot_depths, METH_VARARGS,
     "slot_depths(masks, hashes, allowed) -> [(slot, depth), ...]: prefix_depths per worker "
     "slot (its deepest depth), in slot order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstream.index._table_native",
    "Column, MaskMap and the prefix search of the pure-Python index tables (optional).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__table_native(void)
{
    if (PyType_Ready(&ColumnType) < 0 || PyType_Ready(&NMapType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    if (PyModule_AddObjectRef(mod, "Column", (PyObject *)&ColumnType) < 0
        || PyModule_AddObjectRef(mod, "MaskMap", (PyObject *)&NMapType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
