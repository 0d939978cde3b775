/*
 * kvstream.codec._columns_native: one EventBatch record of schema v3 or v4 (Avro binary) straight
 * into the columns of kvstream.codec.columnar.ColumnBatch, without fastavro's dicts.
 *
 * kvstream/codec/columnar.py holds the reference (fastavro + record_columns) and is the
 * fallback. This decoder only ever ACCEPTS: it returns the columns of a record when it is sure
 * the reference accepts the record and produces exactly these columns, and None otherwise (any
 * malformed, truncated, non-canonical or merely unusual input: a negative enum or union index,
 * an over-long varint, a negative array block count, a validation rule broken, zstd token
 * planes it cannot check...). On None the caller decodes the same bytes with the reference,
 * which raises the reference's DecodeError or returns its result, so both paths agree by
 * construction on everything this file declines. Every read is bounds-checked against the
 * buffer.
 *
 *   configure(widths, unknown_widths, priority_max, attention)
 *       widths: {hash_algo: width} of the known algorithms; unknown_widths: the widths an
 *       unknown algorithm may have; priority_max; attention: the model's values of the
 *       AttentionKind symbols (None, FULL_ATTENTION's, SLIDING_WINDOW's). Once, before decode.
 *   decode(buf, offset, version) -> tuple | None
 *       The record of writer `version` (3 or 4, read with its own schema) starting at
 *       buf[offset]: (end_offset, instance_id, attention_dp_rank, incarnation, ts_ns, tokens,
 *       event_ids, kinds, hash_algos, group_ids, window_sizes, payloads, skipped). `tokens` is
 *       the ids as little-endian uint32 bytes, or (encoding code, count, packed bytes) when
 *       they are zstd-compressed (the caller decompresses, then calls packed_ids). `skipped`
 *       lists (event_id, kind symbol, reason) of the events left out. When `buf` is a bytes
 *       object, valid bit planes are not unpacked: `tokens` is then (count, high_bits,
 *       low16 offset, planes offset) in `buf`, for planes_ids.
 *   planes_ids(buf, count, high_bits, low_off, planes_off) -> bytes
 *       The ids of bit planes in buf (bounds and padding checked again; ValueError).
 *   packed_ids(encoding, data, count) -> bytes | None
 *       The ids of uncompressed packed token data (encoding 2 BIT_PLANES, 3 VARINT,
 *       4 DELTA_VARINT), or None when they are not exactly `count` valid ids.
 *   model_columns(events, stored_type, removed_type, stored_code, removed_code)
 *       ColumnBatch.from_batch's columns of validated models (stored/removed events only;
 *       None for anything else), see below.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define OK 0
#define BAIL (-1) /* not for the fast path: the caller falls back, no exception set */
#define ERR (-2)  /* a Python exception is set */

#define I32_MAX 2147483647LL
#define MAX_HASH 64
#define ALGO_CACHE 16

/* column kind codes (columnar.CREATED ...) per EventKind symbol index of v3/v4;
 * -1: UNKNOWN (skipped), 1 for STORED and STORED_PACKED */
static const int KIND_CODE[8] = {-1, 0, 1, 2, 3, 4, 5, 1};
/* the payload field (created, stored, removed, updated, lost) each code needs; -1: none */
static const int PAYLOAD_OF[6] = {0, 1, 2, 3, -1, 4};

static PyObject *g_widths = NULL;         /* dict */
static PyObject *g_unknown_widths = NULL; /* tuple of ints */
static long long g_priority_max = -1;
static PyObject *g_attention = NULL; /* tuple of 3 */

static struct {
    Py_ssize_t len;
    char bytes[MAX_HASH];
    PyObject *str;
} g_algos[ALGO_CACHE];
static int g_n_algos = 0;

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Rd;

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Vec;

static int
vec_push(Vec *vec, int64_t x)
{
    if (vec->n == vec->cap) {
        Py_ssize_t cap = vec->cap ? 2 * vec->cap : 64;
        int64_t *v = PyMem_Realloc(vec->v, (size_t)cap * sizeof(int64_t));
        if (v == NULL) {
            PyErr_NoMemory();
            return ERR;
        }
        vec->v = v;
        vec->cap = cap;
    }
    vec->v[vec->n++] = x;
    return OK;
}

/* ------------------------------------------------------------------ Avro primitives */

/* A zig-zag varint long. Over 10 bytes, or a 10th byte beyond bit 63: BAIL (fastavro's
 * readings of those differ between builds). */
static inline int
rd_long(Rd *r, int64_t *out)
{
    uint64_t n = 0;
    int shift = 0;
    for (int i = 0; i < 10; i++) {
        if (r->p >= r->end)
            return BAIL;
        uint8_t b = *r->p++;
        if (i == 9 && b > 1)
            return BAIL;
        n |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = (int64_t)((n >> 1) ^ (~(n & 1) + 1));
            return OK;
        }
        shift += 7;
    }
    return BAIL;
}

static inline int
rd_bytes(Rd *r, const uint8_t **ptr, Py_ssize_t *len)
{
    int64_t n;
    if (rd_long(r, &n))
        return BAIL;
    if (n < 0 || n > (int64_t)(r->end - r->p))
        return BAIL;
    *ptr = r->p;
    *len = (Py_ssize_t)n;
    r->p += n;
    return OK;
}

/* a [null, X] union's branch: 0 or 1 */
static inline int
rd_union(Rd *r, int *branch)
{
    int64_t i;
    if (rd_long(r, &i) || (i != 0 && i != 1))
        return BAIL;
    *branch = (int)i;
    return OK;
}

static inline int
rd_enum(Rd *r, int symbols, int *index)
{
    int64_t i;
    if (rd_long(r, &i) || i < 0 || i >= symbols)
        return BAIL;
    *index = (int)i;
    return OK;
}

/* Before each array item: 1 when an item follows, 0 at the end of the array. */
static inline int
arr_more(Rd *r, int64_t *left)
{
    if (*left > 0) {
        (*left)--;
        return 1;
    }
    int64_t c;
    if (rd_long(r, &c) || c < 0)
        return BAIL;
    if (c == 0)
        return 0;
    *left = c - 1;
    return 1;
}

static int
utf8_ok(const uint8_t *p, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[i] & 0x80) {
            PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
            if (s == NULL) {
                PyErr_Clear();
                return 0;
            }
            Py_DECREF(s);
            return 1;
        }
    }
    return 1;
}

/* a string that is parsed but not kept: it must be valid UTF-8 (fastavro decodes it) */
static inline int
skip_str(Rd *r)
{
    const uint8_t *p;
    Py_ssize_t n;
    if (rd_bytes(r, &p, &n) || !utf8_ok(p, n))
        return BAIL;
    return OK;
}

static int
read_ints(Rd *r, Vec *out)
{
    int64_t left = 0, v;
    int more;
    out->n = 0;
    while ((more = arr_more(r, &left)) == 1) {
        if (rd_long(r, &v))
            return BAIL;
        if (vec_push(out, v))
            return ERR;
    }
    return more;
}

/* an array of [null, long] or [null, string]: its length */
static int
count_nullable(Rd *r, int strings, int64_t *count)
{
    int64_t left = 0, v;
    int more, b;
    *count = 0;
    while ((more = arr_more(r, &left)) == 1) {
        if (rd_union(r, &b))
            return BAIL;
        if (b == 1 && (strings ? skip_str(r) : rd_long(r, &v)))
            return BAIL;
        (*count)++;
    }
    return more;
}

/* one extra-key atom of the union [string, long, ExtraKeyBytes, ExtraKeyUInt64] */
static int
skip_atom(Rd *r, int64_t branch)
{
    const uint8_t *p;
    Py_ssize_t n;
    int64_t v;
    switch (branch) {
    case 0:
        return skip_str(r);
    case 1:
    case 3:
        return rd_long(r, &v);
    case 2:
        return rd_bytes(r, &p, &n);
    default:
        return BAIL;
    }
}

/* ------------------------------------------------------------------ token ids */

static inline void
store_u32le(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* whether bit-plane fields are valid (tokens.unpack_tokens' rules) */
static int
planes_check(int64_t count, int64_t high_bits, Py_ssize_t low_len, const uint8_t *planes,
             Py_ssize_t planes_len)
{
    if (count < 0 || high_bits < 0 || high_bits > 16)
        return BAIL;
    if ((low_len & 1) || (int64_t)(low_len >> 1) != count)
        return BAIL;
    Py_ssize_t plane_len = (Py_ssize_t)((count + 7) >> 3);
    if ((int64_t)planes_len != high_bits * (int64_t)plane_len)
        return BAIL;
    int pad = (int)(count & 7);
    if (pad) {
        for (int64_t j = 0; j < high_bits; j++)
            if (planes[(j + 1) * plane_len - 1] >> pad)
                return BAIL;
    }
    return OK;
}

/* valid bit planes (planes_check) -> ids; out has 4 * count bytes */
static void
planes_fill(int64_t count, int64_t high_bits, const uint8_t *low, const uint8_t *planes,
            uint8_t *out)
{
    Py_ssize_t plane_len = (Py_ssize_t)((count + 7) >> 3);
    int pad = (int)(count & 7);
    for (int64_t i = 0; i < count; i++)
        store_u32le(out + 4 * i, (uint32_t)low[2 * i] | ((uint32_t)low[2 * i + 1] << 8));
    for (int64_t j = 0; j < high_bits; j++) {
        const uint8_t *plane = planes + j * plane_len;
        for (Py_ssize_t k = 0; k < plane_len; k++) {
            unsigned x = plane[k];
            if (pad && k == plane_len - 1)
                x &= (1u << pad) - 1; /* checked zero above; never write past the ids */
            while (x) {
                int b = __builtin_ctz(x);
                x &= x - 1;
                out[4 * (8 * k + b) + ((16 + j) >> 3)] |= (uint8_t)(1u << ((16 + j) & 7));
            }
        }
    }
}

static int
planes_decode(int64_t count, int64_t high_bits, const uint8_t *low, Py_ssize_t low_len,
              const uint8_t *planes, Py_ssize_t planes_len, uint8_t *out)
{
    if (planes_check(count, high_bits, low_len, planes, planes_len))
        return BAIL;
    planes_fill(count, high_bits, low, planes, out);
    return OK;
}

/* exactly `count` canonical LEB128 varints (<= 5 bytes, <= 32 bits, no redundant trailing
 * zero group) filling data -> ids; with delta, zig-zag deltas summed (wrapping) */
static int
varint_decode(const uint8_t *p, Py_ssize_t len, int64_t count, int delta, uint8_t *out)
{
    const uint8_t *end = p + len;
    uint32_t prev = 0;
    for (int64_t i = 0; i < count; i++) {
        if (p >= end)
            return BAIL;
        uint32_t v = *p++;
        if (v & 0x80) {
            v &= 0x7F;
            int shift = 7;
            for (;;) {
                if (p >= end)
                    return BAIL;
                uint32_t b = *p++;
                if (shift == 28) {
                    if (b > 0x0F || b == 0)
                        return BAIL;
                    v |= b << 28;
                    break;
                }
                if (!(b & 0x80)) {
                    if (b == 0)
                        return BAIL;
                    v |= b << shift;
                    break;
                }
                v |= (b & 0x7F) << shift;
                shift += 7;
            }
        }
        if (delta) {
            uint32_t d = (v >> 1) ^ (0u - (v & 1));
            prev += d;
            v = prev;
        }
        store_u32le(out + 4 * i, v);
    }
    return p == end ? OK : BAIL;
}

/* uncompressed packed ids (tokens.decode_packed's rules) into a new bytes object; BAIL/ERR */
static int
packed_decode(int encoding, const uint8_t *data, Py_ssize_t len, int64_t count, PyObject **out)
{
    if (count < 0 || count > (int64_t)len)
        return BAIL; /* every id takes at least one byte */
    if (encoding < 2 || encoding > 4)
        return BAIL;
    PyObject *res = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * count));
    if (res == NULL)
        return ERR;
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(res);
    int rc;
    if (encoding == 2) {
        Py_ssize_t plane_len = (Py_ssize_t)((count + 7) >> 3);
        Py_ssize_t extra = len - (Py_ssize_t)(2 * count);
        if (extra < 0 || (extra && (!plane_len || extra % plane_len)))
            rc = BAIL;
        else
            rc = planes_decode(count, plane_len ? extra / plane_len : 0, data,
                               (Py_ssize_t)(2 * count), data + 2 * count, extra, o);
    }
    else {
        rc = varint_decode(data, len, count, encoding == 4, o);
    }
    if (rc) {
        Py_DECREF(res);
        return rc;
    }
    *out = res;
    return OK;
}

/* ------------------------------------------------------------------ validation helpers */

static int
width_ok(PyObject *algo, Py_ssize_t width)
{
    PyObject *want = PyDict_GetItemWithError(g_widths, algo);
    if (want == NULL) {
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        Py_ssize_t n = PyTuple_GET_SIZE(g_unknown_widths);
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyLong_AsSsize_t(PyTuple_GET_ITEM(g_unknown_widths, i)) == width)
                return 1;
        return 0;
    }
    return PyLong_AsSsize_t(want) == width;
}

/* the hash_algo string, shared between batches (the index keys on it) */
static PyObject *
algo_str(const uint8_t *p, Py_ssize_t n)
{
    if (n <= MAX_HASH) {
        for (int i = 0; i < g_n_algos; i++)
            if (g_algos[i].len == n && memcmp(g_algos[i].bytes, p, (size_t)n) == 0) {
                Py_INCREF(g_algos[i].str);
                return g_algos[i].str;
            }
    }
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (s == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (n <= MAX_HASH && g_n_algos < ALGO_CACHE) {
        PyUnicode_InternInPlace(&s);
        g_algos[g_n_algos].len = n;
        memcpy(g_algos[g_n_algos].bytes, p, (size_t)n);
        Py_INCREF(s);
        g_algos[g_n_algos].str = s;
        g_n_algos++;
    }
    return s;
}

static PyObject *
split_hashes(const uint8_t *p, Py_ssize_t len, int64_t count)
{
    Py_ssize_t width = len / (Py_ssize_t)count;
    PyObject *list = PyList_New((Py_ssize_t)count);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)count; i++) {
        PyObject *h = PyBytes_FromStringAndSize((const char *)p + i * width, width);
        if (h == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, h);
    }
    return list;
}

/* ------------------------------------------------------------------ one event */

typedef struct {
    int64_t eid, window, gid;
    int kind; /* EventKind symbol index */
    const uint8_t *algo;
    Py_ssize_t algo_len;
    int has[5]; /* created, stored, removed, updated, lost */
    /* created */
    Vec caps;
    int64_t tpb;
    int attention;
    /* stored */
    int has_parent;
    const uint8_t *parent, *hashes;
    Py_ssize_t parent_len, hashes_len;
    int64_t n, block_size, last_size, level, prio;
    int plain; /* token ids only: no LoRA, salt, multimodal, extra ids or extra keys */
    int has_sizes, has_levels, has_prios;
    Vec sizes, levels, prios;
    /* removed */
    int64_t r_count, r_level;
    int r_has_level;
    const uint8_t *r_hashes;
    Py_ssize_t r_len;
    /* updated */
    const uint8_t *u_hash;
    Py_ssize_t u_len;
    int u_has[2];
    int64_t u_diff[2][2];
    /* lost */
    int64_t l_first, l_count;
    const uint8_t *l_reason;
    Py_ssize_t l_reason_len;
} Ev;

/* the sparse per-block arrays of a stored payload, checked as columnar._sparse_columns does */
static int
read_sparse(Rd *r, Ev *e)
{
    int64_t left, v, idx, last, n = e->n;
    int more, b;
    const uint8_t *p;
    Py_ssize_t len;
    int64_t first = e->has_sizes ? (e->sizes.n ? e->sizes.v[0] : 0)
                                 : (n > 1 ? e->block_size : e->last_size);
    /* mm_keys: block_index non-decreasing from 0 (a block may have several keys), in range */
    left = 0;
    last = 0;
    while ((more = arr_more(r, &left)) == 1) {
        e->plain = 0;
        if (rd_long(r, &idx) || !(last <= idx && idx < n))
            return BAIL;
        last = idx;
        if (r->end - r->p < 32)
            return BAIL;
        r->p += 32;
        if (rd_long(r, &v) || v < 0 || v > I32_MAX)
            return BAIL;
        if (rd_union(r, &b) || (b && skip_str(r)))
            return BAIL;
    }
    if (more)
        return more;
    /* token_extra_ids: strictly increasing, 4 bytes per token of the block */
    left = 0;
    last = -1;
    while ((more = arr_more(r, &left)) == 1) {
        e->plain = 0;
        if (rd_long(r, &idx) || !(last < idx && idx < n))
            return BAIL;
        last = idx;
        if (rd_bytes(r, &p, &len))
            return BAIL;
        int64_t size = e->has_sizes ? e->sizes.v[idx] : (idx == n - 1 ? e->last_size : first);
        if (size < 0 || (int64_t)len != 4 * size)
            return BAIL;
    }
    if (more)
        return more;
    /* extra_keys: strictly increasing */
    left = 0;
    last = -1;
    while ((more = arr_more(r, &left)) == 1) {
        e->plain = 0;
        if (rd_long(r, &idx) || !(last < idx && idx < n))
            return BAIL;
        last = idx;
        int64_t kl = 0;
        int kmore;
        while ((kmore = arr_more(r, &kl)) == 1) {
            int64_t branch;
            if (rd_long(r, &branch))
                return BAIL;
            if (branch == 4) {
                int64_t al = 0;
                int amore;
                while ((amore = arr_more(r, &al)) == 1) {
                    int64_t ab;
                    if (rd_long(r, &ab) || ab < 0 || ab > 3 || skip_atom(r, ab))
                        return BAIL;
                }
                if (amore)
                    return amore;
            }
            else if (branch < 0 || branch > 3 || skip_atom(r, branch)) {
                return BAIL;
            }
        }
        if (kmore)
            return kmore;
    }
    return more;
}

static int
read_stored(Rd *r, Ev *e)
{
    int b, rc;
    int64_t cnt, v;
    if (rd_union(r, &e->has_parent) ||
        (e->has_parent && rd_bytes(r, &e->parent, &e->parent_len)))
        return BAIL;
    if (rd_long(r, &e->n) || rd_bytes(r, &e->hashes, &e->hashes_len) ||
        rd_long(r, &e->block_size) || rd_long(r, &e->last_size))
        return BAIL;
    if (e->n < 1)
        return BAIL;
    e->plain = 1;
    if (rd_union(r, &e->has_sizes))
        return BAIL;
    if (e->has_sizes) {
        if ((rc = read_ints(r, &e->sizes)))
            return rc;
        if (e->sizes.n != e->n)
            return BAIL;
    }
    if (rd_long(r, &e->level) || rd_union(r, &e->has_levels))
        return BAIL;
    if (e->has_levels && (rc = read_ints(r, &e->levels)))
        return rc;
    if (rd_long(r, &e->prio) || rd_union(r, &e->has_prios))
        return BAIL;
    if (e->has_prios && (rc = read_ints(r, &e->prios)))
        return rc;
    /* lora_id, lora_ids, lora_name, lora_names, cache_salt, cache_salts */
    for (int k = 0; k < 6; k++) {
        if (rd_union(r, &b))
            return BAIL;
        if (!b)
            continue;
        e->plain = 0;
        if (k & 1) {
            if ((rc = count_nullable(r, k != 1, &cnt)))
                return rc;
            if (cnt != e->n)
                return BAIL;
        }
        else if (k == 0 ? rd_long(r, &v) : skip_str(r)) {
            return BAIL;
        }
    }
    return read_sparse(r, e);
}

static int
read_event(Rd *r, Ev *e, int kinds)
{
    int rc;
    if (rd_long(r, &e->eid) || rd_enum(r, kinds, &e->kind) || rd_long(r, &e->window) ||
        rd_bytes(r, &e->algo, &e->algo_len) || !utf8_ok(e->algo, e->algo_len) ||
        rd_long(r, &e->gid))
        return BAIL;
    /* created */
    if (rd_union(r, &e->has[0]))
        return BAIL;
    if (e->has[0]) {
        if ((rc = read_ints(r, &e->caps)))
            return rc;
        if (rd_long(r, &e->tpb) || rd_enum(r, 3, &e->attention))
            return BAIL;
    }
    /* stored */
    if (rd_union(r, &e->has[1]))
        return BAIL;
    if (e->has[1] && (rc = read_stored(r, e)))
        return rc;
    /* removed */
    if (rd_union(r, &e->has[2]))
        return BAIL;
    if (e->has[2]) {
        if (rd_long(r, &e->r_count) || rd_bytes(r, &e->r_hashes, &e->r_len) ||
            rd_union(r, &e->r_has_level) || (e->r_has_level && rd_long(r, &e->r_level)))
            return BAIL;
    }
    /* updated */
    if (rd_union(r, &e->has[3]))
        return BAIL;
    if (e->has[3]) {
        if (rd_bytes(r, &e->u_hash, &e->u_len))
            return BAIL;
        for (int k = 0; k < 2; k++) {
            if (rd_union(r, &e->u_has[k]))
                return BAIL;
            if (e->u_has[k] && (rd_long(r, &e->u_diff[k][0]) || rd_long(r, &e->u_diff[k][1])))
                return BAIL;
        }
    }
    /* lost */
    if (rd_union(r, &e->has[4]))
        return BAIL;
    if (e->has[4]) {
        if (rd_long(r, &e->l_first) || rd_long(r, &e->l_count) ||
            rd_bytes(r, &e->l_reason, &e->l_reason_len) ||
            !utf8_ok(e->l_reason, e->l_reason_len))
            return BAIL;
    }
    return OK;
}

/* ------------------------------------------------------------------ one record */

typedef struct {
    PyObject *ids, *kinds, *algos, *gids, *windows, *payloads, *skipped;
    PyObject *layout; /* per stored event: (token offset, block sizes) when plain, else None */
} Cols;

static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return ERR;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc ? ERR : OK;
}

static int
skip_event(Cols *c, int64_t eid, const char *kind, const char *reason)
{
    PyObject *t = Py_BuildValue("(Lss)", (long long)eid, kind, reason);
    return append_new(c->skipped, t);
}

/* A plain stored event's (token offset, block sizes), else None (ColumnBatch.token_layout). */
static PyObject *
stored_layout(Ev *e, int64_t pos)
{
    if (!e->plain)
        Py_RETURN_NONE;
    PyObject *sizes = PyList_New((Py_ssize_t)e->n);
    if (sizes == NULL)
        return NULL;
    int64_t first = e->n > 1 ? e->block_size : e->last_size;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)e->n; i++) {
        int64_t v = e->has_sizes ? e->sizes.v[i] : (i == e->n - 1 ? e->last_size : first);
        PyObject *o = PyLong_FromLongLong(v);
        if (o == NULL) {
            Py_DECREF(sizes);
            return NULL;
        }
        PyList_SET_ITEM(sizes, i, o);
    }
    return Py_BuildValue("(LN)", (long long)pos, sizes);
}

/* the stored payload (parent, hashes, level, first); *pos advances by the blocks' tokens */
static PyObject *
stored_payload(Ev *e, PyObject *algo, int64_t *pos, int64_t n_tokens)
{
    int64_t n = e->n;
    Py_ssize_t len = e->hashes_len;
    if (len == 0 || len % n || len / n > MAX_HASH)
        return NULL;
    Py_ssize_t width = len / (Py_ssize_t)n;
    int64_t first, low, used;
    if (!e->has_sizes) {
        int64_t last = e->last_size;
        first = n > 1 ? e->block_size : last;
        low = first < last ? first : last;
        if (low < 0)
            return NULL;
        if (n > 1 && first > 0 && first > (INT64_MAX - last) / (n - 1))
            return NULL;
        used = first * (n - 1) + last;
    }
    else {
        first = e->sizes.v[0];
        used = 0;
        for (Py_ssize_t i = 0; i < e->sizes.n; i++) {
            int64_t s = e->sizes.v[i];
            if (s < 0 || s > INT64_MAX - used)
                return NULL;
            used += s;
        }
    }
    if (used > n_tokens - *pos)
        return NULL;
    *pos += used;
    PyObject *level;
    if (!e->has_levels) {
        if (e->level < 0 || e->level > I32_MAX)
            return NULL;
        level = PyLong_FromLongLong(e->level);
    }
    else {
        if (e->levels.n != n)
            return NULL;
        int same = 1;
        for (Py_ssize_t i = 0; i < e->levels.n; i++) {
            int64_t v = e->levels.v[i];
            if (v < 0 || v > I32_MAX)
                return NULL;
            same &= v == e->levels.v[0];
        }
        if (same) {
            level = PyLong_FromLongLong(e->levels.v[0]);
        }
        else {
            level = PyList_New(e->levels.n);
            if (level == NULL)
                return NULL;
            for (Py_ssize_t i = 0; i < e->levels.n; i++) {
                PyObject *x = PyLong_FromLongLong(e->levels.v[i]);
                if (x == NULL) {
                    Py_DECREF(level);
                    return NULL;
                }
                PyList_SET_ITEM(level, i, x);
            }
        }
    }
    if (level == NULL)
        return NULL;
    if (!e->has_prios) {
        if (e->prio < 0 || e->prio > g_priority_max)
            goto bail_level;
    }
    else {
        if (e->prios.n != n)
            goto bail_level;
        for (Py_ssize_t i = 0; i < e->prios.n; i++)
            if (e->prios.v[i] < 0 || e->prios.v[i] > g_priority_max)
                goto bail_level;
    }
    if (e->has_parent && e->parent_len != width)
        goto bail_level;
    if (!width_ok(algo, width))
        goto bail_level;
    PyObject *hashes = split_hashes(e->hashes, len, n);
    if (hashes == NULL)
        goto bail_level;
    PyObject *parent;
    if (e->has_parent) {
        parent = PyBytes_FromStringAndSize((const char *)e->parent, e->parent_len);
        if (parent == NULL) {
            Py_DECREF(hashes);
            goto bail_level;
        }
    }
    else {
        parent = Py_NewRef(Py_None);
    }
    PyObject *f = PyLong_FromLongLong(first);
    if (f == NULL) {
        Py_DECREF(hashes);
        Py_DECREF(parent);
        goto bail_level;
    }
    PyObject *t = PyTuple_New(4);
    if (t == NULL) {
        Py_DECREF(hashes);
        Py_DECREF(parent);
        Py_DECREF(f);
        goto bail_level;
    }
    PyTuple_SET_ITEM(t, 0, parent);
    PyTuple_SET_ITEM(t, 1, hashes);
    PyTuple_SET_ITEM(t, 2, level);
    PyTuple_SET_ITEM(t, 3, f);
    return t;
bail_level:
    Py_DECREF(level);
    return NULL;
}

static PyObject *
diff_tuple(int has, int64_t *d)
{
    if (!has)
        return Py_NewRef(Py_None);
    return Py_BuildValue("(LL)", (long long)d[0], (long long)d[1]);
}

/* the payload of event e (a new reference), Py_None for cleared; NULL + no exception: BAIL;
 * *skip set when the event is skipped */
static PyObject *
event_payload(Cols *c, Ev *e, int code, PyObject *algo, int64_t *pos, int64_t n_tokens,
              int *skip)
{
    switch (code) {
    case 1:
        return stored_payload(e, algo, pos, n_tokens);
    case 2: {
        if (e->r_count < 1 || e->r_len == 0 || e->r_len % e->r_count ||
            e->r_len / e->r_count > MAX_HASH)
            return NULL;
        if (e->r_has_level && (e->r_level < 0 || e->r_level > I32_MAX))
            return NULL;
        if (!width_ok(algo, e->r_len / (Py_ssize_t)e->r_count))
            return NULL;
        PyObject *hashes = split_hashes(e->r_hashes, e->r_len, e->r_count);
        if (hashes == NULL)
            return NULL;
        PyObject *lv = e->r_has_level ? PyLong_FromLongLong(e->r_level) : Py_NewRef(Py_None);
        if (lv == NULL) {
            Py_DECREF(hashes);
            return NULL;
        }
        return Py_BuildValue("(NN)", hashes, lv);
    }
    case 3: {
        if (e->u_len < 1 || e->u_len > MAX_HASH)
            return NULL;
        if (!e->u_has[0] && !e->u_has[1])
            return NULL;
        for (int k = 0; k < 2; k++) {
            if (!e->u_has[k])
                continue;
            int64_t hi = k ? g_priority_max : I32_MAX;
            for (int j = 0; j < 2; j++)
                if (e->u_diff[k][j] < 0 || e->u_diff[k][j] > hi)
                    return NULL;
        }
        if (!width_ok(algo, e->u_len))
            return NULL;
        return Py_BuildValue("(y#NN)", (const char *)e->u_hash, e->u_len,
                             diff_tuple(e->u_has[0], e->u_diff[0]),
                             diff_tuple(e->u_has[1], e->u_diff[1]));
    }
    case 0: {
        if (e->tpb == 0) {
            *skip = 1;
            if (skip_event(c, e->eid, "CREATED",
                           "created event without tokens_per_block (v1 data)"))
                return NULL;
            return Py_NewRef(Py_None);
        }
        if (e->attention == 0) {
            *skip = 1;
            if (skip_event(c, e->eid, "CREATED",
                           "created event with attention kind UNKNOWN unknown here"))
                return NULL;
            return Py_NewRef(Py_None);
        }
        if (e->tpb < 1 || e->tpb > I32_MAX || e->caps.n == 0)
            return NULL;
        PyObject *caps = PyTuple_New(e->caps.n);
        if (caps == NULL)
            return NULL;
        for (Py_ssize_t i = 0; i < e->caps.n; i++) {
            PyObject *x;
            if (e->caps.v[i] < 0 || (x = PyLong_FromLongLong(e->caps.v[i])) == NULL) {
                Py_DECREF(caps);
                return NULL;
            }
            PyTuple_SET_ITEM(caps, i, x);
        }
        PyObject *att = PyTuple_GET_ITEM(g_attention, e->attention);
        return Py_BuildValue("(NLO)", caps, (long long)e->tpb, att);
    }
    case 5: {
        if (e->l_first < 0 || e->l_count < 1)
            return NULL;
        PyObject *reason =
            PyUnicode_DecodeUTF8((const char *)e->l_reason, e->l_reason_len, "strict");
        if (reason == NULL) {
            PyErr_Clear();
            return NULL;
        }
        if (PyUnicode_GET_LENGTH(reason) > 1024) {
            Py_DECREF(reason);
            return NULL;
        }
        return Py_BuildValue("(LLN)", (long long)e->l_first, (long long)e->l_count, reason);
    }
    default:
        return Py_NewRef(Py_None);
    }
}

static PyObject *
decode_record(Rd *r, int version, Ev *e, const uint8_t *base, int lazy)
{
    PyObject *inst = NULL, *rank = NULL, *tokens = NULL, *result = NULL;
    Cols c = {0};
    const uint8_t *p, *low, *planes, *packed = NULL;
    Py_ssize_t n, low_len, planes_len, packed_len = 0;
    int64_t v, inc, ts, count, high_bits, packed_count = 0;
    int b, enc = 1, comp = 1, rc;

    /* source */
    if (rd_bytes(r, &p, &n))
        goto bail;
    inst = PyUnicode_DecodeUTF8((const char *)p, n, "strict");
    if (inst == NULL) {
        PyErr_Clear();
        goto bail;
    }
    if (PyUnicode_GET_LENGTH(inst) < 1 || PyUnicode_GET_LENGTH(inst) > 256)
        goto bail;
    if (rd_union(r, &b))
        goto bail;
    if (b) {
        if (rd_long(r, &v) || v < 0 || v > I32_MAX)
            goto bail;
        if ((rank = PyLong_FromLongLong(v)) == NULL)
            goto error;
    }
    else {
        rank = Py_NewRef(Py_None);
    }
    if (rd_long(r, &inc) || inc < 0 || rd_long(r, &ts) || ts < 0)
        goto bail;
    /* tokens */
    if (rd_long(r, &count) || rd_long(r, &high_bits) || rd_bytes(r, &low, &low_len) ||
        rd_bytes(r, &planes, &planes_len))
        goto bail;
    if (version >= 4) {
        if (rd_enum(r, 5, &enc) || rd_enum(r, 3, &comp) || rd_long(r, &packed_count) ||
            rd_bytes(r, &packed, &packed_len))
            goto bail;
    }
    int is_packed = enc != 1;
    int64_t n_tokens;
    if (!is_packed) {
        if (comp != 1 || packed_count != 0 || packed_len != 0)
            goto bail;
        if (planes_check(count, high_bits, low_len, planes, planes_len))
            goto bail;
        if (lazy) { /* valid: unpacked by planes_ids when the ids are asked for */
            tokens = Py_BuildValue("(LLnn)", (long long)count, (long long)high_bits,
                                   (Py_ssize_t)(low - base), (Py_ssize_t)(planes - base));
            if (tokens == NULL)
                goto error;
        }
        else {
            tokens = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * count));
            if (tokens == NULL)
                goto error;
            planes_fill(count, high_bits, low, planes, (uint8_t *)PyBytes_AS_STRING(tokens));
        }
        n_tokens = count;
    }
    else {
        if (count || high_bits || low_len || planes_len || enc == 0 || comp == 0 ||
            packed_count < 0)
            goto bail;
        n_tokens = packed_count;
        int small = packed_count <= (int64_t)packed_len; /* no overflow below */
        Py_ssize_t plane_len = small ? (Py_ssize_t)((packed_count + 7) >> 3) : 0;
        Py_ssize_t extra = small ? packed_len - (Py_ssize_t)(2 * packed_count) : -1;
        if (lazy && enc == 2 && comp == 1 && extra >= 0 &&
            (!extra || (plane_len && extra % plane_len == 0)) &&
            !planes_check(packed_count, plane_len ? extra / plane_len : 0,
                          (Py_ssize_t)(2 * packed_count), packed + 2 * packed_count, extra)) {
            tokens = Py_BuildValue("(LLnn)", (long long)packed_count,
                                   (long long)(plane_len ? extra / plane_len : 0),
                                   (Py_ssize_t)(packed - base),
                                   (Py_ssize_t)(packed + 2 * packed_count - base));
            if (tokens == NULL)
                goto error;
        }
        else if (comp == 1) {
            if ((rc = packed_decode(enc, packed, packed_len, packed_count, &tokens)))
                goto fail;
        }
        else {
            tokens = Py_BuildValue("(iLy#)", enc, (long long)packed_count, (const char *)packed,
                                   packed_len);
            if (tokens == NULL)
                goto error;
        }
    }
    /* events */
    if (!(c.ids = PyList_New(0)) || !(c.kinds = PyList_New(0)) || !(c.algos = PyList_New(0)) ||
        !(c.gids = PyList_New(0)) || !(c.windows = PyList_New(0)) ||
        !(c.payloads = PyList_New(0)) || !(c.skipped = PyList_New(0)) ||
        !(c.layout = PyList_New(0)))
        goto error;
    int kinds = version >= 4 ? 8 : 7;
    int64_t pos = 0, left = 0;
    int more;
    while ((more = arr_more(r, &left)) == 1) {
        e->sizes.n = e->levels.n = e->prios.n = e->caps.n = 0;
        memset(e->has, 0, sizeof e->has);
        if ((rc = read_event(r, e, kinds)))
            goto fail;
        if (e->kind == 0) {
            if (skip_event(&c, e->eid, "UNKNOWN", "event kind unknown to this reader"))
                goto error;
            continue;
        }
        if (e->kind == 2 || e->kind == 7) {
            if ((e->kind == 7) != is_packed)
                goto bail;
        }
        int code = KIND_CODE[e->kind];
        int want = PAYLOAD_OF[code];
        for (int k = 0; k < 5; k++)
            if (e->has[k] != (k == want))
                goto bail;
        PyObject *algo = algo_str(e->algo, e->algo_len);
        if (algo == NULL)
            goto bail;
        int skip = 0;
        int64_t pos0 = pos;
        PyObject *payload = event_payload(&c, e, code, algo, &pos, n_tokens, &skip);
        if (payload == NULL) {
            Py_DECREF(algo);
            if (PyErr_Occurred())
                goto error;
            goto bail;
        }
        if (skip) {
            Py_DECREF(algo);
            Py_DECREF(payload);
            continue;
        }
        if (e->eid < 0 || e->gid < 0 || e->gid > I32_MAX || e->window < 1 ||
            PyUnicode_GET_LENGTH(algo) < 1 || PyUnicode_GET_LENGTH(algo) > 64) {
            Py_DECREF(algo);
            Py_DECREF(payload);
            goto bail;
        }
        if (PyList_Append(c.algos, algo) || PyList_Append(c.payloads, payload)) {
            Py_DECREF(algo);
            Py_DECREF(payload);
            goto error;
        }
        Py_DECREF(algo);
        Py_DECREF(payload);
        if (code == 1 /* stored */ && append_new(c.layout, stored_layout(e, pos0)))
            goto error;
        if (append_new(c.ids, PyLong_FromLongLong(e->eid)) ||
            append_new(c.kinds, PyLong_FromLong(code)) ||
            append_new(c.gids, PyLong_FromLongLong(e->gid)) ||
            append_new(c.windows, PyLong_FromLongLong(e->window)))
            goto error;
    }
    if (more)
        goto fail_more;
    if (pos != n_tokens)
        goto bail;
    result = Py_BuildValue("(nNNLLNNNNNNNNN)", (Py_ssize_t)(r->p - base), inst, rank,
                           (long long)inc, (long long)ts, tokens, c.ids, c.kinds, c.algos,
                           c.gids, c.windows, c.payloads, c.skipped, c.layout);
    return result;

fail_more:
    rc = more;
fail:
    if (rc == ERR)
        goto error;
bail:
    if (PyErr_Occurred())
        goto error;
    Py_XDECREF(inst);
    Py_XDECREF(rank);
    Py_XDECREF(tokens);
    Py_XDECREF(c.ids);
    Py_XDECREF(c.kinds);
    Py_XDECREF(c.algos);
    Py_XDECREF(c.gids);
    Py_XDECREF(c.windows);
    Py_XDECREF(c.payloads);
    Py_XDECREF(c.skipped);
    Py_XDECREF(c.layout);
    Py_RETURN_NONE;
error:
    Py_XDECREF(inst);
    Py_XDECREF(rank);
    Py_XDECREF(tokens);
    Py_XDECREF(c.ids);
    Py_XDECREF(c.kinds);
    Py_XDECREF(c.algos);
    Py_XDECREF(c.gids);
    Py_XDECREF(c.windows);
    Py_XDECREF(c.payloads);
    Py_XDECREF(c.skipped);
    Py_XDECREF(c.layout);
    return NULL;
}

/* ------------------------------------------------------------------ module functions */

static PyObject *
py_decode(PyObject *self, PyObject *args)
{
    Py_buffer view;
    PyObject *obj;
    Py_ssize_t offset;
    int version;
    if (!PyArg_ParseTuple(args, "Oni:decode", &obj, &offset, &version))
        return NULL;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE))
        return NULL;
    PyObject *out = NULL;
    if (g_widths == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_columns_native.configure() was not called");
    }
    else if (version != 3 && version != 4) {
        PyErr_Format(PyExc_ValueError, "schema version %d is not decoded here", version);
    }
    else if (offset < 0 || offset > view.len) {
        PyErr_SetString(PyExc_ValueError, "offset outside the buffer");
    }
    else {
        const uint8_t *base = (const uint8_t *)view.buf;
        Rd r = {base + offset, base + view.len};
        Ev e;
        memset(&e, 0, sizeof e);
        /* bit planes are unpacked later only from an immutable buffer */
        out = decode_record(&r, version, &e, base, PyBytes_CheckExact(obj));
        PyMem_Free(e.caps.v);
        PyMem_Free(e.sizes.v);
        PyMem_Free(e.levels.v);
        PyMem_Free(e.prios.v);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *
py_packed_ids(PyObject *self, PyObject *args)
{
    int encoding;
    Py_buffer view;
    long long count;
    if (!PyArg_ParseTuple(args, "iy*L:packed_ids", &encoding, &view, &count))
        return NULL;
    PyObject *out = NULL;
    int rc = packed_decode(encoding, (const uint8_t *)view.buf, view.len, count, &out);
    PyBuffer_Release(&view);
    if (rc == ERR)
        return NULL;
    if (rc == BAIL)
        Py_RETURN_NONE;
    return out;
}

static PyObject *
py_planes_ids(PyObject *self, PyObject *args)
{
    Py_buffer view;
    long long count, high_bits;
    Py_ssize_t low_off, planes_off;
    if (!PyArg_ParseTuple(args, "y*LLnn:planes_ids", &view, &count, &high_bits, &low_off,
                          &planes_off))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t len = view.len;
    if (count < 0 || high_bits < 0 || high_bits > 16 || count > len || low_off < 0 ||
        planes_off < 0 || low_off > len - 2 * count ||
        planes_off > len - high_bits * ((count + 7) >> 3)) {
        PyErr_SetString(PyExc_ValueError, "bit planes outside the buffer");
    }
    else {
        const uint8_t *base = (const uint8_t *)view.buf;
        Py_ssize_t planes_len = (Py_ssize_t)(high_bits * ((count + 7) >> 3));
        if (planes_check(count, high_bits, (Py_ssize_t)(2 * count), base + planes_off,
                         planes_len)) {
            PyErr_SetString(PyExc_ValueError, "invalid bit planes");
        }
        else if ((out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * count))) != NULL) {
            planes_fill(count, high_bits, base + low_off, base + planes_off,
                        (uint8_t *)PyBytes_AS_STRING(out));
        }
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *
py_configure(PyObject *self, PyObject *args)
{
    PyObject *widths, *unknown, *attention;
    long long priority_max;
    if (!PyArg_ParseTuple(args, "O!O!LO!:configure", &PyDict_Type, &widths, &PyTuple_Type,
                          &unknown, &priority_max, &PyTuple_Type, &attention))
        return NULL;
    if (PyTuple_GET_SIZE(attention) != 3) {
        PyErr_SetString(PyExc_ValueError, "attention needs 3 values");
        return NULL;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(widths, &pos, &k, &v))
        if (!PyUnicode_Check(k) || !PyLong_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "widths maps str to int");
            return NULL;
        }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(unknown); i++)
        if (!PyLong_Check(PyTuple_GET_ITEM(unknown, i))) {
            PyErr_SetString(PyExc_TypeError, "unknown_widths holds ints");
            return NULL;
        }
    Py_XSETREF(g_widths, PyDict_Copy(widths));
    if (g_widths == NULL)
        return NULL;
    Py_XSETREF(g_unknown_widths, Py_NewRef(unknown));
    Py_XSETREF(g_attention, Py_NewRef(attention));
    g_priority_max = priority_max;
    Py_RETURN_NONE;
}

/* model_columns(events, stored_type, removed_type, stored_code, removed_code) -> tuple | None
 *
 * ColumnBatch.from_batch's loop for a batch of validated models whose events are all
 * ``stored`` (data of exactly stored_type) or ``removed`` (removed_type): (event_ids,
 * hash_algos, group_ids, window_sizes, kinds, payloads), each payload the tuple columnar.py
 * builds; None for any other batch (the Python loop, the reference, then builds it).
 */
static PyObject *s_event_id, *s_hash_algo, *s_layer_group_id, *s_window_size, *s_data,
    *s_parent_hash, *s_blocks, *s_block_hash, *s_cache_level, *s_token_ids, *s_block_hashes;

static int
intern_model_names(void)
{
    if (s_event_id != NULL)
        return 0;
#define INTERN(v, name)                                  \
    if ((v = PyUnicode_InternFromString(name)) == NULL) \
        return -1;
    INTERN(s_event_id, "event_id")
    INTERN(s_hash_algo, "hash_algo")
    INTERN(s_layer_group_id, "layer_group_id")
    INTERN(s_window_size, "window_size")
    INTERN(s_data, "data")
    INTERN(s_parent_hash, "parent_hash")
    INTERN(s_blocks, "blocks")
    INTERN(s_block_hash, "block_hash")
    INTERN(s_cache_level, "cache_level")
    INTERN(s_token_ids, "token_ids")
    INTERN(s_block_hashes, "block_hashes")
#undef INTERN
    return 0;
}

/* Whether a model type's fields can be read from an instance's __dict__: none of the names
 * read here is a class attribute (so no descriptor can take precedence over the instance
 * dict), as for pydantic models, whose generic attribute lookup (through the class's
 * __getattr__ hook and its MRO) costs several times a dict probe. Verdicts are remembered
 * for a few types. */
#define MODEL_TYPES 8
static PyTypeObject *model_types[MODEL_TYPES];
static int model_type_ok[MODEL_TYPES], model_types_n;

static int
model_dict_ok(PyTypeObject *tp)
{
    for (int k = 0; k < model_types_n; k++)
        if (model_types[k] == tp)
            return model_type_ok[k];
    PyObject *names[] = {s_event_id, s_hash_algo, s_layer_group_id, s_window_size, s_data,
                         s_parent_hash, s_blocks, s_block_hash, s_cache_level, s_token_ids,
                         s_block_hashes};
    int ok = tp->tp_dictoffset != 0;
    for (size_t i = 0; ok && i < sizeof(names) / sizeof(names[0]); i++)
        ok = _PyType_Lookup(tp, names[i]) == NULL;
    if (model_types_n < MODEL_TYPES) {
        model_types[model_types_n] = (PyTypeObject *)Py_NewRef((PyObject *)tp);
        model_type_ok[model_types_n++] = ok;
    }
    return ok;
}

/* obj.name (a new reference), read from the instance dict where model_dict_ok allows */
static PyObject *
model_attr(PyObject *obj, PyObject *name)
{
    if (model_dict_ok(Py_TYPE(obj))) {
        PyObject **dictptr = _PyObject_GetDictPtr(obj);
        if (dictptr != NULL && *dictptr != NULL && PyDict_CheckExact(*dictptr)) {
            PyObject *v = PyDict_GetItemWithError(*dictptr, name); /* borrowed */
            if (v != NULL)
                return Py_NewRef(v);
            if (PyErr_Occurred())
                return NULL;
        }
    }
    return PyObject_GetAttr(obj, name);
}

/* append the attribute `name` of `obj` to `list`; -1 on error */
static int
append_attr(PyObject *list, PyObject *obj, PyObject *name)
{
    PyObject *v = model_attr(obj, name);
    if (v == NULL)
        return -1;
    int rc = PyList_Append(list, v);
    Py_DECREF(v);
    return rc;
}

/* the payload of a stored event: (parent_hash, hashes, level or levels, tokens of the first
 * block, blocks); NULL with no error set when `blocks` is not a non-empty tuple */
static PyObject *
model_stored_payload(PyObject *data)
{
    PyObject *blocks = model_attr(data, s_blocks);
    if (blocks == NULL)
        return NULL;
    if (!PyTuple_Check(blocks) || PyTuple_GET_SIZE(blocks) == 0) {
        Py_DECREF(blocks);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    PyObject *parent = NULL, *hashes = NULL, *levels = NULL, *level = NULL, *first = NULL;
    PyObject *ntok = NULL, *out = NULL;
    hashes = PyList_New(n);
    levels = PyList_New(n);
    if (hashes == NULL || levels == NULL)
        goto done;
    int uniform = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyTuple_GET_ITEM(blocks, i);
        PyObject *h = model_attr(b, s_block_hash);
        if (h == NULL)
            goto done;
        PyList_SET_ITEM(hashes, i, h);
        PyObject *c = model_attr(b, s_cache_level);
        if (c == NULL)
            goto done;
        PyList_SET_ITEM(levels, i, c);
        if (uniform && i > 0) {
            int eq = PyObject_RichCompareBool(c, PyList_GET_ITEM(levels, 0), Py_EQ);
            if (eq < 0)
                goto done;
            uniform = eq;
        }
    }
    /* one level for all, as `levels.count(levels[0]) == len(levels)` decides */
    level = uniform ? Py_NewRef(PyList_GET_ITEM(levels, 0)) : Py_NewRef(levels);
    first = model_attr(PyTuple_GET_ITEM(blocks, 0), s_token_ids);
    if (first == NULL)
        goto done;
    Py_ssize_t nt = PyObject_Size(first);
    if (nt < 0)
        goto done;
    ntok = PyLong_FromSsize_t(nt);
    parent = model_attr(data, s_parent_hash);
    if (ntok == NULL || parent == NULL)
        goto done;
    out = PyTuple_Pack(5, parent, hashes, level, ntok, blocks);
done:
    Py_XDECREF(parent);
    Py_XDECREF(hashes);
    Py_XDECREF(levels);
    Py_XDECREF(level);
    Py_XDECREF(first);
    Py_XDECREF(ntok);
    Py_DECREF(blocks);
    return out;
}

/* the payload of a removed event: (list of block hashes, cache_level) */
static PyObject *
model_removed_payload(PyObject *data)
{
    PyObject *hs = model_attr(data, s_block_hashes);
    if (hs == NULL)
        return NULL;
    PyObject *list = PySequence_List(hs);
    Py_DECREF(hs);
    if (list == NULL)
        return NULL;
    PyObject *level = model_attr(data, s_cache_level);
    if (level == NULL) {
        Py_DECREF(list);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, list, level);
    Py_DECREF(list);
    Py_DECREF(level);
    return out;
}

static PyObject *
py_model_columns(PyObject *self, PyObject *args)
{
    PyObject *events, *stored_type, *removed_type, *stored_code, *removed_code;
    if (!PyArg_ParseTuple(args, "O!O!O!OO:model_columns", &PyTuple_Type, &events, &PyType_Type,
                          &stored_type, &PyType_Type, &removed_type, &stored_code,
                          &removed_code))
        return NULL;
    if (intern_model_names() < 0)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(events);
    PyObject *cols[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    PyObject *data = NULL, *out = NULL;
    for (int c = 0; c < 6; c++)
        if ((cols[c] = PyList_New(0)) == NULL)
            goto fail;
    PyObject *eids = cols[0], *algos = cols[1], *gids = cols[2], *windows = cols[3];
    PyObject *kinds = cols[4], *payloads = cols[5];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ev = PyTuple_GET_ITEM(events, i);
        data = model_attr(ev, s_data);
        if (data == NULL)
            goto fail;
        PyObject *payload, *code;
        if (Py_IS_TYPE(data, (PyTypeObject *)stored_type)) {
            payload = model_stored_payload(data);
            code = stored_code;
        }
        else if (Py_IS_TYPE(data, (PyTypeObject *)removed_type)) {
            payload = model_removed_payload(data);
            code = removed_code;
        }
        else {
            goto decline;
        }
        Py_CLEAR(data);
        if (payload == NULL) {
            if (PyErr_Occurred())
                goto fail;
            goto decline;
        }
        int rc = PyList_Append(payloads, payload);
        Py_DECREF(payload);
        if (rc < 0 || PyList_Append(kinds, code) < 0 || append_attr(eids, ev, s_event_id) < 0 ||
            append_attr(algos, ev, s_hash_algo) < 0 ||
            append_attr(gids, ev, s_layer_group_id) < 0 ||
            append_attr(windows, ev, s_window_size) < 0)
            goto fail;
    }
    out = PyTuple_New(6);
    if (out == NULL)
        goto fail;
    for (int c = 0; c < 6; c++)
        PyTuple_SET_ITEM(out, c, cols[c]); /* steals */
    return out;
decline:
    Py_XDECREF(data);
    for (int c = 0; c < 6; c++)
        Py_XDECREF(cols[c]);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(data);
    for (int c = 0; c < 6; c++)
        Py_XDECREF(cols[c]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"configure", py_configure, METH_VARARGS,
     "configure(widths, unknown_widths, priority_max, attention): the model's rules."},
    {"decode", py_decode, METH_VARARGS,
     "decode(buf, offset, version) -> columns tuple, or None: use the reference decoder."},
    {"planes_ids", py_planes_ids, METH_VARARGS,
     "planes_ids(buf, count, high_bits, low_off, planes_off) -> uint32 LE ids of bit planes."},
    {"packed_ids", py_packed_ids, METH_VARARGS,
     "packed_ids(encoding, data, count) -> uint32 LE ids, or None when invalid."},
    {"model_columns", py_model_columns, METH_VARARGS,
     "model_columns(events, Stored, Removed, stored_code, removed_code) -> columns, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstream.codec._columns_native",
    "EventBatch records (schema v3/v4) straight into columns (see _columns_native.c).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__columns_native(void)
{
    return PyModule_Create(&module);
}
