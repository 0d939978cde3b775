/* kvstream._native._index: the index's block table as a native type that owns its state.
 *
 * GroupTable has kvstream.index.table.GroupTable's interface and semantics (DESIGN §7: packed
 * per-tier reference counts, ghosts, rooted blocks mirrored into a domain's masks); the Python
 * class stays as its pure-Python twin and the parity tests run both on the same operations.
 *
 * Layout, no Python object per node: one record per node id (parent, first child, next and
 * previous sibling as int32, packed refs as uint64, a flags byte: live and rooted, the key
 * length), the block hash inline after it in ``kw`` bytes (kw grows to the longest hash
 * seen), and an open-addressing map hash -> node id (int32 slots,
 * linear probing, deletion by backward shift). Freed node ids are reused (LIFO).
 *
 * Mask mirroring goes through the masks object's public ``add``/``discard``/``reserve``
 * methods (MaskMap contract, kvstream.index.domain): this file reads no other object's
 * private state. Counters go to the SourceStats' public fields, once per call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROOT (-1)
#define UNKNOWN (-2)
#define NIL (-1)
#define MAX_TIERS 4
#define LAST (MAX_TIERS - 1)
#define FIELD 0xFFFFull
#define F_LIVE 2
#define F_ROOTED 1
#define F_KEYED 4   /* token-keyed tables: the node has its canonical key */
#define F_PENDING 8 /* token-keyed tables: its payload waits for the parent's key */
#define CKEY_BYTES 16
/* Map slots: the node id in the low 32 bits, the high 32 bits of its key's hash above them (the
 * probe start and a filter: a probe reads a node's record only when those bits agree). */
#define MAP_EMPTY UINT64_MAX
#define SLOT(frag, id) (((uint64_t)(frag) << 32) | (uint32_t)(id))
#define SLOT_ID(v) ((int32_t)(uint32_t)(v))
#define SLOT_FRAG(v) ((uint32_t)((v) >> 32))
#define FRAG(h) ((uint32_t)((h) >> 32))
#define MAX_KEY 255

static PyObject *s_add, *s_discard, *s_reserve, *s_get, *s_block_hash, *s_cache_level;

enum {
    C_UNKNOWN_PARENT,
    C_PARENT_MISMATCH,
    C_DUPLICATE,
    C_SATURATED,
    C_UNKNOWN_REMOVE,
    C_TIER_MISMATCH,
    C_REFCOUNTED_REMOVE,
    C_UNKNOWN_UPDATE,
    C_TOKENLESS_RESOLVED,
    C_TOKENLESS_SKIPPED,
    C_N
};
static const char *counter_names[C_N] = {
    "unknown_parent_stores", "parent_mismatches", "duplicate_stores", "refcount_saturated",
    "unknown_removes",       "tier_mismatches",   "refcounted_removes", "unknown_updates",
    "tokenless_resolved",    "tokenless_skipped",
};
static PyObject *counter_str[C_N];

typedef struct {
    PyObject_HEAD
    PyObject *bit;       /* the worker's bit (an int: 1 << slot) */
    PyObject *slot_obj;  /* slot as an int */
    Py_ssize_t slot;
    PyObject *masks;     /* the domain's masks (NULL: detached) */
    uint8_t *nodes;      /* cap records of ``stride`` bytes: a Node, [ck bytes of canonical
                          * key,] then kw bytes of block hash */
    Py_ssize_t kw;       /* bytes per key slot */
    Py_ssize_t stride;   /* NODE_HDR + ck + kw, rounded up to 2 */
    Py_ssize_t hw, cap;  /* node ids used so far (high water), allocated */
    int32_t *freel;
    Py_ssize_t nfree, freecap;
    uint64_t *map;
    Py_ssize_t mcap, mfill; /* slots; used slots */
    Py_ssize_t live, present, lower, rooted;
    Py_ssize_t counters[C_N];
    /* token-keyed tables only (index_tokens.h; ck == 0 in an engine-keyed one): each record
     * holds the node's canonical key (ck bytes) before its hash, a multimap key -> nodes
     * lists every keyed node, and payloads waiting for a parent's key live in ``pending`` */
    Py_ssize_t ck;
    int dynamo;
    uint64_t *kmap;
    Py_ssize_t kcap, kfill, keyed;
    PyObject *pending; /* dict: node id -> (payload bytes, scoped bool) */
} Tab;

static PyTypeObject TabType;

/* One node's record (its key follows it): one cache line or two per node visited, where
 * parallel arrays would touch one per field. Packed: records are 2-byte aligned. */
typedef struct __attribute__((packed)) {
    int32_t parent, kid, next, prev;
    uint64_t refs;
    uint8_t flags, klen;
} Node;
#define NODE_HDR ((Py_ssize_t)sizeof(Node))
#define ND(t, n) ((Node *)((t)->nodes + (size_t)(n) * (size_t)(t)->stride))

#include "py_pairs.h"
#include "index_masks.h"

/* ------------------------------------------------------------------ keys and the map */

static inline uint64_t
mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static inline uint64_t
key_hash(const uint8_t *k, Py_ssize_t n)
{
    uint64_t h = (uint64_t)n * 0x9e3779b97f4a7c15ull;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, k + i, 8);
        h = mix(h ^ w);
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, k + i, (size_t)(n - i));
        h = mix(h ^ w ^ 0x1ull);
    }
    return mix(h);
}

#define KEY(t, n) ((t)->nodes + (size_t)(n) * (size_t)(t)->stride + NODE_HDR + (t)->ck)
#define CKEY(t, n) ((t)->nodes + (size_t)(n) * (size_t)(t)->stride + NODE_HDR)

static inline int
key_eq(Tab *t, int32_t n, const uint8_t *k, Py_ssize_t len)
{
    return ND(t, n)->klen == len && bytes_eq(KEY(t, n), k, len);
}

/* Node id of key k (-1 when absent). */
static inline int32_t
find(Tab *t, const uint8_t *k, Py_ssize_t len)
{
    if (!t->mcap || len > t->kw)
        return -1;
    size_t mask = (size_t)t->mcap - 1;
    uint32_t frag = FRAG(key_hash(k, len));
    for (size_t i = frag & mask;; i = (i + 1) & mask) {
        uint64_t v = t->map[i];
        if (v == MAP_EMPTY)
            return -1;
        if (SLOT_FRAG(v) == frag && key_eq(t, SLOT_ID(v), k, len))
            return SLOT_ID(v);
    }
}

/* Open-addressing maps of node ids (SLOT()s, linear probing, at most 3/4 full, deletion by
 * backward shift): the hash -> node map, and in token-keyed tables the key -> nodes multimap.
 * ``hf`` says what a slot's node is filed under. */
typedef uint64_t (*node_hash_fn)(Tab *t, int32_t n);
typedef struct {
    uint64_t **v;
    Py_ssize_t *cap, *fill;
    node_hash_fn hf;
    uint8_t flag; /* the nodes filed: F_LIVE (every node) or F_KEYED */
} OMap;

static inline uint64_t
hash_of_id(Tab *t, int32_t n)
{
    return key_hash(KEY(t, n), ND(t, n)->klen);
}

static inline uint64_t
ckey_hash(const uint8_t *k)
{
    uint64_t a, b;
    memcpy(&a, k, 8);
    memcpy(&b, k + 8, 8);
    return mix(a ^ (b * 0x9e3779b97f4a7c15ull));
}

static inline uint64_t
hash_of_ckey(Tab *t, int32_t n)
{
    return ckey_hash(CKEY(t, n));
}

#define IDMAP(t) ((OMap){&(t)->map, &(t)->mcap, &(t)->mfill, hash_of_id, F_LIVE})
#define KEYMAP(t) ((OMap){&(t)->kmap, &(t)->kcap, &(t)->kfill, hash_of_ckey, F_KEYED})

static int
om_rebuild(Tab *t, OMap m, Py_ssize_t cap)
{
    uint64_t *v = PyMem_Malloc((size_t)cap * sizeof(uint64_t));
    if (v == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(v, 0xFF, (size_t)cap * sizeof(uint64_t)); /* MAP_EMPTY */
    size_t mask = (size_t)cap - 1;
    Py_ssize_t fill = 0;
    for (Py_ssize_t n = 0; n < t->hw; n++) {
        if (!(ND(t, n)->flags & m.flag))
            continue;
        uint32_t frag = FRAG(m.hf(t, (int32_t)n));
        size_t i = frag & mask;
        while (v[i] != MAP_EMPTY)
            i = (i + 1) & mask;
        v[i] = SLOT(frag, n);
        fill++;
    }
    PyMem_Free(*m.v);
    *m.v = v;
    *m.cap = cap;
    *m.fill = fill;
    return 0;
}

/* Room for one more node in the map (``count`` filed now); rebuilt at most half full. */
static int
om_room(Tab *t, OMap m, Py_ssize_t count)
{
    if ((*m.fill + 1) * 4 <= *m.cap * 3)
        return 0;
    Py_ssize_t cap = 16;
    while ((count + 1) * 2 > cap)
        cap *= 2;
    return om_rebuild(t, m, cap);
}

static void
om_insert(Tab *t, OMap m, int32_t n)
{
    uint64_t *v = *m.v;
    size_t mask = (size_t)*m.cap - 1;
    uint32_t frag = FRAG(m.hf(t, n));
    size_t i = frag & mask;
    while (v[i] != MAP_EMPTY)
        i = (i + 1) & mask;
    (*m.fill)++;
    v[i] = SLOT(frag, n);
}

/* Take node n out of the map by backward shift (no tombstones: probe runs stay short however
 * many keys come and go; a slot's home comes from its own bits, no node is read). */
static void
om_delete(Tab *t, OMap m, int32_t n)
{
    uint64_t *v = *m.v;
    size_t mask = (size_t)*m.cap - 1;
    size_t i = FRAG(m.hf(t, n)) & mask;
    while (SLOT_ID(v[i]) != n || v[i] == MAP_EMPTY)
        i = (i + 1) & mask;
    for (size_t j = (i + 1) & mask; v[j] != MAP_EMPTY; j = (j + 1) & mask) {
        uint64_t w = v[j];
        size_t home = SLOT_FRAG(w) & mask;
        if (i <= j ? (home > i && home <= j) : (home > i || home <= j))
            continue; /* its probe run starts after the hole: it stays */
        v[i] = w;
        i = j;
    }
    v[i] = MAP_EMPTY;
    (*m.fill)--;
}

/* Iterate the slots of canonical key k's probe run in a token-keyed table (frag: FRAG of its
 * hash): for (KEYS_OF(t, frag, i, v)) if (key_at(t, v, frag, k) >= 0) ... */
#define KEYS_OF(t, frag, i, v)                                                               \
    size_t i = (t)->kcap ? (size_t)(frag) & ((size_t)(t)->kcap - 1) : 0;                     \
    (t)->kcap && ((v) = (t)->kmap[i]) != MAP_EMPTY;                                          \
    i = (i + 1) & ((size_t)(t)->kcap - 1)

/* The node of slot v when it holds key k (frag: its hash bits), else -1. */
static inline int32_t
key_at(Tab *t, uint64_t v, uint32_t frag, const uint8_t *k)
{
    return SLOT_FRAG(v) == frag && bytes_eq(CKEY(t, SLOT_ID(v)), k, CKEY_BYTES) ? SLOT_ID(v) : -1;
}

/* The packed refs of the rooted nodes holding key k, or-ed (*any: one is rooted). */
static inline uint64_t
key_refs(Tab *t, const uint8_t *k, int *any)
{
    uint64_t r = 0, v;
    uint32_t frag = FRAG(ckey_hash(k));
    *any = 0;
    for (KEYS_OF(t, frag, i, v)) {
        int32_t n = key_at(t, v, frag, k);
        if (n >= 0 && (ND(t, n)->flags & F_ROOTED)) {
            r |= ND(t, n)->refs;
            *any = 1;
        }
    }
    return r;
}

/* True when a rooted node other than n holds n's key (its mask bit must stay). */
static inline int
shared_rooted(Tab *t, int32_t n)
{
    const uint8_t *k = CKEY(t, n);
    uint32_t frag = FRAG(ckey_hash(k));
    uint64_t v;
    for (KEYS_OF(t, frag, i, v)) {
        int32_t x = key_at(t, v, frag, k);
        if (x >= 0 && x != n && (ND(t, x)->flags & F_ROOTED))
            return 1;
    }
    return 0;
}

#define map_room(t) om_room((t), IDMAP(t), (t)->live)
#define map_insert(t, n) om_insert((t), IDMAP(t), (n))
#define map_delete(t, n) om_delete((t), IDMAP(t), (n))

#define AHEAD 8

/* Start loading the probe run that begins at p: its line and the next one (a run in a map up
 * to 3/4 full often crosses a line). */
static inline void
prefetch_run(const void *p)
{
    __builtin_prefetch(p);
    __builtin_prefetch((const char *)p + 64);
}

/* Start loading the map slot (and the masks' slot, when native) where hs[i]'s probe begins:
 * the loops touch keys ahead, so the cache misses of random hashes overlap. */
static inline void
prefetch_key(Tab *t, PyObject **hs, Py_ssize_t i, Py_ssize_t end, PyTypeObject *mmtype)
{
    if (i >= end || !PyBytes_Check(hs[i]))
        return;
    Py_ssize_t len = PyBytes_GET_SIZE(hs[i]);
    uint64_t h = key_hash((const uint8_t *)PyBytes_AS_STRING(hs[i]), len);
    if (t->mcap)
        prefetch_run(&t->map[FRAG(h) & ((uint64_t)t->mcap - 1)]);
    if (mmtype != NULL && t->masks != NULL && Py_TYPE(t->masks) == mmtype) {
        MM *m = (MM *)t->masks;
        if (m->cap)
            prefetch_run(MM_SLOT(m, h & ((uint64_t)m->cap - 1)));
    }
}

/* ------------------------------------------------------------------ node storage */

static void
nodes_free(Tab *t)
{
    PyMem_Free(t->nodes);
    PyMem_Free(t->freel);
    PyMem_Free(t->map);
    PyMem_Free(t->kmap);
    t->nodes = NULL;
    t->freel = NULL;
    t->map = t->kmap = NULL;
    t->hw = t->cap = t->nfree = t->freecap = t->mcap = t->mfill = 0;
    t->kcap = t->kfill = t->keyed = 0;
    t->live = t->present = t->lower = t->rooted = 0;
    t->kw = 8;
    t->stride = NODE_HDR + t->ck + 8;
    if (t->pending != NULL)
        PyDict_Clear(t->pending);
}

#define GROW(ptr, type, n)                                                   \
    do {                                                                     \
        type *p_ = PyMem_Realloc((ptr), (size_t)(n) * sizeof(type));        \
        if (p_ == NULL) {                                                    \
            PyErr_NoMemory();                                                \
            return -1;                                                       \
        }                                                                    \
        (ptr) = p_;                                                          \
    } while (0)

static int
nodes_grow(Tab *t, Py_ssize_t want)
{
    if (want <= t->cap)
        return 0;
    Py_ssize_t cap = t->cap ? t->cap : 64;
    while (cap < want) /* grow by a quarter: less idle room in a table that stopped growing */
        cap += cap >> 2;
    if (cap > INT32_MAX) {
        if (want > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "a GroupTable holds at most 2**31-1 nodes");
            return -1;
        }
        cap = INT32_MAX;
    }
    GROW(t->nodes, uint8_t, cap * t->stride);
    t->cap = cap;
    return 0;
}

/* Widen every key slot to ``kw`` bytes (a longer hash than any so far). */
static int
keys_widen(Tab *t, Py_ssize_t kw)
{
    Py_ssize_t stride = (NODE_HDR + t->ck + kw + 1) & ~(Py_ssize_t)1;
    uint8_t *k = PyMem_Calloc((size_t)(t->cap ? t->cap : 1), (size_t)stride);
    if (k == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t n = 0; n < t->hw; n++)
        memcpy(k + (size_t)n * (size_t)stride, ND(t, n), (size_t)(NODE_HDR + t->ck + t->kw));
    PyMem_Free(t->nodes);
    t->nodes = k;
    t->kw = kw;
    t->stride = stride;
    return 0;
}

/* Check a hash argument: bytes of at most MAX_KEY bytes. */
static inline int
key_arg(PyObject *h, const uint8_t **k, Py_ssize_t *len)
{
    if (!PyBytes_Check(h)) {
        PyErr_Format(PyExc_TypeError, "block hashes are bytes, not %.100s", Py_TYPE(h)->tp_name);
        return -1;
    }
    *len = PyBytes_GET_SIZE(h);
    if (*len > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "block hashes are at most %d bytes, got %zd", MAX_KEY, *len);
        return -1;
    }
    *k = (const uint8_t *)PyBytes_AS_STRING(h);
    return 0;
}

/* A new node for key k under parent p (refs 0, unrooted, no children); -1 on error. */
static int32_t
alloc_node(Tab *t, const uint8_t *k, Py_ssize_t len, int32_t p)
{
    if (len > t->kw && keys_widen(t, len) < 0)
        return -1;
    if (map_room(t) < 0)
        return -1;
    int32_t n;
    if (t->nfree)
        n = t->freel[--t->nfree];
    else {
        if (nodes_grow(t, t->hw + 1) < 0)
            return -1;
        n = (int32_t)t->hw++;
    }
    ND(t, n)->parent = p;
    ND(t, n)->kid = NIL;
    ND(t, n)->next = ND(t, n)->prev = NIL;
    ND(t, n)->refs = 0;
    ND(t, n)->flags = F_LIVE;
    ND(t, n)->klen = (uint8_t)len;
    memcpy(KEY(t, n), k, (size_t)len);
    t->live++;
    map_insert(t, n);
    return n;
}

static inline PyObject *
key_bytes(Tab *t, int32_t n)
{
    return PyBytes_FromStringAndSize((const char *)KEY(t, n), ND(t, n)->klen);
}

static void
link_child(Tab *t, int32_t n, int32_t p)
{
    int32_t f = ND(t, p)->kid;
    ND(t, n)->prev = NIL;
    ND(t, n)->next = f;
    if (f >= 0)
        ND(t, f)->prev = n;
    ND(t, p)->kid = n;
}

static void
unlink_child(Tab *t, int32_t n)
{
    int32_t p = ND(t, n)->parent;
    if (p < 0)
        return;
    int32_t a = ND(t, n)->prev, b = ND(t, n)->next;
    if (a >= 0)
        ND(t, a)->next = b;
    else if (ND(t, p)->kid == n)
        ND(t, p)->kid = b;
    if (b >= 0)
        ND(t, b)->prev = a;
    ND(t, n)->prev = ND(t, n)->next = NIL;
}

/* ------------------------------------------------------------------ masks */

static int
mask_call(Tab *t, PyObject *name, PyObject *key)
{
    if (Py_TYPE(t->masks) == &MMType) {
        const uint8_t *k;
        Py_ssize_t len;
        if (mm_key_arg(key, &k, &len) < 0)
            return -1;
        if (name == s_add)
            return mm_add((MM *)t->masks, k, len, t->slot);
        mm_discard((MM *)t->masks, k, len, t->slot);
        return 0;
    }
    PyObject *args[3] = {t->masks, key, t->slot_obj};
    PyObject *r = PyObject_VectorcallMethod(name, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Mirror node n (key object ``key`` when the caller has it, else built) into the masks. */
static int
mask_node(Tab *t, PyObject *name, int32_t n, PyObject *key)
{
    if (t->masks == NULL)
        return 0;
    if (t->ck) { /* token-keyed: the canonical key, kept while another rooted node holds it */
        if (name == s_discard && shared_rooted(t, n))
            return 0;
        if (Py_TYPE(t->masks) == &MMType) {
            if (name == s_add)
                return mm_add((MM *)t->masks, CKEY(t, n), CKEY_BYTES, t->slot);
            mm_discard((MM *)t->masks, CKEY(t, n), CKEY_BYTES, t->slot);
            return 0;
        }
        PyObject *k = PyBytes_FromStringAndSize((const char *)CKEY(t, n), CKEY_BYTES);
        if (k == NULL)
            return -1;
        int rc = mask_call(t, name, k);
        Py_DECREF(k);
        return rc;
    }
    if (Py_TYPE(t->masks) == &MMType) { /* the native map: keys straight from the arena */
        if (name == s_add)
            return mm_add((MM *)t->masks, KEY(t, n), ND(t, n)->klen, t->slot);
        mm_discard((MM *)t->masks, KEY(t, n), ND(t, n)->klen, t->slot);
        return 0;
    }
    if (key != NULL)
        return mask_call(t, name, key);
    PyObject *k = key_bytes(t, n);
    if (k == NULL)
        return -1;
    int rc = mask_call(t, name, k);
    Py_DECREF(k);
    return rc;
}

/* ------------------------------------------------------------------ semantics */

static inline int
tier_of(long level)
{
    return level < LAST ? (int)level : LAST;
}

static int
deepest(uint64_t r)
{
    for (int t = LAST; t >= 0; t--)
        if ((r >> (16 * t)) & FIELD)
            return t;
    return -1;
}

static int
best_tier(uint64_t r)
{
    for (int t = 0; t < MAX_TIERS; t++)
        if ((r >> (16 * t)) & FIELD)
            return t;
    return -1;
}

static inline void
set_refs(Tab *t, int32_t n, uint64_t old, uint64_t new)
{
    ND(t, n)->refs = new;
    t->present += (new != 0) - (old != 0);
    t->lower += (new != 0 && !(new & FIELD)) - (old != 0 && !(old & FIELD));
}

static inline void
set_rooted(Tab *t, int32_t n, int on)
{
    if (on && !(ND(t, n)->flags & F_ROOTED)) {
        ND(t, n)->flags |= F_ROOTED;
        t->rooted++;
    }
    else if (!on && (ND(t, n)->flags & F_ROOTED)) {
        ND(t, n)->flags &= (uint8_t)~F_ROOTED;
        t->rooted--;
    }
}

#define ROOTED(t, n) (ND(t, n)->flags & F_ROOTED)

/* A growable stack of node ids (subtree walks). */
typedef struct {
    int32_t *v;
    Py_ssize_t n, cap;
} Stack;

static int
push(Stack *s, int32_t x)
{
    if (s->n == s->cap) {
        Py_ssize_t cap = s->cap ? s->cap * 2 : 64;
        int32_t *v = PyMem_Realloc(s->v, (size_t)cap * sizeof(int32_t));
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
    return 0;
}

static int
push_children(Stack *s, Tab *t, int32_t x)
{
    for (int32_t c = ND(t, x)->kid; c >= 0; c = ND(t, c)->next)
        if (push(s, c) < 0)
            return -1;
    return 0;
}

static int
root_subtree(Tab *t, int32_t n)
{
    Stack s = {0};
    int rc = push(&s, n);
    while (rc == 0 && s.n) {
        int32_t x = s.v[--s.n];
        if (ROOTED(t, x) || !ND(t, x)->refs)
            continue;
        set_rooted(t, x, 1);
        if (mask_node(t, s_add, x, NULL) < 0 || push_children(&s, t, x) < 0)
            rc = -1;
    }
    PyMem_Free(s.v);
    return rc;
}

static int
unroot_subtree(Tab *t, int32_t n)
{
    Stack s = {0};
    int rc = push(&s, n);
    while (rc == 0 && s.n) {
        int32_t x = s.v[--s.n];
        if (!ROOTED(t, x))
            continue;
        set_rooted(t, x, 0);
        if (mask_node(t, s_discard, x, NULL) < 0 || push_children(&s, t, x) < 0)
            rc = -1;
    }
    PyMem_Free(s.v);
    return rc;
}

/* True when n is p or one of p's ancestors. */
static int
is_ancestor(Tab *t, int32_t n, int32_t p)
{
    int32_t x = p;
    for (Py_ssize_t i = 0; i <= t->hw; i++) {
        if (x == n)
            return 1;
        if (x < 0)
            return 0;
        x = ND(t, x)->parent;
    }
    return 1;
}

/* Put node n on the free list (grown on demand: a table that never deletes keeps none). When
 * the list cannot grow, n stays unused: the table stays consistent, the id is not reused. */
static void
push_free(Tab *t, int32_t n)
{
    if (t->nfree == t->freecap) {
        Py_ssize_t cap = t->freecap ? t->freecap * 2 : 64;
        int32_t *f = PyMem_Realloc(t->freel, (size_t)cap * sizeof(int32_t));
        if (f == NULL)
            return;
        t->freel = f;
        t->freecap = cap;
    }
    t->freel[t->nfree++] = n;
}

/* Forget node n's canonical key or pending payload (token-keyed tables). */
static void
drop_key(Tab *t, int32_t n)
{
    uint8_t f = ND(t, n)->flags;
    if (f & F_KEYED) {
        om_delete(t, KEYMAP(t), n);
        t->keyed--;
    }
    if (f & F_PENDING) {
        PyObject *k = PyLong_FromLong(n);
        if (k == NULL || PyDict_DelItem(t->pending, k) < 0)
            PyErr_Clear(); /* only on a failed allocation: the entry is ignored once unflagged */
        Py_XDECREF(k);
    }
    ND(t, n)->flags = f & (uint8_t) ~(F_KEYED | F_PENDING);
}

/* Delete childless non-present n, then any ghost ancestors it leaves childless. */
static void
delete_up(Tab *t, int32_t n)
{
    for (;;) {
        int32_t p = ND(t, n)->parent;
        unlink_child(t, n);
        map_delete(t, n);
        if (t->ck)
            drop_key(t, n);
        ND(t, n)->flags = 0;
        ND(t, n)->klen = 0;
        ND(t, n)->parent = UNKNOWN;
        t->live--;
        push_free(t, n);
        if (p < 0 || ND(t, p)->refs || ND(t, p)->kid >= 0)
            return;
        n = p;
    }
}

static void
adopt_parent(Tab *t, int32_t n, int32_t p)
{
    int32_t q = ND(t, n)->parent;
    if (q == UNKNOWN) {
        if (p >= 0 && is_ancestor(t, n, p))
            t->counters[C_PARENT_MISMATCH]++;
        else {
            ND(t, n)->parent = p;
            if (p >= 0)
                link_child(t, n, p);
        }
    }
    else if (q != p)
        t->counters[C_PARENT_MISMATCH]++;
}

static int
store_existing(Tab *t, int32_t n, int32_t p, long level)
{
    uint64_t r = ND(t, n)->refs;
    int shift = 16 * tier_of(level);
    if (r) {
        t->counters[C_DUPLICATE]++;
        if (ND(t, n)->parent != p)
            t->counters[C_PARENT_MISMATCH]++;
        if (((r >> shift) & FIELD) == FIELD) {
            t->counters[C_SATURATED]++;
            return 0;
        }
        set_refs(t, n, r, r + (1ull << shift));
        return 0;
    }
    adopt_parent(t, n, p);
    set_refs(t, n, 0, 1ull << shift);
    int32_t q = ND(t, n)->parent;
    if (q == ROOT || (q >= 0 && ROOTED(t, q)))
        return root_subtree(t, n);
    return 0;
}

/* A store's parent: *p and *ok (rooted); -1 on error. */
static int
store_parent(Tab *t, PyObject *parent_hash, int32_t *p, int *ok)
{
    if (parent_hash == Py_None) {
        *p = ROOT;
        *ok = 1;
        return 0;
    }
    const uint8_t *k;
    Py_ssize_t len;
    if (key_arg(parent_hash, &k, &len) < 0)
        return -1;
    int32_t q = find(t, k, len);
    if (q < 0) {
        t->counters[C_UNKNOWN_PARENT]++;
        q = alloc_node(t, k, len, UNKNOWN);
        if (q < 0)
            return -1;
        *p = q;
        *ok = 0;
        return 0;
    }
    if (!ND(t, q)->refs)
        t->counters[C_UNKNOWN_PARENT]++;
    *p = q;
    *ok = ROOTED(t, q) ? 1 : 0;
    return 0;
}

static int
flush_counters(Tab *t, PyObject *st)
{
    int rc = 0;
    for (int i = 0; i < C_N; i++) {
        Py_ssize_t c = t->counters[i];
        if (!c)
            continue;
        t->counters[i] = 0;
        if (rc < 0)
            continue;
        PyObject *v = PyObject_GetAttr(st, counter_str[i]);
        if (v == NULL) {
            rc = -1;
            continue;
        }
        PyObject *d = PyLong_FromSsize_t(c);
        PyObject *s = d == NULL ? NULL : PyNumber_Add(v, d);
        Py_DECREF(v);
        Py_XDECREF(d);
        if (s == NULL || PyObject_SetAttr(st, counter_str[i], s) < 0)
            rc = -1;
        Py_XDECREF(s);
    }
    return rc;
}

static int
level_arg(PyObject *o, long *level)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "cache levels are >= 0, got %ld", v);
        return -1;
    }
    *level = v;
    return 0;
}

/* The store loop: hashes (a sequence of bytes) with one level or a level per block. */
static int
do_store(Tab *t, PyObject *parent_hash, PyObject *hashes, PyObject *levels_seq, long one_level)
{
    int32_t p;
    int ok;
    if (store_parent(t, parent_hash, &p, &ok) < 0)
        return -1;
    Py_ssize_t end = PySequence_Fast_GET_SIZE(hashes);
    PyObject **hs = PySequence_Fast_ITEMS(hashes);
    if (levels_seq != NULL && PySequence_Fast_GET_SIZE(levels_seq) != end) {
        PyErr_SetString(PyExc_ValueError, "store: one cache level per block hash");
        return -1;
    }
    for (Py_ssize_t i = 0; i < AHEAD && i < end; i++)
        prefetch_key(t, hs, i, end, &MMType);
    for (Py_ssize_t i = 0; i < end; i++) {
        prefetch_key(t, hs, i + AHEAD, end, &MMType);
        long c = one_level;
        if (levels_seq != NULL && level_arg(PySequence_Fast_GET_ITEM(levels_seq, i), &c) < 0)
            return -1;
        const uint8_t *k;
        Py_ssize_t len;
        if (key_arg(hs[i], &k, &len) < 0)
            return -1;
        int32_t n = find(t, k, len);
        if (n >= 0) {
            if (store_existing(t, n, p, c) < 0)
                return -1;
            ok = ROOTED(t, n) ? 1 : 0;
            p = n;
            continue;
        }
        n = alloc_node(t, k, len, p);
        if (n < 0)
            return -1;
        if (p >= 0)
            link_child(t, n, p);
        set_refs(t, n, 0, 1ull << (16 * tier_of(c)));
        if (ok) {
            set_rooted(t, n, 1);
            if (mask_node(t, s_add, n, hs[i]) < 0)
                return -1;
        }
        p = n;
    }
    /* drop the store's parent when it is a ghost left without children */
    if (parent_hash != Py_None) {
        const uint8_t *k;
        Py_ssize_t len;
        if (key_arg(parent_hash, &k, &len) < 0)
            return -1;
        int32_t q = find(t, k, len);
        if (q >= 0 && !ND(t, q)->refs && ND(t, q)->kid < 0)
            delete_up(t, q);
    }
    return 0;
}

/* ------------------------------------------------------------------ Python methods */

/* store_hashes' work; the counters stay in t (flush_counters). 0, or -1 with an exception. */
static int
store_hashes_run(Tab *t, PyObject *parent, PyObject *hs_arg, PyObject *lv_arg)
{
    if (t->ck) {
        PyErr_SetString(PyExc_TypeError,
                        "a token-keyed table needs the stored blocks' tokens: call store()");
        return -1;
    }
    PyObject *hashes = PySequence_Fast(hs_arg, "store_hashes: hashes must be a sequence");
    if (hashes == NULL)
        return -1;
    PyObject *levels = NULL;
    long one = 0;
    int rc;
    if (PyLong_Check(lv_arg))
        rc = level_arg(lv_arg, &one);
    else {
        levels = PySequence_Fast(lv_arg, "store_hashes: level is an int or a sequence");
        rc = levels == NULL ? -1 : 0;
    }
    if (rc == 0)
        rc = do_store(t, parent, hashes, levels, one);
    Py_DECREF(hashes);
    Py_XDECREF(levels);
    return rc;
}

static PyObject *
tab_store_hashes(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "store_hashes(parent_hash, hashes, level, st)");
        return NULL;
    }
    int rc = store_hashes_run(t, args[0], args[1], args[2]);
    if (flush_counters(t, args[3]) < 0 || rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
tab_store(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "store(parent_hash, blocks, st)");
        return NULL;
    }
    PyObject *blocks = PySequence_Fast(args[1], "store: blocks must be a sequence");
    if (blocks == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    PyObject *hashes = PyList_New(n), *levels = PyList_New(n);
    PyObject *r = NULL;
    if (hashes == NULL || levels == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PySequence_Fast_GET_ITEM(blocks, i);
        PyObject *h = PyObject_GetAttr(b, s_block_hash);
        if (h == NULL)
            goto done;
        PyList_SET_ITEM(hashes, i, h);
        PyObject *c = PyObject_GetAttr(b, s_cache_level);
        if (c == NULL)
            goto done;
        PyList_SET_ITEM(levels, i, c);
    }
    PyObject *a[4] = {args[0], hashes, levels, args[2]};
    r = tab_store_hashes(t, a, 4);
done:
    Py_DECREF(blocks);
    Py_XDECREF(hashes);
    Py_XDECREF(levels);
    return r;
}

static int
remove_one(Tab *t, PyObject *h, int has_level, long level)
{
    const uint8_t *k;
    Py_ssize_t len;
    if (key_arg(h, &k, &len) < 0)
        return -1;
    int32_t n = find(t, k, len);
    uint64_t r = n < 0 ? 0 : ND(t, n)->refs;
    if (!r) {
        t->counters[C_UNKNOWN_REMOVE]++;
        return 0;
    }
    int tier;
    if (!has_level)
        tier = (r >> 16) ? deepest(r) : 0;
    else {
        tier = tier_of(level);
        if (!((r >> (16 * tier)) & FIELD)) {
            t->counters[C_TIER_MISMATCH]++;
            tier = deepest(r);
        }
    }
    uint64_t new = r - (1ull << (16 * tier));
    if (new) {
        t->counters[C_REFCOUNTED_REMOVE]++;
        set_refs(t, n, r, new);
        return 0;
    }
    set_refs(t, n, r, 0);
    if (ROOTED(t, n)) {
        if (ND(t, n)->kid < 0) {
            set_rooted(t, n, 0);
            if (mask_node(t, s_discard, n, h) < 0)
                return -1;
        }
        else if (unroot_subtree(t, n) < 0)
            return -1;
    }
    if (ND(t, n)->kid < 0)
        delete_up(t, n);
    return 0;
}

/* remove()'s prefetch distances, in blocks ahead of the one being removed: its hash's map slot
 * (RM_MAP), then the record of the node that slot names (RM_NODE), then, from that record, its
 * neighbours' records and, in a token-keyed table, its canonical key's key-map and mask slots
 * (RM_KEY). Each stage reads only lines an earlier one loaded, so the misses of a removal (a
 * random hash, then a random key) overlap those of the blocks before it. */
#define RM_MAP 12
#define RM_NODE 8
#define RM_KEY 4

/* The node a probe for hash h most likely ends on: the first slot of its run whose hash bits
 * agree (only map slots are read, no record); -1 when none. */
static inline int32_t
peek_node(Tab *t, PyObject *h)
{
    if (!t->mcap || !PyBytes_Check(h) || PyBytes_GET_SIZE(h) > t->kw)
        return -1;
    uint32_t frag = FRAG(key_hash((const uint8_t *)PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h)));
    size_t mask = (size_t)t->mcap - 1;
    for (size_t i = frag & mask;; i = (i + 1) & mask) {
        uint64_t v = t->map[i];
        if (v == MAP_EMPTY)
            return -1;
        if (SLOT_FRAG(v) == frag)
            return SLOT_ID(v);
    }
}

static inline void
prefetch_record(Tab *t, int32_t n)
{
    if (n < 0)
        return;
    const uint8_t *r = (const uint8_t *)ND(t, n);
    __builtin_prefetch(r);
    __builtin_prefetch(r + t->stride - 1);
}

/* Stage RM_KEY of remove()'s prefetching for hs[i] (see RM_MAP). */
static inline void
prefetch_removal(Tab *t, PyObject **hs, Py_ssize_t i, Py_ssize_t end)
{
    if (i >= end)
        return;
    int32_t n = peek_node(t, hs[i]);
    if (n < 0 || !(ND(t, n)->flags & F_LIVE))
        return;
    Node *d = ND(t, n);
    prefetch_record(t, d->parent);
    prefetch_record(t, d->prev);
    prefetch_record(t, d->next);
    if (!(d->flags & F_KEYED))
        return;
    const uint8_t *k = CKEY(t, n);
    if (t->kcap)
        prefetch_run(&t->kmap[FRAG(ckey_hash(k)) & ((uint64_t)t->kcap - 1)]);
    if (t->masks != NULL && Py_TYPE(t->masks) == &MMType) {
        MM *m = (MM *)t->masks;
        if (m->cap)
            prefetch_run(MM_SLOT(m, key_hash(k, CKEY_BYTES) & ((uint64_t)m->cap - 1)));
    }
}

/* remove's work; the counters stay in t (flush_counters). 0, or -1 with an exception set. */
static int
remove_run(Tab *t, PyObject *hs_arg, PyObject *lv_arg)
{
    long level = 0;
    int has_level = lv_arg != Py_None;
    if (has_level && level_arg(lv_arg, &level) < 0)
        return -1;
    PyObject *hashes = PySequence_Fast(hs_arg, "remove: block_hashes must be iterable");
    if (hashes == NULL)
        return -1;
    int rc = 0;
    Py_ssize_t end = PySequence_Fast_GET_SIZE(hashes);
    PyObject **hs = PySequence_Fast_ITEMS(hashes);
    /* an engine-keyed table's mask slots are its hashes' (a token-keyed one's: stage RM_KEY) */
    PyTypeObject *mmtype = t->ck ? NULL : &MMType;
    for (Py_ssize_t i = -RM_MAP; i < end && rc == 0; i++) {
        prefetch_key(t, hs, i + RM_MAP, end, mmtype);
        if (i + RM_NODE >= 0 && i + RM_NODE < end)
            prefetch_record(t, peek_node(t, hs[i + RM_NODE]));
        if (i + RM_KEY >= 0)
            prefetch_removal(t, hs, i + RM_KEY, end);
        if (i >= 0)
            rc = remove_one(t, hs[i], has_level, level);
    }
    Py_DECREF(hashes);
    return rc;
}

static PyObject *
tab_remove(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "remove(block_hashes, level, st)");
        return NULL;
    }
    int rc = remove_run(t, args[0], args[1]);
    if (flush_counters(t, args[2]) < 0 || rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
tab_update(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "update(block_hash, old, new, st)");
        return NULL;
    }
    const uint8_t *k;
    Py_ssize_t len;
    long old, new;
    if (key_arg(args[0], &k, &len) < 0 || level_arg(args[1], &old) < 0
        || level_arg(args[2], &new) < 0)
        return NULL;
    int32_t n = find(t, k, len);
    uint64_t r = n < 0 ? 0 : ND(t, n)->refs;
    if (!r)
        t->counters[C_UNKNOWN_UPDATE]++;
    else {
        int to = tier_of(old), tn = tier_of(new);
        if (!((r >> (16 * to)) & FIELD)) {
            t->counters[C_TIER_MISMATCH]++;
            to = deepest(r);
        }
        uint64_t moved = r - (1ull << (16 * to));
        if (((moved >> (16 * tn)) & FIELD) == FIELD)
            t->counters[C_SATURATED]++;
        else
            set_refs(t, n, r, moved + (1ull << (16 * tn)));
    }
    if (flush_counters(t, args[3]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Every rooted node's mirror key (its canonical key in a token-keyed table), in node-id
 * order. */
static PyObject *
tab_mirrored(Tab *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t n = 0; n < t->hw; n++) {
        if ((ND(t, n)->flags & (F_LIVE | F_ROOTED)) != (F_LIVE | F_ROOTED))
            continue;
        PyObject *k = t->ck ? PyBytes_FromStringAndSize((const char *)CKEY(t, n), CKEY_BYTES)
                            : key_bytes(t, (int32_t)n);
        if (k == NULL || PyList_Append(out, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(k);
    }
    return out;
}

static int
mirror_all(Tab *t, PyObject *name)
{
    PyObject *keys = tab_mirrored(t, NULL);
    if (keys == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys) && rc == 0; i++)
        rc = mask_call(t, name, PyList_GET_ITEM(keys, i));
    Py_DECREF(keys);
    return rc;
}

static int
detach(Tab *t)
{
    if (t->masks == NULL)
        return 0;
    int rc = mirror_all(t, s_discard);
    Py_CLEAR(t->masks);
    return rc;
}

static PyObject *
tab_detach(Tab *t, PyObject *Py_UNUSED(ignored))
{
    if (detach(t) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
tab_attach(Tab *t, PyObject *masks)
{
    if (t->masks == masks)
        Py_RETURN_NONE;
    if (detach(t) < 0)
        return NULL;
    PyObject *r = PyObject_CallMethodOneArg(masks, s_reserve, t->slot_obj);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    t->masks = Py_NewRef(masks);
    if (mirror_all(t, s_add) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
tab_clear(Tab *t, PyObject *Py_UNUSED(ignored))
{
    int rc = detach(t);
    nodes_free(t);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The node of a hash argument (-1 when absent; -2 on error). */
static int32_t
node_of(Tab *t, PyObject *h)
{
    const uint8_t *k;
    Py_ssize_t len;
    if (!PyBytes_Check(h))
        return -1;
    if (key_arg(h, &k, &len) < 0)
        return -2;
    return find(t, k, len);
}

static PyObject *
tab_tiers_of(Tab *t, PyObject *h)
{
    int32_t n = node_of(t, h);
    if (n == -2)
        return NULL;
    uint64_t r = n < 0 ? 0 : ND(t, n)->refs;
    PyObject *out = PyTuple_New(MAX_TIERS);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < MAX_TIERS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong((r >> (16 * i)) & FIELD);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *
tab_is_rooted(Tab *t, PyObject *h)
{
    int32_t n = node_of(t, h);
    if (n == -2)
        return NULL;
    return PyBool_FromLong(n >= 0 && ROOTED(t, n));
}

static PyObject *
tab_knows(Tab *t, PyObject *h)
{
    int32_t n = node_of(t, h);
    if (n == -2)
        return NULL;
    return PyBool_FromLong(n >= 0);
}

/* What matching sees of one block of a request: its packed refs and whether it is rooted. An
 * engine-keyed table looks the block hash up (refs whether rooted or not); a token-keyed one
 * the canonical key (the rooted nodes holding it, or-ed). -1 on error. */
static int
lookup(Tab *t, PyObject *h, uint64_t *refs, int *rooted)
{
    if (t->ck) {
        if (!PyBytes_Check(h) || PyBytes_GET_SIZE(h) != CKEY_BYTES) {
            *refs = 0;
            *rooted = 0;
            return 0;
        }
        *refs = key_refs(t, (const uint8_t *)PyBytes_AS_STRING(h), rooted);
        return 0;
    }
    int32_t n = node_of(t, h);
    if (n == -2)
        return -1;
    *refs = n < 0 ? 0 : ND(t, n)->refs;
    *rooted = n >= 0 && ROOTED(t, n);
    return 0;
}

static int
depth_arg(PyObject *seq, PyObject *o, Py_ssize_t *depth)
{
    Py_ssize_t d = PyLong_AsSsize_t(o);
    if (d == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    *depth = d < 0 ? 0 : d > n ? n : d;
    return 0;
}

static PyObject *
tab_weighted(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "weighted(hashes, depth, weights)");
        return NULL;
    }
    PyObject *ws = PySequence_Fast(args[2], "weights must be a sequence");
    if (ws == NULL)
        return NULL;
    Py_ssize_t nw = PySequence_Fast_GET_SIZE(ws);
    double w[MAX_TIERS + 1];
    PyObject *out = NULL, *hs = NULL;
    if (nw < 1) {
        PyErr_SetString(PyExc_ValueError, "weights must not be empty");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nw && i <= MAX_TIERS; i++) {
        w[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(ws, i));
        if (w[i] == -1.0 && PyErr_Occurred())
            goto done;
    }
    if (!t->lower) {
        Py_ssize_t d = PyLong_AsSsize_t(args[1]);
        if (d == -1 && PyErr_Occurred())
            goto done;
        out = PyFloat_FromDouble((double)d * w[0]);
        goto done;
    }
    hs = PySequence_Fast(args[0], "hashes must be a sequence");
    Py_ssize_t depth;
    if (hs == NULL || depth_arg(hs, args[1], &depth) < 0)
        goto done;
    double total = 0.0;
    for (Py_ssize_t i = 0; i < depth; i++) {
        uint64_t r;
        int on;
        if (lookup(t, PySequence_Fast_GET_ITEM(hs, i), &r, &on) < 0)
            goto done;
        if (r & FIELD)
            total += w[0];
        else if (r) {
            Py_ssize_t b = best_tier(r);
            total += w[b < nw - 1 ? b : nw - 1];
        }
    }
    out = PyFloat_FromDouble(total);
done:
    Py_DECREF(ws);
    Py_XDECREF(hs);
    return out;
}

static PyObject *
tab_tier_depths(Tab *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "tier_depths(hashes, depth)");
        return NULL;
    }
    Py_ssize_t d0 = PyLong_AsSsize_t(args[1]);
    if (d0 == -1 && PyErr_Occurred())
        return NULL;
    if (!t->lower)
        return Py_BuildValue("(nnn)", d0, d0, d0);
    PyObject *hs = PySequence_Fast(args[0], "hashes must be a sequence");
    Py_ssize_t depth;
    if (hs == NULL || depth_arg(hs, args[1], &depth) < 0) {
        Py_XDECREF(hs);
        return NULL;
    }
    Py_ssize_t gpu = d0, host = d0, disk = d0;
    for (Py_ssize_t i = 0; i < depth; i++) {
        uint64_t r;
        int on;
        if (lookup(t, PySequence_Fast_GET_ITEM(hs, i), &r, &on) < 0) {
            Py_DECREF(hs);
            return NULL;
        }
        if (gpu == d0 && !(r & 0xFFFFull))
            gpu = i;
        if (host == d0 && !(r & 0xFFFFFFFFull))
            host = i;
        if (!(r & 0xFFFFFFFFFFFFull)) {
            disk = i;
            break;
        }
    }
    Py_DECREF(hs);
    return Py_BuildValue("(nnn)", gpu, host, disk);
}

static PyObject *
tab_walk(Tab *t, PyObject *hashes)
{
    PyObject *hs = PySequence_Fast(hashes, "hashes must be a sequence");
    if (hs == NULL)
        return NULL;
    Py_ssize_t d = 0, end = PySequence_Fast_GET_SIZE(hs);
    for (; d < end; d++) {
        uint64_t r;
        int on;
        if (lookup(t, PySequence_Fast_GET_ITEM(hs, d), &r, &on) < 0) {
            Py_DECREF(hs);
            return NULL;
        }
        if (!on)
            break;
    }
    Py_DECREF(hs);
    return PyLong_FromSsize_t(d);
}

static PyObject *
tab_nodes(Tab *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t n = 0; n < t->hw; n++) {
        if (!(ND(t, n)->flags & F_LIVE))
            continue;
        int32_t p = ND(t, n)->parent;
        PyObject *ref = p == ROOT      ? Py_NewRef(Py_None)
                        : p == UNKNOWN ? PyLong_FromLong(UNKNOWN)
                                       : key_bytes(t, p);
        PyObject *k = key_bytes(t, (int32_t)n);
        PyObject *r = PyLong_FromUnsignedLongLong(ND(t, n)->refs);
        PyObject *tup = (ref && k && r) ? PyTuple_Pack(3, k, ref, r) : NULL;
        Py_XDECREF(ref);
        Py_XDECREF(k);
        Py_XDECREF(r);
        if (tup == NULL || PyList_Append(out, tup) < 0) {
            Py_XDECREF(tup);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(tup);
    }
    if (PyList_Sort(out) < 0) { /* hashes are unique: the order of the first items */
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *
tab_dump_nodes(Tab *t, PyObject *Py_UNUSED(ignored))
{
    int32_t *index = PyMem_Malloc((size_t)(t->hw ? t->hw : 1) * sizeof(int32_t));
    PyObject *hs = PyList_New(0), *ps = PyList_New(0), *rs = PyList_New(0);
    if (index == NULL || hs == NULL || ps == NULL || rs == NULL) {
        if (index == NULL)
            PyErr_NoMemory();
        goto fail;
    }
    int32_t i = 0;
    for (Py_ssize_t n = 0; n < t->hw; n++)
        index[n] = (ND(t, n)->flags & F_LIVE) ? i++ : -1;
    for (Py_ssize_t n = 0; n < t->hw; n++) {
        if (!(ND(t, n)->flags & F_LIVE))
            continue;
        int32_t p = ND(t, n)->parent;
        PyObject *k = key_bytes(t, (int32_t)n);
        PyObject *pv = PyLong_FromLong(p >= 0 ? index[p] : p);
        PyObject *r = PyLong_FromUnsignedLongLong(ND(t, n)->refs);
        int bad = k == NULL || pv == NULL || r == NULL || PyList_Append(hs, k) < 0
                  || PyList_Append(ps, pv) < 0 || PyList_Append(rs, r) < 0;
        Py_XDECREF(k);
        Py_XDECREF(pv);
        Py_XDECREF(r);
        if (bad)
            goto fail;
    }
    PyMem_Free(index);
    PyObject *out = PyTuple_Pack(3, hs, ps, rs);
    Py_DECREF(hs);
    Py_DECREF(ps);
    Py_DECREF(rs);
    return out;
fail:
    PyMem_Free(index);
    Py_XDECREF(hs);
    Py_XDECREF(ps);
    Py_XDECREF(rs);
    return NULL;
}

/* Replace the contents with nodes ((hash, parent index, refs) items), unrooted and detached;
 * the masks the table was attached to go to *masks (a new reference, or NULL). The number of
 * nodes, or -1 on error. */
static Py_ssize_t
load_structure(Tab *t, PyObject *nodes, PyObject **masks)
{
    Py_ssize_t count = PySequence_Fast_GET_SIZE(nodes);
    *masks = t->masks ? Py_NewRef(t->masks) : NULL;
    if (count > INT32_MAX || detach(t) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_OverflowError, "a GroupTable holds at most 2**31-1 nodes");
        return -1;
    }
    nodes_free(t);
    if (nodes_grow(t, count) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *h, *pv, *rv;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(nodes, i), "OOO:load_nodes", &h, &pv, &rv))
            return -1;
        const uint8_t *k;
        Py_ssize_t len;
        if (key_arg(h, &k, &len) < 0)
            return -1;
        long p = PyLong_AsLong(pv);
        uint64_t r = PyLong_AsUnsignedLongLong(rv);
        if (PyErr_Occurred())
            return -1;
        if (p >= count || p < UNKNOWN) {
            PyErr_Format(PyExc_ValueError, "node %zd has parent index %ld outside the table", i, p);
            return -1;
        }
        if (find(t, k, len) >= 0) {
            PyErr_SetString(PyExc_ValueError, "duplicate block hashes in a table");
            return -1;
        }
        int32_t n = alloc_node(t, k, len, (int32_t)p);
        if (n < 0)
            return -1;
        set_refs(t, n, 0, r);
    }
    for (int32_t n = (int32_t)count - 1; n >= 0; n--) /* children keep their order */
        if (ND(t, n)->parent >= 0)
            link_child(t, n, ND(t, n)->parent);
    return count;
}

/* Attach to masks (a reference taken over) and root every chain from the root. */
static int
root_all(Tab *t, PyObject *masks)
{
    t->masks = masks;
    for (int32_t n = 0; n < (int32_t)t->hw; n++)
        if ((ND(t, n)->flags & F_LIVE) && ND(t, n)->parent == ROOT && ND(t, n)->refs
            && root_subtree(t, n) < 0)
            return -1;
    return 0;
}

static PyObject *
tab_load_nodes(Tab *t, PyObject *arg)
{
    if (t->ck) {
        PyErr_SetString(PyExc_ValueError,
                        "a token-keyed table is loaded with its keys: use load_keyed()");
        return NULL;
    }
    PyObject *nodes = PySequence_Fast(arg, "load_nodes: nodes must be a sequence");
    if (nodes == NULL)
        return NULL;
    PyObject *masks;
    int rc = load_structure(t, nodes, &masks) < 0 ? -1 : root_all(t, masks);
    if (rc < 0 && t->masks != masks)
        Py_XDECREF(masks);
    Py_DECREF(nodes);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static void
assert_fail(const char *what, Py_ssize_t n)
{
    PyErr_Format(PyExc_AssertionError, "%s (node %zd)", what, n);
}

static Tab *tab_make(PyTypeObject *type, PyObject *bit, Py_ssize_t ck);
static int tab_traverse(Tab *t, visitproc visit, void *arg);
static int tab_clear_refs(Tab *t);
static void tab_dealloc(Tab *t);

#include "index_tokens.h"

static PyObject *
tab_check(Tab *t, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t present = 0, lower = 0, live = 0, rooted = 0;
    for (Py_ssize_t i = 0; i < t->hw; i++) {
        int32_t n = (int32_t)i;
        if (!(ND(t, n)->flags & F_LIVE))
            continue;
        live++;
        if (find(t, KEY(t, n), ND(t, n)->klen) != n) {
            assert_fail("the map does not lead to the node", n);
            return NULL;
        }
        uint64_t r = ND(t, n)->refs;
        if (r) {
            present++;
            lower += !(r & FIELD);
        }
        else if (ND(t, n)->kid < 0) {
            assert_fail("a ghost without children", n);
            return NULL;
        }
        int32_t p = ND(t, n)->parent;
        int want = r && (p == ROOT || (p >= 0 && ROOTED(t, p)));
        if (!!ROOTED(t, n) != want) {
            assert_fail("rooted flag", n);
            return NULL;
        }
        rooted += !!ROOTED(t, n);
        if (t->ck && check_keys(t, n) < 0)
            return NULL;
        if (t->masks != NULL && (!t->ck || (ND(t, n)->flags & F_KEYED))) {
            PyObject *k = t->ck ? PyBytes_FromStringAndSize((const char *)CKEY(t, n), CKEY_BYTES)
                                : key_bytes(t, n);
            PyObject *m = k == NULL ? NULL : PyObject_CallMethodObjArgs(t->masks, s_get, k, NULL);
            Py_XDECREF(k);
            if (m == NULL)
                return NULL;
            PyObject *a = PyNumber_And(m, t->bit);
            Py_DECREF(m);
            if (a == NULL)
                return NULL;
            int on = PyObject_IsTrue(a);
            Py_DECREF(a);
            int want_on = !!ROOTED(t, n) || (t->ck && shared_rooted(t, n));
            if (on != want_on) {
                assert_fail("mask bit", n);
                return NULL;
            }
        }
        int32_t before = NIL;
        for (int32_t c = ND(t, n)->kid; c >= 0; c = ND(t, c)->next) {
            if (ND(t, c)->parent != n || !(ND(t, c)->flags & F_LIVE) || ND(t, c)->prev != before) {
                assert_fail("child link", n);
                return NULL;
            }
            before = c;
        }
        if (p >= 0) {
            int32_t c = ND(t, p)->kid;
            while (c >= 0 && c != n)
                c = ND(t, c)->next;
            if (c != n) {
                assert_fail("parent link", n);
                return NULL;
            }
        }
    }
    if (t->ck && check_key_counts(t) < 0)
        return NULL;
    if (present != t->present || lower != t->lower || live != t->live || rooted != t->rooted) {
        PyErr_Format(PyExc_AssertionError,
                     "gauges: present %zd/%zd, lower %zd/%zd, nodes %zd/%zd, rooted %zd/%zd",
                     present, t->present, lower, t->lower, live, t->live, rooted, t->rooted);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
tab_nbytes(Tab *t, PyObject *Py_UNUSED(ignored))
{
    size_t per = (size_t)t->stride;
    return PyLong_FromSize_t(sizeof(Tab) + (size_t)t->cap * per
                             + (size_t)t->freecap * sizeof(int32_t)
                             + (size_t)(t->mcap + t->kcap) * sizeof(uint64_t));
}

/* ------------------------------------------------------------------ type */

/* A new empty table of ``type`` for the worker bit ``bit``, with ck bytes of canonical key per
 * node (0: engine-keyed). */
static Tab *
tab_make(PyTypeObject *type, PyObject *bit, Py_ssize_t ck)
{
    PyObject *bl = PyObject_CallMethod(bit, "bit_length", NULL);
    Py_ssize_t nbits = bl == NULL ? -1 : PyLong_AsSsize_t(bl);
    Py_XDECREF(bl);
    if (nbits == -1 && PyErr_Occurred())
        return NULL;
    if (nbits < 1) {
        PyErr_SetString(PyExc_ValueError, "GroupTable: bit must be a positive int (1 << slot)");
        return NULL;
    }
    Tab *t = (Tab *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->bit = Py_NewRef(bit);
    t->slot = nbits - 1;
    t->slot_obj = PyLong_FromSsize_t(t->slot);
    t->ck = ck;
    t->kw = 8;
    t->stride = NODE_HDR + ck + 8;
    if (t->slot_obj == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

static PyObject *
tab_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"bit", NULL};
    PyObject *bit;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!:GroupTable", kwlist, &PyLong_Type, &bit))
        return NULL;
    return (PyObject *)tab_make(type, bit, 0);
}

static int
tab_traverse(Tab *t, visitproc visit, void *arg)
{
    Py_VISIT(t->masks);
    Py_VISIT(t->pending);
    return 0;
}

static int
tab_clear_refs(Tab *t)
{
    Py_CLEAR(t->masks);
    return 0;
}

static void
tab_dealloc(Tab *t)
{
    PyObject_GC_UnTrack(t);
    Py_CLEAR(t->masks);
    Py_CLEAR(t->pending);
    Py_CLEAR(t->bit);
    Py_CLEAR(t->slot_obj);
    nodes_free(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
tab_len(Tab *t)
{
    return t->live;
}

static int
tab_contains(Tab *t, PyObject *h)
{
    int32_t n = node_of(t, h);
    if (n == -2)
        return -1;
    return n >= 0 && ND(t, n)->refs != 0;
}

static PyObject *
tab_repr(Tab *t)
{
    return PyUnicode_FromFormat("<GroupTable nodes=%zd present=%zd (native)>", t->live, t->present);
}

static PyObject *
get_masks(Tab *t, void *Py_UNUSED(c))
{
    return Py_NewRef(t->masks ? t->masks : Py_None);
}

#define GAUGE(name, expr)                                                   \
    static PyObject *get_##name(Tab *t, void *Py_UNUSED(c))                 \
    {                                                                       \
        return PyLong_FromSsize_t(expr);                                    \
    }
GAUGE(present, t->present)
GAUGE(lower, t->lower)
GAUGE(ghosts, t->live - t->present)
GAUGE(rooted_count, t->rooted)
GAUGE(slot, t->slot)

static PyObject *
get_bit(Tab *t, void *Py_UNUSED(c))
{
    return Py_NewRef(t->bit);
}

static PyGetSetDef tab_getset[] = {
    {"masks", (getter)get_masks, NULL, "The domain masks mirrored into (None: detached).", NULL},
    {"present", (getter)get_present, NULL, "Present blocks.", NULL},
    {"lower", (getter)get_lower, NULL, "Present blocks not held on the GPU (level 0).", NULL},
    {"ghosts", (getter)get_ghosts, NULL, "Nodes kept only for their descendants.", NULL},
    {"rooted_count", (getter)get_rooted_count, NULL, "Present blocks with their whole chain.",
     NULL},
    {"slot", (getter)get_slot, NULL, "The worker's slot in the domain masks.", NULL},
    {"bit", (getter)get_bit, NULL, "1 << slot.", NULL},
    {NULL},
};

#define FAST(f) (PyCFunction)(void (*)(void))(f)
static PyMethodDef tab_methods[] = {
    {"store", FAST(tab_store), METH_FASTCALL, "Apply a stored event (blocks with block_hash, cache_level)."},
    {"store_hashes", FAST(tab_store_hashes), METH_FASTCALL, "store() from columns."},
    {"remove", FAST(tab_remove), METH_FASTCALL, "Apply a removed event."},
    {"update", FAST(tab_update), METH_FASTCALL, "Apply an updated event's tier move."},
    {"clear", (PyCFunction)tab_clear, METH_NOARGS, "Forget every block (and detach)."},
    {"attach", (PyCFunction)tab_attach, METH_O, "Mirror the rooted blocks into masks from now on."},
    {"detach", (PyCFunction)tab_detach, METH_NOARGS, "Take this worker's bits out and stop mirroring."},
    {"mirrored", (PyCFunction)tab_mirrored, METH_NOARGS, "The rooted nodes' keys."},
    {"tiers_of", (PyCFunction)tab_tiers_of, METH_O, "Reference count per tier of a block."},
    {"is_rooted", (PyCFunction)tab_is_rooted, METH_O, "True when the block is present with its chain."},
    {"knows", (PyCFunction)tab_knows, METH_O, "True when the table has a node (present or ghost)."},
    {"weighted", FAST(tab_weighted), METH_FASTCALL, "Tier-weighted matched blocks."},
    {"tier_depths", FAST(tab_tier_depths), METH_FASTCALL, "(gpu, host, disk) depths."},
    {"walk", (PyCFunction)tab_walk, METH_O, "Rooted prefix length of hashes."},
    {"nodes", (PyCFunction)tab_nodes, METH_NOARGS, "Every node as (hash, parent, refs), sorted."},
    {"dump_nodes", (PyCFunction)tab_dump_nodes, METH_NOARGS, "(hashes, parent indices, refs)."},
    {"load_nodes", (PyCFunction)tab_load_nodes, METH_O, "Replace the contents with nodes."},
    {"check", (PyCFunction)tab_check, METH_NOARGS, "Verify the internal invariants."},
    {"nbytes", (PyCFunction)tab_nbytes, METH_NOARGS, "Bytes the table's arrays hold."},
    {NULL},
};

static PySequenceMethods tab_as_sequence = {
    .sq_length = (lenfunc)tab_len,
    .sq_contains = (objobjproc)tab_contains,
};

static PyTypeObject TabType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream._native._index.GroupTable",
    .tp_doc = "The blocks of one (worker, layer group), native (see kvstream.index.table).",
    .tp_basicsize = sizeof(Tab),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_new = tab_new,
    .tp_dealloc = (destructor)tab_dealloc,
    .tp_traverse = (traverseproc)tab_traverse,
    .tp_clear = (inquiry)tab_clear_refs,
    .tp_repr = (reprfunc)tab_repr,
    .tp_as_sequence = &tab_as_sequence,
    .tp_methods = tab_methods,
    .tp_getset = tab_getset,
};

#include "index_apply.h"

static PyMethodDef module_methods[] = {
    {"apply_plain", FAST(apply_plain), METH_FASTCALL,
     "Apply a batch of plain stores and removals to the tables the caller chose."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstream._native._index",
    "The index's native core (see kvstream.index.table), with its parts _table_native and "
    "_match_native.",
    -1, module_methods,
};

/* The module; PyInit__index (role_index.c) adds the index's other native parts to it. */
PyObject *kvs_index_core(void);

PyObject *
kvs_index_core(void)
{
    if (PyType_Ready(&TabType) < 0 || PyType_Ready(&MMType) < 0 || tokens_ready() < 0)
        return NULL;
#define INTERN(var, s)                                 \
    if ((var = PyUnicode_InternFromString(s)) == NULL) \
        return NULL;
    INTERN(s_add, "add");
    INTERN(s_discard, "discard");
    INTERN(s_reserve, "reserve");
    INTERN(s_get, "get");
    INTERN(s_block_hash, "block_hash");
    INTERN(s_cache_level, "cache_level");
    for (int i = 0; i < C_N; i++)
        INTERN(counter_str[i], counter_names[i]);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "GroupTable", (PyObject *)&TabType) < 0
        || PyModule_AddObjectRef(m, "MaskMap", (PyObject *)&MMType) < 0
        || PyModule_AddObjectRef(m, "TokenTable", (PyObject *)&TokTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
