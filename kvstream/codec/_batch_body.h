/*
 * The Avro body of a model EventBatch in one C call: part of kvstream.codec._tokens_native
 * (included by _tokens_native.c, so the codec keeps one extension module).
 *
 *   body_setup(types, attention, field_names, block_defaults, frames, tails, block_attrs,
 *              encode_tokens)
 *       once, from kvstream/codec/encoder.py: the model classes, the schema's constant byte
 *       runs (per version: each kind's payload frame, a default-attribute stored tail) and two
 *       Python helpers (a stored event's block attributes when some block has any, and the
 *       batch's token encoding). One source of truth for all of them: encoder.py.
 *   encode_body(prefix, batch, events, version, token_encoding) -> bytes | None
 *       exactly encoder._encode_py(...) (the pure-Python twin, property-tested equal), or None
 *       when something is not as the models guarantee (a foreign type, an out-of-range
 *       value, a string that is not UTF-8): the caller then runs the Python path, which
 *       writes or raises what it always did. Exceptions from the two helpers propagate.
 *
 * Models are read only through public access: attributes by name (PyObject_GetAttr) for
 * batches, sources and events, and for stored blocks pydantic's documented field storage,
 * the instance __dict__ (ten fields per block, read in one pass instead of ten attribute
 * lookups). Token ids come from TokenIds.raw, or for the cache manager's chain views from
 * TokenIdsView.run ((packed run, bytes per block)) and run_index: no bytes object is cut
 * per block. Nothing here writes to a Python object.
 */

enum { BODY_OK = 0, BODY_DECLINE = 1, BODY_FAIL = -1 };

#define N_BLOCK_FIELDS 10 /* block_hash, token_ids, then the 8 attributes with defaults */
enum { K_CREATED, K_STORED, K_REMOVED, K_UPDATED, K_CLEARED, K_LOST, N_KINDS };
static const unsigned char KIND_BYTE[N_KINDS] = {0x02, 0x04, 0x06, 0x08, 0x0a, 0x0c};
#define STORED_PACKED_BYTE 0x0e
#define MAX_VERSION 4

static struct {
    int ready;
    PyTypeObject *block, *kinds[N_KINDS], *diff, *token_ids;
    PyObject *full, *sliding; /* AttentionKind members */
    PyObject *names[N_BLOCK_FIELDS];
    PyObject *defaults[N_BLOCK_FIELDS - 2];
    PyObject *frames[MAX_VERSION + 1][N_KINDS][2]; /* bytes, or NULL where v lacks the kind */
    PyObject *tails[MAX_VERSION + 1];
    PyObject *block_attrs, *encode_tokens;
} B;

static PyObject *s_source, *s_instance_id, *s_attention_dp_rank, *s_incarnation, *s_ts_ns,
    *s_event_id, *s_data, *s_window_size, *s_hash_algo, *s_layer_group_id, *s_parent_hash,
    *s_blocks, *s_block_hashes, *s_cache_level, *s_priority, *s_old_value, *s_new_value,
    *s_num_blocks, *s_tokens_per_block, *s_attention_kind, *s_first_event_id, *s_count,
    *s_reason, *s_raw, *s_run, *s_run_index, *s_planes, *s_high_bits, *s_low16, *s_high_planes,
    *s_encoding, *s_compression, *s_packed, *s_block_hash;

static int
body_intern(void)
{
#define I(var, text)                                                                          \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                     \
        return -1;
    I(s_source, "source") I(s_instance_id, "instance_id")
    I(s_attention_dp_rank, "attention_dp_rank") I(s_incarnation, "incarnation")
    I(s_ts_ns, "ts_ns") I(s_event_id, "event_id") I(s_data, "data")
    I(s_window_size, "window_size") I(s_hash_algo, "hash_algo")
    I(s_layer_group_id, "layer_group_id") I(s_parent_hash, "parent_hash") I(s_blocks, "blocks")
    I(s_block_hashes, "block_hashes") I(s_cache_level, "cache_level") I(s_priority, "priority")
    I(s_old_value, "old_value") I(s_new_value, "new_value")
    I(s_num_blocks, "num_blocks_per_cache_level") I(s_tokens_per_block, "tokens_per_block")
    I(s_attention_kind, "attention_kind") I(s_first_event_id, "first_event_id")
    I(s_count, "count") I(s_reason, "reason") I(s_raw, "raw")
    I(s_run, "run") I(s_run_index, "run_index") I(s_planes, "planes") I(s_high_bits, "high_bits")
    I(s_low16, "low16") I(s_high_planes, "high_planes") I(s_encoding, "encoding")
    I(s_compression, "compression") I(s_packed, "packed") I(s_block_hash, "block_hash")
#undef I
    return 0;
}

/* ------------------------------------------------------------------------------ buffers */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

static int
buf_grow(Buf *b, Py_ssize_t need)
{
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + need)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return BODY_FAIL;
    }
    b->p = p;
    b->cap = cap;
    return BODY_OK;
}

#define RESERVE(b, n)                                                                         \
    do {                                                                                      \
        if ((b)->len + (Py_ssize_t)(n) > (b)->cap && buf_grow((b), (Py_ssize_t)(n)) < 0)      \
            return BODY_FAIL;                                                                 \
    } while (0)
#define TRY(x)                                                                                \
    do {                                                                                      \
        int r_ = (x);                                                                         \
        if (r_ != BODY_OK)                                                                    \
            return r_;                                                                        \
    } while (0)

/* The Avro long v (zig-zag varint); room for 10 bytes reserved by the caller. */
static inline void
zz(Buf *b, int64_t v)
{
    uint64_t z = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    char *o = b->p + b->len;
    while (z >= 0x80) {
        *o++ = (char)(z | 0x80);
        z >>= 7;
    }
    *o++ = (char)z;
    b->len = o - b->p;
}

static int
put_byte(Buf *b, unsigned char c)
{
    RESERVE(b, 1);
    b->p[b->len++] = (char)c;
    return BODY_OK;
}

static int
put_mem(Buf *b, const void *p, Py_ssize_t n)
{
    if (n == 0) /* b->p may still be NULL: memcpy must not see it */
        return BODY_OK;
    RESERVE(b, n);
    memcpy(b->p + b->len, p, (size_t)n);
    b->len += n;
    return BODY_OK;
}

static int
put_zz(Buf *b, int64_t v)
{
    RESERVE(b, 10);
    zz(b, v);
    return BODY_OK;
}

/* BODY_DECLINE for a Python exception that means "not as expected" (cleared), BODY_FAIL for
 * anything else (MemoryError, KeyboardInterrupt: kept). */
static int
declined(void)
{
    if (PyErr_ExceptionMatches(PyExc_MemoryError) ||
        !PyErr_ExceptionMatches(PyExc_Exception))
        return BODY_FAIL;
    PyErr_Clear();
    return BODY_DECLINE;
}

/* An int that fits an Avro long (exact int: bool and int subclasses decline). */
static int
as_long(PyObject *o, int64_t *v)
{
    if (!PyLong_CheckExact(o))
        return BODY_DECLINE;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow)
        return BODY_DECLINE;
    if (x == -1 && PyErr_Occurred())
        return declined();
    *v = (int64_t)x;
    return BODY_OK;
}

static int
put_long_obj(Buf *b, PyObject *o)
{
    int64_t v;
    TRY(as_long(o, &v));
    return put_zz(b, v);
}

static int
put_bytes_obj(Buf *b, PyObject *o)
{
    if (!PyBytes_CheckExact(o))
        return BODY_DECLINE;
    Py_ssize_t n = PyBytes_GET_SIZE(o);
    RESERVE(b, n + 10);
    zz(b, n);
    memcpy(b->p + b->len, PyBytes_AS_STRING(o), (size_t)n);
    b->len += n;
    return BODY_OK;
}

static int
put_str_obj(Buf *b, PyObject *o)
{
    if (!PyUnicode_CheckExact(o))
        return BODY_DECLINE;
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(o, &n);
    if (u == NULL)
        return declined(); /* surrogates: the Python path raises its EncodeError */
    RESERVE(b, n + 10);
    zz(b, n);
    memcpy(b->p + b->len, u, (size_t)n);
    b->len += n;
    return BODY_OK;
}

/* obj.name as a new reference in *out. */
static int
get(PyObject *obj, PyObject *name, PyObject **out)
{
    *out = PyObject_GetAttr(obj, name);
    return *out == NULL ? declined() : BODY_OK;
}

/* put(b, obj.name) with put one of the writers above. */
static int
put_attr(Buf *b, PyObject *obj, PyObject *name, int (*put)(Buf *, PyObject *))
{
    PyObject *v;
    TRY(get(obj, name, &v));
    int r = put(b, v);
    Py_DECREF(v);
    return r;
}

/* null, or union branch 1 and the long. */
static int
put_opt_long(Buf *b, PyObject *o)
{
    if (o == Py_None)
        return put_byte(b, 0);
    TRY(put_byte(b, 2));
    return put_long_obj(b, o);
}

/* ------------------------------------------------------------------------------ stored */

/* The token ids of one block appended to raw; its id count in *count. */
static int
block_tokens(PyObject *tok, Buf *raw, Py_ssize_t *count)
{
    PyObject *run = NULL, *src;
    const char *p;
    Py_ssize_t n;
    if (Py_TYPE(tok) != B.token_ids) {
        run = PyObject_GetAttr(tok, s_run);
        if (run == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return declined();
            PyErr_Clear(); /* not a view, or a view that has cut its own bytes: raw */
        }
    }
    if (run != NULL) { /* (packed, step) and the view's run_index */
        PyObject *packed, *step_o, *i_o = NULL;
        Py_ssize_t step, i = -1;
        if (!PyTuple_CheckExact(run) || PyTuple_GET_SIZE(run) != 2 ||
            !PyBytes_CheckExact(packed = PyTuple_GET_ITEM(run, 0)) ||
            !PyLong_CheckExact(step_o = PyTuple_GET_ITEM(run, 1)) ||
            (i_o = PyObject_GetAttr(tok, s_run_index)) == NULL || !PyLong_CheckExact(i_o)) {
            Py_DECREF(run);
            Py_XDECREF(i_o);
            return PyErr_Occurred() ? declined() : BODY_DECLINE;
        }
        step = PyLong_AsSsize_t(step_o);
        i = PyLong_AsSsize_t(i_o);
        Py_DECREF(i_o);
        if ((step == -1 || i == -1) && PyErr_Occurred()) {
            Py_DECREF(run);
            return declined();
        }
        if (step < 0 || step % 4 || i < 0 ||
            (step && i > (PyBytes_GET_SIZE(packed) - step) / step)) {
            Py_DECREF(run);
            return BODY_DECLINE;
        }
        int r = put_mem(raw, PyBytes_AS_STRING(packed) + i * step, step);
        Py_DECREF(run);
        *count = step / 4;
        return r;
    }
    if ((src = PyObject_GetAttr(tok, s_raw)) == NULL)
        return declined();
    if (!PyBytes_CheckExact(src) || PyBytes_GET_SIZE(src) % 4) {
        Py_DECREF(src);
        return BODY_DECLINE;
    }
    p = PyBytes_AS_STRING(src);
    n = PyBytes_GET_SIZE(src);
    int r = put_mem(raw, p, n);
    Py_DECREF(src);
    *count = n / 4;
    return r;
}

/* The ten field values of a StoredBlock (borrowed from its __dict__, which the block keeps). */
static int
block_fields(PyObject *blk, PyObject **vals)
{
    if (Py_TYPE(blk) != B.block)
        return BODY_DECLINE;
    PyObject *d = PyObject_GenericGetDict(blk, NULL);
    if (d == NULL)
        return declined();
    int ok = PyDict_CheckExact(d) && PyDict_GET_SIZE(d) == N_BLOCK_FIELDS;
    if (ok) { /* pydantic keeps the fields in declaration order: one pass, keys checked */
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        for (int k = 0; k < N_BLOCK_FIELDS && ok; k++) {
            ok = PyDict_Next(d, &pos, &key, &value) &&
                 (key == B.names[k] ||
                  (PyUnicode_CheckExact(key) && PyUnicode_Compare(key, B.names[k]) == 0));
            vals[k] = value;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(d);
            return declined();
        }
    }
    if (!ok) { /* another order: by name */
        for (int k = 0; k < N_BLOCK_FIELDS; k++) {
            vals[k] = PyDict_Check(d) ? PyDict_GetItemWithError(d, B.names[k]) : NULL;
            if (vals[k] == NULL) {
                Py_DECREF(d);
                return PyErr_Occurred() ? declined() : BODY_DECLINE;
            }
        }
    }
    Py_DECREF(d);
    return BODY_OK;
}

typedef struct {
    Buf body, raw;
    Py_ssize_t *counts;   /* per block of the current event: its token count */
    PyObject **hashes;    /* per block of the current event: its hash (borrowed) */
    Py_ssize_t scratch;   /* capacity of counts/hashes */
    Py_ssize_t *kinds;    /* offsets in body of the stored events' kind bytes */
    Py_ssize_t n_kinds, kinds_cap;
    PyObject *version_obj;
} Enc;

static int
scratch(Enc *e, Py_ssize_t n)
{
    if (n <= e->scratch)
        return BODY_OK;
    Py_ssize_t *c = PyMem_Realloc(e->counts, sizeof(Py_ssize_t) * (size_t)n);
    if (c == NULL) {
        PyErr_NoMemory();
        return BODY_FAIL;
    }
    e->counts = c;
    PyObject **h = PyMem_Realloc(e->hashes, sizeof(PyObject *) * (size_t)n);
    if (h == NULL) {
        PyErr_NoMemory();
        return BODY_FAIL;
    }
    e->hashes = h;
    e->scratch = n;
    return BODY_OK;
}

static int
stored(Enc *e, PyObject *data, int version)
{
    Buf *b = &e->body;
    PyObject *parent, *blocks;
    TRY(get(data, s_parent_hash, &parent));
    int r = parent == Py_None ? put_byte(b, 0) : put_byte(b, 2);
    if (r == BODY_OK && parent != Py_None)
        r = put_bytes_obj(b, parent);
    Py_DECREF(parent);
    TRY(r);
    TRY(get(data, s_blocks, &blocks));
    Py_ssize_t n = PyTuple_CheckExact(blocks) ? PyTuple_GET_SIZE(blocks) : 0;
    if (n == 0) { /* not a tuple, or no blocks (not a valid Stored) */
        Py_DECREF(blocks);
        return BODY_DECLINE;
    }
    if ((r = scratch(e, n)) != BODY_OK) {
        Py_DECREF(blocks);
        return r;
    }
    Py_ssize_t hash_len = 0;
    int plain = 1;
    for (Py_ssize_t i = 0; i < n && r == BODY_OK; i++) {
        PyObject *vals[N_BLOCK_FIELDS];
        if ((r = block_fields(PyTuple_GET_ITEM(blocks, i), vals)) != BODY_OK)
            break;
        if (!PyBytes_CheckExact(vals[0])) {
            r = BODY_DECLINE;
            break;
        }
        e->hashes[i] = vals[0];
        hash_len += PyBytes_GET_SIZE(vals[0]);
        r = block_tokens(vals[1], &e->raw, &e->counts[i]);
        for (int k = 2; k < N_BLOCK_FIELDS && plain; k++)
            plain = vals[k] == B.defaults[k - 2];
    }
    if (r != BODY_OK) {
        Py_DECREF(blocks);
        return r;
    }
    const Py_ssize_t *c = e->counts;
    int regular = 1; /* every block but the last has the first one's token count */
    for (Py_ssize_t i = 1; i < n - 1 && regular; i++)
        regular = c[i] == c[0];
    if (b->len + hash_len + 10 * (n + 8) > b->cap && buf_grow(b, hash_len + 10 * (n + 8)) < 0) {
        Py_DECREF(blocks);
        return BODY_FAIL;
    }
    zz(b, n);
    zz(b, hash_len);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(b->p + b->len, PyBytes_AS_STRING(e->hashes[i]),
               (size_t)PyBytes_GET_SIZE(e->hashes[i]));
        b->len += PyBytes_GET_SIZE(e->hashes[i]);
    }
    if (regular) { /* block_size, last_block_size, block_sizes null */
        zz(b, c[0]);
        zz(b, c[n - 1]);
        b->p[b->len++] = 0;
    }
    else { /* 0, 0, branch 1 and the sizes as an array */
        b->p[b->len++] = 0;
        b->p[b->len++] = 0;
        b->p[b->len++] = 2;
        zz(b, n);
        for (Py_ssize_t i = 0; i < n; i++)
            zz(b, c[i]);
        b->p[b->len++] = 0;
    }
    if (plain) {
        PyObject *tail = B.tails[version];
        r = put_mem(b, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail));
    }
    else { /* some block has an attribute: the Python helper writes them all */
        PyObject *attrs = PyObject_CallFunctionObjArgs(B.block_attrs, blocks, e->version_obj,
                                                       NULL);
        if (attrs == NULL)
            r = BODY_FAIL;
        else if (!PyBytes_CheckExact(attrs))
            r = BODY_DECLINE;
        else if ((r = put_mem(b, PyBytes_AS_STRING(attrs), PyBytes_GET_SIZE(attrs))) ==
                 BODY_OK) {
            PyObject *post = B.frames[version][K_STORED][1];
            r = put_mem(b, PyBytes_AS_STRING(post), PyBytes_GET_SIZE(post));
        }
        Py_XDECREF(attrs);
    }
    Py_DECREF(blocks);
    return r;
}

/* ------------------------------------------------------------------------------ other kinds */

static int
removed(Enc *e, PyObject *data, int version)
{
    Buf *b = &e->body;
    PyObject *hashes;
    TRY(get(data, s_block_hashes, &hashes));
    if (!PyTuple_CheckExact(hashes)) {
        Py_DECREF(hashes);
        return BODY_DECLINE;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(hashes), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i);
        if (!PyBytes_CheckExact(h)) {
            Py_DECREF(hashes);
            return BODY_DECLINE;
        }
        total += PyBytes_GET_SIZE(h);
    }
    if (b->len + total + 20 > b->cap && buf_grow(b, total + 20) < 0) {
        Py_DECREF(hashes);
        return BODY_FAIL;
    }
    zz(b, n);
    zz(b, total);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i);
        memcpy(b->p + b->len, PyBytes_AS_STRING(h), (size_t)PyBytes_GET_SIZE(h));
        b->len += PyBytes_GET_SIZE(h);
    }
    Py_DECREF(hashes);
    if (version >= 2)
        return put_attr(b, data, s_cache_level, put_opt_long);
    return BODY_OK;
}

static int
put_diff(Buf *b, PyObject *diff)
{
    if (diff == Py_None)
        return put_byte(b, 0);
    if (Py_TYPE(diff) != B.diff)
        return BODY_DECLINE;
    TRY(put_byte(b, 2));
    TRY(put_attr(b, diff, s_old_value, put_long_obj));
    return put_attr(b, diff, s_new_value, put_long_obj);
}

static int
updated(Enc *e, PyObject *data, int version)
{
    (void)version;
    Buf *b = &e->body;
    TRY(put_attr(b, data, s_block_hash, put_bytes_obj));
    TRY(put_attr(b, data, s_cache_level, put_diff));
    return put_attr(b, data, s_priority, put_diff);
}

static int
put_attention(Buf *b, PyObject *kind)
{
    if (kind == B.full)
        return put_byte(b, 2);
    if (kind == B.sliding)
        return put_byte(b, 4);
    return BODY_DECLINE;
}

static int
created(Enc *e, PyObject *data, int version)
{
    Buf *b = &e->body;
    PyObject *levels;
    TRY(get(data, s_num_blocks, &levels));
    int r = PyTuple_CheckExact(levels) ? BODY_OK : BODY_DECLINE;
    Py_ssize_t n = r == BODY_OK ? PyTuple_GET_SIZE(levels) : 0;
    if (r == BODY_OK && n)
        r = put_zz(b, n);
    for (Py_ssize_t i = 0; i < n && r == BODY_OK; i++)
        r = put_long_obj(b, PyTuple_GET_ITEM(levels, i));
    Py_DECREF(levels);
    TRY(r);
    TRY(put_byte(b, 0)); /* the array's end (or the empty array) */
    if (version >= 2) {
        TRY(put_attr(b, data, s_tokens_per_block, put_long_obj));
        TRY(put_attr(b, data, s_attention_kind, put_attention));
    }
    return BODY_OK;
}

static int
lost(Enc *e, PyObject *data, int version)
{
    (void)version;
    Buf *b = &e->body;
    TRY(put_attr(b, data, s_first_event_id, put_long_obj));
    TRY(put_attr(b, data, s_count, put_long_obj));
    return put_attr(b, data, s_reason, put_str_obj);
}

static int
event(Enc *e, PyObject *ev, int version)
{
    Buf *b = &e->body;
    PyObject *data;
    int kind, r;
    TRY(get(ev, s_data, &data));
    for (kind = 0; kind < N_KINDS; kind++)
        if (Py_TYPE(data) == B.kinds[kind])
            break;
    if (kind == N_KINDS || B.frames[version][kind][0] == NULL) {
        Py_DECREF(data); /* a foreign payload, or a kind this version lacks */
        return BODY_DECLINE;
    }
    if ((r = put_attr(b, ev, s_event_id, put_long_obj)) != BODY_OK)
        goto out;
    if (kind == K_STORED) { /* the kind byte is patched once the tokens' encoding is known */
        if (e->n_kinds == e->kinds_cap) {
            Py_ssize_t cap = e->kinds_cap ? 2 * e->kinds_cap : 64;
            Py_ssize_t *k = PyMem_Realloc(e->kinds, sizeof(Py_ssize_t) * (size_t)cap);
            if (k == NULL) {
                PyErr_NoMemory();
                r = BODY_FAIL;
                goto out;
            }
            e->kinds = k;
            e->kinds_cap = cap;
        }
        e->kinds[e->n_kinds++] = b->len;
    }
    if ((r = put_byte(b, KIND_BYTE[kind])) != BODY_OK ||
        (r = put_attr(b, ev, s_window_size, put_long_obj)) != BODY_OK)
        goto out;
    if (version >= 2 && ((r = put_attr(b, ev, s_hash_algo, put_str_obj)) != BODY_OK ||
                         (r = put_attr(b, ev, s_layer_group_id, put_long_obj)) != BODY_OK))
        goto out;
    PyObject *pre = B.frames[version][kind][0];
    if ((r = put_mem(b, PyBytes_AS_STRING(pre), PyBytes_GET_SIZE(pre))) != BODY_OK)
        goto out;
    switch (kind) {
    case K_STORED:
        r = stored(e, data, version); /* writes its own tail */
        goto out;
    case K_REMOVED:
        r = removed(e, data, version);
        break;
    case K_UPDATED:
        r = updated(e, data, version);
        break;
    case K_CREATED:
        r = created(e, data, version);
        break;
    case K_LOST:
        r = lost(e, data, version);
        break;
    default: /* cleared: no payload */
        break;
    }
    if (r == BODY_OK) {
        PyObject *post = B.frames[version][kind][1];
        r = put_mem(b, PyBytes_AS_STRING(post), PyBytes_GET_SIZE(post));
    }
out:
    Py_DECREF(data);
    return r;
}

/* ------------------------------------------------------------------------------ the batch */

/* TokenEncoding / TokenCompression symbols of EncodedTokens as their enum bytes; 0 unknown. */
static unsigned char
symbol(PyObject *s, const char *const *names, const unsigned char *bytes, int n)
{
    if (!PyUnicode_CheckExact(s))
        return 0;
    for (int i = 0; i < n; i++)
        if (PyUnicode_CompareWithASCIIString(s, names[i]) == 0)
            return bytes[i];
    return 0;
}

static const char *const ENCODINGS[] = {"NONE", "BIT_PLANES", "VARINT", "DELTA_VARINT"};
static const unsigned char ENCODING_BYTES[] = {0x02, 0x04, 0x06, 0x08};
static const char *const COMPRESSIONS[] = {"NONE", "ZSTD"};
static const unsigned char COMPRESSION_BYTES[] = {0x02, 0x04};

/* The TokenPack fields of EncodedTokens `tok` into head; *packed set when the ids are packed. */
static int
token_fields(Buf *h, PyObject *tok, int version, int *packed)
{
    PyObject *enc, *planes;
    TRY(get(tok, s_encoding, &enc));
    unsigned char e = symbol(enc, ENCODINGS, ENCODING_BYTES, 4);
    Py_DECREF(enc);
    if (e == 0)
        return BODY_DECLINE;
    *packed = e != 0x02;
    TRY(get(tok, s_planes, &planes));
    int r = put_attr(h, planes, s_count, put_long_obj);
    if (r == BODY_OK)
        r = put_attr(h, planes, s_high_bits, put_long_obj);
    if (r == BODY_OK)
        r = put_attr(h, planes, s_low16, put_bytes_obj);
    if (r == BODY_OK)
        r = put_attr(h, planes, s_high_planes, put_bytes_obj);
    Py_DECREF(planes);
    TRY(r);
    if (version < 4)
        return *packed ? BODY_DECLINE : BODY_OK;
    if (!*packed)
        return put_mem(h, "\x02\x02\x00\x00", 4);
    PyObject *comp;
    TRY(get(tok, s_compression, &comp));
    unsigned char c = symbol(comp, COMPRESSIONS, COMPRESSION_BYTES, 2);
    Py_DECREF(comp);
    if (c == 0)
        return BODY_DECLINE;
    TRY(put_byte(h, e));
    TRY(put_byte(h, c));
    TRY(put_attr(h, tok, s_count, put_long_obj));
    return put_attr(h, tok, s_packed, put_bytes_obj);
}

/* The source, ts_ns and token fields (prefix first) into head. */
static int
batch_head(Buf *h, PyObject *prefix, PyObject *batch, PyObject *tok, int version,
           Py_ssize_t n_events, int *packed)
{
    PyObject *source;
    TRY(put_mem(h, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix)));
    TRY(get(batch, s_source, &source));
    int r = put_attr(h, source, s_instance_id, put_str_obj);
    if (r == BODY_OK)
        r = put_attr(h, source, s_attention_dp_rank, put_opt_long);
    if (r == BODY_OK && version >= 2)
        r = put_attr(h, source, s_incarnation, put_long_obj);
    Py_DECREF(source);
    TRY(r);
    TRY(put_attr(h, batch, s_ts_ns, put_long_obj));
    TRY(token_fields(h, tok, version, packed));
    return put_zz(h, n_events); /* the events array's count, or 0: the empty array */
}


/* What a body encoder returns for status r: the record (head, then the events' bytes `body`
 * with the stored events' kind bytes at offsets `kinds` switched to the packed form when
 * `packed`, then the events array's end when there are n > 0 events), None for BODY_DECLINE,
 * NULL (exception set) otherwise. */
static PyObject *
body_result(int r, const Buf *head, const Buf *body, const Py_ssize_t *kinds,
            Py_ssize_t n_kinds, int packed, Py_ssize_t n)
{
    if (r == BODY_DECLINE)
        Py_RETURN_NONE;
    if (r != BODY_OK)
        return NULL;
    if (packed)
        for (Py_ssize_t i = 0; i < n_kinds; i++)
            body->p[kinds[i]] = (char)STORED_PACKED_BYTE;
    PyObject *res = PyBytes_FromStringAndSize(NULL, head->len + body->len + (n ? 1 : 0));
    if (res != NULL) {
        char *o = PyBytes_AS_STRING(res);
        memcpy(o, head->p, (size_t)head->len);
        if (body->len)
            memcpy(o + head->len, body->p, (size_t)body->len);
        if (n)
            o[head->len + body->len] = 0; /* the events array's end */
    }
    return res;
}

static PyObject *
encode_body(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *prefix, *batch, *events, *token_encoding, *res = NULL, *raw = NULL, *tok = NULL;
    int version;
    if (!PyArg_ParseTuple(args, "O!OO!iU:encode_body", &PyBytes_Type, &prefix, &batch,
                          &PyTuple_Type, &events, &version, &token_encoding))
        return NULL;
    if (!B.ready) {
        PyErr_SetString(PyExc_RuntimeError, "encode_body: body_setup() was not called");
        return NULL;
    }
    if (version < 1 || version > MAX_VERSION || B.tails[version] == NULL)
        Py_RETURN_NONE;
    Enc e = {{NULL, 0, 0}, {NULL, 0, 0}, NULL, NULL, 0, NULL, 0, 0, NULL};
    Buf head = {NULL, 0, 0};
    int r = BODY_OK, packed = 0;
    Py_ssize_t n = PyTuple_GET_SIZE(events);
    if ((e.version_obj = PyLong_FromLong(version)) == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n && r == BODY_OK; i++)
        r = event(&e, PyTuple_GET_ITEM(events, i), version);
    if (r == BODY_OK) {
        raw = PyBytes_FromStringAndSize(e.raw.p ? e.raw.p : "", e.raw.len);
        if (raw == NULL)
            r = BODY_FAIL;
    }
    if (r == BODY_OK) {
        tok = PyObject_CallFunctionObjArgs(B.encode_tokens, raw, token_encoding, NULL);
        r = tok == NULL ? BODY_FAIL : batch_head(&head, prefix, batch, tok, version, n, &packed);
    }
    res = body_result(r, &head, &e.body, e.kinds, e.n_kinds, packed, n);
    Py_XDECREF(raw);
    Py_XDECREF(tok);
    Py_DECREF(e.version_obj);
    PyMem_Free(e.body.p);
    PyMem_Free(e.raw.p);
    PyMem_Free(e.counts);
    PyMem_Free(e.hashes);
    PyMem_Free(e.kinds);
    PyMem_Free(head.p);
    return res;
}

/* ------------------------------------------------------------------------------ setup */

static int
type_arg(PyObject *o, PyTypeObject **out)
{
    if (!PyType_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "body_setup: expected a class");
        return -1;
    }
    Py_INCREF(o);
    Py_XSETREF(*out, (PyTypeObject *)o);
    return 0;
}

static int
bytes_arg(PyObject *o, PyObject **out, int allow_none)
{
    if (o == Py_None && allow_none) {
        Py_CLEAR(*out);
        return 0;
    }
    if (!PyBytes_CheckExact(o)) {
        PyErr_SetString(PyExc_TypeError, "body_setup: expected bytes");
        return -1;
    }
    Py_INCREF(o);
    Py_XSETREF(*out, o);
    return 0;
}

static PyObject *
body_setup(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *types, *attention, *names, *defaults, *frames, *tails, *attrs, *tokens;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!OO:body_setup", &PyTuple_Type, &types,
                          &PyTuple_Type, &attention, &PyTuple_Type, &names, &PyTuple_Type,
                          &defaults, &PyTuple_Type, &frames, &PyTuple_Type, &tails, &attrs,
                          &tokens))
        return NULL;
    if (PyTuple_GET_SIZE(types) != N_KINDS + 3 || PyTuple_GET_SIZE(attention) != 2 ||
        PyTuple_GET_SIZE(names) != N_BLOCK_FIELDS ||
        PyTuple_GET_SIZE(defaults) != N_BLOCK_FIELDS - 2 ||
        PyTuple_GET_SIZE(frames) != MAX_VERSION + 1 ||
        PyTuple_GET_SIZE(tails) != MAX_VERSION + 1 || !PyCallable_Check(attrs) ||
        !PyCallable_Check(tokens)) {
        PyErr_SetString(PyExc_ValueError, "body_setup: unexpected arguments");
        return NULL;
    }
    B.ready = 0;
    /* types: StoredBlock, the six payload classes in kind order, EventDiff, TokenIds */
    if (type_arg(PyTuple_GET_ITEM(types, 0), &B.block) < 0)
        return NULL;
    for (int k = 0; k < N_KINDS; k++)
        if (type_arg(PyTuple_GET_ITEM(types, 1 + k), &B.kinds[k]) < 0)
            return NULL;
    if (type_arg(PyTuple_GET_ITEM(types, N_KINDS + 1), &B.diff) < 0 ||
        type_arg(PyTuple_GET_ITEM(types, N_KINDS + 2), &B.token_ids) < 0)
        return NULL;
    Py_INCREF(PyTuple_GET_ITEM(attention, 0));
    Py_XSETREF(B.full, PyTuple_GET_ITEM(attention, 0));
    Py_INCREF(PyTuple_GET_ITEM(attention, 1));
    Py_XSETREF(B.sliding, PyTuple_GET_ITEM(attention, 1));
    for (int k = 0; k < N_BLOCK_FIELDS; k++) {
        PyObject *name = PyTuple_GET_ITEM(names, k);
        if (!PyUnicode_CheckExact(name)) {
            PyErr_SetString(PyExc_TypeError, "body_setup: field names must be str");
            return NULL;
        }
        Py_INCREF(name);
        Py_XSETREF(B.names[k], name);
    }
    for (int k = 0; k < N_BLOCK_FIELDS - 2; k++) {
        Py_INCREF(PyTuple_GET_ITEM(defaults, k));
        Py_XSETREF(B.defaults[k], PyTuple_GET_ITEM(defaults, k));
    }
    /* frames[v]: None, or per kind None or (pre, post); tails[v]: None or bytes */
    for (int v = 0; v <= MAX_VERSION; v++) {
        PyObject *fv = PyTuple_GET_ITEM(frames, v);
        int have = fv != Py_None;
        if (have && (!PyTuple_CheckExact(fv) || PyTuple_GET_SIZE(fv) != N_KINDS)) {
            PyErr_SetString(PyExc_ValueError, "body_setup: frames[v] must hold 6 entries");
            return NULL;
        }
        for (int k = 0; k < N_KINDS; k++) {
            PyObject *pair = have ? PyTuple_GET_ITEM(fv, k) : Py_None;
            if (pair != Py_None && (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)) {
                PyErr_SetString(PyExc_ValueError, "body_setup: a frame is (pre, post)");
                return NULL;
            }
            for (int j = 0; j < 2; j++)
                if (bytes_arg(pair == Py_None ? Py_None : PyTuple_GET_ITEM(pair, j),
                              &B.frames[v][k][j], pair == Py_None) < 0)
                    return NULL;
        }
        if (bytes_arg(PyTuple_GET_ITEM(tails, v), &B.tails[v], 1) < 0)
            return NULL;
        if (B.tails[v] != NULL && B.frames[v][K_STORED][0] == NULL) {
            PyErr_SetString(PyExc_ValueError, "body_setup: a version with a tail needs frames");
            return NULL;
        }
    }
    Py_INCREF(attrs);
    Py_XSETREF(B.block_attrs, attrs);
    Py_INCREF(tokens);
    Py_XSETREF(B.encode_tokens, tokens);
    B.ready = 1;
    Py_RETURN_NONE;
}
