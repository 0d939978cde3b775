/* apply_plain: the index's most common batch (stores and removals of plain blocks, see
 * PrefixIndex._apply_plain) applied in one call, the events' tables chosen and checked by the
 * caller. Included by index_table.c after index_tokens.h. */

/* apply_plain(tables, limits, kinds, payloads, layout, tokens, seed, st, start, jstart,
 * stored) -> (next, jnext, removed_blocks, over)
 *
 * From event ``start`` (the ``jstart``-th stored event) on: a ``kinds[i] == stored`` event
 * (payload ``(parent, hashes, level, max tokens)``) is stored in ``tables[i]``, from its token
 * ids when ``layout`` is not None (``layout[j] = (at, sizes)``: u32 ids at ``at`` in
 * ``tokens``, a TokenTable's store_tokens), else by hash (store_hashes); any other event
 * (``(hashes, level)``) is removed. It stops after a store that leaves its table with more
 * present blocks than ``limits[i]`` (``over`` true: the caller evicts, then calls again from
 * ``next``). The counters go to ``st`` as the methods' would. An error leaves the events
 * before the failing one applied. */
/* The items of a tuple or list of at least n items (borrowed), else NULL. */
static inline PyObject **
items_of(PyObject *o, Py_ssize_t n)
{
    if (PyTuple_Check(o))
        return PyTuple_GET_SIZE(o) >= n ? &PyTuple_GET_ITEM(o, 0) : NULL;
    if (PyList_Check(o))
        return PyList_GET_SIZE(o) >= n ? ((PyListObject *)o)->ob_item : NULL;
    return NULL;
}

static PyObject *
apply_plain(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "apply_plain(tables, limits, kinds, payloads, layout, "
                                         "tokens, seed, st, start, jstart, stored)");
        return NULL;
    }
    PyObject *tables = args[0], *limits = args[1], *kinds = args[2], *payloads = args[3];
    PyObject *layout = args[4], *st = args[7];
    if (!PyList_Check(tables) || !PyList_Check(limits) || !PyList_Check(kinds)
        || !PyList_Check(payloads) || (layout != Py_None && !PyList_Check(layout))) {
        PyErr_SetString(PyExc_TypeError, "apply_plain: tables, limits, kinds, payloads and "
                                         "layout are lists");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(kinds);
    if (PyList_GET_SIZE(tables) != n || PyList_GET_SIZE(limits) != n
        || PyList_GET_SIZE(payloads) != n) {
        PyErr_SetString(PyExc_ValueError, "apply_plain: one table, limit and payload per kind");
        return NULL;
    }
    uint64_t seed = PyLong_AsUnsignedLongLongMask(args[6]);
    Py_ssize_t i = PyLong_AsSsize_t(args[8]), j = PyLong_AsSsize_t(args[9]);
    long stored = PyLong_AsLong(args[10]);
    if (PyErr_Occurred())
        return NULL;
    if (i < 0 || j < 0) {
        PyErr_SetString(PyExc_ValueError, "apply_plain: start and jstart are >= 0");
        return NULL;
    }
    int by_tokens = layout != Py_None;
    Py_buffer buf = {0};
    if (by_tokens && PyObject_GetBuffer(args[5], &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    PyTypeObject *want = by_tokens ? &TokTableType : &TabType;
    Tab *last = NULL; /* the table whose counters are not flushed yet */
    Py_ssize_t removed = 0;
    int rc = 0, over = 0;
    for (; i < n && rc == 0 && !over; i++) {
        PyObject *to = PyList_GET_ITEM(tables, i), *data = PyList_GET_ITEM(payloads, i);
        if (!PyObject_TypeCheck(to, want)) {
            PyErr_Format(PyExc_TypeError, "apply_plain: event %zd's table is not a %s", i,
                         want->tp_name);
            rc = -1;
            break;
        }
        Tab *t = (Tab *)to;
        if (last != NULL && last != t && flush_counters(last, st) < 0) {
            rc = -1;
            break;
        }
        last = t;
        long kind = PyLong_AsLong(PyList_GET_ITEM(kinds, i));
        if (kind == -1 && PyErr_Occurred()) {
            rc = -1;
            break;
        }
        if (kind != stored) {
            PyObject **rm = items_of(data, 2);
            if (rm == NULL) {
                PyErr_Format(PyExc_TypeError, "apply_plain: event %zd: a removal is (hashes, "
                                              "level)", i);
                rc = -1;
                break;
            }
            Py_ssize_t k = PyObject_Length(rm[0]);
            rc = k < 0 ? -1 : remove_run(t, rm[0], rm[1]);
            removed += rc == 0 ? k : 0;
            continue;
        }
        PyObject **sv = items_of(data, 4);
        if (sv == NULL) {
            PyErr_Format(PyExc_TypeError, "apply_plain: event %zd: a store is (parent, hashes, "
                                          "level, max tokens)", i);
            rc = -1;
            break;
        }
        PyObject *parent = sv[0], *hashes = sv[1], *level = sv[2];
        if (by_tokens) {
            PyObject *entry = j < PyList_GET_SIZE(layout) ? PyList_GET_ITEM(layout, j) : NULL;
            PyObject **at_sizes = entry == NULL ? NULL : items_of(entry, 2);
            j++;
            if (at_sizes == NULL || !(PyList_Check(at_sizes[1]) || PyTuple_Check(at_sizes[1]))) {
                PyErr_Format(PyExc_ValueError, "apply_plain: stored event %zd has no (at, "
                                               "sizes) in the layout", j - 1);
                rc = -1;
                break;
            }
            PyObject *sizes = at_sizes[1];
            Py_ssize_t at = PyLong_AsSsize_t(at_sizes[0]), total = 0;
            for (Py_ssize_t b = 0; at >= 0 && b < PySequence_Fast_GET_SIZE(sizes); b++) {
                Py_ssize_t sz = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, b));
                if (sz < 0) {
                    at = -1;
                    break;
                }
                total += sz;
            }
            if (at < 0 || total > buf.len / 4 - at) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "apply_plain: stored event %zd's tokens "
                                                   "are outside the token buffer", j - 1);
                rc = -1;
                break;
            }
            rc = store_tokens_run(t, parent, hashes, level, (const uint8_t *)buf.buf + 4 * at,
                                  4 * total, sizes, seed);
        }
        else
            rc = store_hashes_run(t, parent, hashes, level);
        if (rc == 0) {
            long limit = PyLong_AsLong(PyList_GET_ITEM(limits, i));
            if (limit == -1 && PyErr_Occurred())
                rc = -1;
            else
                over = t->present > limit;
        }
    }
    if (buf.obj != NULL)
        PyBuffer_Release(&buf);
    if (last != NULL && flush_counters(last, st) < 0)
        rc = -1;
    if (rc < 0)
        return NULL;
    return Py_BuildValue("nnnO", i, j, removed, over ? Py_True : Py_False);
}
