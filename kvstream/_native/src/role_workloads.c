/* kvstream._native._workloads: trace generators (see roles.h). */
#include "roles.h"

PyMODINIT_FUNC PyInit__mooncake_native(void);

static struct PyModuleDef role = {
    PyModuleDef_HEAD_INIT, "kvstream._native._workloads",
    "kvstream's native workload generators: the Mooncake trace's blocks (_mooncake_native).",
    -1, NULL,
};

PyMODINIT_FUNC
PyInit__workloads(void)
{
    PyObject *m = PyModule_Create(&role);

    if (m == NULL)
        return NULL;
    if (role_attach(m, "kvstream.workloads._mooncake_native", PyInit__mooncake_native) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
