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
/* o as a tuple of at least n items (a new reference: a list is copied, so nothing run
 * while the event is applied can change what its items point to), else NULL with no error. */
static inline PyObject *
tuple_of(PyObject *o, Py_ssize_t n)
{
    PyObject *t = NULL;
    if (PyTuple_Check(o))
        t = Py_NewRef(o);
    else if (PyList_Check(o) && (t = PyList_AsTuple(o)) == NULL)
        PyErr_Clear();
    if (t != NULL && PyTuple_GET_SIZE(t) < n)
        Py_CLEAR(t);
    return t;
}

/* One event of apply_plain (see there): its table ``t``, its kind, payload, layout entry
 * (stores by token ids: an (at, sizes) pair, else NULL) and limit. Returns 0, or -1 with an
 * exception set; *removed grows by a removal's block count, *over is set when a store leaves
 * the table with more present blocks than ``limit``. */
static int
apply_event(Tab *t, int is_store, PyObject *data, PyObject *entry, const Py_buffer *buf,
            uint64_t seed, PyObject *limit, Py_ssize_t i, Py_ssize_t *removed, int *over)
{
    int rc = -1;
    PyObject *ev = tuple_of(data, is_store ? 4 : 2), *at_sizes = NULL;
    if (ev == NULL) {
        PyErr_Format(PyExc_TypeError, is_store ? "apply_plain: event %zd: a store is (parent, "
                                                 "hashes, level, max tokens)"
                                               : "apply_plain: event %zd: a removal is (hashes, "
                                                 "level)",
                     i);
        return -1;
    }
    PyObject **it = &PyTuple_GET_ITEM(ev, 0);
    if (!is_store) {
        Py_ssize_t k = PyObject_Length(it[0]);
        if (k >= 0 && (rc = remove_run(t, it[0], it[1])) == 0)
            *removed += k;
        goto out;
    }
    if (buf == NULL)
        rc = store_hashes_run(t, it[0], it[1], it[2]);
    else {
        at_sizes = entry == NULL ? NULL : tuple_of(entry, 2);
        PyObject *sizes = at_sizes == NULL ? NULL : PyTuple_GET_ITEM(at_sizes, 1);
        if (sizes == NULL || !(PyList_Check(sizes) || PyTuple_Check(sizes))) {
            PyErr_Format(PyExc_ValueError, "apply_plain: event %zd has no (at, sizes) in the "
                                           "layout", i);
            goto out;
        }
        sizes = PySequence_Fast(sizes, "sizes"); /* (a list or tuple: this cannot fail) */
        if (sizes == NULL)
            goto out;
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(at_sizes, 0)), total = 0;
        for (Py_ssize_t b = 0; at >= 0 && b < PySequence_Fast_GET_SIZE(sizes); b++) {
            Py_ssize_t sz = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, b));
            if (sz < 0) {
                at = -1;
                break;
            }
            total += sz;
        }
        if (at < 0 || total > buf->len / 4 - at) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "apply_plain: event %zd's tokens are outside "
                                               "the token buffer", i);
        }
        else
            rc = store_tokens_run(t, it[0], it[1], it[2], (const uint8_t *)buf->buf + 4 * at,
                                  4 * total, sizes, seed);
        Py_DECREF(sizes);
    }
    if (rc == 0) {
        long lim = PyLong_AsLong(limit);
        if (lim == -1 && PyErr_Occurred())
            rc = -1;
        else
            *over = t->present > lim;
    }
out:
    Py_DECREF(ev);
    Py_XDECREF(at_sizes);
    return rc;
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
    PyObject *last = NULL; /* the table whose counters are not flushed yet (held) */
    Py_ssize_t removed = 0;
    int rc = 0, over = 0;
    for (; i < n && rc == 0 && !over; i++) {
        /* this event's objects held while it is applied (the lists are the caller's) */
        PyObject *to = Py_NewRef(PyList_GET_ITEM(tables, i));
        PyObject *data = Py_NewRef(PyList_GET_ITEM(payloads, i));
        PyObject *limit = Py_NewRef(PyList_GET_ITEM(limits, i));
        PyObject *entry = NULL;
        long kind = PyLong_AsLong(PyList_GET_ITEM(kinds, i));
        if (kind == -1 && PyErr_Occurred())
            rc = -1;
        else if (!PyObject_TypeCheck(to, want)) {
            PyErr_Format(PyExc_TypeError, "apply_plain: event %zd's table is not a %s", i,
                         want->tp_name);
            rc = -1;
        }
        else if (last != to && last != NULL && flush_counters((Tab *)last, st) < 0)
            rc = -1;
        if (rc == 0) {
            Py_XSETREF(last, Py_NewRef(to));
            int is_store = kind == stored;
            if (is_store && by_tokens) {
                if (j < PyList_GET_SIZE(layout))
                    entry = Py_NewRef(PyList_GET_ITEM(layout, j));
                j++;
            }
            rc = apply_event((Tab *)to, is_store, data, entry, by_tokens ? &buf : NULL, seed,
                             limit, i, &removed, &over);
        }
        Py_DECREF(to);
        Py_DECREF(data);
        Py_DECREF(limit);
        Py_XDECREF(entry);
    }
    if (buf.obj != NULL)
        PyBuffer_Release(&buf);
    if (last != NULL && flush_counters((Tab *)last, st) < 0)
        rc = -1;
    Py_XDECREF(last);
    if (rc < 0)
        return NULL;
    return Py_BuildValue("nnnO", i, j, removed, over ? Py_True : Py_False);
}
