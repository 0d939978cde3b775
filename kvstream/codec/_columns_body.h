/*
 * The Avro body of a publisher ColumnBatch in one C call: part of kvstream.codec._tokens_native
 * (included by _tokens_native.c after _batch_body.h, whose buffers, writers, payload frames,
 * default stored tails and token-fields writer it shares).
 *
 *   columns_setup(attention_values, default_hash_algo, v1_kinds, attr_fields)
 *       once, from kvstream/codec/column_encoder.py: the AttentionKind values (FULL,
 *       SLIDING_WINDOW) in symbol order, the hash algorithm schema v1 implies, a bit mask of
 *       the kind codes schema v1 carries, and the Python helper that writes a stored event's
 *       block attribute fields when they are not all at their defaults.
 *   encode_columns(prefix, cols, version, token_encoding, lossy) -> bytes | None
 *       exactly column_encoder._encode_columns_py(...) (the pure-Python twin, property-tested
 *       equal) for columns with stored_extra set, or None when something is not as the
 *       columns' contract says (a foreign type, a length mismatch, an out-of-range value) or
 *       when the Python path would raise (an event an older version cannot carry without
 *       lossy): the caller then runs the Python path, which writes or raises what it always
 *       did. Exceptions from the two helpers propagate.
 *
 * The columns are read through public attributes only (ColumnBatch's slots by name, the
 * tokens property); their lists and tuples through the C API's list/tuple accessors. Nothing
 * here writes to a Python object.
 */

static struct {
    int ready;
    PyObject *attention[2]; /* AttentionKind values: symbols 1 and 2 */
    PyObject *default_algo;
    unsigned v1_kinds; /* bit k: kind code k exists in schema v1 */
    PyObject *attr_fields;
} C;

static PyObject *s_event_ids, *s_kinds, *s_hash_algos, *s_group_ids, *s_window_sizes,
    *s_payloads, *s_stored_extra, *s_tokens;

static int
columns_intern(void)
{
#define I(var, text)                                                                          \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                     \
        return -1;
    I(s_event_ids, "event_ids") I(s_kinds, "kinds") I(s_hash_algos, "hash_algos")
    I(s_group_ids, "group_ids") I(s_window_sizes, "window_sizes") I(s_payloads, "payloads")
    I(s_stored_extra, "stored_extra") I(s_tokens, "tokens")
#undef I
    return 0;
}

/* Item i of an exact list or tuple (borrowed), or NULL (not a list/tuple, or out of range). */
static inline PyObject *
seq_item(PyObject *seq, Py_ssize_t i)
{
    if (PyList_CheckExact(seq))
        return i < PyList_GET_SIZE(seq) ? PyList_GET_ITEM(seq, i) : NULL;
    if (PyTuple_CheckExact(seq))
        return i < PyTuple_GET_SIZE(seq) ? PyTuple_GET_ITEM(seq, i) : NULL;
    return NULL;
}

/* The length of an exact list or tuple, or -1. */
static inline Py_ssize_t
seq_len(PyObject *seq)
{
    if (PyList_CheckExact(seq))
        return PyList_GET_SIZE(seq);
    if (PyTuple_CheckExact(seq))
        return PyTuple_GET_SIZE(seq);
    return -1;
}

/* The items of an exact tuple of size n, or NULL. */
static inline PyObject **
tuple_of(PyObject *o, Py_ssize_t n)
{
    return PyTuple_CheckExact(o) && PyTuple_GET_SIZE(o) == n ? &PyTuple_GET_ITEM(o, 0) : NULL;
}

/* A small exact int into *v (the kind codes). */
static int
small_int(PyObject *o, long *v)
{
    if (!PyLong_CheckExact(o))
        return BODY_DECLINE;
    int overflow;
    *v = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow)
        return BODY_DECLINE;
    if (*v == -1 && PyErr_Occurred())
        return declined();
    return BODY_OK;
}

/* The count and the joined bytes of a list/tuple of exact bytes (a hashes column entry). */
static int
put_hashes(Buf *b, PyObject *hashes, int with_count)
{
    Py_ssize_t n = seq_len(hashes), total = 0;
    if (n < 0)
        return BODY_DECLINE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = seq_item(hashes, i);
        if (h == NULL || !PyBytes_CheckExact(h))
            return BODY_DECLINE;
        total += PyBytes_GET_SIZE(h);
    }
    RESERVE(b, total + 20);
    if (with_count)
        zz(b, n);
    zz(b, total);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = seq_item(hashes, i);
        memcpy(b->p + b->len, PyBytes_AS_STRING(h), (size_t)PyBytes_GET_SIZE(h));
        b->len += PyBytes_GET_SIZE(h);
    }
    return BODY_OK;
}

/* block_size, last_block_size, block_sizes of blocks of `sizes` tokens (encoder._size_fields);
 * the sizes' total in *total. */
static int
put_sizes(Buf *b, PyObject *sizes, int64_t *total)
{
    Py_ssize_t n = seq_len(sizes);
    if (n <= 0)
        return BODY_DECLINE;
    int64_t first = 0, last = 0, sum = 0;
    Py_ssize_t same = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v;
        TRY(as_long(seq_item(sizes, i), &v));
        if (i == 0)
            first = v;
        last = v;
        same += v == first;
        if (v < 0 || v > ((int64_t)1 << 40)) /* a token count, not a size a batch could hold */
            return BODY_DECLINE;
        sum += v;
    }
    *total = sum;
    if (same == n || (same == n - 1 && last != first)) {
        RESERVE(b, 21);
        zz(b, first);
        zz(b, last);
        b->p[b->len++] = 0;
        return BODY_OK;
    }
    RESERVE(b, 10 * n + 14);
    b->p[b->len++] = 0;
    b->p[b->len++] = 0;
    b->p[b->len++] = 2;
    zz(b, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v = 0;
        as_long(seq_item(sizes, i), &v); /* checked above */
        zz(b, v);
    }
    b->p[b->len++] = 0;
    return BODY_OK;
}

/* 1 when a stored event's attrs (a StoredAttrs tuple) have extra keys on some block (what
 * schema v1-2 cannot carry), 0 if not, BODY_DECLINE-as-negative for an unexpected shape. */
static int
has_extra_keys(PyObject *attrs)
{
    if (attrs == Py_None)
        return 0;
    PyObject **a = tuple_of(attrs, 8);
    if (a == NULL || seq_len(a[7]) < 0)
        return -1;
    Py_ssize_t n = seq_len(a[7]);
    for (Py_ssize_t i = 0; i < n; i++)
        if (seq_item(a[7], i) != Py_None)
            return 1;
    return 0;
}

typedef struct {
    Buf body;
    Py_ssize_t *kinds; /* offsets in body of the stored events' kind bytes */
    Py_ssize_t n_kinds, kinds_cap;
} CEnc;

/* One stored event: parent .. its tail. payload (parent, hashes, level, first tokens), extra
 * (sizes, attrs | None); its token count in *ntok. */
static int
col_stored(CEnc *e, PyObject *payload, PyObject *extra, int version, PyObject *version_obj,
           int64_t *ntok)
{
    Buf *b = &e->body;
    PyObject **p = tuple_of(payload, 4), **x = tuple_of(extra, 2);
    if (p == NULL || x == NULL)
        return BODY_DECLINE;
    if (p[0] == Py_None)
        TRY(put_byte(b, 0));
    else {
        TRY(put_byte(b, 2));
        TRY(put_bytes_obj(b, p[0]));
    }
    TRY(put_hashes(b, p[1], 1));
    TRY(put_sizes(b, x[0], ntok));
    PyObject *attrs = x[1], *level = p[2];
    if (attrs == Py_None && PyLong_CheckExact(level) && PyLong_AsLong(level) == 0) {
        PyObject *tail = B.tails[version];
        return put_mem(b, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail));
    }
    if (PyErr_Occurred()) /* a level too large for a C long: not 0 */
        PyErr_Clear();
    /* some attribute not at its default (or a per-block level): the Python helper */
    PyObject *n_blocks = PyLong_FromSsize_t(seq_len(p[1]));
    if (n_blocks == NULL)
        return BODY_FAIL;
    PyObject *fields =
        PyObject_CallFunctionObjArgs(C.attr_fields, attrs, level, n_blocks, version_obj, NULL);
    Py_DECREF(n_blocks);
    if (fields == NULL)
        return BODY_FAIL;
    int r = PyBytes_CheckExact(fields)
                ? put_mem(b, PyBytes_AS_STRING(fields), PyBytes_GET_SIZE(fields))
                : BODY_DECLINE;
    Py_DECREF(fields);
    TRY(r);
    PyObject *post = B.frames[version][K_STORED][1];
    return put_mem(b, PyBytes_AS_STRING(post), PyBytes_GET_SIZE(post));
}

static int
put_pair(Buf *b, PyObject *pair)
{
    if (pair == Py_None)
        return put_byte(b, 0);
    if (seq_len(pair) != 2)
        return BODY_DECLINE;
    TRY(put_byte(b, 2));
    TRY(put_long_obj(b, seq_item(pair, 0)));
    return put_long_obj(b, seq_item(pair, 1));
}

/* The payload of a kind other than stored (column_encoder._events). */
static int
col_other(Buf *b, int kind, PyObject *payload, int version)
{
    PyObject **p;
    switch (kind) {
    case K_REMOVED:
        if ((p = tuple_of(payload, 2)) == NULL)
            return BODY_DECLINE;
        TRY(put_hashes(b, p[0], 1));
        return version >= 2 ? put_opt_long(b, p[1]) : BODY_OK;
    case K_UPDATED:
        if ((p = tuple_of(payload, 3)) == NULL)
            return BODY_DECLINE;
        TRY(put_bytes_obj(b, p[0]));
        TRY(put_pair(b, p[1]));
        return put_pair(b, p[2]);
    case K_CREATED: {
        if ((p = tuple_of(payload, 3)) == NULL)
            return BODY_DECLINE;
        Py_ssize_t n = seq_len(p[0]);
        if (n < 0)
            return BODY_DECLINE;
        if (n)
            TRY(put_zz(b, n));
        for (Py_ssize_t i = 0; i < n; i++)
            TRY(put_long_obj(b, seq_item(p[0], i)));
        TRY(put_byte(b, 0));
        if (version < 2)
            return BODY_OK;
        TRY(put_long_obj(b, p[1]));
        for (int k = 0; k < 2; k++) {
            int eq = PyUnicode_CheckExact(p[2]) ? PyUnicode_Compare(p[2], C.attention[k]) : 1;
            if (eq == -1 && PyErr_Occurred())
                return declined();
            if (eq == 0)
                return put_byte(b, (unsigned char)(2 + 2 * k));
        }
        return BODY_DECLINE;
    }
    case K_LOST:
        if ((p = tuple_of(payload, 3)) == NULL)
            return BODY_DECLINE;
        TRY(put_long_obj(b, p[0]));
        TRY(put_long_obj(b, p[1]));
        return put_str_obj(b, p[2]);
    case K_CLEARED:
        return BODY_OK;
    default:
        return BODY_DECLINE;
    }
}

/* Whether schema v1 carries event i (kind and hash algorithm); -1 with an error set. */
static int
v1_keeps(long kind, PyObject *algo)
{
    if (!(C.v1_kinds >> kind & 1u))
        return 0;
    if (algo == C.default_algo)
        return 1;
    if (!PyUnicode_CheckExact(algo))
        return 0; /* the Python path decides (and raises or drops) */
    int eq = PyUnicode_Compare(algo, C.default_algo);
    return eq == -1 && PyErr_Occurred() ? -1 : eq == 0;
}

/* The six event columns of cols, borrowed from refs (new references the caller releases). */
enum { COL_IDS, COL_KINDS, COL_ALGOS, COL_GROUPS, COL_WINDOWS, COL_PAYLOADS, N_COLS };

static int
col_events(CEnc *e, PyObject *const *col, Py_ssize_t n, PyObject *extra, int version,
           PyObject *version_obj, int lossy, Buf *kept_raw, PyObject *tokens,
           Py_ssize_t *n_kept, int *dropped)
{
    Buf *b = &e->body;
    Py_ssize_t j = 0;    /* the next stored extra */
    Py_ssize_t tpos = 0; /* byte offset in tokens of the next stored event's ids */
    Py_ssize_t tlen = PyBytes_GET_SIZE(tokens);
    int collect = version == 1 && lossy; /* only v1 drops events (lossy) */
    for (Py_ssize_t i = 0; i < n; i++) {
        long kind;
        PyObject *algo = seq_item(col[COL_ALGOS], i);
        TRY(small_int(seq_item(col[COL_KINDS], i), &kind));
        if (kind < 0 || kind >= N_KINDS)
            return BODY_DECLINE; /* the Python path's "unknown event kind code" */
        PyObject *ex = NULL;
        if (kind == K_STORED) {
            if ((ex = seq_item(extra, j++)) == NULL)
                return BODY_DECLINE;
        }
        int keep = 1;
        if (version < 3) { /* what an older version cannot carry: dropped if lossy */
            if (ex != NULL) {
                PyObject **x = tuple_of(ex, 2);
                int k = x == NULL ? -1 : has_extra_keys(x[1]);
                if (k < 0)
                    return BODY_DECLINE;
                if (k && !lossy)
                    return BODY_DECLINE; /* the Python path raises */
            }
            if (version == 1) {
                if ((keep = v1_keeps(kind, algo)) < 0)
                    return declined();
                if (!keep && !lossy)
                    return BODY_DECLINE; /* the Python path raises */
            }
        }
        PyObject *payload = seq_item(col[COL_PAYLOADS], i);
        if (!keep) {
            if (ex != NULL) { /* its token ids leave the batch with it */
                PyObject **x = tuple_of(ex, 2);
                Py_ssize_t m = x == NULL ? -1 : seq_len(x[0]);
                int64_t sum = 0;
                for (Py_ssize_t s = 0; s < m; s++) {
                    int64_t v;
                    TRY(as_long(seq_item(x[0], s), &v));
                    if (v < 0 || v > ((int64_t)1 << 40))
                        return BODY_DECLINE;
                    sum += v;
                }
                if (m < 0)
                    return BODY_DECLINE;
                Py_ssize_t end = tpos + 4 * (Py_ssize_t)sum;
                tpos = end;
                *dropped = 1;
            }
            continue;
        }
        ++*n_kept;
        TRY(put_long_obj(b, seq_item(col[COL_IDS], i)));
        if (kind == K_STORED) { /* the kind byte is patched once the tokens' encoding is known */
            if (e->n_kinds == e->kinds_cap) {
                Py_ssize_t cap = e->kinds_cap ? 2 * e->kinds_cap : 64;
                Py_ssize_t *k = PyMem_Realloc(e->kinds, sizeof(Py_ssize_t) * (size_t)cap);
                if (k == NULL) {
                    PyErr_NoMemory();
                    return BODY_FAIL;
                }
                e->kinds = k;
                e->kinds_cap = cap;
            }
            e->kinds[e->n_kinds++] = b->len;
        }
        PyObject *pre = B.frames[version][kind][0];
        if (pre == NULL)
            return BODY_DECLINE;
        TRY(put_byte(b, KIND_BYTE[kind]));
        TRY(put_long_obj(b, seq_item(col[COL_WINDOWS], i)));
        if (version >= 2) {
            TRY(put_str_obj(b, algo));
            TRY(put_long_obj(b, seq_item(col[COL_GROUPS], i)));
        }
        TRY(put_mem(b, PyBytes_AS_STRING(pre), PyBytes_GET_SIZE(pre)));
        if (kind == K_STORED) {
            int64_t ntok = 0;
            /* payload and extra are held: the attribute helper runs Python code */
            Py_INCREF(payload);
            Py_INCREF(ex);
            int r = col_stored(e, payload, ex, version, version_obj, &ntok);
            Py_DECREF(payload);
            Py_DECREF(ex);
            TRY(r);
            Py_ssize_t start = tpos < tlen ? tpos : tlen;
            tpos += 4 * (Py_ssize_t)ntok;
            Py_ssize_t end = tpos < tlen ? tpos : tlen;
            if (collect) /* some stored event is dropped: the kept ones' ids */
                TRY(put_mem(kept_raw, PyBytes_AS_STRING(tokens) + start, end - start));
            continue;
        }
        TRY(col_other(b, (int)kind, payload, version));
        PyObject *post = B.frames[version][kind][1];
        TRY(put_mem(b, PyBytes_AS_STRING(post), PyBytes_GET_SIZE(post)));
    }
    return BODY_OK;
}

static PyObject *
encode_columns(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *const *attr_names[N_COLS] = {&s_event_ids, &s_kinds, &s_hash_algos,
                                           &s_group_ids, &s_window_sizes, &s_payloads};
    PyObject *prefix, *cols, *token_encoding, *res = NULL, *raw = NULL, *tok = NULL;
    PyObject *col[N_COLS] = {NULL}, *extra = NULL, *tokens = NULL, *version_obj = NULL;
    int version, lossy;
    if (!PyArg_ParseTuple(args, "O!OiUp:encode_columns", &PyBytes_Type, &prefix, &cols,
                          &version, &token_encoding, &lossy))
        return NULL;
    if (!B.ready || !C.ready) {
        PyErr_SetString(PyExc_RuntimeError,
                        "encode_columns: body_setup() and columns_setup() were not called");
        return NULL;
    }
    if (version < 1 || version > MAX_VERSION || B.tails[version] == NULL)
        Py_RETURN_NONE;
    CEnc e = {{NULL, 0, 0}, NULL, 0, 0};
    Buf head = {NULL, 0, 0}, kept_raw = {NULL, 0, 0};
    int r = BODY_OK, packed = 0, dropped = 0;
    Py_ssize_t n = -1, n_kept = 0;
    for (int c = 0; c < N_COLS && r == BODY_OK; c++) {
        r = get(cols, *attr_names[c], &col[c]);
        if (r == BODY_OK) {
            Py_ssize_t m = seq_len(col[c]);
            if (m < 0 || (n >= 0 && m != n))
                r = BODY_DECLINE; /* the Python path's zip(strict=True) raises */
            n = m;
        }
    }
    if (r == BODY_OK && (r = get(cols, s_stored_extra, &extra)) == BODY_OK && seq_len(extra) < 0)
        r = BODY_DECLINE;
    if (r == BODY_OK && (r = get(cols, s_tokens, &tokens)) == BODY_OK &&
        !PyBytes_CheckExact(tokens))
        r = BODY_DECLINE;
    if (r == BODY_OK && (version_obj = PyLong_FromLong(version)) == NULL)
        r = BODY_FAIL;
    if (r == BODY_OK)
        r = col_events(&e, col, n, extra, version, version_obj, lossy, &kept_raw, tokens, &n_kept,
                       &dropped);
    if (r == BODY_OK) {
        if (dropped) {
            raw = PyBytes_FromStringAndSize(kept_raw.p ? kept_raw.p : "", kept_raw.len);
            if (raw == NULL)
                r = BODY_FAIL;
        }
        else {
            raw = tokens; /* every stored event kept: the ids as the columns hold them */
            Py_INCREF(raw);
        }
    }
    if (r == BODY_OK) {
        tok = PyObject_CallFunctionObjArgs(B.encode_tokens, raw, token_encoding, NULL);
        if (tok == NULL)
            r = BODY_FAIL;
    }
    if (r == BODY_OK) { /* prefix, source fields, ts_ns, token fields, the events' count */
        r = put_mem(&head, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix));
        if (r == BODY_OK)
            r = put_attr(&head, cols, s_instance_id, put_str_obj);
        if (r == BODY_OK)
            r = put_attr(&head, cols, s_attention_dp_rank, put_opt_long);
        if (r == BODY_OK && version >= 2)
            r = put_attr(&head, cols, s_incarnation, put_long_obj);
        if (r == BODY_OK)
            r = put_attr(&head, cols, s_ts_ns, put_long_obj);
        if (r == BODY_OK)
            r = token_fields(&head, tok, version, &packed);
        if (r == BODY_OK)
            r = put_zz(&head, n_kept);
    }
    res = body_result(r, &head, &e.body, e.kinds, e.n_kinds, packed, n_kept);
    for (int c = 0; c < N_COLS; c++)
        Py_XDECREF(col[c]);
    Py_XDECREF(extra);
    Py_XDECREF(tokens);
    Py_XDECREF(version_obj);
    Py_XDECREF(raw);
    Py_XDECREF(tok);
    PyMem_Free(e.body.p);
    PyMem_Free(e.kinds);
    PyMem_Free(head.p);
    PyMem_Free(kept_raw.p);
    return res;
}

static PyObject *
columns_setup(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *attention, *algo, *attrs;
    unsigned int v1_kinds;
    if (!PyArg_ParseTuple(args, "O!UIO:columns_setup", &PyTuple_Type, &attention, &algo,
                          &v1_kinds, &attrs))
        return NULL;
    if (PyTuple_GET_SIZE(attention) != 2 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(attention, 0)) ||
        !PyUnicode_CheckExact(PyTuple_GET_ITEM(attention, 1)) || !PyCallable_Check(attrs)) {
        PyErr_SetString(PyExc_ValueError, "columns_setup: unexpected arguments");
        return NULL;
    }
    C.ready = 0;
    for (int k = 0; k < 2; k++) {
        Py_INCREF(PyTuple_GET_ITEM(attention, k));
        Py_XSETREF(C.attention[k], PyTuple_GET_ITEM(attention, k));
    }
    Py_INCREF(algo);
    Py_XSETREF(C.default_algo, algo);
    C.v1_kinds = v1_kinds;
    Py_INCREF(attrs);
    Py_XSETREF(C.attr_fields, attrs);
    C.ready = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------ deferred rows */

/*
 *   deferred_rows(records, start, columns, raws, block_run, default_algo, default_group) -> int
 *       the loop of kvstream.events.deferred_columns.deferred_columns over records[start:]
 *       for the records it reads straight (stored events of a plain BlockRun, non-empty
 *       removed events): each one's row appended to columns (event_ids, kinds, hash_algos,
 *       group_ids, window_sizes, payloads, stored_extra: the ColumnBatch's lists) and its
 *       token bytes to raws, exactly as the Python loop appends them. Returns the index of
 *       the first record it leaves to Python (nothing of it appended), or len(records).
 *       Records are read through the dict API, BlockRun and TokenIds through attributes.
 */

static PyObject *s_data_key, *s_type_key, *s_blocks_key, *s_hashes, *s_attrs, *s_tokens_attr,
    *s_parent_key, *s_block_hashes_key, *s_cache_level_key, *s_event_id_key, *s_hash_algo_key,
    *s_group_key, *s_window_key, *s_stored_str, *s_removed_str, *i_stored, *i_removed, *i_zero;

static int
deferred_intern(void)
{
#define I(var, text)                                                                          \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                     \
        return -1;
    I(s_data_key, "data") I(s_type_key, "type") I(s_blocks_key, "blocks") I(s_hashes, "hashes")
    I(s_attrs, "attrs") I(s_tokens_attr, "tokens") I(s_parent_key, "parent_hash")
    I(s_block_hashes_key, "block_hashes") I(s_cache_level_key, "cache_level")
    I(s_event_id_key, "event_id") I(s_hash_algo_key, "hash_algo")
    I(s_group_key, "layer_group_id") I(s_window_key, "window_size") I(s_stored_str, "stored")
    I(s_removed_str, "removed")
#undef I
    if ((i_stored = PyLong_FromLong(K_STORED)) == NULL ||
        (i_removed = PyLong_FromLong(K_REMOVED)) == NULL || (i_zero = PyLong_FromLong(0)) == NULL)
        return -1;
    return 0;
}

/* d[key] borrowed, or NULL (d not an exact dict, key missing, or an error: cleared). */
static PyObject *
dict_item(PyObject *d, PyObject *key)
{
    if (!PyDict_CheckExact(d))
        return NULL;
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL)
        PyErr_Clear();
    return v;
}

/* The rows' lists and tuples hold only bytes, ints and None (and the rows' own lists of
 * them): they cannot be part of a reference cycle, so the cyclic GC is told not to track
 * them (the public PyObject_GC_UnTrack). A deferred batch's columns would otherwise add ~4
 * tracked containers per event, and at a fleet's rates those trigger full GC passes over
 * the whole process while they wait to be encoded. Columns are read-only for their readers
 * (ColumnBatch's contract); a reader that stored a cycle in one would leak it, not crash. */
static void
untrack(PyObject *o)
{
    if (PyObject_GC_IsTracked(o))
        PyObject_GC_UnTrack(o);
}

/* untrack(o), a list or tuple, when every item is untracked (atoms, untracked lists). */
static void
untrack_if_atoms(PyObject *o)
{
    Py_ssize_t n = seq_len(o);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = seq_item(o, i);
        if (PyObject_IS_GC(x) && PyObject_GC_IsTracked(x))
            return;
    }
    if (n >= 0)
        untrack(o);
}

/* Whether the str s equals the interned `want` (exact str only). */
static int
is_str(PyObject *s, PyObject *want)
{
    if (s == want)
        return 1;
    return PyUnicode_CheckExact(s) && PyUnicode_Compare(s, want) == 0;
}

/* The token source and block count of one entry of a BlockRun's tokens (a TokenIds, or
 * (packed TokenIds, k)); 0 when the entry is left to Python. */
static int
run_entry(PyObject *t, PyObject **src, Py_ssize_t *k)
{
    *src = t;
    *k = 1;
    if (!PyTuple_Check(t))
        return 1;
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 2 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(t, 1)))
        return 0;
    *src = PyTuple_GET_ITEM(t, 0);
    *k = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
    if (*k <= 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* The payload and stored extra of a plain stored record's BlockRun, its token bytes appended
 * to raws; 0 when the record is left to Python (nothing appended), -1 on an error. */
static int
deferred_stored(PyObject *data, PyObject *run, PyObject *raws, PyObject **payload,
                PyObject **extra)
{
    PyObject *hashes = NULL, *attrs = NULL, *tokens = NULL, *sizes = NULL, *hash_list = NULL;
    Py_ssize_t raws0 = PyList_GET_SIZE(raws), n_blocks = 0;
    int r = 0;
    PyObject *parent = dict_item(data, s_parent_key);
    if (parent == NULL)
        return 0;
    if ((hashes = PyObject_GetAttr(run, s_hashes)) == NULL ||
        (attrs = PyObject_GetAttr(run, s_attrs)) == NULL ||
        (tokens = PyObject_GetAttr(run, s_tokens_attr)) == NULL) {
        r = declined() == BODY_FAIL ? -1 : 0;
        goto out;
    }
    if (!PyList_CheckExact(hashes) || PyList_GET_SIZE(hashes) == 0 || !PyDict_CheckExact(attrs) ||
        PyDict_GET_SIZE(attrs) != 0 || !PyList_CheckExact(tokens) ||
        PyList_GET_SIZE(tokens) == 0)
        goto out;
    Py_ssize_t nt = PyList_GET_SIZE(tokens);
    /* first pass: every entry readable, each one's bytes appended to raws */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tokens); i++) {
        PyObject *src, *raw;
        Py_ssize_t k;
        if (!run_entry(PyList_GET_ITEM(tokens, i), &src, &k))
            goto out;
        if ((raw = PyObject_GetAttr(src, s_raw)) == NULL) {
            r = declined() == BODY_FAIL ? -1 : 0;
            goto out;
        }
        int bad = !PyBytes_CheckExact(raw) || k > PY_SSIZE_T_MAX - n_blocks;
        if (!bad && PyList_Append(raws, raw) < 0)
            r = -1;
        Py_DECREF(raw);
        if (bad || r < 0)
            goto out;
        n_blocks += k;
    }
    if (PyList_GET_SIZE(tokens) != nt || PyList_GET_SIZE(raws) != raws0 + nt)
        goto out; /* changed under us (attribute code): Python decides */
    /* second pass: the block sizes (one int object per run entry, shared by its k blocks) */
    if ((sizes = PyList_New(n_blocks)) == NULL) {
        r = -1;
        goto out;
    }
    for (Py_ssize_t i = 0, b = 0; i < nt; i++) {
        PyObject *src;
        Py_ssize_t k;
        run_entry(PyList_GET_ITEM(tokens, i), &src, &k); /* checked above */
        PyObject *size =
            PyLong_FromSsize_t(PyBytes_GET_SIZE(PyList_GET_ITEM(raws, raws0 + i)) / k >> 2);
        if (size == NULL) {
            r = -1;
            goto out;
        }
        for (Py_ssize_t j = 0; j < k; j++, b++) {
            Py_INCREF(size);
            PyList_SET_ITEM(sizes, b, size);
        }
        Py_DECREF(size);
    }
    if ((hash_list = PyList_GetSlice(hashes, 0, PyList_GET_SIZE(hashes))) == NULL) {
        r = -1;
        goto out;
    }
    *payload = PyTuple_Pack(4, parent, hash_list, i_zero, PyList_GET_ITEM(sizes, 0));
    *extra = *payload == NULL ? NULL : PyTuple_Pack(2, sizes, Py_None);
    if (*extra == NULL) {
        Py_CLEAR(*payload);
        r = -1;
        goto out;
    }
    untrack(sizes); /* ints only */
    untrack_if_atoms(hash_list);
    untrack_if_atoms(*payload);
    untrack_if_atoms(*extra);
    r = 1;
out:
    if (r != 1 && PyList_GET_SIZE(raws) > raws0 &&
        PyList_SetSlice(raws, raws0, PyList_GET_SIZE(raws), NULL) < 0)
        r = -1; /* nothing of a record left to Python stays appended */
    Py_XDECREF(hashes);
    Py_XDECREF(attrs);
    Py_XDECREF(tokens);
    Py_XDECREF(sizes);
    Py_XDECREF(hash_list);
    return r;
}

static PyObject *
deferred_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *records, *columns, *raws, *block_run, *default_algo, *default_group;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!nO!O!OOO:deferred_rows", &PyList_Type, &records, &start,
                          &PyTuple_Type, &columns, &PyList_Type, &raws, &block_run,
                          &default_algo, &default_group))
        return NULL;
    if (PyTuple_GET_SIZE(columns) != 7) {
        PyErr_SetString(PyExc_ValueError, "deferred_rows: seven column lists expected");
        return NULL;
    }
    PyObject **col = &PyTuple_GET_ITEM(columns, 0);
    for (int c = 0; c < 7; c++)
        if (!PyList_Check(col[c])) {
            PyErr_SetString(PyExc_TypeError, "deferred_rows: the columns must be lists");
            return NULL;
        }
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < PyList_GET_SIZE(records); i++) {
        PyObject *rec = PyList_GET_ITEM(records, i), *payload = NULL, *extra = NULL, *kind;
        PyObject *data = dict_item(rec, s_data_key);
        PyObject *type = data == NULL ? NULL : dict_item(data, s_type_key);
        PyObject *eid = dict_item(rec, s_event_id_key), *window = dict_item(rec, s_window_key);
        if (type == NULL || eid == NULL || window == NULL)
            break;
        PyObject *algo = dict_item(rec, s_hash_algo_key), *group = dict_item(rec, s_group_key);
        if (PyErr_Occurred())
            return NULL;
        if (is_str(type, s_stored_str)) {
            PyObject *run = dict_item(data, s_blocks_key);
            if (run == NULL || (PyObject *)Py_TYPE(run) != block_run)
                break;
            Py_INCREF(rec); /* held: attribute reads may run Python code */
            int r = deferred_stored(data, run, raws, &payload, &extra);
            Py_DECREF(rec);
            if (r < 0)
                return NULL;
            if (r == 0)
                break;
            kind = i_stored;
        }
        else if (is_str(type, s_removed_str)) {
            PyObject *hashes = dict_item(data, s_block_hashes_key);
            PyObject *level = dict_item(data, s_cache_level_key);
            if (hashes == NULL || level == NULL || seq_len(hashes) <= 0)
                break;
            PyObject *list = PySequence_List(hashes);
            if (list == NULL)
                return NULL;
            payload = PyTuple_Pack(2, list, level);
            untrack_if_atoms(list);
            Py_DECREF(list);
            if (payload == NULL)
                return NULL;
            untrack_if_atoms(payload);
            kind = i_removed;
        }
        else
            break;
        PyObject *row[6] = {eid, kind, algo ? algo : default_algo, group ? group : default_group,
                            window, payload};
        int bad = 0;
        for (int c = 0; c < 6 && !bad; c++)
            bad = PyList_Append(col[c], row[c]) < 0;
        if (!bad && extra != NULL)
            bad = PyList_Append(col[6], extra) < 0;
        Py_DECREF(payload);
        Py_XDECREF(extra);
        if (bad)
            return NULL;
    }
    return PyLong_FromSsize_t(i);
}
