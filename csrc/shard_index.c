/* kvtier._shard_index: a hash table of fixed-width keys to fixed-width values, driven a batch at a time.
 *
 * The chunk engine's in-memory index of committed shard records by name (tenant/key/index; see
 * kvstore/shard_index.py). A node holds hundreds of thousands of them and a 64 KiB-block request brings a thousand
 * names, so every operation takes a whole table of keys (n rows of key_width bytes, as numpy builds them from
 * a request) and answers with a table: no Python object per key or per record. A dict of bytes to bytes keeps a
 * shard in four scattered objects; here a shard is a 4-byte tag in one array and its key and value side by side
 * in another, and a batch's slots are prefetched a few keys ahead, so the cache misses of a thousand lookups
 * overlap instead of following one another.
 *
 * Open addressing with linear probing over a power-of-two table. Probes walk the tags (0 empty, 1 deleted, else
 * 2 | the high bits of the key's hash), sixteen to a cache line, and compare key bytes only where a tag
 * matches: a put's new names are misses, whose probes run past every deleted slot to an empty one. The hash is seeded
 * at random per table, so keys cannot be chosen to collide. The table grows (or drops its deleted slots) once
 * live and deleted slots fill three quarters of it, to at most half full after. Not thread-safe: the caller
 * serialises calls (the chunk engine holds its lock), and every call holds the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <sys/random.h>

#define EMPTY 0u
#define DELETED 1u
#define MIN_CAPACITY 1024

#define PREFETCH_AHEAD 8 /* keys of a batch whose home slot is prefetched before it is probed */

typedef struct {
    PyObject_HEAD Py_ssize_t key_width, value_width;
    Py_ssize_t capacity, used, filled; /* slots: all, live, live or deleted */
    size_t stride;                     /* bytes of an entry: key, value */
    uint32_t *tags;
    unsigned char *entries;
    uint64_t seed;
} IndexObject;

static inline uint32_t tag_at(const IndexObject *self, size_t i) { return self->tags[i]; }
static inline void set_tag(IndexObject *self, size_t i, uint32_t tag) { self->tags[i] = tag; }
static inline unsigned char *key_at(const IndexObject *self, size_t i) { return self->entries + i * self->stride; }
static inline unsigned char *value_at(const IndexObject *self, size_t i) { return key_at(self, i) + self->key_width; }

static uint64_t mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    return h ^ (h >> 33);
}

static uint64_t key_hash(const IndexObject *self, const unsigned char *key) {
    uint64_t h = self->seed, word;
    Py_ssize_t i = 0;
    for (; i + 8 <= self->key_width; i += 8) {
        memcpy(&word, key + i, 8);
        h = mix(h ^ word);
    }
    if (i < self->key_width) {
        word = 0;
        memcpy(&word, key + i, (size_t)(self->key_width - i));
        h = mix(h ^ word ^ 0x9e3779b97f4a7c15ULL);
    }
    return h;
}

static uint32_t tag_of(uint64_t h) { return (uint32_t)(h >> 32) | 2u; }

/* The slot holding key, or -1; then *slot_for gets where it would go (the first deleted slot on its path, else
 * the empty one that ended it). */
static Py_ssize_t find(const IndexObject *self, const unsigned char *key, uint64_t h, Py_ssize_t *slot_for) {
    size_t mask = (size_t)self->capacity - 1, i = (size_t)h & mask;
    uint32_t tag = tag_of(h);
    Py_ssize_t reuse = -1;
    for (;;) {
        uint32_t t = tag_at(self, i);
        if (t == EMPTY) {
            *slot_for = reuse >= 0 ? reuse : (Py_ssize_t)i;
            return -1;
        }
        if (t == DELETED) {
            if (reuse < 0) reuse = (Py_ssize_t)i;
        } else if (t == tag && !memcmp(key_at(self, i), key, (size_t)self->key_width)) {
            return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

/* The hashes of a batch's n keys (PyMem_Free them), or NULL with MemoryError. */
static uint64_t *batch_hashes(const IndexObject *self, const unsigned char *keys, Py_ssize_t n) {
    uint64_t *h = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!h) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t r = 0; r < n; r++) h[r] = key_hash(self, keys + (size_t)r * (size_t)self->key_width);
    return h;
}

/* Before probing row r of a batch: fetch the home slot of row r + PREFETCH_AHEAD (its tag, its entry's lines). */
static inline void prefetch_ahead(const IndexObject *self, const uint64_t *h, Py_ssize_t r, Py_ssize_t n) {
    if (r + PREFETCH_AHEAD < n) {
        size_t home = (size_t)h[r + PREFETCH_AHEAD] & ((size_t)self->capacity - 1);
        const unsigned char *at = key_at(self, home);
        __builtin_prefetch(self->tags + home);
        __builtin_prefetch(at);
        __builtin_prefetch(at + self->stride - 1);
    }
}

static int allocate(IndexObject *self, Py_ssize_t capacity) {
    uint32_t *tags = PyMem_Calloc((size_t)capacity, sizeof(uint32_t));
    unsigned char *entries = PyMem_Malloc((size_t)capacity * self->stride);
    if (!tags || !entries) {
        PyMem_Free(tags);
        PyMem_Free(entries);
        PyErr_NoMemory();
        return -1;
    }
    self->tags = tags, self->entries = entries;
    self->capacity = capacity, self->filled = self->used = 0;
    return 0;
}

/* Rebuild into a table of capacity slots (drops deleted slots). */
static int rehash(IndexObject *self, Py_ssize_t capacity) {
    IndexObject old = *self; /* allocate changes nothing when it fails */
    if (allocate(self, capacity) < 0) return -1;
    size_t mask = (size_t)capacity - 1;
    for (Py_ssize_t s = 0; s < old.capacity; s++) {
        if (tag_at(&old, (size_t)s) <= DELETED) continue;
        uint64_t h = key_hash(self, key_at(&old, (size_t)s));
        size_t i = (size_t)h & mask;
        while (tag_at(self, i) != EMPTY) i = (i + 1) & mask;
        set_tag(self, i, tag_at(&old, (size_t)s));
        memcpy(key_at(self, i), key_at(&old, (size_t)s), self->stride);
    }
    self->used = self->filled = old.used;
    PyMem_Free(old.tags);
    PyMem_Free(old.entries);
    return 0;
}

/* Room for more new keys with live and deleted slots at most three quarters of the table. */
static int reserve(IndexObject *self, Py_ssize_t more) {
    if ((self->filled + more) * 4 <= self->capacity * 3) return 0;
    Py_ssize_t capacity = self->capacity;
    while ((self->used + more) * 2 > capacity) capacity *= 2;
    return rehash(self, capacity);
}

static int index_init(IndexObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"key_width", "value_width", NULL};
    Py_ssize_t kw, vw;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nn:ShardIndexTable", kwlist, &kw, &vw)) return -1;
    if (kw < 1 || vw < 1 || kw > 65535 || vw > 65535) {
        PyErr_SetString(PyExc_ValueError, "key_width and value_width must be between 1 and 65535 bytes");
        return -1;
    }
    if (self->tags) return 0; /* __init__ called again: keep the table */
    self->key_width = kw, self->value_width = vw;
    self->stride = (size_t)(kw + vw);
    if (getrandom(&self->seed, sizeof self->seed, 0) != (ssize_t)sizeof self->seed)
        self->seed = (uint64_t)(uintptr_t)self ^ 0x2545f4914f6cdd1dULL;
    return allocate(self, MIN_CAPACITY);
}

static void index_dealloc(IndexObject *self) {
    PyMem_Free(self->tags);
    PyMem_Free(self->entries);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t index_len(IndexObject *self) { return self->used; }

/* keys as n rows of key_width bytes; n, or -1 with ValueError. */
static Py_ssize_t key_rows(IndexObject *self, Py_buffer *keys) {
    if (!self->tags) {
        PyErr_SetString(PyExc_RuntimeError, "ShardIndexTable used before __init__");
        return -1;
    }
    if (keys->len % self->key_width) {
        PyErr_Format(PyExc_ValueError, "keys must be whole rows of %zd bytes, got %zd bytes", self->key_width,
                     keys->len);
        return -1;
    }
    return keys->len / self->key_width;
}

static int rows_match(IndexObject *self, Py_buffer *values, Py_ssize_t n, const char *what) {
    if (values->len != n * self->value_width) {
        PyErr_Format(PyExc_ValueError, "%s must be %zd rows of %zd bytes, got %zd bytes", what, n, self->value_width,
                     values->len);
        return -1;
    }
    return 0;
}

/* lookup and remove: per row of keys 1 (present: its value copied into that row of out; with take, removed) or 0
 * (the row of out untouched). */
static PyObject *copy_out(IndexObject *self, PyObject *args, const char *format, int take) {
    Py_buffer keys, out;
    if (!PyArg_ParseTuple(args, format, &keys, &out)) return NULL;
    PyObject *found = NULL;
    Py_ssize_t n = key_rows(self, &keys), slot_for;
    uint64_t *h = NULL;
    if (n < 0 || rows_match(self, &out, n, "out") < 0 || !(h = batch_hashes(self, keys.buf, n))) goto done;
    found = PyBytes_FromStringAndSize(NULL, n);
    if (!found) goto done;
    char *hit = PyBytes_AS_STRING(found);
    size_t kw = (size_t)self->key_width, vw = (size_t)self->value_width;
    for (Py_ssize_t r = 0; r < n; r++) {
        prefetch_ahead(self, h, r, n);
        Py_ssize_t s = find(self, (const unsigned char *)keys.buf + (size_t)r * kw, h[r], &slot_for);
        hit[r] = s >= 0;
        if (s < 0) continue;
        memcpy((unsigned char *)out.buf + (size_t)r * vw, value_at(self, (size_t)s), vw);
        if (take) {
            set_tag(self, (size_t)s, DELETED);
            self->used--;
        }
    }
done:
    PyMem_Free(h);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return found;
}

static PyObject *index_lookup(IndexObject *self, PyObject *args) { return copy_out(self, args, "y*w*:lookup", 0); }

static PyObject *index_remove(IndexObject *self, PyObject *args) { return copy_out(self, args, "y*w*:remove", 1); }

/* contains(keys) -> bytes: per row 1 (present) or 0. */
static PyObject *index_contains(IndexObject *self, PyObject *arg) {
    Py_buffer keys;
    if (PyObject_GetBuffer(arg, &keys, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *found = NULL;
    Py_ssize_t n = key_rows(self, &keys), slot_for;
    uint64_t *h = n >= 0 ? batch_hashes(self, keys.buf, n) : NULL;
    if (h && (found = PyBytes_FromStringAndSize(NULL, n))) {
        char *hit = PyBytes_AS_STRING(found);
        for (Py_ssize_t r = 0; r < n; r++) {
            prefetch_ahead(self, h, r, n);
            const unsigned char *key = (const unsigned char *)keys.buf + (size_t)r * (size_t)self->key_width;
            hit[r] = find(self, key, h[r], &slot_for) >= 0;
        }
    }
    PyMem_Free(h);
    PyBuffer_Release(&keys);
    return found;
}

/* insert(keys, values, replace) -> bytes: per row 1 if its key was present already (an earlier row of the same
 * call counts), then its value is replaced only with replace; 0: inserted. */
static PyObject *index_insert(IndexObject *self, PyObject *args) {
    Py_buffer keys, values;
    int replace;
    if (!PyArg_ParseTuple(args, "y*y*p:insert", &keys, &values, &replace)) return NULL;
    PyObject *present = NULL;
    Py_ssize_t n = key_rows(self, &keys), slot_for;
    uint64_t *h = NULL;
    if (n < 0 || rows_match(self, &values, n, "values") < 0 || reserve(self, n) < 0) goto done;
    if (!(h = batch_hashes(self, keys.buf, n)) || !(present = PyBytes_FromStringAndSize(NULL, n))) goto done;
    char *was = PyBytes_AS_STRING(present);
    size_t kw = (size_t)self->key_width, vw = (size_t)self->value_width;
    for (Py_ssize_t r = 0; r < n; r++) {
        prefetch_ahead(self, h, r, n);
        const unsigned char *key = (const unsigned char *)keys.buf + (size_t)r * kw;
        const unsigned char *value = (const unsigned char *)values.buf + (size_t)r * vw;
        Py_ssize_t s = find(self, key, h[r], &slot_for);
        was[r] = s >= 0;
        if (s >= 0) {
            if (replace) memcpy(value_at(self, (size_t)s), value, vw);
            continue;
        }
        if (tag_at(self, (size_t)slot_for) == EMPTY) self->filled++;
        self->used++;
        set_tag(self, (size_t)slot_for, tag_of(h[r]));
        memcpy(key_at(self, (size_t)slot_for), key, kw);
        memcpy(value_at(self, (size_t)slot_for), value, vw);
    }
done:
    PyMem_Free(h);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&values);
    return present;
}

/* items() -> (keys, values): every live entry, keys as rows of key_width bytes, values in the same order. */
static PyObject *index_items(IndexObject *self, PyObject *Py_UNUSED(ignored)) {
    size_t kw = (size_t)self->key_width, vw = (size_t)self->value_width;
    PyObject *keys = PyBytes_FromStringAndSize(NULL, self->used * (Py_ssize_t)kw);
    PyObject *values = PyBytes_FromStringAndSize(NULL, self->used * (Py_ssize_t)vw);
    if (!keys || !values) {
        Py_XDECREF(keys);
        Py_XDECREF(values);
        return NULL;
    }
    unsigned char *k = (unsigned char *)PyBytes_AS_STRING(keys), *v = (unsigned char *)PyBytes_AS_STRING(values);
    for (Py_ssize_t s = 0; s < self->capacity; s++) {
        if (tag_at(self, (size_t)s) <= DELETED) continue;
        memcpy(k, key_at(self, (size_t)s), kw);
        memcpy(v, value_at(self, (size_t)s), vw);
        k += kw, v += vw;
    }
    return Py_BuildValue("(NN)", keys, values);
}

static PyObject *get_key_width(IndexObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->key_width);
}
static PyObject *get_value_width(IndexObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->value_width);
}

static PyGetSetDef index_getset[] = {
    {"key_width", (getter)get_key_width, NULL, "bytes of every key", NULL},
    {"value_width", (getter)get_value_width, NULL, "bytes of every value", NULL},
    {NULL},
};

static PyMethodDef index_methods[] = {
    {"lookup", (PyCFunction)index_lookup, METH_VARARGS,
     "lookup(keys, out) -> bytes: per row of keys 1 if present (its value copied into that row of out), else 0."},
    {"contains", (PyCFunction)index_contains, METH_O, "contains(keys) -> bytes: per row of keys 1 if present, else 0."},
    {"insert", (PyCFunction)index_insert, METH_VARARGS,
     "insert(keys, values, replace) -> bytes: per row 1 if its key was present (an earlier row of this call\n"
     "counts; its value is replaced only with replace), 0 if inserted."},
    {"remove", (PyCFunction)index_remove, METH_VARARGS,
     "remove(keys, out) -> bytes: per row 1 if it was present (removed; its value copied into that row of out)."},
    {"items", (PyCFunction)index_items, METH_NOARGS, "items() -> (keys, values): every entry, as two tables."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods index_as_sequence = {.sq_length = (lenfunc)index_len};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.kvstore._shard_index.ShardIndexTable",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ShardIndexTable(key_width, value_width): fixed-width keys to fixed-width values (csrc/shard_index.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)index_init,
    .tp_dealloc = (destructor)index_dealloc,
    .tp_methods = index_methods,
    .tp_getset = index_getset,
    .tp_as_sequence = &index_as_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier.kvstore._shard_index",
                                    "Fixed-width hash tables for the shard index (see csrc/shard_index.c).", -1, NULL};

PyMODINIT_FUNC PyInit__shard_index(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "ShardIndexTable", (PyObject *)&IndexType) < 0) Py_CLEAR(m);
    return m;
}
