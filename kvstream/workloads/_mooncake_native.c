/*
 * kvstream.workloads._mooncake_native: a hash-id row's prompt bytes in one call.
 *
 * The definition (and the pure-Python reference, which is also the fallback and the path that
 * reports bad input) is MooncakeTokens.prompt in kvstream/workloads/mooncake.py: block h is
 * the 3 stamp tokens (h % v, h / v % v, h / v**2) then block_tokens - 3 tokens of the pool at
 * token offset ((h ^ seed) * MIX mod 2**64) % (pool tokens - (block_tokens - 3)); the prompt
 * is the blocks concatenated, cut to n_tokens.
 *
 *   prompt(pool, hash_ids, seed, vocab_size, block_tokens, n_tokens) -> bytes | None
 *       pool: the u32 LE pool; hash_ids: a tuple or list of ints; n_tokens: 0 .. the blocks'
 *       total. None (the caller takes the Python path, which raises the proper error) when
 *       anything is outside what this handles: an id that is not an exact int in
 *       0 .. vocab_size**3 - 1, vocab_size outside 2 .. 2**32 - 1, block_tokens <= 3 or not
 *       shorter than the pool plus 3, n_tokens outside its range.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define STAMP 3
#define MIX 0x9E3779B97F4A7C15ull

static inline void
put_le32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

PyDoc_STRVAR(prompt_doc,
             "prompt(pool, hash_ids, seed, vocab_size, block_tokens, n_tokens) -> bytes | None\n\n"
             "A hash-id row's prompt as u32 LE bytes (see the module docstring); None when the "
             "Python reference must run instead.");

static PyObject *
mn_prompt(PyObject *self, PyObject *args)
{
    Py_buffer pool;
    PyObject *ids, *seed_obj, *out = NULL, **items;
    Py_ssize_t block_tokens, n_tokens, n, i, pool_tokens, body, vocab_arg;
    unsigned long long vocab, vv, seed, span;
    unsigned char *p;
    size_t left;

    if (!PyArg_ParseTuple(args, "y*OOnnn", &pool, &ids, &seed_obj, &vocab_arg, &block_tokens,
                          &n_tokens))
        return NULL;
    if (!PyLong_Check(seed_obj) || (!PyTuple_Check(ids) && !PyList_Check(ids)))
        goto fallback;
    seed = PyLong_AsUnsignedLongLongMask(seed_obj); /* seed mod 2**64: what the mask keeps */
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto fallback;
    }
    n = PySequence_Fast_GET_SIZE(ids);
    vocab = vocab_arg < 0 ? 0 : (unsigned long long)vocab_arg;
    pool_tokens = pool.len / 4;
    body = block_tokens - STAMP;
    if (vocab < 2 || vocab > 0xFFFFFFFFull || block_tokens <= STAMP || body >= pool_tokens ||
        n_tokens < 0 || n > PY_SSIZE_T_MAX / block_tokens || n_tokens > n * block_tokens)
        goto fallback;
    vv = vocab * vocab;
    span = (unsigned long long)(pool_tokens - body);
    out = PyBytes_FromStringAndSize(NULL, 4 * n_tokens);
    if (out == NULL) {
        PyBuffer_Release(&pool);
        return NULL;
    }
    p = (unsigned char *)PyBytes_AS_STRING(out);
    left = 4 * (size_t)n_tokens;
    /* no Python code runs in the loop (exact ints only), so the item array stays put */
    items = PySequence_Fast_ITEMS(ids);
    for (i = 0; i < n; i++) {
        PyObject *item = items[i];
        unsigned long long h, off;
        unsigned char blk[4 * STAMP];
        size_t k;
        if (!PyLong_CheckExact(item))
            goto fallback;
        h = PyLong_AsUnsignedLongLong(item);
        if (h == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or beyond 64 bits */
            goto fallback;
        }
        if (h / vv >= vocab) /* h >= vocab**3: the stamp would not be unique */
            goto fallback;
        if (left == 0)
            continue; /* past the cut: ids are still checked, as the reference does */
        off = ((h ^ seed) * MIX) % span;
        put_le32(blk, (uint32_t)(h % vocab));
        put_le32(blk + 4, (uint32_t)(h / vocab % vocab));
        put_le32(blk + 8, (uint32_t)(h / vv));
        k = left < sizeof blk ? left : sizeof blk;
        memcpy(p, blk, k);
        p += k;
        left -= k;
        k = left < 4 * (size_t)body ? left : 4 * (size_t)body;
        memcpy(p, (const unsigned char *)pool.buf + 4 * off, k);
        p += k;
        left -= k;
    }
    PyBuffer_Release(&pool);
    return out;

fallback:
    Py_XDECREF(out);
    PyBuffer_Release(&pool);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"prompt", mn_prompt, METH_VARARGS, prompt_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    "kvstream.workloads._mooncake_native",
    "A Mooncake hash-id row's prompt bytes in C (see kvstream.workloads.mooncake).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__mooncake_native(void)
{
    return PyModule_Create(&moduledef);
}
