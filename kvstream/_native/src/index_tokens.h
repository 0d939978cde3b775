/* kvstream._native._index.TokenTable: the token-keyed table (included by index_table.c).
 *
 * A TokenTable is a GroupTable (the same records, tree, reference counts, ghosts and rooting)
 * whose nodes also hold their canonical key (kvstream/index/keys.py): the key, not the
 * engine hash, is what the domain masks mirror and what matching looks up. Its Python twin,
 * and the reference of every rule here, is kvstream.index.token_table.TokenGroupTable:
 *
 * - a block's key chains from its parent's key and its payload: Dynamo's key
 *   (XXH3(parent key || local hash) || local hash) in ``dynamo`` tables, else
 *   ``kvstream_tokens_v2``: XXH3-128 of parent key || payload (canonical bytes) for a plain
 *   payload, the first 16 bytes of BLAKE3 derive-key of the same for a scoped one;
 * - a block stored under a parent whose key is unknown keeps its payload pending, and gets
 *   its key when the chain above gets one (when it could become rooted);
 * - a store without tokens (a payload of b"") is a placeholder: it adds a reference to a block
 *   the table knows, and is skipped (counted) for one it does not;
 * - two nodes may hold one key (an engine hashing what the events do not carry): the key map
 *   is a multimap, and a key's mask bit stays while any rooted node holds it.
 *
 * Payloads come from Python (``store_payloads``: token_table.event_payloads of the model
 * blocks) or straight from an event's token ids (``store_tokens``: plain blocks, the columns
 * an engine decoder fills), where this file computes them: the raw u32 LE tokens, or their
 * Dynamo local hash. Pending payloads live in a dict the table owns. */

#define XXH_INLINE_ALL
#include "../../hashing/xxhash.h"
#include "blake3_portable.h"

#define DEFERRED (-3) /* the parent is a skipped placeholder: resolved by hash when needed */
#define DYN_LOCAL 8
#define KEY_CONTEXT "kvstream.index token block key v1"

_Static_assert(CKEY_BYTES == 16, "b3p_hash_prefixed16 takes a 16-byte parent key");

static PyTypeObject TokTableType;
static uint32_t scoped_key_words[8]; /* BLAKE3 derive-key words of KEY_CONTEXT */

static inline void
put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

/* The key of a block with ``payload`` under the key ``parent`` (module doc). */
static int
compute_key(Tab *t, const uint8_t *parent, const uint8_t *payload, Py_ssize_t plen, int scoped,
            uint8_t out[CKEY_BYTES])
{
    if (t->dynamo) {
        uint8_t msg[CKEY_BYTES + DYN_LOCAL];
        memcpy(msg, parent, CKEY_BYTES);
        memcpy(msg + CKEY_BYTES, payload, DYN_LOCAL);
        put_be64(out, XXH3_64bits(msg, sizeof msg));
        memcpy(out + DYN_LOCAL, payload, DYN_LOCAL);
        return 0;
    }
    if (scoped && CKEY_BYTES + plen <= B3P_CHUNK_LEN) {
        b3p_hash_prefixed16(scoped_key_words, B3P_DERIVE_KEY_MATERIAL, parent, payload,
                            (size_t)plen, out);
        return 0;
    }
    /* parent || payload in one buffer: on the stack for blocks up to 256 tokens */
    size_t len = CKEY_BYTES + (size_t)plen;
    uint8_t small[CKEY_BYTES + 1024];
    uint8_t *msg = len <= sizeof small ? small : PyMem_Malloc(len);
    if (msg == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(msg, parent, CKEY_BYTES);
    memcpy(msg + CKEY_BYTES, payload, (size_t)plen);
    if (scoped)
        b3p_hash(scoped_key_words, B3P_DERIVE_KEY_MATERIAL, msg, len, out, CKEY_BYTES);
    else /* kvstream_tokens_v2: XXH3-128, canonical (big-endian) bytes */
        XXH128_canonicalFromHash((XXH128_canonical_t *)out, XXH3_128bits(msg, len));
    if (msg != small)
        PyMem_Free(msg);
    return 0;
}

/* Give node n (unkeyed, not pending) its key. */
static int
set_key(Tab *t, int32_t n, const uint8_t key[CKEY_BYTES])
{
    if (om_room(t, KEYMAP(t), t->keyed) < 0) /* before the flag: a rebuild files flagged nodes */
        return -1;
    memcpy(CKEY(t, n), key, CKEY_BYTES);
    ND(t, n)->flags |= F_KEYED;
    om_insert(t, KEYMAP(t), n);
    t->keyed++;
    return 0;
}

/* Keep node n's payload until its parent has a key (obj: the payload as bytes, or NULL). */
static int
set_pending(Tab *t, int32_t n, const uint8_t *payload, Py_ssize_t plen, int scoped, PyObject *obj)
{
    PyObject *b = obj ? Py_NewRef(obj) : PyBytes_FromStringAndSize((const char *)payload, plen);
    PyObject *item = b == NULL ? NULL : PyTuple_Pack(2, b, scoped ? Py_True : Py_False);
    PyObject *k = item == NULL ? NULL : PyLong_FromLong(n);
    int rc = k == NULL ? -1 : PyDict_SetItem(t->pending, k, item);
    Py_XDECREF(b);
    Py_XDECREF(item);
    Py_XDECREF(k);
    if (rc == 0)
        ND(t, n)->flags |= F_PENDING;
    return rc;
}

/* Key n and its pending descendants whose parents' keys are now known. */
static int
resolve(Tab *t, int32_t n)
{
    if (!(ND(t, n)->flags & F_PENDING))
        return 0;
    Stack s = {0};
    int rc = push(&s, n);
    while (rc == 0 && s.n) {
        int32_t x = s.v[--s.n];
        if (!(ND(t, x)->flags & F_PENDING))
            continue;
        int32_t q = ND(t, x)->parent;
        uint8_t pk[CKEY_BYTES], key[CKEY_BYTES];
        if (q == ROOT)
            memset(pk, 0, CKEY_BYTES);
        else if (q >= 0 && (ND(t, q)->flags & F_KEYED))
            memcpy(pk, CKEY(t, q), CKEY_BYTES);
        else
            continue;
        PyObject *k = PyLong_FromLong(x);
        PyObject *item = k == NULL ? NULL : PyDict_GetItemWithError(t->pending, k);
        if (item == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_SystemError, "a pending node without its payload");
            Py_XDECREF(k);
            rc = -1;
            break;
        }
        Py_INCREF(item);
        PyObject *payload = PyTuple_GET_ITEM(item, 0);
        rc = compute_key(t, pk, (const uint8_t *)PyBytes_AS_STRING(payload),
                         PyBytes_GET_SIZE(payload), PyTuple_GET_ITEM(item, 1) == Py_True, key);
        Py_DECREF(item);
        if (rc == 0)
            rc = PyDict_DelItem(t->pending, k);
        Py_DECREF(k);
        if (rc < 0)
            break;
        ND(t, x)->flags &= (uint8_t)~F_PENDING;
        rc = set_key(t, x, key);
        if (rc == 0)
            rc = push_children(&s, t, x);
    }
    PyMem_Free(s.v);
    return rc;
}

/* Where the next block of a store hangs: node p (or ROOT, or DEFERRED), rooted or not, and
 * p's key when it has one. */
typedef struct {
    int32_t p;
    int ok, haspk;
    uint8_t pk[CKEY_BYTES];
    PyObject *skipped; /* borrowed: the last skipped placeholder's hash (NULL: none) */
    /* the next block's key computed ahead (store_tokens), valid while pk is pre_parent */
    const uint8_t *pre_parent, *pre_key;
} Cursor;

static void
cursor_at(Tab *t, Cursor *c, int32_t n)
{
    c->p = n;
    c->ok = ROOTED(t, n) ? 1 : 0;
    c->haspk = (ND(t, n)->flags & F_KEYED) != 0;
    if (c->haspk)
        memcpy(c->pk, CKEY(t, n), CKEY_BYTES);
}

/* A store's parent (TokenGroupTable._parent): the root, the known node, or a new ghost. */
static int
cursor_parent(Tab *t, Cursor *c, PyObject *parent_hash)
{
    if (store_parent(t, parent_hash, &c->p, &c->ok) < 0)
        return -1;
    if (c->p == ROOT) {
        c->haspk = 1;
        memset(c->pk, 0, CKEY_BYTES);
    }
    else
        cursor_at(t, c, c->p);
    return 0;
}

/* A placeholder store of a known block: one reference more at level. */
static int
store_known(Tab *t, int32_t n, long level)
{
    uint64_t r = ND(t, n)->refs;
    int shift = 16 * tier_of(level);
    if (((r >> shift) & FIELD) == FIELD) {
        t->counters[C_SATURATED]++;
        return 0;
    }
    set_refs(t, n, r, r + (1ull << shift));
    int32_t q = ND(t, n)->parent;
    if (!r && (q == ROOT || (q >= 0 && ROOTED(t, q))))
        return root_subtree(t, n);
    return 0;
}

/* A store of a block the table has: a reference more, or a ghost stored again (which gets the
 * payload if it had none, then its key once the parent's is known). */
static int
store_existing_keyed(Tab *t, int32_t n, int32_t p, long level, const uint8_t *payload,
                     Py_ssize_t plen, int scoped, PyObject *obj)
{
    if (ND(t, n)->refs)
        return store_existing(t, n, p, level); /* a duplicate: reference counted */
    adopt_parent(t, n, p);
    if (!(ND(t, n)->flags & (F_KEYED | F_PENDING))
        && set_pending(t, n, payload, plen, scoped, obj) < 0)
        return -1;
    if (resolve(t, n) < 0)
        return -1;
    set_refs(t, n, 0, 1ull << (16 * tier_of(level)));
    int32_t q = ND(t, n)->parent;
    if (q == ROOT || (q >= 0 && ROOTED(t, q)))
        return root_subtree(t, n);
    return 0;
}

/* After a store: delete h's node when it is a ghost without children. */
static int
drop_bare_ghost(Tab *t, PyObject *h)
{
    if (h == NULL || h == Py_None)
        return 0;
    const uint8_t *k;
    Py_ssize_t len;
    if (key_arg(h, &k, &len) < 0)
        return -1;
    int32_t q = find(t, k, len);
    if (q >= 0 && !ND(t, q)->refs && ND(t, q)->kid < 0)
        delete_up(t, q);
    return 0;
}

/* One block of a store: its hash, level and payload (plen 0: a placeholder without tokens;
 * obj: the payload as bytes when the caller has it). */
static int
store_block(Tab *t, Cursor *c, PyObject *h, long level, const uint8_t *payload, Py_ssize_t plen,
            int scoped, PyObject *obj)
{
    const uint8_t *k;
    Py_ssize_t len;
    if (key_arg(h, &k, &len) < 0)
        return -1;
    int32_t n;
    if (!plen) {
        n = find(t, k, len);
        if (n < 0 || !(ND(t, n)->refs || (ND(t, n)->flags & (F_KEYED | F_PENDING)))) {
            t->counters[C_TOKENLESS_SKIPPED]++;
            c->p = DEFERRED;
            c->ok = c->haspk = 0;
            c->skipped = h;
            return 0;
        }
        t->counters[C_TOKENLESS_RESOLVED]++;
        if (store_known(t, n, level) < 0)
            return -1;
        cursor_at(t, c, n);
        return 0;
    }
    if (t->dynamo && plen != DYN_LOCAL) {
        PyErr_Format(PyExc_ValueError, "a Dynamo-keyed payload is an %d-byte local hash, got %zd",
                     DYN_LOCAL, plen);
        return -1;
    }
    PyObject *deferred = c->p == DEFERRED ? c->skipped : NULL;
    if (deferred != NULL && cursor_parent(t, c, deferred) < 0)
        return -1;
    n = find(t, k, len);
    if (n >= 0) {
        if (store_existing_keyed(t, n, c->p, level, payload, plen, scoped, obj) < 0)
            return -1;
        cursor_at(t, c, n);
        /* the skipped parent's ghost, if nothing hangs off it */
        return deferred != NULL ? drop_bare_ghost(t, deferred) : 0;
    }
    n = alloc_node(t, k, len, c->p);
    if (n < 0)
        return -1;
    if (c->p >= 0)
        link_child(t, n, c->p);
    set_refs(t, n, 0, 1ull << (16 * tier_of(level)));
    if (c->ok)
        set_rooted(t, n, 1);
    if (c->haspk) {
        uint8_t key[CKEY_BYTES];
        if (c->pre_key != NULL && bytes_eq(c->pk, c->pre_parent, CKEY_BYTES))
            memcpy(key, c->pre_key, CKEY_BYTES);
        else if (compute_key(t, c->pk, payload, plen, scoped, key) < 0)
            return -1;
        if (set_key(t, n, key) < 0)
            return -1;
        memcpy(c->pk, key, CKEY_BYTES);
        if (c->ok && mask_node(t, s_add, n, NULL) < 0)
            return -1;
    }
    else if (set_pending(t, n, payload, plen, scoped, obj) < 0)
        return -1;
    c->p = n;
    return 0;
}

/* The level of block i: one for all, or levels[i]. */
static inline int
block_level(PyObject *levels, Py_ssize_t i, long one, long *level)
{
    *level = one;
    return levels == NULL ? 0 : level_arg(PySequence_Fast_GET_ITEM(levels, i), level);
}

/* Parse (hashes, level) arguments: hashes a sequence, level an int or one per block. */
static int
hashes_levels(PyObject *hs_arg, PyObject *lv_arg, PyObject **hashes, PyObject **levels, long *one)
{
    *levels = NULL;
    *one = 0;
    *hashes = PySequence_Fast(hs_arg, "store: hashes must be a sequence");
    if (*hashes == NULL)
        return -1;
    if (PyLong_Check(lv_arg))
        return level_arg(lv_arg, one);
    *levels = PySequence_Fast(lv_arg, "store: level is an int or a sequence");
    if (*levels == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(*levels) != PySequence_Fast_GET_SIZE(*hashes)) {
        PyErr_SetString(PyExc_ValueError, "store: one cache level per block hash");
        return -1;
    }
    return 0;
}

/* Start loading the key map slot and the (native) mask slot where key's probes begin. */
static inline void
prefetch_ckey(Tab *t, const uint8_t *key)
{
    if (t->kcap)
        prefetch_run(&t->kmap[FRAG(ckey_hash(key)) & ((uint64_t)t->kcap - 1)]);
    if (t->masks != NULL && Py_TYPE(t->masks) == &MMType) {
        MM *m = (MM *)t->masks;
        if (m->cap)
            prefetch_run(MM_SLOT(m, key_hash(key, CKEY_BYTES) & ((uint64_t)m->cap - 1)));
    }
}

static PyObject *
tok_store_payloads(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "store_payloads(parent_hash, hashes, level, payloads, scoped, st)");
        return NULL;
    }
    PyObject *hashes, *levels, *payloads = NULL, *scoped = NULL;
    long one;
    int rc = hashes_levels(args[1], args[2], &hashes, &levels, &one);
    if (rc == 0) {
        payloads = PySequence_Fast(args[3], "store_payloads: payloads must be a sequence");
        if (payloads != NULL && args[4] != Py_None)
            scoped = PySequence_Fast(args[4], "store_payloads: scoped must be a sequence");
        Py_ssize_t nb = PySequence_Fast_GET_SIZE(hashes);
        if (payloads == NULL || (args[4] != Py_None && scoped == NULL))
            rc = -1;
        else if (PySequence_Fast_GET_SIZE(payloads) != nb
                 || (scoped != NULL && PySequence_Fast_GET_SIZE(scoped) != nb)) {
            PyErr_SetString(PyExc_ValueError, "store_payloads: one payload (and scope) per block");
            rc = -1;
        }
    }
    Cursor c = {0};
    if (rc == 0)
        rc = cursor_parent(t, &c, args[0]);
    for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(hashes); i++) {
        PyObject *pl = PySequence_Fast_GET_ITEM(payloads, i);
        long level;
        int sc = 0;
        if (!PyBytes_Check(pl)) {
            PyErr_Format(PyExc_TypeError, "payloads are bytes, not %.100s", Py_TYPE(pl)->tp_name);
            rc = -1;
        }
        else if (block_level(levels, i, one, &level) < 0
                 || (scoped != NULL && (sc = PyObject_IsTrue(PySequence_Fast_GET_ITEM(scoped, i))) < 0))
            rc = -1;
        else
            rc = store_block(t, &c, PySequence_Fast_GET_ITEM(hashes, i), level,
                             (const uint8_t *)PyBytes_AS_STRING(pl), PyBytes_GET_SIZE(pl), sc, pl);
    }
    if (rc == 0 && (drop_bare_ghost(t, args[0]) < 0 || drop_bare_ghost(t, c.skipped) < 0))
        rc = -1;
    Py_XDECREF(hashes);
    Py_XDECREF(levels);
    Py_XDECREF(payloads);
    Py_XDECREF(scoped);
    if (flush_counters(t, args[5]) < 0 || rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* store_tokens' work on a token span given as memory (``tokens``, ``toklen`` bytes); the
 * counters stay in t (flush_counters). 0, or -1 with an exception set. */
static int
store_tokens_run(Tab *t, PyObject *parent, PyObject *hs_arg, PyObject *lv_arg,
                 const uint8_t *tokens, Py_ssize_t toklen, PyObject *sz_arg, uint64_t seed)
{
    PyObject *hashes, *levels, *sizes = NULL;
    long one;
    struct {
        const void *buf;
        Py_ssize_t len;
    } buf = {tokens, toklen};
    int rc = hashes_levels(hs_arg, lv_arg, &hashes, &levels, &one);
    if (rc == 0) {
        sizes = PySequence_Fast(sz_arg, "store_tokens: sizes must be a sequence");
        if (sizes == NULL)
            rc = -1;
        else if (PySequence_Fast_GET_SIZE(sizes) != PySequence_Fast_GET_SIZE(hashes)) {
            PyErr_SetString(PyExc_ValueError, "store_tokens: one size per block hash");
            rc = -1;
        }
    }
    Py_ssize_t off = 0, nb = rc == 0 ? PySequence_Fast_GET_SIZE(hashes) : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < nb; i++) { /* check the layout before any change */
        Py_ssize_t sz = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, i));
        if (sz < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "store_tokens: block sizes are >= 0");
            rc = -1;
        }
        else
            off += 4 * sz;
    }
    if (rc == 0 && off != buf.len) {
        PyErr_Format(PyExc_ValueError, "store_tokens: the sizes need %zd bytes of tokens, got %zd",
                     off, buf.len);
        rc = -1;
    }
    Cursor c = {0};
    if (rc == 0)
        rc = cursor_parent(t, &c, parent);
    /* The keys the blocks get if each is new and hangs off the one before (a chunked store's
     * usual case), computed first so that the key map and mask slots they land in load while
     * the blocks before them are stored (AHEAD blocks ahead: a long event's prefetches issued
     * at once queue for the few line-fill buffers); a block that breaks the chain computes
     * its own. */
    uint8_t small_keys[64][CKEY_BYTES], small_locals[64][DYN_LOCAL];
    uint8_t(*keys)[CKEY_BYTES] = small_keys;
    uint8_t(*locals)[DYN_LOCAL] = small_locals;
    Py_ssize_t ahead = 0; /* blocks with a key computed ahead */
    if (rc == 0 && nb > 64) {
        keys = PyMem_Malloc((size_t)nb * CKEY_BYTES);
        locals = PyMem_Malloc((size_t)nb * DYN_LOCAL);
        if (keys == NULL || locals == NULL) {
            PyErr_NoMemory();
            rc = -1;
        }
    }
    off = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < nb; i++) {
        Py_ssize_t len = 4 * PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, i));
        const uint8_t *tok = (const uint8_t *)buf.buf + off;
        off += len;
        if (!len)
            break; /* a placeholder: the rest is keyed as it comes */
        if (t->dynamo) {
            put_be64(locals[i], XXH3_64bits_withSeed(tok, (size_t)len, seed));
            tok = locals[i];
            len = DYN_LOCAL;
        }
        if (c.haspk) {
            if (compute_key(t, i ? keys[i - 1] : c.pk, tok, len, 0, keys[i]) < 0) {
                rc = -1;
                break;
            }
        }
        ahead = i + 1;
    }
    Py_ssize_t keyed = c.haspk ? ahead : 0; /* blocks whose keys[] hold their key */
    uint8_t first_parent[CKEY_BYTES];
    memcpy(first_parent, c.pk, CKEY_BYTES);
    off = 0;
    PyObject **hs = rc == 0 ? PySequence_Fast_ITEMS(hashes) : NULL;
    for (Py_ssize_t i = 0; rc == 0 && i < AHEAD && i < nb; i++) {
        prefetch_key(t, hs, i, nb, NULL);
        if (i < keyed)
            prefetch_ckey(t, keys[i]);
    }
    for (Py_ssize_t i = 0; rc == 0 && i < nb; i++) {
        prefetch_key(t, hs, i + AHEAD, nb, NULL);
        if (i + AHEAD < keyed)
            prefetch_ckey(t, keys[i + AHEAD]);
        Py_ssize_t len = 4 * PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, i));
        const uint8_t *tok = (const uint8_t *)buf.buf + off;
        uint8_t local[DYN_LOCAL];
        long level;
        off += len;
        if (block_level(levels, i, one, &level) < 0) {
            rc = -1;
            break;
        }
        if (t->dynamo && len) {
            if (i < ahead)
                memcpy(local, locals[i], DYN_LOCAL);
            else
                put_be64(local, XXH3_64bits_withSeed(tok, (size_t)len, seed));
            tok = local;
            len = DYN_LOCAL;
        }
        c.pre_key = i < ahead && c.haspk ? keys[i] : NULL;
        c.pre_parent = i ? keys[i - 1] : first_parent;
        rc = store_block(t, &c, PySequence_Fast_GET_ITEM(hashes, i), level, tok, len, 0, NULL);
    }
    if (keys != small_keys)
        PyMem_Free(keys);
    if (locals != small_locals)
        PyMem_Free(locals);
    if (rc == 0 && (drop_bare_ghost(t, parent) < 0 || drop_bare_ghost(t, c.skipped) < 0))
        rc = -1;
    Py_XDECREF(hashes);
    Py_XDECREF(levels);
    Py_XDECREF(sizes);
    return rc;
}

static PyObject *
tok_store_tokens(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "store_tokens(parent_hash, hashes, level, tokens, sizes, seed, st)");
        return NULL;
    }
    Py_buffer buf;
    uint64_t seed = PyLong_AsUnsignedLongLongMask(args[5]);
    if (seed == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[3], &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = store_tokens_run(t, args[0], args[1], args[2], (const uint8_t *)buf.buf, buf.len,
                              args[4], seed);
    PyBuffer_Release(&buf);
    if (flush_counters(t, args[6]) < 0 || rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ keys out and in */

static inline PyObject *
ckey_bytes(Tab *t, int32_t n)
{
    return PyBytes_FromStringAndSize((const char *)CKEY(t, n), CKEY_BYTES);
}

/* n's pending (payload, scoped) (a new reference), None when it has none. */
static PyObject *
pending_of(Tab *t, int32_t n)
{
    if (!(ND(t, n)->flags & F_PENDING))
        Py_RETURN_NONE;
    PyObject *k = PyLong_FromLong(n);
    PyObject *v = k == NULL ? NULL : PyDict_GetItemWithError(t->pending, k);
    Py_XDECREF(k);
    if (v == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "a pending node without its payload");
    return Py_XNewRef(v);
}

static PyObject *
tok_key_of(Tab *t, PyObject *h)
{
    int32_t n = node_of(t, h);
    if (n == -2)
        return NULL;
    if (n < 0 || !(ND(t, n)->flags & F_KEYED))
        Py_RETURN_NONE;
    return ckey_bytes(t, n);
}

/* Every node as (hash, key or b"", pending payload or None), sorted by hash. */
static PyObject *
tok_keys(Tab *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < t->hw; i++) {
        int32_t n = (int32_t)i;
        if (!(ND(t, n)->flags & F_LIVE))
            continue;
        PyObject *h = key_bytes(t, n);
        PyObject *k = (ND(t, n)->flags & F_KEYED) ? ckey_bytes(t, n) : PyBytes_FromStringAndSize("", 0);
        PyObject *p = pending_of(t, n);
        PyObject *tup = h && k && p ? PyTuple_Pack(3, h, k, p) : NULL;
        Py_XDECREF(h);
        Py_XDECREF(k);
        Py_XDECREF(p);
        if (tup == NULL || PyList_Append(out, tup) < 0)
            Py_CLEAR(out);
        Py_XDECREF(tup);
    }
    if (out != NULL && PyList_Sort(out) < 0) /* hashes are unique: the first items decide */
        Py_CLEAR(out);
    return out;
}

/* (keys, pending) in dump_nodes order: each node's key (b"" when unknown), and (index,
 * payload, scoped) of every pending payload. */
static PyObject *
tok_dump_keys(Tab *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *keys = PyList_New(0), *pend = PyList_New(0);
    Py_ssize_t idx = 0;
    for (Py_ssize_t i = 0; keys != NULL && pend != NULL && i < t->hw; i++) {
        int32_t n = (int32_t)i;
        if (!(ND(t, n)->flags & F_LIVE))
            continue;
        PyObject *k = (ND(t, n)->flags & F_KEYED) ? ckey_bytes(t, n) : PyBytes_FromStringAndSize("", 0);
        int bad = k == NULL || PyList_Append(keys, k) < 0;
        Py_XDECREF(k);
        if (!bad && (ND(t, n)->flags & F_PENDING)) {
            PyObject *p = pending_of(t, n);
            PyObject *e = p == NULL ? NULL
                                    : Py_BuildValue("(nOO)", idx, PyTuple_GET_ITEM(p, 0),
                                                    PyTuple_GET_ITEM(p, 1));
            bad = e == NULL || PyList_Append(pend, e) < 0;
            Py_XDECREF(p);
            Py_XDECREF(e);
        }
        if (bad) {
            Py_CLEAR(keys);
            break;
        }
        idx++;
    }
    PyObject *out = keys && pend ? PyTuple_Pack(2, keys, pend) : NULL;
    Py_XDECREF(keys);
    Py_XDECREF(pend);
    return out;
}

/* Every cached, keyed block as (hash, parent's hash or None, key, refs), parents first. */
static PyObject *
tok_cached_blocks(Tab *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    Stack s = {0};
    int rc = out == NULL ? -1 : 0;
    for (Py_ssize_t i = t->hw - 1; rc == 0 && i >= 0; i--)
        if ((ND(t, i)->flags & F_LIVE) && ND(t, i)->parent < 0)
            rc = push(&s, (int32_t)i);
    while (rc == 0 && s.n) {
        int32_t n = s.v[--s.n];
        if (ND(t, n)->refs && (ND(t, n)->flags & F_KEYED)) {
            int32_t p = ND(t, n)->parent;
            PyObject *h = key_bytes(t, n);
            PyObject *ph = p >= 0 ? key_bytes(t, p) : Py_NewRef(Py_None);
            PyObject *k = ckey_bytes(t, n);
            PyObject *r = PyLong_FromUnsignedLongLong(ND(t, n)->refs);
            PyObject *tup = h && ph && k && r ? PyTuple_Pack(4, h, ph, k, r) : NULL;
            Py_XDECREF(h);
            Py_XDECREF(ph);
            Py_XDECREF(k);
            Py_XDECREF(r);
            if (tup == NULL || PyList_Append(out, tup) < 0)
                rc = -1;
            Py_XDECREF(tup);
        }
        if (rc == 0)
            rc = push_children(&s, t, n);
    }
    PyMem_Free(s.v);
    if (rc < 0)
        Py_CLEAR(out);
    return out;
}

static int
load_fail(Py_ssize_t i, const char *what)
{
    PyErr_Format(PyExc_ValueError, "node %zd %s", i, what);
    return -1;
}

/* load_keyed's keys and pending payloads onto the structure just loaded, checked. */
static int
load_keys(Tab *t, PyObject *keys, PyObject *pend, Py_ssize_t count)
{
    if (PySequence_Fast_GET_SIZE(keys) != count) {
        PyErr_Format(PyExc_ValueError, "%zd keys for %zd nodes", PySequence_Fast_GET_SIZE(keys),
                     count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
        if (!PyBytes_Check(k)) {
            PyErr_Format(PyExc_TypeError, "keys are bytes, not %.100s", Py_TYPE(k)->tp_name);
            return -1;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(k);
        if (!len)
            continue;
        if (len != CKEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "node %zd has a %zd-byte key", i, len);
            return -1;
        }
        if (set_key(t, (int32_t)i, (const uint8_t *)PyBytes_AS_STRING(k)) < 0)
            return -1;
    }
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(pend); j++) {
        Py_ssize_t i;
        PyObject *payload, *scoped;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(pend, j), "nSO:load_keyed", &i, &payload,
                              &scoped))
            return -1;
        if (i < 0 || i >= count || (ND(t, i)->flags & (F_KEYED | F_PENDING))) {
            PyErr_Format(PyExc_ValueError, "pending payload for node %zd is out of place", i);
            return -1;
        }
        int sc = PyObject_IsTrue(scoped);
        if (sc < 0 || set_pending(t, (int32_t)i, NULL, 0, sc, payload) < 0)
            return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        uint8_t f = ND(t, i)->flags;
        int32_t q = ND(t, i)->parent;
        int parent_keyed = q >= 0 && (ND(t, q)->flags & F_KEYED);
        if (ND(t, i)->refs && !(f & (F_KEYED | F_PENDING)))
            return load_fail(i, "is cached but has neither a key nor a payload");
        if ((f & F_KEYED) && q != ROOT && !parent_keyed)
            return load_fail(i, "has a key but its parent has none");
        if ((f & F_PENDING) && (q == ROOT || parent_keyed))
            return load_fail(i, "is pending under a keyed parent");
    }
    return 0;
}

static PyObject *
tok_load_keyed(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "load_keyed(nodes, keys, pending)");
        return NULL;
    }
    PyObject *nodes = PySequence_Fast(args[0], "load_keyed: nodes must be a sequence");
    PyObject *keys = nodes ? PySequence_Fast(args[1], "load_keyed: keys must be a sequence") : NULL;
    PyObject *pend = keys ? PySequence_Fast(args[2], "load_keyed: pending must be a sequence") : NULL;
    PyObject *masks = NULL;
    int rc = -1;
    if (pend != NULL) {
        Py_ssize_t count = load_structure(t, nodes, &masks);
        if (count >= 0 && load_keys(t, keys, pend, count) == 0) {
            rc = root_all(t, masks);
            masks = NULL; /* the table holds it now */
        }
    }
    Py_XDECREF(masks);
    Py_XDECREF(nodes);
    Py_XDECREF(keys);
    Py_XDECREF(pend);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ invariants (check()) */

static int
check_keys(Tab *t, int32_t n)
{
    uint8_t f = ND(t, n)->flags;
    int32_t q = ND(t, n)->parent;
    if (ND(t, n)->refs && !(f & (F_KEYED | F_PENDING))) {
        assert_fail("cached node without content", n);
        return -1;
    }
    if ((f & F_ROOTED) && !(f & F_KEYED)) {
        assert_fail("rooted node without a key", n);
        return -1;
    }
    if (f & F_KEYED) {
        uint64_t v;
        uint32_t frag = FRAG(ckey_hash(CKEY(t, n)));
        int listed = 0;
        for (KEYS_OF(t, frag, i, v))
            listed |= key_at(t, v, frag, CKEY(t, n)) == n;
        if ((f & F_PENDING) || !(q == ROOT || (q >= 0 && (ND(t, q)->flags & F_KEYED))) || !listed) {
            assert_fail("a key out of place (pending too, under no key, or not in the map)", n);
            return -1;
        }
    }
    else if ((f & F_PENDING) && !(q == UNKNOWN || (q >= 0 && !(ND(t, q)->flags & F_KEYED)))) {
        assert_fail("a pending node under a keyed parent", n);
        return -1;
    }
    return 0;
}

static int
check_key_counts(Tab *t)
{
    Py_ssize_t keyed = 0, pending = 0;
    for (Py_ssize_t n = 0; n < t->hw; n++) {
        keyed += (ND(t, n)->flags & (F_LIVE | F_KEYED)) == (F_LIVE | F_KEYED);
        pending += (ND(t, n)->flags & (F_LIVE | F_PENDING)) == (F_LIVE | F_PENDING);
    }
    if (keyed != t->keyed || keyed != t->kfill || pending != PyDict_GET_SIZE(t->pending)) {
        PyErr_Format(PyExc_AssertionError, "keys: %zd keyed, %zd counted, %zd in the map; "
                     "%zd pending, %zd payloads", keyed, t->keyed, t->kfill, pending,
                     PyDict_GET_SIZE(t->pending));
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ type */

static PyObject *
tok_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"bit", "dynamo", NULL};
    PyObject *bit;
    int dynamo = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|p:TokenTable", kwlist, &PyLong_Type, &bit,
                                     &dynamo))
        return NULL;
    Tab *t = tab_make(type, bit, CKEY_BYTES);
    if (t == NULL)
        return NULL;
    t->dynamo = dynamo;
    t->pending = PyDict_New();
    if (t->pending == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static PyObject *
tok_repr(Tab *t)
{
    return PyUnicode_FromFormat("<TokenTable nodes=%zd present=%zd pending=%zd (native)>", t->live,
                                t->present, PyDict_GET_SIZE(t->pending));
}

static PyObject *
get_dynamo(Tab *t, void *Py_UNUSED(c))
{
    return PyBool_FromLong(t->dynamo);
}

static PyGetSetDef tok_getset[] = {
    {"dynamo", (getter)get_dynamo, NULL, "Keys are Dynamo's (local hashes chained by XXH3).",
     NULL},
    {NULL},
};

static PyMethodDef tok_methods[] = {
    {"store_payloads", (PyCFunction)(void (*)(void))tok_store_payloads, METH_FASTCALL,
     "Apply a stored event given each block's payload (b\"\": no tokens) and scope."},
    {"store_tokens", (PyCFunction)(void (*)(void))tok_store_tokens, METH_FASTCALL,
     "Apply a stored event of plain blocks from their u32 LE token ids and sizes."},
    {"key_of", (PyCFunction)tok_key_of, METH_O, "The canonical key of a block (None: unknown)."},
    {"keys", (PyCFunction)tok_keys, METH_NOARGS, "Every node's (hash, key, pending), sorted."},
    {"dump_keys", (PyCFunction)tok_dump_keys, METH_NOARGS, "(keys, pending) in dump order."},
    {"cached_blocks", (PyCFunction)tok_cached_blocks, METH_NOARGS,
     "Every cached keyed block as (hash, parent hash, key, refs), parents first."},
    {"load_keyed", (PyCFunction)(void (*)(void))tok_load_keyed, METH_FASTCALL,
     "Replace the contents: load_nodes() plus dump_keys() output."},
    {NULL},
};

static PyTypeObject TokTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream._native._index.TokenTable",
    .tp_doc = "The blocks of one (worker, layer group) under canonical keys, native "
              "(see kvstream.index.token_table).",
    .tp_basicsize = sizeof(Tab),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = tok_new,
    .tp_repr = (reprfunc)tok_repr,
    .tp_methods = tok_methods,
    .tp_getset = tok_getset,
};

static int
tokens_ready(void)
{
    TokTableType.tp_base = &TabType;
    TokTableType.tp_traverse = (traverseproc)tab_traverse;
    TokTableType.tp_clear = (inquiry)tab_clear_refs;
    TokTableType.tp_dealloc = (destructor)tab_dealloc;
    b3p_use_simd(1);
    b3p_context_key(KEY_CONTEXT, scoped_key_words);
    return PyType_Ready(&TokTableType);
}
