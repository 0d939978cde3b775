/*
 * kvstream.index._table_native: the hot loop of GroupTable.store_hashes in C.
 *
 *   store_run(table, hashes, start, p, ok, inc) -> (stop, p, added)
 *
 * Links the blocks hashes[start:], all stored at one cache level (``inc``: the packed
 * reference count of one store at that level), as a chain under node ``p`` (ROOT = -1), each
 * new block rooted when ``ok``, exactly as the pure-Python loop of
 * kvstream/index/table.py (GroupTable.store_hashes) does for blocks the table does not know:
 * a node id from the table's free list (or the next one), ``ids[h] = n``, the parallel
 * lists (hashes, parent, refs, kid, rooted) written, the node linked under its parent
 * (``kid`` or the ``more`` side sets) and, when rooted and attached, ``bit`` or-ed into
 * ``masks[h]``. It stops at the first block the table already holds: ``stop`` is its index
 * in ``hashes`` (len(hashes) when none), ``p`` the last node linked and ``added`` how many
 * nodes were created; the caller applies that block (a duplicate store or a ghost stored
 * again) in Python and calls again from stop + 1. The caller keeps the present/lower gauges.
 *
 * table.py is the reference and the fallback (KVSTREAM_NO_NATIVE=1 or no C compiler);
 * tests/test_index_fastpath.py checks both give identical tables.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_ids, *s_hashes, *s_parent, *s_refs, *s_kid, *s_rooted, *s_free, *s_more,
    *s_masks, *s_bit;
static PyObject *nil; /* -1 */

typedef struct {
    PyObject *ids, *hashes, *parent, *refs, *kid, *rooted, *free, *more, *masks, *bit;
} Table;

static void
table_release(Table *t)
{
    Py_XDECREF(t->ids);
    Py_XDECREF(t->hashes);
    Py_XDECREF(t->parent);
    Py_XDECREF(t->refs);
    Py_XDECREF(t->kid);
    Py_XDECREF(t->rooted);
    Py_XDECREF(t->free);
    Py_XDECREF(t->more);
    Py_XDECREF(t->masks);
    Py_XDECREF(t->bit);
}

static int
table_get(PyObject *obj, Table *t)
{
    memset(t, 0, sizeof(*t));
    if (!(t->ids = PyObject_GetAttr(obj, s_ids)) || !(t->hashes = PyObject_GetAttr(obj, s_hashes))
        || !(t->parent = PyObject_GetAttr(obj, s_parent))
        || !(t->refs = PyObject_GetAttr(obj, s_refs)) || !(t->kid = PyObject_GetAttr(obj, s_kid))
        || !(t->rooted = PyObject_GetAttr(obj, s_rooted))
        || !(t->free = PyObject_GetAttr(obj, s_free))
        || !(t->more = PyObject_GetAttr(obj, s_more))
        || !(t->masks = PyObject_GetAttr(obj, s_masks)) || !(t->bit = PyObject_GetAttr(obj, s_bit)))
        return -1;
    if (!PyDict_CheckExact(t->ids) || !PyList_CheckExact(t->hashes) || !PyList_CheckExact(t->parent)
        || !PyList_CheckExact(t->refs) || !PyList_CheckExact(t->kid)
        || !PyByteArray_CheckExact(t->rooted) || !PyList_CheckExact(t->free)
        || !PyDict_CheckExact(t->more) || !(t->masks == Py_None || PyDict_CheckExact(t->masks))
        || !PyLong_CheckExact(t->bit)) {
        PyErr_SetString(PyExc_TypeError, "store_run: not a GroupTable's state");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(t->hashes);
    if (PyList_GET_SIZE(t->parent) != n || PyList_GET_SIZE(t->refs) != n
        || PyList_GET_SIZE(t->kid) != n || PyByteArray_GET_SIZE(t->rooted) != n) {
        PyErr_SetString(PyExc_ValueError, "store_run: the table's columns differ in length");
        return -1;
    }
    return 0;
}

/* more[p].add(n), creating the set. */
static int
add_more(PyObject *more, PyObject *pobj, PyObject *nobj)
{
    PyObject *s = PyDict_GetItemWithError(more, pobj); /* borrowed */
    if (s == NULL) {
        if (PyErr_Occurred())
            return -1;
        s = PySet_New(NULL);
        if (s == NULL)
            return -1;
        int rc = PySet_Add(s, nobj);
        if (rc == 0)
            rc = PyDict_SetItem(more, pobj, s);
        Py_DECREF(s);
        return rc;
    }
    if (!PySet_CheckExact(s)) {
        PyErr_SetString(PyExc_TypeError, "store_run: a GroupTable.more entry is not a set");
        return -1;
    }
    return PySet_Add(s, nobj);
}

static PyObject *
store_run(PyObject *module, PyObject *args)
{
    PyObject *obj, *hashes, *inc;
    Py_ssize_t start, p;
    int ok;
    if (!PyArg_ParseTuple(args, "OO!nnpO!", &obj, &PyList_Type, &hashes, &start, &p, &ok,
                          &PyLong_Type, &inc))
        return NULL;
    Table t;
    if (table_get(obj, &t) < 0) {
        table_release(&t);
        return NULL;
    }
    Py_ssize_t end = PyList_GET_SIZE(hashes);
    Py_ssize_t nodes = PyList_GET_SIZE(t.hashes);
    Py_ssize_t i, added = 0;
    if (start < 0 || start > end || p < -2 || p >= nodes) {
        PyErr_SetString(PyExc_ValueError, "store_run: start or parent out of range");
        goto error;
    }
    for (i = start; i < end; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        Py_ssize_t nfree = PyList_GET_SIZE(t.free);
        Py_ssize_t n;
        if (nfree) {
            n = PyLong_AsSsize_t(PyList_GET_ITEM(t.free, nfree - 1));
            if (n == -1 && PyErr_Occurred())
                goto error;
            if (n < 0 || n >= nodes) {
                PyErr_SetString(PyExc_ValueError, "store_run: a free node id is out of range");
                goto error;
            }
        }
        else {
            n = nodes;
        }
        PyObject *nobj = PyLong_FromSsize_t(n);
        if (nobj == NULL)
            goto error;
        PyObject *got = PyDict_SetDefault(t.ids, h, nobj); /* borrowed */
        if (got == NULL) {
            Py_DECREF(nobj);
            goto error;
        }
        if (got != nobj) {
            /* a key already present maps to a live node, never to a free or new id */
            Py_DECREF(nobj);
            break;
        }
        if (p >= 0) {
            Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(t.kid, p));
            if (k == -1 && PyErr_Occurred()) {
                Py_DECREF(nobj);
                goto error;
            }
            if (k < 0) {
                Py_INCREF(nobj);
                PyList_SetItem(t.kid, p, nobj);
            }
            else {
                PyObject *pobj = PyLong_FromSsize_t(p);
                int rc = pobj == NULL ? -1 : add_more(t.more, pobj, nobj);
                Py_XDECREF(pobj);
                if (rc < 0) {
                    Py_DECREF(nobj);
                    goto error;
                }
            }
        }
        PyObject *pobj = PyLong_FromSsize_t(p);
        if (pobj == NULL) {
            Py_DECREF(nobj);
            goto error;
        }
        if (n == nodes) {
            int rc = PyList_Append(t.hashes, h);
            if (rc == 0)
                rc = PyList_Append(t.parent, pobj);
            if (rc == 0)
                rc = PyList_Append(t.refs, inc);
            if (rc == 0)
                rc = PyList_Append(t.kid, nil);
            if (rc == 0)
                rc = PyByteArray_Resize(t.rooted, nodes + 1);
            Py_DECREF(pobj);
            if (rc < 0) {
                Py_DECREF(nobj);
                goto error;
            }
            PyByteArray_AS_STRING(t.rooted)[nodes] = (char)ok;
            nodes++;
        }
        else {
            if (PyList_SetSlice(t.free, nfree - 1, nfree, NULL) < 0) {
                Py_DECREF(pobj);
                Py_DECREF(nobj);
                goto error;
            }
            Py_INCREF(h);
            PyList_SetItem(t.hashes, n, h);
            PyList_SetItem(t.parent, n, pobj); /* steals */
            Py_INCREF(inc);
            PyList_SetItem(t.refs, n, inc);
            Py_INCREF(nil);
            PyList_SetItem(t.kid, n, nil);
            PyByteArray_AS_STRING(t.rooted)[n] = (char)ok;
        }
        Py_DECREF(nobj);
        if (ok && t.masks != Py_None) {
            PyObject *m = PyDict_SetDefault(t.masks, h, t.bit); /* borrowed */
            if (m == NULL)
                goto error;
            if (m != t.bit) {
                PyObject *or = PyNumber_Or(m, t.bit);
                int rc = or == NULL ? -1 : PyDict_SetItem(t.masks, h, or);
                Py_XDECREF(or);
                if (rc < 0)
                    goto error;
            }
        }
        added++;
        p = n;
    }
    table_release(&t);
    return Py_BuildValue("nnn", i, p, added);
error:
    table_release(&t);
    return NULL;
}

static PyMethodDef methods[] = {
    {"store_run", store_run, METH_VARARGS,
     "store_run(table, hashes, start, p, ok, inc) -> (stop, p, added): link the blocks "
     "hashes[start:] the table does not hold (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_table_native",
    "C loop of kvstream.index.table.GroupTable.store_hashes (optional accelerator).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__table_native(void)
{
#define INTERN(var, name)                                                                         \
    if (!(var = PyUnicode_InternFromString(name)))                                                \
        return NULL;
    INTERN(s_ids, "ids");
    INTERN(s_hashes, "hashes");
    INTERN(s_parent, "parent");
    INTERN(s_refs, "refs");
    INTERN(s_kid, "kid");
    INTERN(s_rooted, "rooted");
    INTERN(s_free, "free");
    INTERN(s_more, "more");
    INTERN(s_masks, "masks");
    INTERN(s_bit, "bit");
#undef INTERN
    if (!(nil = PyLong_FromLong(-1)))
        return NULL;
    return PyModule_Create(&module);
}
