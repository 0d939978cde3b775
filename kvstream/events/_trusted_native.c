/*
 * kvstream.events._trusted_native: the hot loops of kvstream/events/trusted.py in C.
 *
 * trusted.py builds model objects from values a decoder has already checked, without
 * pydantic validation: object.__new__, a fresh ``__dict__`` holding every field in
 * declaration order, and pydantic's three slots (``__pydantic_fields_set__`` a new set,
 * ``__pydantic_extra__`` and ``__pydantic_private__`` None). This module does exactly the
 * same, with the slots written through their member descriptors (what object.__setattr__
 * does; pydantic's own __setattr__ refuses on frozen models). trusted.py is the reference and
 * the fallback; tests/test_trusted_native.py checks the two give equal objects.
 *
 *   ModelFactory(cls, template)        a factory of instances of one pydantic model class;
 *                                      ``template``: every field in declaration order with its
 *                                      default (a dict, copied)
 *     .new(fields, fields_set)         instance whose __dict__ IS ``fields`` (a dict, not
 *                                      copied) and whose fields set is set(fields_set)
 *     .build(values)                   __dict__ = copy of the template updated with ``values``,
 *                                      fields set = set(values): trusted.trusted()
 *     .blocks(block_hashes, token_ids, *, extra_keys=None, lora_id=None, lora_name=None,
 *             cache_level=0, cache_salt=None, fields_set=frozenset({"block_hash",
 *             "token_ids"}))           StoredBlock's factory only: the blocks of one stored
 *                                      event, as a tuple; block i's __dict__ is the template
 *                                      with the given shared values, block_hash =
 *                                      block_hashes[i], token_ids = token_ids[i] and, where
 *                                      extra_keys[i] is not None, extra_keys = extra_keys[i]
 *                                      (then "extra_keys" joins its fields set):
 *                                      trusted.trusted_stored_blocks
 *   TokenFactory(cls)                  a factory of a ``__slots__ = ("_raw",)`` class
 *     .split(raw, step)                tuple of instances whose _raw are the consecutive
 *                                      ``step``-byte slices of ``raw`` (the last may be
 *                                      shorter): TokenIds per block
 *   EmittedEvents(event, stored, removed, block, tokens, run_type, view_type, fallback)
 *     .events(records)                 emitter.emitted_batch's loop in one call: the tuple of
 *                                      events of an EventEmitter's buffered records. A
 *                                      ``stored`` record whose blocks are a ``run_type``
 *                                      (BlockRun) without per-block attributes, and a non-empty
 *                                      ``removed`` record, are built here with the factories
 *                                      (the same objects as emitter._py_events makes of the
 *                                      same values: block i of a packed chain of k > 1 blocks
 *                                      gets a ``view_type`` (TokenIdsView) with _run = (the
 *                                      chain's bytes, bytes per block) and _i = i); any other
 *                                      record is ``fallback(record)``
 *
 * The callers' contract (as trusted.py's) is that every value is already valid; the factories
 * check only what keeps the interpreter safe (argument types, lengths).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>

static PyObject *s_block_hash = NULL, *s_token_ids = NULL, *s_extra_keys = NULL;

/* blocks()'s parameters, in order; the first two are required, the others keyword-only. */
enum { B_HASHES, B_TOKENS, B_EXTRA, B_LORA_ID, B_LORA_NAME, B_LEVEL, B_SALT, B_FIELDS, B_N };
static const char *const block_params[B_N] = {
    "block_hashes", "token_ids", "extra_keys", "lora_id",
    "lora_name",    "cache_level", "cache_salt", "fields_set",
};
static PyObject *block_param_names[B_N]; /* interned */
static PyObject *base_fields_set = NULL;  /* frozenset({"block_hash", "token_ids"}) */

/* A member descriptor (a __slots__ entry) of ``cls`` named ``name``, checked writable. */
static PyObject *
slot_descriptor(PyTypeObject *cls, const char *name)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)cls, name);
    if (d == NULL)
        return NULL;
    if (Py_TYPE(d) != &PyMemberDescr_Type || Py_TYPE(d)->tp_descr_set == NULL) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member", cls->tp_name, name);
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static inline int
set_slot(PyObject *descr, PyObject *obj, PyObject *value)
{
    return Py_TYPE(descr)->tp_descr_set(descr, obj, value);
}

/* The offset of a slot_descriptor()'s value in an instance, or -1 when it is not a plain
 * object slot (then set_slot() is the way to write it). */
static Py_ssize_t
slot_offset(PyObject *descr)
{
    PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;

    return m->type == T_OBJECT_EX && !(m->flags & READONLY) ? m->offset : -1;
}

/* Store ``value`` in the slot of a fresh instance (tp_alloc zeroes it, so there is no old
 * value): what member_set does, without its call and checks. */
static inline int
init_slot(PyObject *descr, Py_ssize_t off, PyObject *obj, PyObject *value)
{
    if (off < 0)
        return set_slot(descr, obj, value);
    Py_INCREF(value);
    *(PyObject **)((char *)obj + off) = value;
    return 0;
}

/* ------------------------------------------------------------------------- ModelFactory */

typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;
    PyObject *template;                           /* every field in order: build()'s base */
    PyObject *d_fields_set, *d_extra, *d_private; /* pydantic's slot descriptors */
    Py_ssize_t off_fields_set, off_extra, off_private; /* their offsets (slot_offset) */
    int is_block; /* the template has every field blocks() writes */
} ModelFactory;

static int
mf_init(ModelFactory *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cls", "template", NULL};
    PyObject *cls, *tmpl;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!:ModelFactory", kwlist, &PyType_Type, &cls,
                                     &PyDict_Type, &tmpl))
        return -1;
    if (((PyTypeObject *)cls)->tp_itemsize != 0 ||
        (((PyTypeObject *)cls)->tp_flags & Py_TPFLAGS_IS_ABSTRACT) ||
        ((PyTypeObject *)cls)->tp_alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "ModelFactory needs a concrete class of fixed size");
        return -1;
    }
    Py_CLEAR(self->cls);
    Py_CLEAR(self->template);
    Py_CLEAR(self->d_fields_set);
    Py_CLEAR(self->d_extra);
    Py_CLEAR(self->d_private);
    self->d_fields_set = slot_descriptor((PyTypeObject *)cls, "__pydantic_fields_set__");
    if (self->d_fields_set == NULL)
        return -1;
    self->d_extra = slot_descriptor((PyTypeObject *)cls, "__pydantic_extra__");
    if (self->d_extra == NULL)
        return -1;
    self->d_private = slot_descriptor((PyTypeObject *)cls, "__pydantic_private__");
    if (self->d_private == NULL)
        return -1;
    self->off_fields_set = slot_offset(self->d_fields_set);
    self->off_extra = slot_offset(self->d_extra);
    self->off_private = slot_offset(self->d_private);
    self->template = PyDict_Copy(tmpl);
    if (self->template == NULL)
        return -1;
    self->is_block = 1;
    {
        PyObject *keys[] = {s_block_hash, s_token_ids, s_extra_keys,
                            block_param_names[B_LORA_ID], block_param_names[B_LORA_NAME],
                            block_param_names[B_LEVEL], block_param_names[B_SALT]};
        size_t k;

        for (k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
            int has = PyDict_Contains(self->template, keys[k]);
            if (has < 0)
                return -1;
            if (!has)
                self->is_block = 0;
        }
    }
    Py_INCREF(cls);
    self->cls = (PyTypeObject *)cls;
    return 0;
}

static int
mf_traverse(ModelFactory *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cls);
    Py_VISIT(self->template);
    Py_VISIT(self->d_fields_set);
    Py_VISIT(self->d_extra);
    Py_VISIT(self->d_private);
    return 0;
}

static int
mf_clear(ModelFactory *self)
{
    Py_CLEAR(self->cls);
    Py_CLEAR(self->template);
    Py_CLEAR(self->d_fields_set);
    Py_CLEAR(self->d_extra);
    Py_CLEAR(self->d_private);
    return 0;
}

static void
mf_dealloc(ModelFactory *self)
{
    PyObject_GC_UnTrack(self);
    mf_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
ready(ModelFactory *self)
{
    if (self->cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ModelFactory was not initialised");
        return -1;
    }
    return 0;
}

/* An instance with ``dict`` (borrowed; the instance takes its own reference) as __dict__
 * and set(fields_set) as its fields set. */
static PyObject *
make(ModelFactory *self, PyObject *dict, PyObject *fields_set)
{
    PyObject *obj, *fs;

    /* tp_alloc, not object.__new__: on 3.11 object.__new__ would also lay out the instance's
     * attribute values that PyObject_GenericSetDict then has to turn into a dict only to drop
     * it. An instance fresh from tp_alloc has no attributes at all. */
    obj = self->cls->tp_alloc(self->cls, 0);
    if (obj == NULL)
        return NULL;
    fs = PySet_New(fields_set);
    if (fs == NULL)
        goto fail;
    if (PyObject_GenericSetDict(obj, dict, NULL) < 0 ||
        init_slot(self->d_fields_set, self->off_fields_set, obj, fs) < 0 ||
        init_slot(self->d_extra, self->off_extra, obj, Py_None) < 0 ||
        init_slot(self->d_private, self->off_private, obj, Py_None) < 0) {
        Py_DECREF(fs);
        goto fail;
    }
    Py_DECREF(fs);
    return obj;
fail:
    Py_DECREF(obj);
    return NULL;
}

static PyObject *
mf_new(ModelFactory *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (ready(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "new(fields, fields_set) takes 2 arguments");
        return NULL;
    }
    if (!PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "new(): fields must be a dict");
        return NULL;
    }
    return make(self, args[0], args[1]);
}

static PyObject *
mf_build(ModelFactory *self, PyObject *values)
{
    PyObject *dict, *obj;

    if (ready(self) < 0)
        return NULL;
    if (!PyDict_CheckExact(values)) {
        PyErr_SetString(PyExc_TypeError, "build(): values must be a dict");
        return NULL;
    }
    dict = PyDict_Copy(self->template);
    if (dict == NULL)
        return NULL;
    if (PyDict_Update(dict, values) < 0) {
        Py_DECREF(dict);
        return NULL;
    }
    obj = make(self, dict, values);
    Py_DECREF(dict);
    return obj;
}


/* The arguments of a METH_FASTCALL | METH_KEYWORDS call into ``out`` (NULL where not given):
 * the first ``n_positional`` parameters are required and may be positional, the others are
 * keyword-only; -1 with TypeError on a bad call. */
static int
parse_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out,
           int n_params, int n_positional, const char *fname)
{
    Py_ssize_t i, k, nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);

    if (nargs > n_positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d positional arguments (%zd given)", fname,
                     n_positional, nargs);
        return -1;
    }
    for (i = 0; i < n_params; i++)
        out[i] = i < nargs ? args[i] : NULL;
    for (k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);

        for (i = 0; i < n_params; i++) {
            if (name == block_param_names[i])
                break;
        }
        if (i == n_params) { /* not interned the same way: compare the text */
            for (i = 0; i < n_params; i++) {
                int eq = PyUnicode_Compare(name, block_param_names[i]);
                if (eq == -1 && PyErr_Occurred())
                    return -1;
                if (eq == 0)
                    break;
            }
        }
        if (i == n_params) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname,
                         name);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         block_params[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (i = 0; i < n_positional; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname,
                         block_params[i]);
            return -1;
        }
    }
    return 0;
}

static PyObject *
mf_blocks(ModelFactory *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[B_N], *hashes, *tokens, *extra, *fs, *tmpl = NULL, *fs_extra = NULL;
    PyObject *out = NULL;
    Py_ssize_t n, i;
    static const int shared[] = {B_LORA_ID, B_LORA_NAME, B_LEVEL, B_SALT};

    if (ready(self) < 0)
        return NULL;
    if (!self->is_block) {
        PyErr_Format(PyExc_TypeError, "blocks(): %s is not a block model", self->cls->tp_name);
        return NULL;
    }
    if (parse_args(args, nargs, kwnames, a, B_N, 2, "blocks") < 0)
        return NULL;
    hashes = a[B_HASHES];
    tokens = a[B_TOKENS];
    extra = a[B_EXTRA] == NULL ? Py_None : a[B_EXTRA];
    fs = a[B_FIELDS] == NULL ? base_fields_set : a[B_FIELDS];
    if (!PyTuple_CheckExact(hashes) || !PyTuple_CheckExact(tokens) ||
        (extra != Py_None && !PyTuple_CheckExact(extra))) {
        PyErr_SetString(PyExc_TypeError,
                        "blocks(): block_hashes and token_ids must be tuples, extra_keys a tuple "
                        "or None");
        return NULL;
    }
    n = PyTuple_GET_SIZE(hashes);
    if (PyTuple_GET_SIZE(tokens) != n || (extra != Py_None && PyTuple_GET_SIZE(extra) != n)) {
        PyErr_SetString(PyExc_ValueError,
                        "block_hashes, token_ids and extra_keys need one entry per block");
        return NULL;
    }
    /* the event's shared values over the defaults, in declaration order */
    tmpl = PyDict_Copy(self->template);
    if (tmpl == NULL)
        return NULL;
    for (i = 0; i < 4; i++) {
        int k = shared[i];
        if (a[k] != NULL && PyDict_SetItem(tmpl, block_param_names[k], a[k]) < 0)
            goto done;
    }
    if (extra != Py_None) {
        fs_extra = PySet_New(fs);
        if (fs_extra == NULL || PySet_Add(fs_extra, block_param_names[B_EXTRA]) < 0)
            goto done;
    }
    out = PyTuple_New(n);
    if (out == NULL)
        goto done;
    for (i = 0; i < n; i++) {
        PyObject *keys = extra == Py_None ? Py_None : PyTuple_GET_ITEM(extra, i);
        PyObject *dict = PyDict_Copy(tmpl), *obj;

        if (dict == NULL)
            goto fail;
        if (PyDict_SetItem(dict, s_block_hash, PyTuple_GET_ITEM(hashes, i)) < 0 ||
            PyDict_SetItem(dict, s_token_ids, PyTuple_GET_ITEM(tokens, i)) < 0 ||
            (keys != Py_None && PyDict_SetItem(dict, s_extra_keys, keys) < 0)) {
            Py_DECREF(dict);
            goto fail;
        }
        obj = make(self, dict, keys == Py_None ? fs : fs_extra);
        Py_DECREF(dict);
        if (obj == NULL)
            goto fail;
        PyTuple_SET_ITEM(out, i, obj);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_DECREF(tmpl);
    Py_XDECREF(fs_extra);
    return out;
}

static PyMethodDef mf_methods[] = {
    {"new", (PyCFunction)(void (*)(void))mf_new, METH_FASTCALL,
     "new(fields, fields_set): an instance whose __dict__ is ``fields`` (not copied)."},
    {"build", (PyCFunction)mf_build, METH_O,
     "build(values): __dict__ = the template updated with values; fields set = set(values)."},
    {"blocks", (PyCFunction)(void (*)(void))mf_blocks, METH_FASTCALL | METH_KEYWORDS,
     "blocks(block_hashes, token_ids, *, extra_keys=None, lora_id=None, lora_name=None, "
     "cache_level=0, cache_salt=None, fields_set=frozenset({'block_hash', 'token_ids'})): "
     "the blocks of one stored event, as a tuple (see trusted.trusted_stored_blocks)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef mf_members[] = {
    {"cls", T_OBJECT, offsetof(ModelFactory, cls), READONLY, "the model class"},
    {"template", T_OBJECT, offsetof(ModelFactory, template), READONLY,
     "every field in declaration order with its default (None for required ones)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ModelFactoryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream.events._trusted_native.ModelFactory",
    .tp_basicsize = sizeof(ModelFactory),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ModelFactory(cls, template): unvalidated instances of one pydantic model class.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mf_init,
    .tp_traverse = (traverseproc)mf_traverse,
    .tp_clear = (inquiry)mf_clear,
    .tp_dealloc = (destructor)mf_dealloc,
    .tp_methods = mf_methods,
    .tp_members = mf_members,
};

/* ------------------------------------------------------------------------- TokenFactory */

typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;
    PyObject *d_raw;
    Py_ssize_t off_raw; /* slot_offset(d_raw) */
} TokenFactory;

static int
tf_init(TokenFactory *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"cls", NULL};
    PyObject *cls;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!:TokenFactory", kwlist, &PyType_Type, &cls))
        return -1;
    if (((PyTypeObject *)cls)->tp_itemsize != 0 ||
        (((PyTypeObject *)cls)->tp_flags & Py_TPFLAGS_IS_ABSTRACT) ||
        ((PyTypeObject *)cls)->tp_alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "TokenFactory needs a concrete class of fixed size");
        return -1;
    }
    Py_CLEAR(self->cls);
    Py_CLEAR(self->d_raw);
    self->d_raw = slot_descriptor((PyTypeObject *)cls, "_raw");
    if (self->d_raw == NULL)
        return -1;
    self->off_raw = slot_offset(self->d_raw);
    Py_INCREF(cls);
    self->cls = (PyTypeObject *)cls;
    return 0;
}

static int
tf_traverse(TokenFactory *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cls);
    Py_VISIT(self->d_raw);
    return 0;
}

static int
tf_clear(TokenFactory *self)
{
    Py_CLEAR(self->cls);
    Py_CLEAR(self->d_raw);
    return 0;
}

static void
tf_dealloc(TokenFactory *self)
{
    PyObject_GC_UnTrack(self);
    tf_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
wrap_raw(TokenFactory *self, PyObject *raw)
{
    PyObject *obj = self->cls->tp_alloc(self->cls, 0);

    if (obj == NULL)
        return NULL;
    if (init_slot(self->d_raw, self->off_raw, obj, raw) < 0) {
        Py_DECREF(obj);
        return NULL;
    }
    return obj;
}

static PyObject *
tf_split(TokenFactory *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *raw, *out;
    Py_ssize_t size, step, n, i;
    const char *p;

    if (self->cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "TokenFactory was not initialised");
        return NULL;
    }
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "split(raw, step) takes 2 arguments");
        return NULL;
    }
    raw = args[0];
    if (!PyBytes_CheckExact(raw)) {
        PyErr_SetString(PyExc_TypeError, "split(): raw must be bytes");
        return NULL;
    }
    step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    size = PyBytes_GET_SIZE(raw);
    if (step <= 0 || step % 4 || size % 4) {
        PyErr_SetString(PyExc_ValueError,
                        "split(): step must be a positive multiple of 4 and raw a multiple of 4 "
                        "bytes");
        return NULL;
    }
    n = size / step + (size % step != 0);
    out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    p = PyBytes_AS_STRING(raw);
    for (i = 0; i < n; i++) {
        Py_ssize_t off = i * step, len = size - off < step ? size - off : step;
        PyObject *chunk, *obj;

        if (len == size) {
            Py_INCREF(raw);
            chunk = raw;
        }
        else {
            chunk = PyBytes_FromStringAndSize(p + off, len);
            if (chunk == NULL)
                goto fail;
        }
        obj = wrap_raw(self, chunk);
        Py_DECREF(chunk);
        if (obj == NULL)
            goto fail;
        PyTuple_SET_ITEM(out, i, obj);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef tf_methods[] = {
    {"split", (PyCFunction)(void (*)(void))tf_split, METH_FASTCALL,
     "split(raw, step): one instance per consecutive step-byte slice of raw."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef tf_members[] = {
    {"cls", T_OBJECT, offsetof(TokenFactory, cls), READONLY, "the token class"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject TokenFactoryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream.events._trusted_native.TokenFactory",
    .tp_basicsize = sizeof(TokenFactory),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TokenFactory(cls): instances of a __slots__ = ('_raw',) class from packed bytes.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)tf_init,
    .tp_traverse = (traverseproc)tf_traverse,
    .tp_clear = (inquiry)tf_clear,
    .tp_dealloc = (destructor)tf_dealloc,
    .tp_methods = tf_methods,
    .tp_members = tf_members,
};

/* ------------------------------------------------------------------------ EmittedEvents */

/* emitter.emitted_batch's loop: the events of an EventEmitter's buffered records. A ``stored``
 * record whose blocks are a BlockRun without per-block attributes and a non-empty ``removed``
 * record are built here, exactly as trusted.py's builders would build them from the same
 * values; any other record goes to ``fallback(record)`` (the validated path). */
typedef struct {
    PyObject_HEAD
    ModelFactory *event, *stored, *removed, *block;
    TokenFactory *tokens;
    PyTypeObject *run_type, *view_type;
    PyObject *d_hashes, *d_tokens, *d_attrs; /* BlockRun's slot descriptors */
    PyObject *d_view_run, *d_view_i;         /* TokenIdsView's */
    Py_ssize_t off_view_run, off_view_i;
    PyObject *fallback;
} EmittedEvents;

static PyObject *s_data = NULL, *s_type = NULL, *s_blocks = NULL, *s_parent_hash = NULL,
                *s_cache_level = NULL, *s_stored = NULL, *s_removed = NULL;
static PyObject *stored_fields_set = NULL;  /* frozenset({"type", "parent_hash", "blocks"}) */
static PyObject *removed_fields_set = NULL; /* frozenset({"type", "block_hashes", "cache_level"}) */

static int
ee_init(EmittedEvents *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"event",    "stored",    "removed",  "block", "tokens",
                             "run_type", "view_type", "fallback", NULL};
    PyObject *ev, *st, *rm, *bl, *tk, *run, *view, *fb;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!O!O!O:EmittedEvents", kwlist,
                                     &ModelFactoryType, &ev, &ModelFactoryType, &st,
                                     &ModelFactoryType, &rm, &ModelFactoryType, &bl,
                                     &TokenFactoryType, &tk, &PyType_Type, &run, &PyType_Type,
                                     &view, &fb))
        return -1;
    if (((PyTypeObject *)view)->tp_itemsize != 0 || ((PyTypeObject *)view)->tp_alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "EmittedEvents: view_type must be of fixed size");
        return -1;
    }
    if (((ModelFactory *)ev)->cls == NULL || ((ModelFactory *)st)->cls == NULL ||
        ((ModelFactory *)rm)->cls == NULL || ((TokenFactory *)tk)->cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "EmittedEvents: a factory was not initialised");
        return -1;
    }
    if (!((ModelFactory *)bl)->is_block) {
        PyErr_SetString(PyExc_TypeError, "EmittedEvents: block must be a block model's factory");
        return -1;
    }
    if (!PyCallable_Check(fb)) {
        PyErr_SetString(PyExc_TypeError, "EmittedEvents: fallback must be callable");
        return -1;
    }
    Py_CLEAR(self->d_hashes);
    Py_CLEAR(self->d_tokens);
    Py_CLEAR(self->d_attrs);
    Py_CLEAR(self->d_view_run);
    Py_CLEAR(self->d_view_i);
    if ((self->d_hashes = slot_descriptor((PyTypeObject *)run, "hashes")) == NULL ||
        (self->d_tokens = slot_descriptor((PyTypeObject *)run, "tokens")) == NULL ||
        (self->d_attrs = slot_descriptor((PyTypeObject *)run, "attrs")) == NULL ||
        (self->d_view_run = slot_descriptor((PyTypeObject *)view, "_run")) == NULL ||
        (self->d_view_i = slot_descriptor((PyTypeObject *)view, "_i")) == NULL)
        return -1;
    self->off_view_run = slot_offset(self->d_view_run);
    self->off_view_i = slot_offset(self->d_view_i);
#define EE_SET(field, value)                                                                   \
    do {                                                                                       \
        Py_INCREF(value);                                                                      \
        Py_XSETREF(self->field, (void *)(value));                                              \
    } while (0)
    EE_SET(event, ev);
    EE_SET(stored, st);
    EE_SET(removed, rm);
    EE_SET(block, bl);
    EE_SET(tokens, tk);
    EE_SET(run_type, run);
    EE_SET(view_type, view);
    EE_SET(fallback, fb);
#undef EE_SET
    return 0;
}

static int
ee_traverse(EmittedEvents *self, visitproc visit, void *arg)
{
    Py_VISIT(self->event);
    Py_VISIT(self->stored);
    Py_VISIT(self->removed);
    Py_VISIT(self->block);
    Py_VISIT(self->tokens);
    Py_VISIT(self->run_type);
    Py_VISIT(self->view_type);
    Py_VISIT(self->d_view_run);
    Py_VISIT(self->d_view_i);
    Py_VISIT(self->d_hashes);
    Py_VISIT(self->d_tokens);
    Py_VISIT(self->d_attrs);
    Py_VISIT(self->fallback);
    return 0;
}

static int
ee_clear(EmittedEvents *self)
{
    Py_CLEAR(self->event);
    Py_CLEAR(self->stored);
    Py_CLEAR(self->removed);
    Py_CLEAR(self->block);
    Py_CLEAR(self->tokens);
    Py_CLEAR(self->run_type);
    Py_CLEAR(self->view_type);
    Py_CLEAR(self->d_view_run);
    Py_CLEAR(self->d_view_i);
    Py_CLEAR(self->d_hashes);
    Py_CLEAR(self->d_tokens);
    Py_CLEAR(self->d_attrs);
    Py_CLEAR(self->fallback);
    return 0;
}

static void
ee_dealloc(EmittedEvents *self)
{
    PyObject_GC_UnTrack(self);
    ee_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline PyObject *
get_slot(PyObject *descr, PyObject *obj)
{
    return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
}

/* The model built from ``factory``'s template with n (key, value) pairs set, its fields set
 * ``fields_set``: what factory.build() makes of a dict holding exactly those pairs. */
static PyObject *
build_pairs(ModelFactory *factory, PyObject *fields_set, int n, PyObject **kv)
{
    PyObject *dict = PyDict_Copy(factory->template), *obj;
    int i;

    if (dict == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        if (PyDict_SetItem(dict, kv[2 * i], kv[2 * i + 1]) < 0) {
            Py_DECREF(dict);
            return NULL;
        }
    }
    obj = make(factory, dict, fields_set);
    Py_DECREF(dict);
    return obj;
}

/* A TokenIdsView of block ``i`` of ``run`` ((packed bytes, step), shared): a new reference. */
static PyObject *
run_view(EmittedEvents *self, PyObject *run, Py_ssize_t i)
{
    PyObject *obj = self->view_type->tp_alloc(self->view_type, 0), *index;

    if (obj == NULL)
        return NULL;
    index = PyLong_FromSsize_t(i);
    if (index == NULL || init_slot(self->d_view_run, self->off_view_run, obj, run) < 0 ||
        init_slot(self->d_view_i, self->off_view_i, obj, index) < 0) {
        Py_XDECREF(index);
        Py_DECREF(obj);
        return NULL;
    }
    Py_DECREF(index);
    return obj;
}

/* The StoredBlock objects of a BlockRun without attributes: a new tuple, or NULL with no error
 * set when the run is not one this path builds (the caller then falls back), or NULL with an
 * error. */
static PyObject *
run_blocks(EmittedEvents *self, PyObject *run)
{
    PyObject *hashes = NULL, *tokens = NULL, *attrs = NULL, *out = NULL, *raw = NULL;
    PyObject *view_run = NULL; /* (raw, step) of a packed entry of several blocks */
    Py_ssize_t n, e, at = 0;

    if ((hashes = get_slot(self->d_hashes, run)) == NULL ||
        (tokens = get_slot(self->d_tokens, run)) == NULL ||
        (attrs = get_slot(self->d_attrs, run)) == NULL)
        goto done;
    if (!PyList_CheckExact(hashes) || !PyList_CheckExact(tokens) || !PyDict_CheckExact(attrs) ||
        PyDict_GET_SIZE(attrs) != 0 || PyList_GET_SIZE(hashes) == 0)
        goto done; /* not this path */
    n = PyList_GET_SIZE(hashes);
    out = PyTuple_New(n);
    if (out == NULL)
        goto done;
    for (e = 0; e < PyList_GET_SIZE(tokens); e++) {
        PyObject *entry = PyList_GET_ITEM(tokens, e);
        Py_ssize_t k, j, size, step = 0;

        if (PyTuple_CheckExact(entry)) { /* (packed TokenIds, k): k blocks of equal length */
            PyObject *packed;

            if (PyTuple_GET_SIZE(entry) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(entry, 1)))
                goto not_this;
            packed = PyTuple_GET_ITEM(entry, 0);
            k = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
            if (k == -1 && PyErr_Occurred())
                goto fail;
            if (Py_TYPE(packed) == self->tokens->cls && self->tokens->off_raw >= 0) {
                raw = *(PyObject **)((char *)packed + self->tokens->off_raw);
                if (raw == NULL)
                    goto not_this;
                Py_INCREF(raw);
            }
            else if ((raw = PyObject_GetAttrString(packed, "_raw")) == NULL)
                goto fail;
            size = PyBytes_CheckExact(raw) ? PyBytes_GET_SIZE(raw) : -1;
            if (k <= 0 || size <= 0 || size % k || (size / k) % 4 || at + k > n)
                goto not_this;
            step = size / k;
            if (k > 1) {
                PyObject *step_obj = PyLong_FromSsize_t(step);

                if (step_obj == NULL)
                    goto fail;
                view_run = PyTuple_Pack(2, raw, step_obj);
                Py_DECREF(step_obj);
                if (view_run == NULL)
                    goto fail;
            }
        }
        else {
            k = 1;
            if (at + 1 > n)
                goto not_this;
        }
        for (j = 0; j < k; j++, at++) {
            PyObject *kv[4], *tok, *obj;

            if (raw == NULL) {
                Py_INCREF(entry);
                tok = entry;
            }
            else if (k == 1) /* the whole packed run is the block: share its bytes */
                tok = wrap_raw(self->tokens, raw);
            else /* block j of the run: a view of its bytes (no copy) */
                tok = run_view(self, view_run, j);
            if (tok == NULL)
                goto fail;
            kv[0] = s_block_hash;
            kv[1] = PyList_GET_ITEM(hashes, at);
            kv[2] = s_token_ids;
            kv[3] = tok;
            obj = build_pairs(self->block, base_fields_set, 2, kv);
            Py_DECREF(tok);
            if (obj == NULL)
                goto fail;
            PyTuple_SET_ITEM(out, at, obj);
        }
        Py_CLEAR(raw);
        Py_CLEAR(view_run);
    }
    if (at != n)
        goto not_this;
    goto done;
not_this:
    Py_CLEAR(out);
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(raw);
    Py_XDECREF(view_run);
    Py_XDECREF(hashes);
    Py_XDECREF(tokens);
    Py_XDECREF(attrs);
    return out;
}

/* The payload of one record built here, a new reference; NULL with no error set when the
 * record is not one this path builds, NULL with an error on failure. */
static PyObject *
record_payload(EmittedEvents *self, PyObject *data)
{
    PyObject *kind, *kv[6];
    int eq;

    kind = PyDict_GetItemWithError(data, s_type);
    if (kind == NULL || !PyUnicode_CheckExact(kind))
        return NULL;
    if ((eq = PyUnicode_Compare(kind, s_stored)) == 0) {
        PyObject *run = PyDict_GetItemWithError(data, s_blocks), *parent, *blocks, *built;

        if (run == NULL || Py_TYPE(run) != self->run_type)
            return NULL;
        parent = PyDict_GetItemWithError(data, s_parent_hash);
        if (parent == NULL)
            return NULL;
        blocks = run_blocks(self, run);
        if (blocks == NULL)
            return NULL;
        kv[0] = s_type, kv[1] = s_stored, kv[2] = s_parent_hash, kv[3] = parent;
        kv[4] = s_blocks, kv[5] = blocks;
        built = build_pairs(self->stored, stored_fields_set, 3, kv);
        Py_DECREF(blocks);
        return built;
    }
    if (eq == -1 && PyErr_Occurred())
        return NULL;
    if (PyUnicode_Compare(kind, s_removed) == 0) {
        PyObject *hashes = PyDict_GetItemWithError(data, block_param_names[B_HASHES]), *level,
                 *tuple, *built;

        if (hashes == NULL || !PyList_CheckExact(hashes) || PyList_GET_SIZE(hashes) == 0)
            return NULL;
        level = PyDict_GetItemWithError(data, s_cache_level);
        if (level == NULL)
            return NULL;
        tuple = PyList_AsTuple(hashes);
        if (tuple == NULL)
            return NULL;
        kv[0] = s_type, kv[1] = s_removed, kv[2] = block_param_names[B_HASHES], kv[3] = tuple;
        kv[4] = s_cache_level, kv[5] = level;
        built = build_pairs(self->removed, removed_fields_set, 3, kv);
        Py_DECREF(tuple);
        return built;
    }
    return NULL;
}

/* One record's event (a new reference). */
static PyObject *
record_event(EmittedEvents *self, PyObject *rec)
{
    PyObject *data, *payload, *dict, *obj;

    if (!PyDict_CheckExact(rec))
        return PyObject_CallOneArg(self->fallback, rec);
    data = PyDict_GetItemWithError(rec, s_data);
    payload = data != NULL && PyDict_CheckExact(data) ? record_payload(self, data) : NULL;
    if (payload == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return PyObject_CallOneArg(self->fallback, rec);
    }
    /* {**rec, "data": payload} over the event template; fields set: rec's keys */
    dict = PyDict_Copy(self->event->template);
    if (dict == NULL || PyDict_Update(dict, rec) < 0 || PyDict_SetItem(dict, s_data, payload) < 0) {
        Py_XDECREF(dict);
        Py_DECREF(payload);
        return NULL;
    }
    Py_DECREF(payload);
    obj = make(self->event, dict, rec);
    Py_DECREF(dict);
    return obj;
}

static PyObject *
ee_call(EmittedEvents *self, PyObject *records)
{
    PyObject *it, *rec, *out, *tuple;

    if (self->event == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "EmittedEvents was not initialised");
        return NULL;
    }
    out = PyList_New(0);
    if (out == NULL)
        return NULL;
    it = PyObject_GetIter(records);
    if (it == NULL)
        goto fail;
    while ((rec = PyIter_Next(it)) != NULL) {
        PyObject *ev = record_event(self, rec);

        Py_DECREF(rec);
        if (ev == NULL || PyList_Append(out, ev) < 0) {
            Py_XDECREF(ev);
            Py_DECREF(it);
            goto fail;
        }
        Py_DECREF(ev);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        goto fail;
    tuple = PyList_AsTuple(out);
    Py_DECREF(out);
    return tuple;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef ee_methods[] = {
    {"events", (PyCFunction)ee_call, METH_O,
     "events(records): the events of an emitter's records, as a tuple (see "
     "emitter.emitted_batch)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EmittedEventsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstream.events._trusted_native.EmittedEvents",
    .tp_basicsize = sizeof(EmittedEvents),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "EmittedEvents(event, stored, removed, block, tokens, run_type, fallback): the "
              "events of an EventEmitter's buffered records, built without re-validation.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ee_init,
    .tp_traverse = (traverseproc)ee_traverse,
    .tp_clear = (inquiry)ee_clear,
    .tp_dealloc = (destructor)ee_dealloc,
    .tp_methods = ee_methods,
};

static PyMethodDef methods[] = {
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
             "Unvalidated construction of kvstream model objects (see kvstream.events.trusted).");

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvstream.events._trusted_native", module_doc, -1, methods,
    NULL,                  NULL,                              NULL,       NULL,
};

PyMODINIT_FUNC
PyInit__trusted_native(void)
{
    PyObject *m;

    if (s_block_hash == NULL && (s_block_hash = PyUnicode_InternFromString("block_hash")) == NULL)
        return NULL;
    if (s_token_ids == NULL && (s_token_ids = PyUnicode_InternFromString("token_ids")) == NULL)
        return NULL;
    if (s_extra_keys == NULL && (s_extra_keys = PyUnicode_InternFromString("extra_keys")) == NULL)
        return NULL;
    for (int i = 0; i < B_N; i++) {
        if (block_param_names[i] == NULL &&
            (block_param_names[i] = PyUnicode_InternFromString(block_params[i])) == NULL)
            return NULL;
    }
    if (base_fields_set == NULL) {
        PyObject *names = PyTuple_Pack(2, s_block_hash, s_token_ids);
        if (names == NULL)
            return NULL;
        base_fields_set = PyFrozenSet_New(names);
        Py_DECREF(names);
        if (base_fields_set == NULL)
            return NULL;
    }
    {
        struct {
            PyObject **var;
            const char *text;
        } names[] = {{&s_data, "data"},         {&s_type, "type"},
                     {&s_blocks, "blocks"},     {&s_parent_hash, "parent_hash"},
                     {&s_cache_level, "cache_level"}, {&s_stored, "stored"},
                     {&s_removed, "removed"}};
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
            if (*names[i].var == NULL &&
                (*names[i].var = PyUnicode_InternFromString(names[i].text)) == NULL)
                return NULL;
        }
    }
    if (stored_fields_set == NULL) {
        PyObject *names = PyTuple_Pack(3, s_type, s_parent_hash, s_blocks);
        if (names == NULL)
            return NULL;
        stored_fields_set = PyFrozenSet_New(names);
        Py_DECREF(names);
        if (stored_fields_set == NULL)
            return NULL;
    }
    if (removed_fields_set == NULL) {
        PyObject *names = PyTuple_Pack(3, s_type, block_param_names[B_HASHES], s_cache_level);
        if (names == NULL)
            return NULL;
        removed_fields_set = PyFrozenSet_New(names);
        Py_DECREF(names);
        if (removed_fields_set == NULL)
            return NULL;
    }
    if (PyType_Ready(&ModelFactoryType) < 0 || PyType_Ready(&TokenFactoryType) < 0 ||
        PyType_Ready(&EmittedEventsType) < 0)
        return NULL;
    m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ModelFactoryType);
    if (PyModule_AddObject(m, "ModelFactory", (PyObject *)&ModelFactoryType) < 0) {
        Py_DECREF(&ModelFactoryType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&TokenFactoryType);
    if (PyModule_AddObject(m, "TokenFactory", (PyObject *)&TokenFactoryType) < 0) {
        Py_DECREF(&TokenFactoryType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&EmittedEventsType);
    if (PyModule_AddObject(m, "EmittedEvents", (PyObject *)&EmittedEventsType) < 0) {
        Py_DECREF(&EmittedEventsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
