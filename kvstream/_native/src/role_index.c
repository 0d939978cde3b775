/* kvstream._native._index: the index's tables and matching (see roles.h). The role module is
 * the table core itself (GroupTable, TokenTable, MaskMap: their type names say
 * kvstream._native._index), with the older parts as submodules. */
#include "roles.h"

PyObject *kvs_index_core(void);
PyMODINIT_FUNC PyInit__table_native(void);
PyMODINIT_FUNC PyInit__match_native(void);

PyMODINIT_FUNC
PyInit__index(void)
{
    PyObject *m = kvs_index_core();

    if (m == NULL)
        return NULL;
    if (role_attach(m, "kvstream.index._table_native", PyInit__table_native) < 0
        || role_attach(m, "kvstream.index._match_native", PyInit__match_native) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
