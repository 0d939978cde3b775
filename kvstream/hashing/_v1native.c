/*
 * kvstream.hashing._v1native: TensorRT-LLM ``v1_block_key`` block-hash chains in C.
 *
 * The definition (see kvstream/hashing/trtllm.py, the pure-Python reference):
 *
 *   mix(s, w)   = s ^ (w + (s << 6) + (s >> 2))                       (mod 2**64)
 *   w32(token)  = hash32 of the uint32 token, + 0x9E3779B9 mod 2**32
 *   w64(v)      = splitmix64 finalizer of v, + 0x9E3779B9 mod 2**64
 *   hash(block, parent):
 *       s = n_tokens ^ (parent * 0xBF58476D1CE4E5B9)
 *       if parent == 0 and salt: s = mix(s, w64(salt_id))
 *       for each token: s = mix(s, w32(token)); with extra ids also s = mix(s, w64(extra))
 *       if lora: s = mix(s, w64(lora_id))
 *       for each mm key: s = mix(s, w32(word)) for its 8 LE u32 digest words,
 *                        then s = mix(s, w64(start_offset))
 *
 * Entry points (all arguments may be given by keyword):
 *
 *   chain(tokens, block_sizes=None, parent=0, salt_id=None, lora_id=None,
 *         extra_ids=None, mm_keys=None) -> list[int]
 *   chain_bytes(...same...) -> list[bytes]      (8-byte big-endian hashes)
 *   chain_buffer(...same...) -> bytes           (the 8-byte big-endian hashes concatenated)
 *   block_key(tokens, parent=0, salt_id=None, lora_id=None, extra_ids=None, mm_keys=None)
 *         -> int                                (one block)
 *
 * tokens:      one buffer of little-endian uint32 ids cut by block_sizes (an int: tokens per
 *              block, the last block may be shorter; or a sequence of positive sizes summing to
 *              the token count), or a list/tuple of per-block buffers (block_sizes None).
 * extra_ids:   None, one buffer of little-endian uint64 ids (one per token of the request), or
 *              a list/tuple with one entry per block (None or a buffer of 8 bytes per token).
 * mm_keys:     None, or a list/tuple with one entry per block (None or a buffer of 36-byte
 *              records: 32-byte digest || start_offset as uint32 little-endian).
 *              block_key takes the one block's buffer (or None) for both.
 *
 * Bad inputs raise kvstream.errors.HashingError (wrong call signatures raise TypeError).
 * Large single-buffer requests are hashed with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define K32 0x045D9F3Bu
#define GOLD 0x9E3779B9u
#define SM1 0xBF58476D1CE4E5B9ull
#define SM2 0x94D049BB133111EBull
#define MM_RECORD 36
/* Release the GIL for single-buffer requests with at least this many tokens. */
#define NOGIL_MIN_TOKENS 16384
#define N_ARGS 7

static PyObject *HashingError = NULL; /* kvstream.errors.HashingError */

/* ------------------------------------------------------------------------- the algorithm */

static inline uint32_t
load_u32le(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static inline uint64_t
load_u64le(const unsigned char *p)
{
    return (uint64_t)load_u32le(p) | ((uint64_t)load_u32le(p + 4) << 32);
}

static inline void
store_u64be(unsigned char *p, uint64_t v)
{
    int i;
    for (i = 7; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
}

static inline uint64_t
w32(uint32_t v)
{
    v = (uint32_t)(((v >> 16) ^ v) * K32);
    v = (uint32_t)(((v >> 16) ^ v) * K32);
    v = (v >> 16) ^ v;
    return (uint64_t)(uint32_t)(v + GOLD);
}

static inline uint64_t
w64(uint64_t v)
{
    v = (v ^ (v >> 30)) * SM1;
    v = (v ^ (v >> 27)) * SM2;
    v ^= v >> 31;
    return v + GOLD;
}

static inline uint64_t
mix(uint64_t s, uint64_t w)
{
    return s ^ (w + (s << 6) + (s >> 2));
}

typedef struct {
    int has_salt;
    int has_lora;
    uint64_t salt_w;
    uint64_t lora_w;
} scope_t;

typedef struct {
    const unsigned char *tok; /* n little-endian u32 ids */
    Py_ssize_t n;
    const unsigned char *extra; /* NULL or n little-endian u64 ids */
    const unsigned char *mm;    /* NULL or n_mm records of MM_RECORD bytes */
    Py_ssize_t n_mm;
} block_t;

static uint64_t
hash_block(uint64_t parent, const block_t *b, const scope_t *sc)
{
    const unsigned char *p = b->tok;
    const Py_ssize_t n = b->n;
    Py_ssize_t i;
    uint64_t s = (uint64_t)n ^ (parent * SM1);

    if (parent == 0 && sc->has_salt)
        s = mix(s, sc->salt_w);
    if (b->extra == NULL) {
        for (i = 0; i < n; i++)
            s = mix(s, w32(load_u32le(p + 4 * i)));
    }
    else {
        const unsigned char *e = b->extra;
        for (i = 0; i < n; i++) {
            s = mix(s, w32(load_u32le(p + 4 * i)));
            s = mix(s, w64(load_u64le(e + 8 * i)));
        }
    }
    if (sc->has_lora)
        s = mix(s, sc->lora_w);
    for (i = 0; i < b->n_mm; i++) {
        const unsigned char *r = b->mm + (size_t)MM_RECORD * (size_t)i;
        int j;
        for (j = 0; j < 8; j++)
            s = mix(s, w32(load_u32le(r + 4 * j)));
        s = mix(s, w64((uint64_t)load_u32le(r + 32)));
    }
    return s;
}

/* ----------------------------------------------------------------------- argument parsing */

/*
 * Fill out[0..N_ARGS) (borrowed references, NULL when not given) from a vectorcall.
 * names[i] is NULL for a parameter the function does not take; the first `required`
 * parameters must be given.
 */
static int
parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
           const char *const *names, int required, PyObject **out)
{
    int slots[N_ARGS];
    int nslots = 0, i;
    Py_ssize_t k, nkw;

    for (i = 0; i < N_ARGS; i++) {
        out[i] = NULL;
        if (names[i] != NULL)
            slots[nslots++] = i;
    }
    if (nargs > nslots) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)",
                     fname, nslots, nargs);
        return -1;
    }
    for (k = 0; k < nargs; k++)
        out[slots[k]] = args[k];
    nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        for (i = 0; i < nslots; i++) {
            if (PyUnicode_CompareWithASCIIString(key, names[slots[i]]) == 0) {
                found = slots[i];
                break;
            }
        }
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname,
                         key);
            return -1;
        }
        if (out[found] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[found]);
            return -1;
        }
        out[found] = args[nargs + k];
    }
    for (i = 0; i < required; i++) {
        if (out[slots[i]] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname,
                         names[slots[i]]);
            return -1;
        }
    }
    return 0;
}

/* An unsigned 64-bit int argument (kvstream's check_u64 rules: an int, not a bool). */
static int
parse_u64(PyObject *o, const char *name, uint64_t *out)
{
    unsigned long long v;

    if (PyBool_Check(o) || !PyLong_Check(o)) {
        PyErr_Format(HashingError, "%s must be an int, got %.200s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(HashingError, "%s must be in 0..2**64-1, got %R", name, o);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int
parse_scope(PyObject *salt, PyObject *lora, scope_t *sc)
{
    uint64_t v;

    sc->has_salt = sc->has_lora = 0;
    sc->salt_w = sc->lora_w = 0;
    if (salt != NULL && salt != Py_None) {
        if (parse_u64(salt, "salt_id", &v) < 0)
            return -1;
        sc->has_salt = 1;
        sc->salt_w = w64(v);
    }
    if (lora != NULL && lora != Py_None) {
        if (parse_u64(lora, "lora_id", &v) < 0)
            return -1;
        sc->has_lora = 1;
        sc->lora_w = w64(v);
    }
    return 0;
}

/*
 * A read-only byte view of a bytes-like object. Bytes objects are read in place (no buffer
 * export); anything else through the buffer protocol (C-contiguous), released by view_release.
 */
typedef struct {
    Py_buffer view;
    int held;
} view_t;

static int
view_get(PyObject *o, view_t *v, const unsigned char **ptr, Py_ssize_t *len, const char *what,
         Py_ssize_t index)
{
    v->held = 0;
    if (PyBytes_Check(o)) {
        *ptr = (const unsigned char *)PyBytes_AS_STRING(o);
        *len = PyBytes_GET_SIZE(o);
        return 0;
    }
    if (PyUnicode_Check(o) || PyObject_GetBuffer(o, &v->view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        if (index < 0)
            PyErr_Format(HashingError,
                         "%s must be a C-contiguous bytes-like object, got %.200s", what,
                         Py_TYPE(o)->tp_name);
        else
            PyErr_Format(HashingError,
                         "%s[%zd] must be a C-contiguous bytes-like object, got %.200s", what,
                         index, Py_TYPE(o)->tp_name);
        return -1;
    }
    v->held = 1;
    *ptr = (const unsigned char *)v->view.buf;
    *len = v->view.len;
    return 0;
}

static void
view_release(view_t *v)
{
    if (v->held) {
        PyBuffer_Release(&v->view);
        v->held = 0;
    }
}

/* "name" or "name[i]" for error messages. */
static void
label(char *buf, size_t size, const char *what, Py_ssize_t index)
{
    if (index < 0)
        PyOS_snprintf(buf, size, "%s", what);
    else
        PyOS_snprintf(buf, size, "%s[%zd]", what, index);
}

static int
check_tokens_len(Py_ssize_t len, const char *what, Py_ssize_t index, int allow_empty)
{
    char where[64];

    if (len % 4 == 0 && (len > 0 || allow_empty))
        return 0;
    label(where, sizeof where, what, index);
    if (len % 4)
        PyErr_Format(HashingError,
                     "%s: %zd bytes is not a whole number of token ids (4 bytes each, uint32 "
                     "little-endian)",
                     where, len);
    else
        PyErr_Format(HashingError, "%s: a block needs at least one token", where);
    return -1;
}

static int
check_extra_len(Py_ssize_t len, Py_ssize_t n_tokens, Py_ssize_t index)
{
    char where[64];

    if (len == 8 * n_tokens)
        return 0;
    label(where, sizeof where, "extra_ids", index);
    if (len % 8)
        PyErr_Format(HashingError,
                     "%s: %zd bytes is not a whole number of extra ids (8 bytes each, uint64 "
                     "little-endian)",
                     where, len);
    else
        PyErr_Format(HashingError, "%s has %zd entries for %zd tokens", where, len / 8,
                     n_tokens);
    return -1;
}

static int
check_mm_len(Py_ssize_t len, Py_ssize_t index)
{
    char where[64];

    if (len % MM_RECORD == 0)
        return 0;
    label(where, sizeof where, "mm_keys", index);
    PyErr_Format(HashingError,
                 "%s: %zd bytes is not a whole number of %d-byte records (32-byte digest + "
                 "start_offset as uint32 little-endian)",
                 where, len, MM_RECORD);
    return -1;
}

/* A list or tuple with one entry per block (new reference), or NULL with HashingError set. */
static PyObject *
per_block_seq(PyObject *o, const char *what, Py_ssize_t n_blocks)
{
    Py_ssize_t n;

    if (!PyList_Check(o) && !PyTuple_Check(o)) {
        PyErr_Format(HashingError,
                     "%s must be None or a list/tuple with one entry per block, got %.200s",
                     what, Py_TYPE(o)->tp_name);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(o);
    if (n != n_blocks) {
        PyErr_Format(HashingError, "%s needs one entry per block: got %zd for %zd blocks", what,
                     n, n_blocks);
        return NULL;
    }
    /* A tuple copy: the per-block loop then owns every item even if the caller's list changes. */
    return PySequence_Tuple(o);
}

/*
 * Block sizes of a single-buffer request: an int (tokens per block, last block may be
 * shorter) or a sequence of positive ints summing to n_tokens. Returns a PyMem array (NULL
 * with *n_blocks set when there are no blocks or sizes are uniform: *tpb is then set).
 */
static int
parse_sizes(PyObject *o, Py_ssize_t n_tokens, Py_ssize_t **sizes, Py_ssize_t *n_blocks,
            Py_ssize_t *tpb)
{
    PyObject *seq, *item, *idx;
    Py_ssize_t n, i, total = 0, v;

    *sizes = NULL;
    *tpb = 0;
    if (o == NULL || o == Py_None) {
        PyErr_SetString(HashingError,
                        "block_sizes is required when tokens is one buffer (an int: tokens "
                        "per block, or a sequence of block sizes)");
        return -1;
    }
    if (PyBool_Check(o)) {
        PyErr_SetString(HashingError, "block_sizes must be an int or a sequence of ints, got bool");
        return -1;
    }
    if (PyLong_Check(o)) {
        v = PyLong_AsSsize_t(o);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(HashingError, "block_sizes (tokens per block) = %R is out of range", o);
            return -1;
        }
        if (v <= 0) {
            PyErr_Format(HashingError, "block_sizes (tokens per block) must be positive, got %zd",
                         v);
            return -1;
        }
        *tpb = v;
        *n_blocks = n_tokens / v + (n_tokens % v != 0);
        return 0;
    }
    if (PyUnicode_Check(o) || PyBytes_Check(o) || PyByteArray_Check(o)) {
        PyErr_Format(HashingError, "block_sizes must be an int or a sequence of ints, got %.200s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    seq = PySequence_Fast(o, "block_sizes must be an int or a sequence of ints");
    if (seq == NULL) {
        PyErr_Clear();
        PyErr_Format(HashingError, "block_sizes must be an int or a sequence of ints, got %.200s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    if (n > 0) {
        *sizes = PyMem_New(Py_ssize_t, (size_t)n);
        if (*sizes == NULL) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
    }
    for (i = 0; i < n; i++) {
        item = PySequence_Fast_GET_ITEM(seq, i);
        if (PyBool_Check(item)) {
            PyErr_Format(HashingError, "block_sizes[%zd] must be an int, got bool", i);
            goto fail;
        }
        idx = PyNumber_Index(item);
        if (idx == NULL) {
            PyErr_Clear();
            PyErr_Format(HashingError, "block_sizes[%zd] must be an int, got %.200s", i,
                         Py_TYPE(item)->tp_name);
            goto fail;
        }
        v = PyLong_AsSsize_t(idx);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(HashingError, "block_sizes[%zd] = %R is out of range", i, idx);
            Py_DECREF(idx);
            goto fail;
        }
        Py_DECREF(idx);
        if (v <= 0) {
            if (v == 0)
                PyErr_Format(HashingError,
                             "block_sizes[%zd] = 0: a block needs at least one token", i);
            else
                PyErr_Format(HashingError, "block_sizes[%zd] = %zd: block sizes must be positive",
                             i, v);
            goto fail;
        }
        if (v > n_tokens - total) {
            PyErr_Format(HashingError,
                         "block_sizes[:%zd] sum to more than the %zd tokens in tokens", i + 1,
                         n_tokens);
            goto fail;
        }
        total += v;
        (*sizes)[i] = v;
    }
    Py_DECREF(seq);
    if (total != n_tokens) {
        PyErr_Format(HashingError, "block_sizes sum to %zd tokens but tokens holds %zd", total,
                     n_tokens);
        PyMem_Free(*sizes);
        *sizes = NULL;
        return -1;
    }
    *n_blocks = n;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_Free(*sizes);
    *sizes = NULL;
    return -1;
}

/* --------------------------------------------------------------------------- the chains */

enum { OUT_INTS, OUT_BYTES, OUT_BUFFER };

static PyObject *
build_output(const uint64_t *keys, Py_ssize_t n, int kind)
{
    PyObject *out, *item;
    Py_ssize_t i;

    if (kind == OUT_BUFFER) {
        unsigned char *p;
        out = PyBytes_FromStringAndSize(NULL, 8 * n);
        if (out == NULL)
            return NULL;
        p = (unsigned char *)PyBytes_AS_STRING(out);
        for (i = 0; i < n; i++)
            store_u64be(p + 8 * i, keys[i]);
        return out;
    }
    out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        if (kind == OUT_INTS) {
            item = PyLong_FromUnsignedLongLong((unsigned long long)keys[i]);
        }
        else {
            item = PyBytes_FromStringAndSize(NULL, 8);
            if (item != NULL)
                store_u64be((unsigned char *)PyBytes_AS_STRING(item), keys[i]);
        }
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* Optional per-block entry (None or a buffer) of a per-block tuple. */
static int
block_part(PyObject *seq, Py_ssize_t i, const char *what, view_t *v, const unsigned char **ptr,
           Py_ssize_t *len)
{
    PyObject *o = PyTuple_GET_ITEM(seq, i);

    *ptr = NULL;
    *len = 0;
    v->held = 0;
    if (o == Py_None)
        return 0;
    return view_get(o, v, ptr, len, what, i);
}

/* A request given as a list/tuple of per-block buffers: hashed block by block with the GIL. */
static int
chain_blocks(PyObject *blocks_obj, uint64_t parent, const scope_t *sc, PyObject *extra_obj,
             PyObject *mm_obj, uint64_t **keys_out, Py_ssize_t *n_out)
{
    PyObject *blocks = NULL, *extra = NULL, *mm = NULL;
    uint64_t *keys = NULL;
    Py_ssize_t n, i, len, ext_len = 0, ext_off = 0;
    const unsigned char *ext_base = NULL;
    view_t ext_view = {.held = 0};
    int rc = -1;

    blocks = PySequence_Tuple(blocks_obj); /* owns the blocks for the whole loop */
    if (blocks == NULL)
        return -1;
    n = PyTuple_GET_SIZE(blocks);
    if (extra_obj != NULL && extra_obj != Py_None) {
        if (PyList_Check(extra_obj) || PyTuple_Check(extra_obj)) {
            extra = per_block_seq(extra_obj, "extra_ids", n);
            if (extra == NULL)
                goto done;
        }
        else if (view_get(extra_obj, &ext_view, &ext_base, &ext_len, "extra_ids", -1) < 0) {
            goto done;
        }
    }
    if (mm_obj != NULL && mm_obj != Py_None) {
        mm = per_block_seq(mm_obj, "mm_keys", n);
        if (mm == NULL)
            goto done;
    }
    keys = PyMem_New(uint64_t, (size_t)(n > 0 ? n : 1));
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        block_t b;
        view_t tv, ev = {.held = 0}, mv = {.held = 0};
        int bad;

        if (view_get(PyTuple_GET_ITEM(blocks, i), &tv, &b.tok, &len, "blocks", i) < 0)
            goto done;
        b.n = len / 4;
        b.extra = NULL;
        b.mm = NULL;
        b.n_mm = 0;
        bad = check_tokens_len(len, "blocks", i, 0) < 0;
        if (!bad && extra != NULL) {
            bad = block_part(extra, i, "extra_ids", &ev, &b.extra, &len) < 0 ||
                  (b.extra != NULL && check_extra_len(len, b.n, i) < 0);
        }
        else if (!bad && ext_base != NULL) {
            if (ext_len - ext_off < 8 * b.n) {
                PyErr_Format(HashingError,
                             "extra_ids has %zd entries, fewer than the tokens of blocks[:%zd]",
                             ext_len / 8, i + 1);
                bad = 1;
            }
            else {
                b.extra = ext_base + ext_off;
                ext_off += 8 * b.n;
            }
        }
        if (!bad && mm != NULL) {
            bad = block_part(mm, i, "mm_keys", &mv, &b.mm, &len) < 0 || check_mm_len(len, i) < 0;
            b.n_mm = len / MM_RECORD;
        }
        if (!bad)
            parent = keys[i] = hash_block(parent, &b, sc);
        view_release(&tv);
        view_release(&ev);
        view_release(&mv);
        if (bad)
            goto done;
    }
    if (ext_base != NULL && ext_off != ext_len) {
        if (check_extra_len(ext_len, ext_off / 8, -1) == 0) /* cannot happen: lengths differ */
            PyErr_SetString(HashingError, "extra_ids length mismatch");
        goto done;
    }
    *keys_out = keys;
    *n_out = n;
    keys = NULL;
    rc = 0;
done:
    view_release(&ext_view);
    PyMem_Free(keys);
    Py_XDECREF(blocks);
    Py_XDECREF(extra);
    Py_XDECREF(mm);
    return rc;
}

/* A request given as one buffer cut by block_sizes. */
static int
chain_buffer_impl(PyObject *tokens_obj, PyObject *sizes_obj, uint64_t parent, const scope_t *sc,
                  PyObject *extra_obj, PyObject *mm_obj, uint64_t **keys_out, Py_ssize_t *n_out)
{
    view_t tok_view = {.held = 0}, ext_view = {.held = 0};
    const unsigned char *tok = NULL, *ext_base = NULL;
    Py_ssize_t tok_len, n_tok, ext_len = 0, n_blocks = 0, tpb = 0, i, off = 0;
    Py_ssize_t *sizes = NULL;
    PyObject *extra = NULL, *mm = NULL;
    uint64_t *keys = NULL;
    int rc = -1;

    if (view_get(tokens_obj, &tok_view, &tok, &tok_len, "tokens", -1) < 0)
        return -1;
    if (check_tokens_len(tok_len, "tokens", -1, 1) < 0)
        goto done;
    n_tok = tok_len / 4;
    if (parse_sizes(sizes_obj, n_tok, &sizes, &n_blocks, &tpb) < 0)
        goto done;
    if (extra_obj != NULL && extra_obj != Py_None) {
        if (PyList_Check(extra_obj) || PyTuple_Check(extra_obj)) {
            extra = per_block_seq(extra_obj, "extra_ids", n_blocks);
            if (extra == NULL)
                goto done;
        }
        else {
            if (view_get(extra_obj, &ext_view, &ext_base, &ext_len, "extra_ids", -1) < 0 ||
                check_extra_len(ext_len, n_tok, -1) < 0)
                goto done;
        }
    }
    if (mm_obj != NULL && mm_obj != Py_None) {
        mm = per_block_seq(mm_obj, "mm_keys", n_blocks);
        if (mm == NULL)
            goto done;
    }
    keys = PyMem_New(uint64_t, (size_t)(n_blocks > 0 ? n_blocks : 1));
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (extra == NULL && mm == NULL) {
        /* Everything is validated: hash without touching Python objects. */
        int nogil = n_tok >= NOGIL_MIN_TOKENS;
        PyThreadState *ts = NULL;
        if (nogil)
            ts = PyEval_SaveThread();
        for (i = 0; i < n_blocks; i++) {
            block_t b;
            b.n = sizes != NULL ? sizes[i] : (n_tok - off < tpb ? n_tok - off : tpb);
            b.tok = tok + 4 * off;
            b.extra = ext_base != NULL ? ext_base + 8 * off : NULL;
            b.mm = NULL;
            b.n_mm = 0;
            parent = keys[i] = hash_block(parent, &b, sc);
            off += b.n;
        }
        if (nogil)
            PyEval_RestoreThread(ts);
    }
    else {
        for (i = 0; i < n_blocks; i++) {
            block_t b;
            view_t ev = {.held = 0}, mv = {.held = 0};
            Py_ssize_t len = 0;
            int bad = 0;

            b.n = sizes != NULL ? sizes[i] : (n_tok - off < tpb ? n_tok - off : tpb);
            b.tok = tok + 4 * off;
            b.extra = ext_base != NULL ? ext_base + 8 * off : NULL;
            b.mm = NULL;
            b.n_mm = 0;
            if (extra != NULL)
                bad = block_part(extra, i, "extra_ids", &ev, &b.extra, &len) < 0 ||
                      (b.extra != NULL && check_extra_len(len, b.n, i) < 0);
            if (!bad && mm != NULL) {
                bad = block_part(mm, i, "mm_keys", &mv, &b.mm, &len) < 0 ||
                      check_mm_len(len, i) < 0;
                b.n_mm = len / MM_RECORD;
            }
            if (!bad)
                parent = keys[i] = hash_block(parent, &b, sc);
            view_release(&ev);
            view_release(&mv);
            if (bad)
                goto done;
            off += b.n;
        }
    }
    *keys_out = keys;
    *n_out = n_blocks;
    keys = NULL;
    rc = 0;
done:
    view_release(&tok_view);
    view_release(&ext_view);
    PyMem_Free(sizes);
    PyMem_Free(keys);
    Py_XDECREF(extra);
    Py_XDECREF(mm);
    return rc;
}

static const char *const CHAIN_NAMES[N_ARGS] = {
    "tokens", "block_sizes", "parent", "salt_id", "lora_id", "extra_ids", "mm_keys",
};

static PyObject *
chain_common(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
             int kind)
{
    PyObject *a[N_ARGS], *out;
    uint64_t parent = 0, *keys = NULL;
    Py_ssize_t n = 0;
    scope_t sc;
    int rc;

    if (parse_args(fname, args, nargs, kwnames, CHAIN_NAMES, 1, a) < 0)
        return NULL;
    if (a[2] != NULL && parse_u64(a[2], "parent", &parent) < 0)
        return NULL;
    if (parse_scope(a[3], a[4], &sc) < 0)
        return NULL;
    if (PyList_Check(a[0]) || PyTuple_Check(a[0])) {
        if (a[1] != NULL && a[1] != Py_None) {
            PyErr_SetString(HashingError,
                            "block_sizes must be None when tokens is a list/tuple of blocks");
            return NULL;
        }
        rc = chain_blocks(a[0], parent, &sc, a[5], a[6], &keys, &n);
    }
    else {
        rc = chain_buffer_impl(a[0], a[1], parent, &sc, a[5], a[6], &keys, &n);
    }
    if (rc < 0)
        return NULL;
    out = build_output(keys, n, kind);
    PyMem_Free(keys);
    return out;
}

static PyObject *
v1_chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return chain_common("chain", args, nargs, kwnames, OUT_INTS);
}

static PyObject *
v1_chain_bytes(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames)
{
    return chain_common("chain_bytes", args, nargs, kwnames, OUT_BYTES);
}

static PyObject *
v1_chain_buffer(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
                PyObject *kwnames)
{
    return chain_common("chain_buffer", args, nargs, kwnames, OUT_BUFFER);
}

static const char *const BLOCK_NAMES[N_ARGS] = {
    "tokens", NULL, "parent", "salt_id", "lora_id", "extra_ids", "mm_keys",
};

static PyObject *
v1_block_key(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs,
             PyObject *kwnames)
{
    PyObject *a[N_ARGS];
    view_t tv = {.held = 0}, ev = {.held = 0}, mv = {.held = 0};
    uint64_t parent = 0, key = 0;
    Py_ssize_t len = 0;
    scope_t sc;
    block_t b;
    int bad;

    if (parse_args("block_key", args, nargs, kwnames, BLOCK_NAMES, 1, a) < 0)
        return NULL;
    if (a[2] != NULL && parse_u64(a[2], "parent", &parent) < 0)
        return NULL;
    if (parse_scope(a[3], a[4], &sc) < 0)
        return NULL;
    if (view_get(a[0], &tv, &b.tok, &len, "tokens", -1) < 0)
        return NULL;
    b.n = len / 4;
    b.extra = NULL;
    b.mm = NULL;
    b.n_mm = 0;
    bad = check_tokens_len(len, "tokens", -1, 0) < 0;
    if (!bad && a[5] != NULL && a[5] != Py_None)
        bad = view_get(a[5], &ev, &b.extra, &len, "extra_ids", -1) < 0 ||
              check_extra_len(len, b.n, -1) < 0;
    if (!bad && a[6] != NULL && a[6] != Py_None) {
        bad = view_get(a[6], &mv, &b.mm, &len, "mm_keys", -1) < 0 || check_mm_len(len, -1) < 0;
        b.n_mm = len / MM_RECORD;
    }
    if (!bad)
        key = hash_block(parent, &b, &sc);
    view_release(&tv);
    view_release(&ev);
    view_release(&mv);
    if (bad)
        return NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)key);
}

/* ------------------------------------------------------------------------------ module */

PyDoc_STRVAR(chain_doc,
             "chain(tokens, block_sizes=None, parent=0, salt_id=None, lora_id=None, "
             "extra_ids=None, mm_keys=None) -> list[int]\n\n"
             "The v1_block_key chain of a request as unsigned 64-bit ints.\n\n"
             "tokens: one buffer of uint32 little-endian ids cut by block_sizes (an int: "
             "tokens per block, the last block may be shorter; or a sequence of positive "
             "sizes summing to the token count), or a list/tuple of per-block buffers "
             "(block_sizes None). parent: the first block's parent (0 = root). salt_id is "
             "mixed into any block whose parent is 0, lora_id into every block. extra_ids: "
             "None, one buffer of uint64 little-endian ids (one per token), or one entry per "
             "block (None or a buffer). mm_keys: None or one entry per block (None or a "
             "buffer of 36-byte records: 32-byte digest || uint32 LE start_offset). Raises "
             "kvstream.errors.HashingError for bad inputs.");
PyDoc_STRVAR(chain_bytes_doc,
             "chain_bytes(...) -> list[bytes]\n\nLike chain(), each hash as 8 bytes big-endian.");
PyDoc_STRVAR(chain_buffer_doc,
             "chain_buffer(...) -> bytes\n\nLike chain(), the 8-byte big-endian hashes "
             "concatenated.");
PyDoc_STRVAR(block_key_doc,
             "block_key(tokens, parent=0, salt_id=None, lora_id=None, extra_ids=None, "
             "mm_keys=None) -> int\n\nThe v1_block_key hash of one block (tokens: a non-empty "
             "buffer of uint32 LE ids; extra_ids/mm_keys: None or that block's buffer).");

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))v1_chain, METH_FASTCALL | METH_KEYWORDS, chain_doc},
    {"chain_bytes", (PyCFunction)(void (*)(void))v1_chain_bytes, METH_FASTCALL | METH_KEYWORDS,
     chain_bytes_doc},
    {"chain_buffer", (PyCFunction)(void (*)(void))v1_chain_buffer, METH_FASTCALL | METH_KEYWORDS,
     chain_buffer_doc},
    {"block_key", (PyCFunction)(void (*)(void))v1_block_key, METH_FASTCALL | METH_KEYWORDS,
     block_key_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
             "TensorRT-LLM v1_block_key block-hash chains in C (see "
             "kvstream.hashing.trtllm, the pure-Python reference).");

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvstream.hashing._v1native", module_doc, -1, methods,
    NULL,                  NULL,                         NULL,       NULL,
};

PyMODINIT_FUNC
PyInit__v1native(void)
{
    PyObject *m, *errors;

    errors = PyImport_ImportModule("kvstream.errors");
    if (errors == NULL)
        return NULL;
    Py_XDECREF(HashingError);
    HashingError = PyObject_GetAttrString(errors, "HashingError");
    Py_DECREF(errors);
    if (HashingError == NULL)
        return NULL;
    m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "ALGORITHM", "v1_block_key") < 0 ||
        PyModule_AddIntConstant(m, "MM_RECORD_SIZE", MM_RECORD) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
