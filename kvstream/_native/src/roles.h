/*
 * One extension module per role (hashing, codec/wire, index, workloads): each role's module is
 * built from its parts' sources (pyproject.toml's ext-modules) and carries each part as a
 * submodule attribute named as the part's own module was (``_v1native``...). The parts keep
 * their own module definitions and names; kvstream._native.load finds them through their role.
 * A part is also entered in sys.modules under its own name, so an object that names its
 * module there (a pickled type) finds it once its role is loaded.
 */
#ifndef KVSTREAM_ROLES_H
#define KVSTREAM_ROLES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

/* Add the part ``init()`` makes to ``role`` as attribute ``attr``, named ``name`` (its own
 * full module name, whatever its definition says); 0, or -1 with an error. */
static int
role_attach(PyObject *role, const char *name, PyObject *(*init)(void))
{
    PyObject *part = init(), *full;
    const char *attr = strrchr(name, '.');
    int rc;

    if (part == NULL)
        return -1;
    full = PyUnicode_FromString(name);
    rc = full == NULL ? -1 : PyObject_SetAttrString(part, "__name__", full);
    if (rc == 0)
        rc = PyDict_SetItem(PyImport_GetModuleDict(), full, part);
    Py_XDECREF(full);
    if (rc == 0)
        rc = PyModule_AddObjectRef(role, attr ? attr + 1 : name, part);
    Py_DECREF(part);
    return rc;
}

#endif
