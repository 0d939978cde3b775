/* kvstream.index._match_native: the per-worker results of PrefixIndex.match, in one C call.
 *
 *   fill(out, found, rows, new, n, tpb, algo, w0) -> list
 *
 * For each ``(slot, depth)`` pair of ``found`` (what HashDomain.slot_depths returns), the
 * plan row ``rows[slot] = (key, table, domain, trusted, note, pos, more)`` names the worker;
 * when its table holds no block below the first tier (``table.lower`` is 0), the result is
 * ``new(key, depth, depth * w0, n, tpb, algo, trusted, note)`` and it is stored at ``out[pos]``
 * and at ``out[i]`` for every ``i`` in ``more``. Pairs whose table has lower-tier blocks are
 * returned (in order) for the caller to weigh block by block (``GroupTable.weighted``).
 *
 * This is the loop of kvstream/index/index.py's PrefixIndex.match without the interpreter's
 * per-worker steps; that loop is the reference and the fallback (KVSTREAM_NO_NATIVE=1 or no C
 * compiler). tests/test_match_native.py checks both give identical results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_lower;

static PyObject *
fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "fill() takes 8 arguments");
        return NULL;
    }
    PyObject *out = args[0], *found = args[1], *rows = args[2], *new = args[3];
    PyObject *n = args[4], *tpb = args[5], *algo = args[6];
    double w0 = PyFloat_AsDouble(args[7]);
    if (w0 == -1.0 && PyErr_Occurred())
        return NULL;
    if (!PyList_Check(out) || !PyList_Check(found) || !PyDict_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "fill(): out and found must be lists, rows a dict");
        return NULL;
    }
    PyObject *left = PyList_New(0);
    if (left == NULL)
        return NULL;
    Py_ssize_t size = PyList_GET_SIZE(out);
    Py_ssize_t count = PyList_GET_SIZE(found);
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *pair = PyList_GET_ITEM(found, j);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "fill(): found holds (slot, depth) pairs");
            goto fail;
        }
        PyObject *slot = PyTuple_GET_ITEM(pair, 0), *depth = PyTuple_GET_ITEM(pair, 1);
        PyObject *row = PyDict_GetItemWithError(rows, slot);
        if (row == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, slot);
            goto fail;
        }
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 7) {
            PyErr_SetString(PyExc_TypeError, "fill(): a plan row is a 7-tuple");
            goto fail;
        }
        PyObject *lower = PyObject_GetAttr(PyTuple_GET_ITEM(row, 1), s_lower);
        if (lower == NULL)
            goto fail;
        int has_lower = PyObject_IsTrue(lower);
        Py_DECREF(lower);
        if (has_lower < 0)
            goto fail;
        if (has_lower) {
            if (PyList_Append(left, pair) < 0)
                goto fail;
            continue;
        }
        long long d = PyLong_AsLongLong(depth);
        if (d == -1 && PyErr_Occurred())
            goto fail;
        PyObject *weighted = PyFloat_FromDouble((double)d * w0);
        if (weighted == NULL)
            goto fail;
        PyObject *call[8] = {
            PyTuple_GET_ITEM(row, 0), depth, weighted, n, tpb, algo,
            PyTuple_GET_ITEM(row, 3), PyTuple_GET_ITEM(row, 4),
        };
        PyObject *m = PyObject_Vectorcall(new, call, 8, NULL);
        Py_DECREF(weighted);
        if (m == NULL)
            goto fail;
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 5));
        if (pos == -1 && PyErr_Occurred()) {
            Py_DECREF(m);
            goto fail;
        }
        if (pos < 0 || pos >= size) {
            Py_DECREF(m);
            PyErr_SetString(PyExc_IndexError, "fill(): a row's position is outside out");
            goto fail;
        }
        PyObject *more = PyTuple_GET_ITEM(row, 6);
        if (!PyList_Check(more)) {
            Py_DECREF(m);
            PyErr_SetString(PyExc_TypeError, "fill(): a row's further positions are a list");
            goto fail;
        }
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(more); k++) {
            Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(more, k));
            if (i == -1 && PyErr_Occurred()) {
                Py_DECREF(m);
                goto fail;
            }
            if (i < 0 || i >= size) {
                Py_DECREF(m);
                PyErr_SetString(PyExc_IndexError, "fill(): a row's position is outside out");
                goto fail;
            }
            Py_INCREF(m);
            PyList_SetItem(out, i, m); /* steals the new reference, drops the old item */
        }
        PyList_SetItem(out, pos, m); /* steals m */
    }
    return left;
fail:
    Py_DECREF(left);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL,
     "fill(out, found, rows, new, n, tpb, algo, w0) -> pairs left to weigh"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_match_native", "PrefixIndex.match's per-worker results in C.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__match_native(void)
{
    s_lower = PyUnicode_InternFromString("lower");
    if (s_lower == NULL)
        return NULL;
    return PyModule_Create(&module);
}
