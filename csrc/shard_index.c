/* kvtier._shard_index: a hash table of fixed-width keys to fixed-width values, driven a batch at a time.
 *
 * The chunk engine's in-memory index of committed shard records by name (tenant/key/index; see
 * kvstore/node/shard_index.py). A node holds hundreds of thousands of them and a 64 KiB-block request brings a thousand
 * names, so every operation takes a whole table of keys (n rows of key_width bytes, as numpy builds them from
 * a request) and answers with a table: no Python object per key or per record. A dict of bytes to bytes keeps a
 * shard in four scattered objects; here a shard is a 4-byte tag in one array and its key and value side by side
 * in another, and a batch's slots are prefetched a few keys ahead, so the cache misses of a thousand lookups
 * overlap instead of following one another.
 *
 * Open addressing with linear probing over a power-of-two table. Probes walk the tags (0 empty, 1 deleted, else
 * 2 | the high bits of the key's hash), sixteen to a cache line, and compare key bytes only where a tag
 * matches: a put's new names are misses, whose probes run past every deleted slot to an empty one. The hash is seeded
 * at random per table, so keys cannot be chosen to collide.
 *
 * Growth moves entries a batch at a time. Once live and deleted slots would fill three quarters of the table, a
 * new one (at most half full after) becomes current and the old one drains into it: every insert first moves the
 * entries of MOVE_PER_ROW old slots per row it brings (a remove too), so the old table is empty after an eighth of
 * the new one's capacity in inserts, and its drained entries' pages go back to the kernel as it drains. Meanwhile a
 * key lives in exactly one of the two (a moved slot is marked deleted, so the old table's probe chains stay whole):
 * lookups and removes probe the current table, then the old one; inserts add to the current one. Rebuilding the
 * table at once held the node's lock (and the GIL) 330-370 ms at 2 M entries; drained, the longest 1,024-row insert
 * on the way to 2 M took 8.4-8.8 ms (the inserts' total 6-15 % more: the old table is probed too, and the new one's
 * pages are first touched a batch at a time). A growth before the last one has drained (not at these rates, but
 * bounded all the same) rebuilds both into one table at once.
 * Not thread-safe: the caller serialises calls (the chunk engine holds its lock), and every call holds the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#define EMPTY 0u
#define DELETED 1u
#define MIN_CAPACITY 1024
#define MOVE_PER_ROW 8 /* old slots drained per row inserted while the table grows */
#define DISCARD_BYTES (1 << 20) /* drained entries of the old table go back to the kernel this many bytes at a time */
#define MOVE_AHEAD 16 /* old slots whose new home is prefetched before they move */

#define PREFETCH_AHEAD 8 /* keys of a batch whose home slot is prefetched before it is probed */

typedef struct {
    uint32_t *tags;
    unsigned char *entries;
    Py_ssize_t capacity, used, filled; /* slots: all, live, live or deleted */
} Table;

typedef struct {
    PyObject_HEAD Py_ssize_t key_width, value_width;
    size_t stride; /* bytes of an entry: key, value */
    uint64_t seed;
    Table cur;         /* where new keys go */
    Table old;         /* while growing: the table before, draining into cur (tags NULL otherwise) */
    Py_ssize_t drained;   /* the old table's slots before this one have moved */
    size_t discarded;     /* bytes of the old table's entries given back to the kernel (none is read again) */
} IndexObject;

static inline uint32_t tag_at(const Table *t, size_t i) { return t->tags[i]; }
static inline void set_tag(Table *t, size_t i, uint32_t tag) { t->tags[i] = tag; }
static inline unsigned char *key_at(const IndexObject *self, const Table *t, size_t i) {
    return t->entries + i * self->stride;
}
static inline unsigned char *value_at(const IndexObject *self, const Table *t, size_t i) {
    return key_at(self, t, i) + self->key_width;
}

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

/* The slot of table t holding key, or -1; then *slot_for gets where it would go (the first deleted slot on its
 * path, else the empty one that ended it). */
static Py_ssize_t find(const IndexObject *self, const Table *t, const unsigned char *key, uint64_t h,
                       Py_ssize_t *slot_for) {
    size_t mask = (size_t)t->capacity - 1, i = (size_t)h & mask;
    uint32_t tag = tag_of(h);
    Py_ssize_t reuse = -1;
    for (;;) {
        uint32_t got = tag_at(t, i);
        if (got == EMPTY) {
            *slot_for = reuse >= 0 ? reuse : (Py_ssize_t)i;
            return -1;
        }
        if (got == DELETED) {
            if (reuse < 0) reuse = (Py_ssize_t)i;
        } else if (got == tag && !memcmp(key_at(self, t, i), key, (size_t)self->key_width)) {
            return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

/* The slot holding key, in the current table or else the old one (*in says which), or -1; *slot_for: where it
 * would go in the current table. */
static Py_ssize_t locate(IndexObject *self, const unsigned char *key, uint64_t h, Table **in, Py_ssize_t *slot_for) {
    *in = &self->cur;
    Py_ssize_t s = find(self, &self->cur, key, h, slot_for), unused;
    if (s < 0 && self->old.tags && (s = find(self, &self->old, key, h, &unused)) >= 0) *in = &self->old;
    return s;
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

static inline void prefetch_home(const IndexObject *self, const Table *t, uint64_t h) {
    size_t home = (size_t)h & ((size_t)t->capacity - 1);
    const unsigned char *at = key_at(self, t, home);
    __builtin_prefetch(t->tags + home);
    __builtin_prefetch(at);
    __builtin_prefetch(at + self->stride - 1);
}

/* Before probing row r of a batch: fetch the home slot of row r + PREFETCH_AHEAD (its tag, its entry's lines), in
 * the old table too while it drains. */
static inline void prefetch_ahead(const IndexObject *self, const uint64_t *h, Py_ssize_t r, Py_ssize_t n) {
    if (r + PREFETCH_AHEAD < n) {
        prefetch_home(self, &self->cur, h[r + PREFETCH_AHEAD]);
        if (self->old.tags) prefetch_home(self, &self->old, h[r + PREFETCH_AHEAD]);
    }
}

static int allocate(const IndexObject *self, Table *t, Py_ssize_t capacity) {
    uint32_t *tags = PyMem_Calloc((size_t)capacity, sizeof(uint32_t));
    unsigned char *entries = PyMem_Malloc((size_t)capacity * self->stride);
    if (!tags || !entries) {
        PyMem_Free(tags);
        PyMem_Free(entries);
        PyErr_NoMemory();
        return -1;
    }
    *t = (Table){.tags = tags, .entries = entries, .capacity = capacity};
    return 0;
}

static void release(Table *t) {
    PyMem_Free(t->tags);
    PyMem_Free(t->entries);
    *t = (Table){0};
}

/* Put slot s of table from (live, its key hashing to h, and not in to) into table to, at the first slot on its
 * path that is not live. */
static void move_entry(const IndexObject *self, Table *to, const Table *from, size_t s, uint64_t h) {
    size_t mask = (size_t)to->capacity - 1, i = (size_t)h & mask;
    while (tag_at(to, i) > DELETED) i = (i + 1) & mask;
    if (tag_at(to, i) == EMPTY) to->filled++;
    to->used++;
    set_tag(to, i, tag_at(from, s));
    memcpy(key_at(self, to, i), key_at(self, from, s), self->stride);
}

/* Give the pages of the old table's entries drained so far back to the kernel, a megabyte or more at a time (a
 * moved slot's entry is never read again; its tag stays, for the probe chains), so that freeing the old table at
 * the end unmaps little: freeing 157 MB at once held the lock ~10 ms. */
static void discard_drained(IndexObject *self) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), base = (size_t)(uintptr_t)self->old.entries;
    size_t upto = (size_t)self->drained * self->stride;
    if (upto - self->discarded < DISCARD_BYTES) return;
    size_t from = (base + self->discarded + page - 1) & ~(page - 1), to = (base + upto) & ~(page - 1);
    if (to > from) madvise((void *)from, to - from, MADV_DONTNEED); /* advice only: a failure costs memory, no more */
    self->discarded = upto;
}

/* Move the entries of up to budget more old slots into the current table, no further than three quarters of it
 * (each batch's new homes prefetched first); the old table is freed once it is empty. */
static void drain(IndexObject *self, Py_ssize_t budget) {
    Table *old = &self->old, *cur = &self->cur;
    if (!old->tags) return;
    Py_ssize_t end = budget < old->capacity - self->drained ? self->drained + budget : old->capacity;
    uint64_t h[MOVE_AHEAD];
    while (self->drained < end && (cur->filled + MOVE_AHEAD) * 4 <= cur->capacity * 3) {
        Py_ssize_t first = self->drained, last = first + MOVE_AHEAD < end ? first + MOVE_AHEAD : end;
        for (Py_ssize_t s = first; s < last; s++) {
            if (tag_at(old, (size_t)s) <= DELETED) continue;
            h[s - first] = key_hash(self, key_at(self, old, (size_t)s));
            __builtin_prefetch(cur->tags + (h[s - first] & ((uint64_t)cur->capacity - 1)));
        }
        for (Py_ssize_t s = first; s < last; s++) {
            if (tag_at(old, (size_t)s) <= DELETED) continue;
            move_entry(self, cur, old, (size_t)s, h[s - first]);
            set_tag(old, (size_t)s, DELETED);
            old->used--;
        }
        self->drained = last;
    }
    if (self->drained < old->capacity) {
        discard_drained(self);
        return;
    }
    release(old);
    self->drained = 0, self->discarded = 0;
}

/* Room for more new keys in the current table, live and deleted slots at most three quarters of it: drains the
 * old table a step, or begins a growth (a table at most half full after; a growth before the last one drained
 * rebuilds both at once). */
static int reserve(IndexObject *self, Py_ssize_t more) {
    drain(self, MOVE_PER_ROW * more);
    if ((self->cur.filled + more) * 4 <= self->cur.capacity * 3) return 0;
    Py_ssize_t used = self->cur.used + self->old.used, capacity = self->cur.capacity;
    while ((used + more) * 2 > capacity) capacity *= 2;
    Table fresh;
    if (allocate(self, &fresh, capacity) < 0) return -1;
    if (self->old.tags) { /* both into the fresh table now */
        const Table *sources[2] = {&self->cur, &self->old};
        for (int k = 0; k < 2; k++)
            for (Py_ssize_t s = 0; s < sources[k]->capacity; s++)
                if (tag_at(sources[k], (size_t)s) > DELETED)
                    move_entry(self, &fresh, sources[k], (size_t)s, key_hash(self, key_at(self, sources[k], s)));
        release(&self->cur);
        release(&self->old);
        self->cur = fresh;
        self->drained = 0, self->discarded = 0;
        return 0;
    }
    self->old = self->cur;
    self->cur = fresh;
    self->drained = 0, self->discarded = 0;
    drain(self, MOVE_PER_ROW * more);
    return 0;
}

static int index_init(IndexObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"key_width", "value_width", NULL};
    Py_ssize_t kw, vw;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nn:ShardIndexTable", kwlist, &kw, &vw)) return -1;
    if (kw < 1 || vw < 1 || kw > 65535 || vw > 65535) {
        PyErr_SetString(PyExc_ValueError, "key_width and value_width must be between 1 and 65535 bytes");
        return -1;
    }
    if (self->cur.tags) return 0; /* __init__ called again: keep the table */
    self->key_width = kw, self->value_width = vw;
    self->stride = (size_t)(kw + vw);
    if (getrandom(&self->seed, sizeof self->seed, 0) != (ssize_t)sizeof self->seed)
        self->seed = (uint64_t)(uintptr_t)self ^ 0x2545f4914f6cdd1dULL;
    return allocate(self, &self->cur, MIN_CAPACITY);
}

static void index_dealloc(IndexObject *self) {
    release(&self->cur);
    release(&self->old);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t index_len(IndexObject *self) { return self->cur.used + self->old.used; }

/* keys as n rows of key_width bytes; n, or -1 with ValueError. */
static Py_ssize_t key_rows(IndexObject *self, Py_buffer *keys) {
    if (!self->cur.tags) {
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
    if (n < 0 || rows_match(self, &out, n, "out") < 0) goto done;
    if (take) drain(self, MOVE_PER_ROW * n); /* evictions alone finish a growth too */
    if (!(h = batch_hashes(self, keys.buf, n))) goto done;
    found = PyBytes_FromStringAndSize(NULL, n);
    if (!found) goto done;
    char *hit = PyBytes_AS_STRING(found);
    size_t kw = (size_t)self->key_width, vw = (size_t)self->value_width;
    for (Py_ssize_t r = 0; r < n; r++) {
        prefetch_ahead(self, h, r, n);
        Table *in;
        Py_ssize_t s = locate(self, (const unsigned char *)keys.buf + (size_t)r * kw, h[r], &in, &slot_for);
        hit[r] = s >= 0;
        if (s < 0) continue;
        memcpy((unsigned char *)out.buf + (size_t)r * vw, value_at(self, in, (size_t)s), vw);
        if (take) {
            set_tag(in, (size_t)s, DELETED);
            in->used--;
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
            Table *in;
            hit[r] = locate(self, key, h[r], &in, &slot_for) >= 0;
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
        Table *in, *cur = &self->cur;
        Py_ssize_t s = locate(self, key, h[r], &in, &slot_for);
        was[r] = s >= 0;
        if (s >= 0) {
            if (replace) memcpy(value_at(self, in, (size_t)s), value, vw);
            continue;
        }
        if (tag_at(cur, (size_t)slot_for) == EMPTY) cur->filled++;
        cur->used++;
        set_tag(cur, (size_t)slot_for, tag_of(h[r]));
        memcpy(key_at(self, cur, (size_t)slot_for), key, kw);
        memcpy(value_at(self, cur, (size_t)slot_for), value, vw);
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
    Py_ssize_t used = index_len(self);
    PyObject *keys = PyBytes_FromStringAndSize(NULL, used * (Py_ssize_t)kw);
    PyObject *values = PyBytes_FromStringAndSize(NULL, used * (Py_ssize_t)vw);
    if (!keys || !values) {
        Py_XDECREF(keys);
        Py_XDECREF(values);
        return NULL;
    }
    unsigned char *k = (unsigned char *)PyBytes_AS_STRING(keys), *v = (unsigned char *)PyBytes_AS_STRING(values);
    const Table *tables[2] = {&self->cur, &self->old};
    for (int t = 0; t < 2; t++) {
        for (Py_ssize_t s = 0; s < tables[t]->capacity; s++) {
            if (tag_at(tables[t], (size_t)s) <= DELETED) continue;
            memcpy(k, key_at(self, tables[t], (size_t)s), kw);
            memcpy(v, value_at(self, tables[t], (size_t)s), vw);
            k += kw, v += vw;
        }
    }
    return Py_BuildValue("(NN)", keys, values);
}

static PyObject *get_key_width(IndexObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->key_width);
}
static PyObject *get_value_width(IndexObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->value_width);
}
static PyObject *get_moving(IndexObject *self, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(self->old.used); }

static PyGetSetDef index_getset[] = {
    {"key_width", (getter)get_key_width, NULL, "bytes of every key", NULL},
    {"value_width", (getter)get_value_width, NULL, "bytes of every value", NULL},
    {"moving", (getter)get_moving, NULL, "entries of the table before the last growth not moved yet", NULL},
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
