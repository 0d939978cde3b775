/* kvstream.index._match_native: the index's result records, and the per-worker results of
 * PrefixIndex.match and Router.route in one C call.
 *
 *   Record, Field(index, name)
 *
 * The base of kvstream.index.record.Record (WorkerMatch, MatchResult, WorkerScore,
 * RouteDecision): an immutable record whose values this type owns, one array slot per field
 * as a tuple holds its items. A subclass names its fields in ``__record_fields__`` (and the
 * defaults of the last ones in ``__record_defaults__``); ``Field`` is the read-only accessor
 * of one of them. Constructing one is this type's own ``tp_new``, so the classes' public
 * constructor is as cheap as a C call: no per-field ``object.__setattr__`` of a frozen
 * dataclass, and nothing written into another class's slots. record.py's _PyRecord is the
 * reference and the fallback; tests/test_index_record.py holds them equal.
 *
 *   fill(out, found, rows, new, n, tpb, algo, w0) -> list
 *
 * For each ``(slot, depth)`` pair of ``found`` (what HashDomain.slot_depths returns), the
 * plan row ``rows[slot] = (key, table, domain, trusted, note, pos, more)`` names the worker;
 * when its table holds no block below the first tier (``table.lower`` is 0), the result is
 * ``new(key, depth, depth * w0, n, tpb, algo, trusted, note)`` and it is stored at ``out[pos]``
 * and at ``out[i]`` for every ``i`` in ``more``. Pairs whose table has lower-tier blocks are
 * returned (in order) for the caller to weigh block by block (``GroupTable.weighted``).
 *
 *   zeros(out, rows, new, n_of) -> None
 *
 * The result of every candidate that holds nothing of the request (its ``out[pos]`` still
 * None): ``new(key, 0, 0.0, n, tpb, algo, trusted, note)`` per such plan row, ``n`` the
 * request's blocks in its domain (``n_of``).
 *
 * Both build a result with the record type's own allocation when ``new`` is a Record class
 * that overrides neither ``__new__`` nor ``__init__`` (what calling it would do, without
 * parsing an argument tuple), and call ``new`` otherwise.
 *
 * (and ``score``, below: Router.route's per-worker scores).
 *
 * This is the loop of kvstream/index/index.py's PrefixIndex.match without the interpreter's
 * per-worker steps; that loop is the reference and the fallback (KVSTREAM_NO_NATIVE=1 or no C
 * compiler). tests/test_match_native.py checks both give identical results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ------------------------------------------------------------------ Record */

typedef struct {
    PyObject_VAR_HEAD
    PyObject *item[1];
} Record;

static PyTypeObject RecordType;
static PyObject *s_fields, *s_defaults, *s_qualname, *s_dictoffset, *frozen_error;

/* The record class's field names and defaults (new references), checked. */
static int
record_layout(PyTypeObject *type, PyObject **names, PyObject **defaults)
{
    *defaults = NULL;
    *names = PyObject_GetAttr((PyObject *)type, s_fields);
    if (*names == NULL)
        return -1;
    if (!PyTuple_Check(*names) || PyTuple_GET_SIZE(*names) == 0) {
        PyErr_Format(PyExc_TypeError, "%s is not a record class with fields", type->tp_name);
        goto fail;
    }
    *defaults = PyObject_GetAttr((PyObject *)type, s_defaults);
    if (*defaults == NULL)
        goto fail;
    if (!PyTuple_Check(*defaults) || PyTuple_GET_SIZE(*defaults) > PyTuple_GET_SIZE(*names)) {
        PyErr_Format(PyExc_TypeError, "%s.__record_defaults__ is not a tuple of at most one "
                     "default per field", type->tp_name);
        goto fail;
    }
    return 0;
fail:
    Py_CLEAR(*names);
    Py_CLEAR(*defaults);
    return -1;
}

/* True for objects that reference nothing else (so cannot be part of a cycle). */
static int
is_leaf(PyObject *o)
{
    return o == Py_None || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyBool_Check(o)
           || PyUnicode_CheckExact(o) || PyBytes_CheckExact(o);
}

/* The last tuple subclass found to have no instance __dict__ (a NamedTuple: WorkerKey). */
static PyObject *dictless_tuple_type;

/* A leaf, or a tuple of leaves (a tuple subclass only when its instances have no __dict__,
 * through which a cycle could pass). -1 on error. */
static int
is_acyclic(PyObject *o)
{
    if (is_leaf(o))
        return 1;
    if (!PyTuple_Check(o))
        return 0;
    if (!PyTuple_CheckExact(o) && (PyObject *)Py_TYPE(o) != dictless_tuple_type) {
        PyObject *off = PyObject_GetAttr((PyObject *)Py_TYPE(o), s_dictoffset);
        if (off == NULL)
            return -1;
        int none = PyLong_Check(off) && PyLong_AsSsize_t(off) == 0;
        Py_DECREF(off);
        if (!none)
            return 0;
        Py_XSETREF(dictless_tuple_type, Py_NewRef((PyObject *)Py_TYPE(o)));
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++)
        if (!is_leaf(PyTuple_GET_ITEM(o, i)))
            return 0;
    return 1;
}

static PyObject *
record_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *names, *defaults;
    if (record_layout(type, &names, &defaults) < 0)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(names), nd = PyTuple_GET_SIZE(defaults);
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    Record *self = NULL;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments but %zd were given",
                     type->tp_name, n, nargs);
        goto fail;
    }
    self = (Record *)type->tp_alloc(type, n);
    if (self == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < nargs; i++)
        self->item[i] = Py_NewRef(PyTuple_GET_ITEM(args, i));
    if (kwds != NULL) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwds, &pos, &key, &value)) {
            Py_ssize_t j = -1;
            for (Py_ssize_t i = 0; i < n && j < 0; i++) {
                PyObject *name = PyTuple_GET_ITEM(names, i);
                if (name == key)
                    j = i;
                else if (PyUnicode_Check(key)) {
                    int eq = PyUnicode_Compare(name, key);
                    if (eq == -1 && PyErr_Occurred())
                        goto fail;
                    if (eq == 0)
                        j = i;
                }
            }
            if (j < 0) {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R",
                             type->tp_name, key);
                goto fail;
            }
            if (self->item[j] != NULL) {
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument %R",
                             type->tp_name, key);
                goto fail;
            }
            self->item[j] = Py_NewRef(value);
        }
    }
    int acyclic = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (self->item[i] == NULL) {
            if (i < n - nd) {
                PyErr_Format(PyExc_TypeError, "%s() missing required argument %R",
                             type->tp_name, PyTuple_GET_ITEM(names, i));
                goto fail;
            }
            self->item[i] = Py_NewRef(PyTuple_GET_ITEM(defaults, i - (n - nd)));
        }
        if (acyclic) {
            acyclic = is_acyclic(self->item[i]);
            if (acyclic < 0)
                goto fail;
        }
    }
    /* as CPython does for tuples of atoms: a record whose values cannot lead back to it is
     * left to reference counting, so a stream of results triggers no collections */
    if (acyclic && PyObject_GC_IsTracked((PyObject *)self))
        PyObject_GC_UnTrack(self);
    Py_DECREF(names);
    Py_DECREF(defaults);
    return (PyObject *)self;
fail:
    Py_XDECREF(self);
    Py_DECREF(names);
    Py_DECREF(defaults);
    return NULL;
}

/* Whether ``new`` builds its records with record_new alone (a Record subclass that overrides
 * neither __new__ nor __init__) and has exactly ``n`` fields: then record_make may stand in
 * for calling it. 1 yes, 0 no, -1 on error. */
static int
record_direct(PyObject *new, Py_ssize_t n)
{
    if (!PyType_Check(new) || !PyType_IsSubtype((PyTypeObject *)new, &RecordType))
        return 0;
    PyTypeObject *type = (PyTypeObject *)new;
    if (type->tp_new != record_new || type->tp_init != PyBaseObject_Type.tp_init)
        return 0;
    PyObject *names, *defaults;
    if (record_layout(type, &names, &defaults) < 0)
        return -1;
    int ok = PyTuple_GET_SIZE(names) == n;
    Py_DECREF(names);
    Py_DECREF(defaults);
    return ok;
}

/* A record of ``type`` holding the ``n`` values ``items`` (borrowed; every field given),
 * exactly as record_new would build it from them: what ``type(*items)`` returns when
 * record_direct(type, n) holds, without parsing an argument tuple. */
static PyObject *
record_make(PyTypeObject *type, PyObject *const *items, Py_ssize_t n)
{
    Record *self = (Record *)type->tp_alloc(type, n);
    if (self == NULL)
        return NULL;
    int acyclic = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        self->item[i] = Py_NewRef(items[i]);
        if (acyclic) {
            acyclic = is_acyclic(items[i]);
            if (acyclic < 0) {
                Py_DECREF(self);
                return NULL;
            }
        }
    }
    if (acyclic && PyObject_GC_IsTracked((PyObject *)self))
        PyObject_GC_UnTrack(self);
    return (PyObject *)self;
}

static void
record_dealloc(Record *self)
{
    PyObject_GC_UnTrack(self);
    for (Py_ssize_t i = 0; i < Py_SIZE(self); i++)
        Py_XDECREF(self->item[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
record_traverse(Record *self, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < Py_SIZE(self); i++)
        Py_VISIT(self->item[i]);
    return 0;
}

/* The values as a tuple (a new reference). */
static PyObject *
record_values(Record *self)
{
    PyObject *t = PyTuple_New(Py_SIZE(self));
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < Py_SIZE(self); i++) {
        if (self->item[i] == NULL) {
            Py_DECREF(t);
            PyErr_SetString(PyExc_SystemError, "a record without all its values");
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, Py_NewRef(self->item[i]));
    }
    return t;
}

/* As a frozen dataclass's: equal when of the same class with equal values in order. */
static PyObject *
record_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != Py_TYPE(b))
        Py_RETURN_NOTIMPLEMENTED;
    Record *x = (Record *)a, *y = (Record *)b;
    int equal = Py_SIZE(x) == Py_SIZE(y);
    for (Py_ssize_t i = 0; equal && i < Py_SIZE(x); i++) {
        if (x->item[i] == NULL || y->item[i] == NULL) {
            PyErr_SetString(PyExc_SystemError, "a record without all its values");
            return NULL;
        }
        equal = PyObject_RichCompareBool(x->item[i], y->item[i], Py_EQ);
        if (equal < 0)
            return NULL;
    }
    return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

/* hash(values as a tuple), as a frozen dataclass's. */
static Py_hash_t
record_hash(Record *self)
{
    PyObject *t = record_values(self);
    if (t == NULL)
        return -1;
    Py_hash_t h = PyObject_Hash(t);
    Py_DECREF(t);
    return h;
}

/* ``Name(field=value!r, ...)``, as a frozen dataclass's (``...`` when recursive). */
static PyObject *
record_repr(Record *self)
{
    int rec = Py_ReprEnter((PyObject *)self);
    if (rec != 0)
        return rec > 0 ? PyUnicode_FromString("...") : NULL;
    PyObject *out = NULL, *parts = NULL, *sep = NULL, *body = NULL;
    PyObject *qualname = PyObject_GetAttr((PyObject *)Py_TYPE(self), s_qualname);
    PyObject *names = PyObject_GetAttr((PyObject *)Py_TYPE(self), s_fields);
    if (qualname == NULL || names == NULL)
        goto done;
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != Py_SIZE(self)) {
        PyErr_SetString(PyExc_TypeError, "the record's __record_fields__ changed");
        goto done;
    }
    parts = PyList_New(Py_SIZE(self));
    if (parts == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < Py_SIZE(self); i++) {
        PyObject *part = PyUnicode_FromFormat("%U=%R", PyTuple_GET_ITEM(names, i),
                                              self->item[i] ? self->item[i] : Py_None);
        if (part == NULL)
            goto done;
        PyList_SET_ITEM(parts, i, part);
    }
    if ((sep = PyUnicode_FromString(", ")) == NULL || (body = PyUnicode_Join(sep, parts)) == NULL)
        goto done;
    out = PyUnicode_FromFormat("%U(%U)", qualname, body);
done:
    Py_XDECREF(qualname);
    Py_XDECREF(names);
    Py_XDECREF(parts);
    Py_XDECREF(sep);
    Py_XDECREF(body);
    Py_ReprLeave((PyObject *)self);
    return out;
}

static PyObject *
record_reduce(Record *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *t = record_values(self);
    return t == NULL ? NULL : Py_BuildValue("(ON)", (PyObject *)Py_TYPE(self), t);
}

static PyMethodDef record_methods[] = {
    {"__reduce__", (PyCFunction)record_reduce, METH_NOARGS,
     "(class, values): a record pickles and copies as a call of its class."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstream.index._match_native.Record",
    .tp_basicsize = sizeof(Record) - sizeof(PyObject *),
    .tp_itemsize = sizeof(PyObject *),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The base of the index's immutable result records (see kvstream.index.record).",
    .tp_new = record_new,
    .tp_dealloc = (destructor)record_dealloc,
    .tp_traverse = (traverseproc)record_traverse,
    .tp_richcompare = record_richcompare,
    .tp_hash = (hashfunc)record_hash,
    .tp_repr = (reprfunc)record_repr,
    .tp_methods = record_methods,
    .tp_free = PyObject_GC_Del,
};

/* ------------------------------------------------------------------ Field */

typedef struct {
    PyObject_HEAD
    Py_ssize_t index;
    PyObject *name;
} Field;

static PyObject *
field_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"index", "name", NULL};
    Py_ssize_t index;
    PyObject *name;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nU:Field", kwlist, &index, &name))
        return NULL;
    if (index < 0) {
        PyErr_SetString(PyExc_ValueError, "Field: a negative index");
        return NULL;
    }
    Field *self = (Field *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->index = index;
    self->name = Py_NewRef(name);
    return (PyObject *)self;
}

static void
field_dealloc(Field *self)
{
    Py_XDECREF(self->name);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
field_get(Field *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef((PyObject *)self);
    if (!PyObject_TypeCheck(obj, &RecordType)) {
        PyErr_Format(PyExc_TypeError, "field %R reads records, not %s", self->name,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    Record *r = (Record *)obj;
    if (self->index >= Py_SIZE(r) || r->item[self->index] == NULL) {
        PyErr_Format(PyExc_AttributeError, "%s has no field %R", Py_TYPE(obj)->tp_name,
                     self->name);
        return NULL;
    }
    return Py_NewRef(r->item[self->index]);
}

static int
field_set(Field *self, PyObject *obj, PyObject *value)
{
    PyErr_Format(frozen_error, value == NULL ? "cannot delete field %R"
                                             : "cannot assign to field %R", self->name);
    return -1;
}

static PyObject *
field_name(Field *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->name);
}

static PyObject *
field_index(Field *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->index);
}

static PyGetSetDef field_getset[] = {
    {"name", (getter)field_name, NULL, "the field's name", NULL},
    {"index", (getter)field_index, NULL, "the field's position", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FieldType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstream.index._match_native.Field",
    .tp_basicsize = sizeof(Field),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Field(index, name): the read-only accessor of a record's field.",
    .tp_new = field_new,
    .tp_dealloc = (destructor)field_dealloc,
    .tp_descr_get = (descrgetfunc)field_get,
    .tp_descr_set = (descrsetfunc)field_set,
    .tp_getset = field_getset,
};

/* ------------------------------------------------------------------ fill */

/* Store ``m`` (a new reference, always consumed) at ``out[pos]`` and at ``out[i]`` for every
 * ``i`` in ``more`` of the plan row ``(key, table, domain, trusted, note, pos, more)``. */
static int
place(PyObject *out, PyObject *row, PyObject *m)
{
    Py_ssize_t size = PyList_GET_SIZE(out);
    Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 5));
    if (pos == -1 && PyErr_Occurred())
        goto fail;
    if (pos < 0 || pos >= size) {
        PyErr_SetString(PyExc_IndexError, "a plan row's position is outside out");
        goto fail;
    }
    PyObject *more = PyTuple_GET_ITEM(row, 6);
    if (!PyList_Check(more)) {
        PyErr_SetString(PyExc_TypeError, "a plan row's further positions are a list");
        goto fail;
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(more); k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(more, k));
        if (i == -1 && PyErr_Occurred())
            goto fail;
        if (i < 0 || i >= size) {
            PyErr_SetString(PyExc_IndexError, "a plan row's position is outside out");
            goto fail;
        }
        Py_INCREF(m);
        PyList_SetItem(out, i, m); /* steals the new reference, drops the old item */
    }
    PyList_SetItem(out, pos, m); /* steals m */
    return 0;
fail:
    Py_DECREF(m);
    return -1;
}

static PyObject *s_lower;

static PyObject *
fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "fill() takes 8 arguments");
        return NULL;
    }
    PyObject *out = args[0], *found = args[1], *rows = args[2], *new = args[3];
    PyObject *n = args[4], *tpb = args[5], *algo = args[6];
    double w0 = PyFloat_AsDouble(args[7]);
    if (w0 == -1.0 && PyErr_Occurred())
        return NULL;
    if (!PyList_Check(out) || !PyList_Check(found) || !PyDict_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "fill(): out and found must be lists, rows a dict");
        return NULL;
    }
    int direct = record_direct(new, 8);
    if (direct < 0)
        return NULL;
    PyObject *left = PyList_New(0);
    if (left == NULL)
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(found);
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *pair = PyList_GET_ITEM(found, j);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "fill(): found holds (slot, depth) pairs");
            goto fail;
        }
        PyObject *slot = PyTuple_GET_ITEM(pair, 0), *depth = PyTuple_GET_ITEM(pair, 1);
        PyObject *row = PyDict_GetItemWithError(rows, slot);
        if (row == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, slot);
            goto fail;
        }
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 7) {
            PyErr_SetString(PyExc_TypeError, "fill(): a plan row is a 7-tuple");
            goto fail;
        }
        PyObject *lower = PyObject_GetAttr(PyTuple_GET_ITEM(row, 1), s_lower);
        if (lower == NULL)
            goto fail;
        int has_lower = PyObject_IsTrue(lower);
        Py_DECREF(lower);
        if (has_lower < 0)
            goto fail;
        if (has_lower) {
            if (PyList_Append(left, pair) < 0)
                goto fail;
            continue;
        }
        long long d = PyLong_AsLongLong(depth);
        if (d == -1 && PyErr_Occurred())
            goto fail;
        PyObject *weighted = PyFloat_FromDouble((double)d * w0);
        if (weighted == NULL)
            goto fail;
        PyObject *call[8] = {
            PyTuple_GET_ITEM(row, 0), depth, weighted, n, tpb, algo,
            PyTuple_GET_ITEM(row, 3), PyTuple_GET_ITEM(row, 4),
        };
        PyObject *m = direct ? record_make((PyTypeObject *)new, call, 8)
                             : PyObject_Vectorcall(new, call, 8, NULL);
        Py_DECREF(weighted);
        if (m == NULL)
            goto fail;
        if (place(out, row, m) < 0)
            goto fail;
    }
    return left;
fail:
    Py_DECREF(left);
    return NULL;
}

static PyObject *s_algo, *s_tpb, *s_weighted, *s_trusted;

/* zeros(out, rows, new, n_of) -> None
 *
 * For every plan row ``(key, table, domain, trusted, note, pos, more)`` of the dict ``rows``
 * whose ``out[pos]`` is None (a candidate no match placed), ``new(key, 0, 0.0, n_of[domain],
 * domain.tokens_per_block, domain.hash_algo, trusted, note)`` stored at ``out[pos]`` and at
 * ``out[i]`` for every ``i`` in ``more``: _Plan.zero_row's loop for the rows left. */
static PyObject *
zeros(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "zeros() takes 4 arguments");
        return NULL;
    }
    PyObject *out = args[0], *rows = args[1], *new = args[2], *n_of = args[3];
    if (!PyList_Check(out) || !PyDict_Check(rows) || !PyDict_Check(n_of)) {
        PyErr_SetString(PyExc_TypeError, "zeros(): out must be a list, rows and n_of dicts");
        return NULL;
    }
    int direct = record_direct(new, 8);
    if (direct < 0)
        return NULL;
    PyObject *zero = PyLong_FromLong(0), *fzero = PyFloat_FromDouble(0.0);
    PyObject *dom = NULL, *n = NULL, *tpb = NULL, *algo = NULL;
    PyObject *result = NULL;
    if (zero == NULL || fzero == NULL)
        goto done;
    PyObject *slot, *row;
    Py_ssize_t it = 0;
    while (PyDict_Next(rows, &it, &slot, &row)) {
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 7) {
            PyErr_SetString(PyExc_TypeError, "zeros(): a plan row is a 7-tuple");
            goto done;
        }
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(row, 5));
        if (pos == -1 && PyErr_Occurred())
            goto done;
        if (pos < 0 || pos >= PyList_GET_SIZE(out)) {
            PyErr_SetString(PyExc_IndexError, "a plan row's position is outside out");
            goto done;
        }
        if (PyList_GET_ITEM(out, pos) != Py_None)
            continue; /* matched */
        PyObject *d = PyTuple_GET_ITEM(row, 2);
        if (d != dom) { /* rows of one domain come together: look it up once per run */
            Py_XSETREF(dom, Py_NewRef(d));
            Py_CLEAR(tpb);
            Py_CLEAR(algo);
            n = PyDict_GetItemWithError(n_of, d); /* borrowed: n_of outlives the call */
            if (n == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, d);
                goto done;
            }
            tpb = PyObject_GetAttr(d, s_tpb);
            if (tpb == NULL)
                goto done;
            algo = PyObject_GetAttr(d, s_algo);
            if (algo == NULL)
                goto done;
        }
        PyObject *call[8] = {
            PyTuple_GET_ITEM(row, 0), zero, fzero, n, tpb, algo,
            PyTuple_GET_ITEM(row, 3), PyTuple_GET_ITEM(row, 4),
        };
        PyObject *m = direct ? record_make((PyTypeObject *)new, call, 8)
                             : PyObject_Vectorcall(new, call, 8, NULL);
        if (m == NULL || place(out, row, m) < 0)
            goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(zero);
    Py_XDECREF(fzero);
    Py_XDECREF(dom);
    Py_XDECREF(tpb);
    Py_XDECREF(algo);
    return result;
}

/* score(matches, pending, blocks, requests, base, n_tokens, factor, default_tpb, new)
 *     -> (scores, costs)
 *
 * Router.route's per-worker loop (kvstream/index/router.py, the reference and the fallback):
 * for worker i, ``tpb = m.tokens_per_block or default_tpb``, ``prefill = max(n_tokens -
 * (m.weighted_blocks * tpb if m.trusted else 0.0), 0.0) / tpb``, ``cost = factor * prefill +
 * base[i]`` and the score ``new(m, requests[i], blocks[i], prefill, cost, pending[i])``, in
 * the same double arithmetic as Python's. */

static PyObject *
score(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "score() takes 9 arguments");
        return NULL;
    }
    PyObject *matches = args[0], *pending = args[1], *blocks = args[2], *requests = args[3];
    PyObject *base = args[4], *new = args[8];
    if (!PyTuple_Check(matches) || !PyTuple_Check(pending) || !PyTuple_Check(blocks)
        || !PyTuple_Check(requests) || !PyTuple_Check(base)) {
        PyErr_SetString(PyExc_TypeError, "score(): the columns must be tuples");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(matches);
    if (PyTuple_GET_SIZE(pending) != n || PyTuple_GET_SIZE(blocks) != n
        || PyTuple_GET_SIZE(requests) != n || PyTuple_GET_SIZE(base) != n) {
        PyErr_SetString(PyExc_ValueError, "score(): columns of different lengths");
        return NULL;
    }
    double n_tokens = PyFloat_AsDouble(args[5]);
    if (n_tokens == -1.0 && PyErr_Occurred())
        return NULL;
    double factor = PyFloat_AsDouble(args[6]);
    if (factor == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *default_tpb = args[7];
    PyObject *scores = PyList_New(n), *costs = PyList_New(n);
    if (scores == NULL || costs == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyTuple_GET_ITEM(matches, i);
        PyObject *t = PyObject_GetAttr(m, s_tpb);
        if (t == NULL)
            goto fail;
        int truthy = PyObject_IsTrue(t);
        if (truthy < 0) {
            Py_DECREF(t);
            goto fail;
        }
        double tpb = PyFloat_AsDouble(truthy ? t : default_tpb);
        Py_DECREF(t);
        if (tpb == -1.0 && PyErr_Occurred())
            goto fail;
        PyObject *tr = PyObject_GetAttr(m, s_trusted);
        if (tr == NULL)
            goto fail;
        int trusted = PyObject_IsTrue(tr);
        Py_DECREF(tr);
        if (trusted < 0)
            goto fail;
        double used = 0.0;
        if (trusted) {
            PyObject *w = PyObject_GetAttr(m, s_weighted);
            if (w == NULL)
                goto fail;
            double wb = PyFloat_AsDouble(w);
            Py_DECREF(w);
            if (wb == -1.0 && PyErr_Occurred())
                goto fail;
            used = wb * tpb;
        }
        double left = n_tokens - used;
        double q = PyFloat_AsDouble(PyTuple_GET_ITEM(base, i));
        if (q == -1.0 && PyErr_Occurred())
            goto fail;
        double prefill = (left > 0.0 ? left : 0.0) / tpb;
        PyObject *p = PyFloat_FromDouble(prefill);
        if (p == NULL)
            goto fail;
        PyObject *c = PyFloat_FromDouble(factor * prefill + q);
        if (c == NULL) {
            Py_DECREF(p);
            goto fail;
        }
        PyObject *call[6] = {
            m, PyTuple_GET_ITEM(requests, i), PyTuple_GET_ITEM(blocks, i), p, c,
            PyTuple_GET_ITEM(pending, i),
        };
        PyObject *sc = PyObject_Vectorcall(new, call, 6, NULL);
        Py_DECREF(p);
        if (sc == NULL) {
            Py_DECREF(c);
            goto fail;
        }
        PyList_SET_ITEM(scores, i, sc);
        PyList_SET_ITEM(costs, i, c);
    }
    return Py_BuildValue("(NN)", scores, costs);
fail:
    Py_XDECREF(scores);
    Py_XDECREF(costs);
    return NULL;
}

static PyMethodDef methods[] = {
    {"score", (PyCFunction)(void (*)(void))score, METH_FASTCALL,
     "score(matches, pending, blocks, requests, base, n_tokens, factor, default_tpb, new) "
     "-> (scores, costs)"},
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL,
     "fill(out, found, rows, new, n, tpb, algo, w0) -> pairs left to weigh"},
    {"zeros", (PyCFunction)(void (*)(void))zeros, METH_FASTCALL,
     "zeros(out, rows, new, n_of) -> None: every candidate's result when none matches"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstream.index._match_native",
    "The index's result records, and PrefixIndex.match's and Router.route's per-worker "
    "results in C.",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__match_native(void)
{
    s_lower = PyUnicode_InternFromString("lower");
    s_tpb = PyUnicode_InternFromString("tokens_per_block");
    s_algo = PyUnicode_InternFromString("hash_algo");
    s_weighted = PyUnicode_InternFromString("weighted_blocks");
    s_trusted = PyUnicode_InternFromString("trusted");
    s_fields = PyUnicode_InternFromString("__record_fields__");
    s_defaults = PyUnicode_InternFromString("__record_defaults__");
    s_qualname = PyUnicode_InternFromString("__qualname__");
    s_dictoffset = PyUnicode_InternFromString("__dictoffset__");
    if (s_lower == NULL || s_tpb == NULL || s_algo == NULL || s_weighted == NULL || s_trusted == NULL
        || s_fields == NULL || s_defaults == NULL || s_qualname == NULL || s_dictoffset == NULL)
        return NULL;
    if (frozen_error == NULL) {
        PyObject *dc = PyImport_ImportModule("dataclasses");
        if (dc == NULL)
            return NULL;
        frozen_error = PyObject_GetAttrString(dc, "FrozenInstanceError");
        Py_DECREF(dc);
        if (frozen_error == NULL)
            return NULL;
    }
    if (PyType_Ready(&RecordType) < 0 || PyType_Ready(&FieldType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    if (PyModule_AddObjectRef(mod, "Record", (PyObject *)&RecordType) < 0
        || PyModule_AddObjectRef(mod, "Field", (PyObject *)&FieldType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
