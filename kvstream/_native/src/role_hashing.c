/* kvstream._native._hashing: the block-hash chains (see roles.h). */
#include "roles.h"

PyMODINIT_FUNC PyInit__v1native(void);
PyMODINIT_FUNC PyInit__chainnative(void);

static struct PyModuleDef role = {
    PyModuleDef_HEAD_INIT, "kvstream._native._hashing",
    "kvstream's native hashing: TensorRT-LLM's v1 keys (_v1native), the SHA-256/xxHash/BLAKE3 "
    "chains (_chainnative).",
    -1, NULL,
};

PyMODINIT_FUNC
PyInit__hashing(void)
{
    PyObject *m = PyModule_Create(&role);

    if (m == NULL)
        return NULL;
    if (role_attach(m, "kvstream.hashing._v1native", PyInit__v1native) < 0
        || role_attach(m, "kvstream.hashing._chainnative", PyInit__chainnative) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
