/* kvstream._native._codec: bytes on the wire, in and out (see roles.h). */
#include "roles.h"

PyMODINIT_FUNC PyInit__tokens_native(void);
PyMODINIT_FUNC PyInit__columns_native(void);
PyMODINIT_FUNC PyInit__wire_native(void);

static struct PyModuleDef role = {
    PyModuleDef_HEAD_INIT, "kvstream._native._codec",
    "kvstream's native codec and wire readers: Avro token planes and batch bodies "
    "(_tokens_native), Avro to columns (_columns_native), vLLM-family msgpack (_wire_native).",
    -1, NULL,
};

PyMODINIT_FUNC
PyInit__codec(void)
{
    PyObject *m = PyModule_Create(&role);

    if (m == NULL)
        return NULL;
    if (role_attach(m, "kvstream.codec._tokens_native", PyInit__tokens_native) < 0
        || role_attach(m, "kvstream.codec._columns_native", PyInit__columns_native) < 0
        || role_attach(m, "kvstream.engines._wire_native", PyInit__wire_native) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
