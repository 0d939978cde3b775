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
 * (and ``score``, below: Router.route's per-worker scores).
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

/* score(matches, pending, blocks, requests, base, n_tokens, factor, default_tpb, new)
 *     -> (scores, costs)
 *
 * Router.route's per-worker loop (kvstream/index/router.py, the reference and the fallback):
 * for worker i, ``tpb = m.tokens_per_block or default_tpb``, ``prefill = max(n_tokens -
 * (m.weighted_blocks * tpb if m.trusted else 0.0), 0.0) / tpb``, ``cost = factor * prefill +
 * base[i]`` and the score ``new(m, requests[i], blocks[i], prefill, cost, pending[i])``, in
 * the same double arithmetic as Python's. */
static PyObject *s_tpb, *s_weighted, *s_trusted;

static PyObject *
score(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "score() takes 9 arguments");
        return NULL;
    }
    PyObject *matches = args[0], *pending = args[1], *blocks = args[2], *requests = args[3];
    PyObject *base = args[4], *new = args[8];
    if (!PyTuple_Check(matches) || !PyTuple_Check(pending) || !PyTuple_Check(blocks)
        || !PyTuple_Check(requests) || !PyTuple_Check(base)) {
        PyErr_SetString(PyExc_TypeError, "score(): the columns must be tuples");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(matches);
    if (PyTuple_GET_SIZE(pending) != n || PyTuple_GET_SIZE(blocks) != n
        || PyTuple_GET_SIZE(requests) != n || PyTuple_GET_SIZE(base) != n) {
        PyErr_SetString(PyExc_ValueError, "score(): columns of different lengths");
        return NULL;
    }
    double n_tokens = PyFloat_AsDouble(args[5]);
    if (n_tokens == -1.0 && PyErr_Occurred())
        return NULL;
    double factor = PyFloat_AsDouble(args[6]);
    if (factor == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *default_tpb = args[7];
    PyObject *scores = PyList_New(n), *costs = PyList_New(n);
    if (scores == NULL || costs == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyTuple_GET_ITEM(matches, i);
        PyObject *t = PyObject_GetAttr(m, s_tpb);
        if (t == NULL)
            goto fail;
        int truthy = PyObject_IsTrue(t);
        if (truthy < 0) {
            Py_DECREF(t);
            goto fail;
        }
        double tpb = PyFloat_AsDouble(truthy ? t : default_tpb);
        Py_DECREF(t);
        if (tpb == -1.0 && PyErr_Occurred())
            goto fail;
        PyObject *tr = PyObject_GetAttr(m, s_trusted);
        if (tr == NULL)
            goto fail;
        int trusted = PyObject_IsTrue(tr);
        Py_DECREF(tr);
        if (trusted < 0)
            goto fail;
        double used = 0.0;
        if (trusted) {
            PyObject *w = PyObject_GetAttr(m, s_weighted);
            if (w == NULL)
                goto fail;
            double wb = PyFloat_AsDouble(w);
            Py_DECREF(w);
            if (wb == -1.0 && PyErr_Occurred())
                goto fail;
            used = wb * tpb;
        }
        double left = n_tokens - used;
        double q = PyFloat_AsDouble(PyTuple_GET_ITEM(base, i));
        if (q == -1.0 && PyErr_Occurred())
            goto fail;
        double prefill = (left > 0.0 ? left : 0.0) / tpb;
        PyObject *p = PyFloat_FromDouble(prefill);
        if (p == NULL)
            goto fail;
        PyObject *c = PyFloat_FromDouble(factor * prefill + q);
        if (c == NULL) {
            Py_DECREF(p);
            goto fail;
        }
        PyObject *call[6] = {
            m, PyTuple_GET_ITEM(requests, i), PyTuple_GET_ITEM(blocks, i), p, c,
            PyTuple_GET_ITEM(pending, i),
        };
        PyObject *sc = PyObject_Vectorcall(new, call, 6, NULL);
        Py_DECREF(p);
        if (sc == NULL) {
            Py_DECREF(c);
            goto fail;
        }
        PyList_SET_ITEM(scores, i, sc);
        PyList_SET_ITEM(costs, i, c);
    }
    return Py_BuildValue("(NN)", scores, costs);
fail:
    Py_XDECREF(scores);
    Py_XDECREF(costs);
    return NULL;
}

static PyMethodDef methods[] = {
    {"score", (PyCFunction)(void (*)(void))score, METH_FASTCALL,
     "score(matches, pending, blocks, requests, base, n_tokens, factor, default_tpb, new) "
     "-> (scores, costs)"},
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
    s_tpb = PyUnicode_InternFromString("tokens_per_block");
    s_weighted = PyUnicode_InternFromString("weighted_blocks");
    s_trusted = PyUnicode_InternFromString("trusted");
    if (s_lower == NULL || s_tpb == NULL || s_weighted == NULL || s_trusted == NULL)
        return NULL;
    return PyModule_Create(&module);
}
