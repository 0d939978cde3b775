/*
 * kvstream.index._table_native: the hot loops of GroupTable.store_hashes and .remove in C.
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
 *   remove_run(table, hashes, start) -> (stop, removed)
 *
 * The common removal, as GroupTable.remove does it: a block holding exactly one reference,
 * on the GPU (refs == 1), with no children. Its count drops to 0, it leaves the masks
 * (when rooted and attached), and it is deleted with the childless ghost ancestors it leaves
 * (_delete_up: unlinked from its parent, ``ids`` entry dropped, slot freed). It stops at the
 * first hash that is not such a block (unknown, several references, deeper tiers, children):
 * ``stop`` is its index, ``removed`` how many blocks left; the caller applies that hash in
 * Python (which counts what needs counting) and calls again from stop + 1. Only for plain
 * engine-hash tables (a token table's keys differ from its hashes), with the removal's level
 * None or 0. The caller keeps the present gauge.
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

/* _unlink(n) of table.py: take node n out of its parent's children. */
static int
unlink_node(Table *t, Py_ssize_t n, Py_ssize_t p)
{
    if (p < 0)
        return 0;
    PyObject *pobj = PyLong_FromSsize_t(p);
    if (pobj == NULL)
        return -1;
    PyObject *s = PyDict_GetItemWithError(t->more, pobj); /* borrowed */
    int rc = 0;
    if (s == NULL && PyErr_Occurred()) {
        rc = -1;
        goto done;
    }
    if (s != NULL && !PySet_CheckExact(s)) {
        PyErr_SetString(PyExc_TypeError, "remove_run: a GroupTable.more entry is not a set");
        rc = -1;
        goto done;
    }
    Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(t->kid, p));
    if (k == -1 && PyErr_Occurred()) {
        rc = -1;
        goto done;
    }
    if (k == n) {
        if (s != NULL && PySet_GET_SIZE(s)) {
            PyObject *c = PySet_Pop(s); /* new reference: becomes kid[p] */
            if (c == NULL) {
                rc = -1;
                goto done;
            }
            PyList_SetItem(t->kid, p, c);
            if (!PySet_GET_SIZE(s))
                rc = PyDict_DelItem(t->more, pobj);
        }
        else {
            Py_INCREF(nil);
            PyList_SetItem(t->kid, p, nil);
        }
    }
    else if (s != NULL) {
        PyObject *nobj = PyLong_FromSsize_t(n);
        if (nobj == NULL || PySet_Discard(s, nobj) < 0)
            rc = -1;
        Py_XDECREF(nobj);
        if (rc == 0 && !PySet_GET_SIZE(s))
            rc = PyDict_DelItem(t->more, pobj);
    }
done:
    Py_DECREF(pobj);
    return rc;
}

static PyObject *
remove_run(PyObject *module, PyObject *args)
{
    PyObject *obj, *hashes;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "OO!n", &obj, &PyList_Type, &hashes, &start))
        return NULL;
    Table t;
    if (table_get(obj, &t) < 0) {
        table_release(&t);
        return NULL;
    }
    Py_ssize_t end = PyList_GET_SIZE(hashes);
    Py_ssize_t nodes = PyList_GET_SIZE(t.hashes);
    Py_ssize_t i, removed = 0;
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    PyObject *unknown = PyLong_FromLong(-2);
    PyObject *notbit = PyNumber_Invert(t.bit);
    if (empty == NULL || unknown == NULL || notbit == NULL || start < 0 || start > end) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "remove_run: start out of range");
        goto error;
    }
    for (i = start; i < end; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        PyObject *nobj = PyDict_GetItemWithError(t.ids, h); /* borrowed */
        if (nobj == NULL) {
            if (PyErr_Occurred())
                goto error;
            break; /* unknown: the caller counts it */
        }
        Py_ssize_t n = PyLong_AsSsize_t(nobj);
        if (n == -1 && PyErr_Occurred())
            goto error;
        if (n < 0 || n >= nodes) {
            PyErr_SetString(PyExc_ValueError, "remove_run: a node id is out of range");
            goto error;
        }
        PyObject *r = PyList_GET_ITEM(t.refs, n);
        if (!PyLong_CheckExact(r) || PyLong_AsLong(r) != 1)
            break; /* not exactly one GPU reference */
        if (PyLong_AsSsize_t(PyList_GET_ITEM(t.kid, n)) >= 0)
            break; /* has children: unrooting a subtree, done in Python */
        /* the block leaves: refs 0, unrooted, deleted with its childless ghost ancestors */
        PyObject *zero = PyLong_FromLong(0);
        if (zero == NULL)
            goto error;
        PyList_SetItem(t.refs, n, zero);
        char *rooted = PyByteArray_AS_STRING(t.rooted);
        if (rooted[n] && t.masks != Py_None) {
            PyObject *m = PyDict_GetItemWithError(t.masks, h); /* borrowed */
            if (m == NULL && PyErr_Occurred())
                goto error;
            PyObject *left = m == NULL ? PyLong_FromLong(0) : PyNumber_And(m, notbit);
            if (left == NULL)
                goto error;
            int truth = PyObject_IsTrue(left);
            int rc = truth ? PyDict_SetItem(t.masks, h, left)
                           : (m == NULL ? 0 : PyDict_DelItem(t.masks, h));
            Py_DECREF(left);
            if (truth < 0 || rc < 0)
                goto error;
        }
        rooted[n] = 0;
        removed++;
        for (;;) { /* _delete_up */
            Py_ssize_t p = PyLong_AsSsize_t(PyList_GET_ITEM(t.parent, n));
            if (p == -1 && PyErr_Occurred())
                goto error;
            if (unlink_node(&t, n, p) < 0)
                goto error;
            if (PyDict_DelItem(t.ids, PyList_GET_ITEM(t.hashes, n)) < 0)
                goto error;
            Py_INCREF(empty);
            PyList_SetItem(t.hashes, n, empty);
            Py_INCREF(unknown);
            PyList_SetItem(t.parent, n, unknown);
            PyByteArray_AS_STRING(t.rooted)[n] = 0;
            PyObject *fobj = PyLong_FromSsize_t(n);
            int rc = fobj == NULL ? -1 : PyList_Append(t.free, fobj);
            Py_XDECREF(fobj);
            if (rc < 0)
                goto error;
            if (p < 0)
                break;
            PyObject *rp = PyList_GET_ITEM(t.refs, p);
            int live = PyObject_IsTrue(rp);
            if (live < 0)
                goto error;
            Py_ssize_t kp = PyLong_AsSsize_t(PyList_GET_ITEM(t.kid, p));
            if (kp == -1 && PyErr_Occurred())
                goto error;
            if (live || kp >= 0)
                break;
            n = p;
        }
    }
    Py_DECREF(empty);
    Py_DECREF(unknown);
    Py_DECREF(notbit);
    table_release(&t);
    return Py_BuildValue("nn", i, removed);
error:
    Py_XDECREF(empty);
    Py_XDECREF(unknown);
    Py_XDECREF(notbit);
    table_release(&t);
    return NULL;
}

static PyMethodDef methods[] = {
    {"remove_run", remove_run, METH_VARARGS,
     "remove_run(table, hashes, start) -> (stop, removed): remove the blocks hashes[start:] "
     "that hold exactly one GPU reference and no children (see the module source)."},
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
