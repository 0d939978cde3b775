/* kvstream._native._index.MaskMap: a hash domain's block key -> worker bitmask map
 * (kvstream.index.domain.MaskMap's contract), keys inline, and the prefix search over it.
 *
 * One open-addressing table (linear probing, deletion by backward shift: no tombstones); a
 * slot is
 * [state: 1, key length: 1, pad: 6][key: kw bytes][bits: width bytes] (the key's hash is
 * recomputed when needed: keys are block hashes, one multiply-mix per 8 bytes), kw the
 * longest key so far rounded up to 8 (a longer key rebuilds the table wider). No Python object
 * per key. Included by index_table.c: the table mirrors its rooted blocks with mm_add and
 * mm_discard directly when its masks are this type. */

typedef struct {
    PyObject_HEAD
    uint8_t *slots;
    Py_ssize_t cap, used, fill; /* slots (a power of two, 0 before the first key); keys (twice) */
    Py_ssize_t kw, width, stride;
} MM;

static PyTypeObject MMType;

#define MM_HDR 8
#define MM_SLOT(m, i) ((m)->slots + (size_t)(i) * (size_t)(m)->stride)
#define MM_STATE(m, i) (MM_SLOT(m, i)[0])
#define MM_LEN(m, i) (MM_SLOT(m, i)[1])
#define MM_KEY(m, i) (MM_SLOT(m, i) + MM_HDR)
#define MM_BITS(m, i) (MM_SLOT(m, i) + MM_HDR + (m)->kw)
#define MM_EMPTY 0
#define MM_LIVE 1

static inline uint64_t key_hash(const uint8_t *k, Py_ssize_t n);

/* a[0:n] == b[0:n]; block hashes and keys are mostly 8 or 16 bytes: compared in registers,
 * not through a library call */
static inline int
bytes_eq(const uint8_t *a, const uint8_t *b, Py_ssize_t n)
{
    uint64_t x, y;
    if (n == 8) {
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        return x == y;
    }
    if (n == 16) {
        uint64_t x2, y2;
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        memcpy(&x2, a + 8, 8);
        memcpy(&y2, b + 8, 8);
        return ((x ^ y) | (x2 ^ y2)) == 0;
    }
    return !memcmp(a, b, (size_t)n);
}

static Py_ssize_t
mm_find(MM *m, const uint8_t *k, Py_ssize_t len, uint64_t h)
{
    if (!m->cap || len > m->kw)
        return -1;
    size_t mask = (size_t)m->cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        uint8_t s = MM_STATE(m, i);
        if (s == MM_EMPTY)
            return -1;
        if (s == MM_LIVE && MM_LEN(m, i) == len && bytes_eq(MM_KEY(m, i), k, len))
            return (Py_ssize_t)i;
    }
}

static int
mm_rebuild(MM *m, Py_ssize_t cap, Py_ssize_t kw, Py_ssize_t width)
{
    Py_ssize_t stride = MM_HDR + kw + width;
    uint8_t *slots = PyMem_Calloc((size_t)cap, (size_t)stride);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    MM old = *m;
    m->slots = slots;
    m->cap = cap;
    m->kw = kw;
    m->width = width;
    m->stride = stride;
    m->fill = m->used;
    size_t mask = (size_t)cap - 1;
    for (Py_ssize_t j = 0; j < old.cap; j++) {
        if (MM_STATE(&old, j) != MM_LIVE)
            continue;
        size_t i = (size_t)key_hash(MM_KEY(&old, j), MM_LEN(&old, j)) & mask;
        while (MM_STATE(m, i) != MM_EMPTY)
            i = (i + 1) & mask;
        memcpy(MM_SLOT(m, i), MM_SLOT(&old, j), (size_t)(MM_HDR + old.kw));
        memcpy(MM_BITS(m, i), MM_BITS(&old, j), (size_t)old.width);
    }
    PyMem_Free(old.slots);
    return 0;
}

/* Set bit ``slot`` of key k's mask (the slot must be reserved). */
static int
mm_add(MM *m, const uint8_t *k, Py_ssize_t len, Py_ssize_t slot)
{
    if (slot < 0 || (slot >> 3) >= m->width) {
        PyErr_SetString(PyExc_ValueError, "MaskMap.add: the slot is not reserved");
        return -1;
    }
    uint64_t h = key_hash(k, len);
    Py_ssize_t i = mm_find(m, k, len, h);
    if (i >= 0) {
        MM_BITS(m, i)[slot >> 3] |= (uint8_t)(1 << (slot & 7));
        return 0;
    }
    if (len > m->kw || (m->fill + 1) * 4 > m->cap * 3) { /* at most 3/4 full */
        Py_ssize_t cap = 16;
        while ((m->used + 1) * 2 > cap) /* at most half full after the rebuild */
            cap *= 2;
        Py_ssize_t kw = len > m->kw ? (len + 7) & ~(Py_ssize_t)7 : m->kw;
        if (mm_rebuild(m, cap, kw, m->width) < 0)
            return -1;
    }
    size_t mask = (size_t)m->cap - 1;
    size_t j = (size_t)h & mask;
    while (MM_STATE(m, j) == MM_LIVE)
        j = (j + 1) & mask;
    if (MM_STATE(m, j) == MM_EMPTY)
        m->fill++;
    m->used++;
    MM_STATE(m, j) = MM_LIVE;
    MM_LEN(m, j) = (uint8_t)len;
    memcpy(MM_KEY(m, j), k, (size_t)len);
    memset(MM_KEY(m, j) + len, 0, (size_t)(m->kw - len));
    uint8_t *bits = MM_BITS(m, j);
    memset(bits, 0, (size_t)m->width);
    bits[slot >> 3] = (uint8_t)(1 << (slot & 7));
    return 0;
}

/* True when ``home`` lies cyclically in (i, j]: an entry there must stay behind the hole. */
static inline int
stays(size_t home, size_t i, size_t j)
{
    return i <= j ? (home > i && home <= j) : (home > i || home <= j);
}

/* Empty slot i by backward shift (linear probing without tombstones: later entries of the
 * probe run move up, so lookups never cross dead slots). */
static void
mm_erase(MM *m, size_t i)
{
    size_t mask = (size_t)m->cap - 1;
    for (size_t j = (i + 1) & mask; MM_STATE(m, j) == MM_LIVE; j = (j + 1) & mask) {
        size_t home = (size_t)key_hash(MM_KEY(m, j), MM_LEN(m, j)) & mask;
        if (stays(home, i, j))
            continue;
        memcpy(MM_SLOT(m, i), MM_SLOT(m, j), (size_t)m->stride);
        i = j;
    }
    MM_STATE(m, i) = MM_EMPTY;
}

/* Clear bit ``slot`` of key k's mask, dropping a key left without bits. */
static void
mm_discard(MM *m, const uint8_t *k, Py_ssize_t len, Py_ssize_t slot)
{
    Py_ssize_t i = mm_find(m, k, len, key_hash(k, len));
    if (i < 0 || slot < 0 || (slot >> 3) >= m->width)
        return;
    uint8_t *bits = MM_BITS(m, i);
    bits[slot >> 3] &= (uint8_t)~(1 << (slot & 7));
    for (Py_ssize_t b = 0; b < m->width; b++)
        if (bits[b])
            return;
    mm_erase(m, (size_t)i);
    m->used--;
    m->fill--;
}

/* The bits of bytes key ``key`` (NULL when absent or not a key). */
static const uint8_t *
mm_bits_of(MM *m, PyObject *key)
{
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) > MAX_KEY)
        return NULL;
    const uint8_t *k = (const uint8_t *)PyBytes_AS_STRING(key);
    Py_ssize_t len = PyBytes_GET_SIZE(key);
    Py_ssize_t i = mm_find(m, k, len, key_hash(k, len));
    return i < 0 ? NULL : MM_BITS(m, i);
}

static int
mm_key_arg(PyObject *key, const uint8_t **k, Py_ssize_t *len)
{
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "MaskMap keys are bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *len = PyBytes_GET_SIZE(key);
    if (*len > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "MaskMap keys are at most %d bytes, got %zd", MAX_KEY, *len);
        return -1;
    }
    *k = (const uint8_t *)PyBytes_AS_STRING(key);
    return 0;
}

static PyObject *
mm_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "MaskMap() takes no arguments");
        return NULL;
    }
    MM *m = (MM *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    m->kw = 8;
    m->width = 8;
    m->stride = MM_HDR + 16;
    return (PyObject *)m;
}

static void
mm_dealloc(MM *m)
{
    PyMem_Free(m->slots);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static int
mm_reserve(MM *m, Py_ssize_t slot)
{
    if (slot < 8 * m->width)
        return 0;
    Py_ssize_t width = ((slot >> 6) + 1) * 8;
    if (!m->cap) {
        m->width = width;
        m->stride = MM_HDR + m->kw + width;
        return 0;
    }
    return mm_rebuild(m, m->cap, m->kw, width);
}

static PyObject *
mm_py_reserve(MM *m, PyObject *arg)
{
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (mm_reserve(m, slot) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int
mm_args(PyObject *const *args, Py_ssize_t nargs, const char *name, const uint8_t **k,
        Py_ssize_t *len, Py_ssize_t *slot)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "MaskMap.%s(key, slot)", name);
        return -1;
    }
    if (mm_key_arg(args[0], k, len) < 0)
        return -1;
    *slot = PyLong_AsSsize_t(args[1]);
    return *slot == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *
mm_py_add(MM *m, PyObject *const *args, Py_ssize_t nargs)
{
    const uint8_t *k;
    Py_ssize_t len, slot;
    if (mm_args(args, nargs, "add", &k, &len, &slot) < 0 || mm_add(m, k, len, slot) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
mm_py_discard(MM *m, PyObject *const *args, Py_ssize_t nargs)
{
    const uint8_t *k;
    Py_ssize_t len, slot;
    if (mm_args(args, nargs, "discard", &k, &len, &slot) < 0)
        return NULL;
    mm_discard(m, k, len, slot);
    Py_RETURN_NONE;
}

/* An int of ``width`` little-endian bytes. */
static PyObject *
bits_int(const uint8_t *b, Py_ssize_t width)
{
    return _PyLong_FromByteArray(b, (size_t)width, 1, 0);
}

static PyObject *
mm_py_get(MM *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "MaskMap.get(key, default=0)");
        return NULL;
    }
    const uint8_t *b = mm_bits_of(m, args[0]);
    if (b == NULL)
        return nargs == 2 ? Py_NewRef(args[1]) : PyLong_FromLong(0);
    return bits_int(b, m->width);
}

static PyObject *
mm_py_as_dict(MM *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < m->cap; i++) {
        if (MM_STATE(m, i) != MM_LIVE)
            continue;
        PyObject *k = PyBytes_FromStringAndSize((const char *)MM_KEY(m, i), MM_LEN(m, i));
        PyObject *v = k == NULL ? NULL : bits_int(MM_BITS(m, i), m->width);
        int bad = v == NULL || PyDict_SetItem(d, k, v) < 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (bad) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

static Py_ssize_t
mm_len(MM *m)
{
    return m->used;
}

static int
mm_contains(MM *m, PyObject *key)
{
    return mm_bits_of(m, key) != NULL;
}

static PyObject *
mm_get_width(MM *m, void *Py_UNUSED(c))
{
    return PyLong_FromSsize_t(m->width);
}

static PyObject *
mm_nbytes(MM *m, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(sizeof(MM) + (size_t)m->cap * (size_t)m->stride);
}

static PyObject *
mm_repr(MM *m)
{
    return PyUnicode_FromFormat("<MaskMap keys=%zd width=%zd (native)>", m->used, m->width);
}

/* ------------------------------------------------------------------ the prefix search */

/* kvstream.index.domain.prefix_depths over this map: masks only shrink along a request's
 * chain, so bisect between positions whose masks differ. */
typedef struct {
    MM *m;
    PyObject *hashes, *out;
    const uint8_t *allowed;
    Py_ssize_t width;
    uint8_t *scratch;     /* width bytes per recursion level */
    Py_ssize_t *depth_of; /* per slot: its deepest depth (slot_depths), else pairs to out */
} Search;

static void
search_get(Search *s, Py_ssize_t i, uint8_t *dst)
{
    const uint8_t *b = mm_bits_of(s->m, PyList_GET_ITEM(s->hashes, i));
    if (b == NULL)
        memset(dst, 0, (size_t)s->width);
    else
        memcpy(dst, b, (size_t)s->width);
    if (s->allowed != NULL)
        for (Py_ssize_t k = 0; k < s->width; k++)
            dst[k] &= s->allowed[k];
}

static int
is_zero(const uint8_t *b, Py_ssize_t w)
{
    for (Py_ssize_t k = 0; k < w; k++)
        if (b[k])
            return 0;
    return 1;
}

static int
search_emit(Search *s, const uint8_t *mlo, const uint8_t *mhi, Py_ssize_t depth)
{
    uint8_t *b = s->scratch; /* level 0 is free once the split runs */
    for (Py_ssize_t k = 0; k < s->width; k++)
        b[k] = mlo[k] & (uint8_t)~mhi[k];
    if (s->depth_of != NULL) {
        for (Py_ssize_t k = 0; k < s->width; k++)
            for (int j = 0; b[k] >> j; j++)
                if ((b[k] >> j) & 1 && s->depth_of[8 * k + j] < depth)
                    s->depth_of[8 * k + j] = depth;
        return 0;
    }
    PyObject *pair = pair_steal(bits_int(b, s->width), PyLong_FromSsize_t(depth));
    if (pair == NULL)
        return -1;
    int rc = PyList_Append(s->out, pair);
    Py_DECREF(pair);
    return rc;
}

static int
search_split(Search *s, Py_ssize_t lo, const uint8_t *mlo, Py_ssize_t hi, const uint8_t *mhi,
             int level)
{
    Py_ssize_t mid = (lo + hi) >> 1;
    if (mid == lo)
        return search_emit(s, mlo, mhi, hi);
    uint8_t *mm = s->scratch + (Py_ssize_t)level * s->width;
    search_get(s, mid, mm);
    if (memcmp(mm, mlo, (size_t)s->width) && search_split(s, lo, mlo, mid, mm, level + 1) < 0)
        return -1;
    if (memcmp(mm, mhi, (size_t)s->width) && search_split(s, mid, mm, hi, mhi, level + 1) < 0)
        return -1;
    return 0;
}

static PyObject *
mm_search(MM *m, PyObject *const *args, Py_ssize_t nargs, int per_slot)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "(hashes: list of bytes, allowed: width bytes or None)");
        return NULL;
    }
    Search s = {m, args[0], NULL, NULL, m->width, NULL, NULL};
    if (args[1] != Py_None) {
        if (!PyBytes_Check(args[1]) || PyBytes_GET_SIZE(args[1]) != m->width) {
            PyErr_SetString(PyExc_ValueError, "MaskMap search: allowed must be width bytes");
            return NULL;
        }
        s.allowed = (const uint8_t *)PyBytes_AS_STRING(args[1]);
    }
    PyObject *out = PyList_New(0);
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (out == NULL || !n)
        return out;
    s.out = out;
    int levels = 4; /* 0 for emit, 1 and 2 for both ends, 3 for zero, one per level */
    for (Py_ssize_t k = n; k; k >>= 1)
        levels++;
    s.scratch = PyMem_Malloc((size_t)(levels * m->width));
    if (s.scratch == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    uint8_t *first = s.scratch + m->width, *last = s.scratch + 2 * m->width;
    search_get(&s, 0, first);
    if (is_zero(first, m->width))
        goto done;
    search_get(&s, n - 1, last);
    if (per_slot && (s.depth_of = PyMem_Calloc((size_t)(8 * m->width), sizeof(Py_ssize_t))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (!is_zero(last, m->width)) {
        uint8_t *zero = s.scratch + 3 * m->width;
        memset(zero, 0, (size_t)m->width);
        if (search_emit(&s, last, zero, n) < 0)
            goto fail;
    }
    if (memcmp(first, last, (size_t)m->width) && search_split(&s, 0, first, n - 1, last, 4) < 0)
        goto fail;
    if (per_slot)
        for (Py_ssize_t k = 0; k < 8 * m->width; k++) {
            if (!s.depth_of[k])
                continue;
            PyObject *pair = pair_steal(PyLong_FromSsize_t(k), PyLong_FromSsize_t(s.depth_of[k]));
            int bad = pair == NULL || PyList_Append(out, pair) < 0;
            Py_XDECREF(pair);
            if (bad)
                goto fail;
        }
done:
    PyMem_Free(s.depth_of);
    PyMem_Free(s.scratch);
    return out;
fail:
    PyMem_Free(s.depth_of);
    PyMem_Free(s.scratch);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
mm_prefix_depths(MM *m, PyObject *const *args, Py_ssize_t nargs)
{
    return mm_search(m, args, nargs, 0);
}

static PyObject *
mm_slot_depths(MM *m, PyObject *const *args, Py_ssize_t nargs)
{
    return mm_search(m, args, nargs, 1);
}

static PyMethodDef mm_methods[] = {
    {"reserve", (PyCFunction)mm_py_reserve, METH_O, "Make room for bit slot in every entry."},
    {"add", (PyCFunction)(void (*)(void))mm_py_add, METH_FASTCALL, "Set bit slot of key's mask."},
    {"discard", (PyCFunction)(void (*)(void))mm_py_discard, METH_FASTCALL,
     "Clear bit slot of key's mask; a key left without bits is dropped."},
    {"get", (PyCFunction)(void (*)(void))mm_py_get, METH_FASTCALL, "The mask of key as an int."},
    {"as_dict", (PyCFunction)mm_py_as_dict, METH_NOARGS, "Every key's mask as an int."},
    {"prefix_depths", (PyCFunction)(void (*)(void))mm_prefix_depths, METH_FASTCALL,
     "(workers mask, depth) pairs of a request's hashes (domain.prefix_depths)."},
    {"slot_depths", (PyCFunction)(void (*)(void))mm_slot_depths, METH_FASTCALL,
     "(slot, depth) of every slot holding a prefix of the hashes, in slot order."},
    {"nbytes", (PyCFunction)mm_nbytes, METH_NOARGS, "Bytes the table holds."},
    {NULL},
};

static PyGetSetDef mm_getset[] = {
    {"width", (getter)mm_get_width, NULL, "Bytes of bits per key (8 per 64 worker slots).", NULL},
    {NULL},
};

static PySequenceMethods mm_as_sequence = {
    .sq_length = (lenfunc)mm_len,
    .sq_contains = (objobjproc)mm_contains,
};

static PyTypeObject MMType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream._native._index.MaskMap",
    .tp_doc = "Block key -> bitmask of worker slots, keys inline (kvstream.index.domain).",
    .tp_basicsize = sizeof(MM),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = mm_new,
    .tp_dealloc = (destructor)mm_dealloc,
    .tp_repr = (reprfunc)mm_repr,
    .tp_as_sequence = &mm_as_sequence,
    .tp_methods = mm_methods,
    .tp_getset = mm_getset,
};
