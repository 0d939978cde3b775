/*
 * Small tuple builders shared by the native parts (header-only: each part is its own
 * translation unit).
 */
#ifndef KVSTREAM_PY_PAIRS_H
#define KVSTREAM_PY_PAIRS_H

#include <Python.h>

/* The tuple (a, b), stealing both references; either may be NULL (an error already set), and
 * then both are released and NULL returned. No format string is parsed per pair, as
 * Py_BuildValue would (a few percent of a match with 64 candidates). */
static inline PyObject *
pair_steal(PyObject *a, PyObject *b)
{
    PyObject *t = a == NULL || b == NULL ? NULL : PyTuple_New(2);
    if (t == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, a);
    PyTuple_SET_ITEM(t, 1, b);
    return t;
}

#endif
