/* kvtier.kernels._hostcopy: the CPU row copy, dst[dst_rows[b]] = src[src_rows[b]] (first nbytes of each row), in
 * one call without the GIL: swap-in and swap-out between host staging slots and a KV cache in host memory; and
 * check_rows, the bounds and repeat check of a row list that CPU swaps run first (a bitmap, in one pass; GPU swaps
 * check on the device, kernels/rowcopy.py's RowCheckKernel, and use this one only to name a refused id); and
 * narrow_ids, which writes a GPU swap's ids as int32 into the host buffer the device reads them from.
 *
 * Why C: per row, a Python-level copy costs a microsecond or two of call overhead (a 16 KiB row moves in about
 * that time), and torch's index_copy_ is an element-wise loop plus a second pass for the gather. Why streaming
 * stores: a row is written once and not read back soon, and a normal store first reads the destination line into
 * the cache (read-for-ownership), a third of the memory traffic; glibc's memcpy streams only for copies larger
 * than about the last-level cache, so a loop of row-sized memcpys runs at about 0.55x one large memcpy.
 *
 * The caller (kvtier.transfer.swapin) has checked every index against its table and that the rows fit; this
 * module trusts them. The reference semantics are kernels/rowcopy.py's copy_rows_reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HC_X86 1
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

/* Rows shorter than this are copied with memcpy: streaming pays only over whole cache lines. */
#define STREAM_MIN 1024
/* Software prefetch, measured on the H200 host (one thread, 256 MiB, random rows, ratio to one glibc memcpy of the
 * same bytes in the same run, 16 / 64 KiB rows): no prefetch 0.67-0.71x; 1 KiB ahead in the row 0.74-0.79 /
 * 0.79-0.83x; 2 or 4 KiB ahead no better; 1 KiB ahead plus the next row's first 1 KiB before each row 0.77-0.81 /
 * 0.71-0.85x. This one: 1 KiB ahead into L1, and, for each line copied, the same line of the *next* row into L2,
 * a prefetch distance of one whole row across the jump to the next row's random place: 0.87 / 0.83x (9 rounds;
 * 0.83-0.86 / 0.82-0.83 with 16-byte stores or 2 KiB ahead). Copying four pages line by line in turn (glibc's
 * large-copy scheme) reached 0.77-0.85x there but ran at 0.2x on the 2-core development VM whenever the source was
 * a shared-memory segment, so it is not used. */
#define PREFETCH_AHEAD 1024

#ifdef HC_X86
#include <immintrin.h>
/* 32-byte loads and streaming stores where the processor has AVX2 (checked once, at import), else 16-byte ones. */
static int use_avx2;

__attribute__((target("avx2"))) static void stream_lines_avx2(char *dst, const char *src, const char *next,
                                                               size_t body) {
    for (size_t i = 0; i < body; i += 64) {
        _mm_prefetch(src + i + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch(next + i, _MM_HINT_T1);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    }
}
#endif

static void copy_row(char *dst, const char *src, const char *next, size_t n) {
#ifdef HC_X86
    if (use_avx2 && n >= STREAM_MIN && ((uintptr_t)dst & 31) == 0) {
        size_t body = n & ~(size_t)63;
        stream_lines_avx2(dst, src, next, body);
        memcpy(dst + body, src + body, n - body);
        return;
    }
    if (n >= STREAM_MIN && ((uintptr_t)dst & 15) == 0) {
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            _mm_prefetch(src + i + PREFETCH_AHEAD, _MM_HINT_T0); /* past the row's end it is a harmless hint */
            _mm_prefetch(next + i, _MM_HINT_T1);
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    (void)next;
    memcpy(dst, src, n);
}

PyDoc_STRVAR(copy_rows_doc,
             "copy_rows(dst_address, dst_pitch, dst_rows, src_address, src_pitch, src_rows, nbytes)\n\n"
             "For every b: copy nbytes from src_address + src_rows[b] * src_pitch to\n"
             "dst_address + dst_rows[b] * dst_pitch. Rows: contiguous int64 buffers of equal length, already\n"
             "checked by the caller. Runs without the GIL; stores are complete when it returns.");

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    unsigned long long dst_address, src_address;
    Py_ssize_t dst_pitch, src_pitch, nbytes;
    Py_buffer dst_rows, src_rows;
    if (!PyArg_ParseTuple(args, "Kny*Kny*n", &dst_address, &dst_pitch, &dst_rows, &src_address, &src_pitch,
                          &src_rows, &nbytes))
        return NULL;
    PyObject *result = NULL;
    if (dst_rows.len != src_rows.len || dst_rows.len % (Py_ssize_t)sizeof(int64_t) || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: row lists of int64 of equal length and nbytes >= 0 needed");
        goto done;
    }
    const int64_t *d = dst_rows.buf, *s = src_rows.buf;
    Py_ssize_t count = dst_rows.len / (Py_ssize_t)sizeof(int64_t);
    Py_BEGIN_ALLOW_THREADS
    const char *base = (const char *)(uintptr_t)src_address;
    for (Py_ssize_t b = 0; b < count; b++) {
        const char *next = base + s[b + 1 < count ? b + 1 : b] * src_pitch; /* the last row: itself, harmlessly */
        copy_row((char *)(uintptr_t)dst_address + d[b] * dst_pitch, base + s[b] * src_pitch, next, (size_t)nbytes);
    }
#ifdef HC_X86
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
#endif
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst_rows);
    PyBuffer_Release(&src_rows);
    return result;
}

PyDoc_STRVAR(check_rows_doc,
             "check_rows(rows, count, distinct) -> int\n\n"
             "The position of the first row index (rows: a contiguous int64 buffer) outside [0, count), or, with\n"
             "distinct, equal to an earlier one; -1 when there is none. Runs without the GIL.");

/* The first bad position, one row at a time: only run once the fast pass below found something wrong. */
static Py_ssize_t first_bad(const int64_t *r, Py_ssize_t n, Py_ssize_t count, uint64_t *seen) {
    if (seen) memset(seen, 0, ((size_t)count / 64 + 1) * sizeof(uint64_t));
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t v = (uint64_t)r[b];
        if (v >= (uint64_t)count) return b; /* negative ones too */
        if (seen) {
            uint64_t bit = 1ull << (v & 63);
            if (seen[v >> 6] & bit) return b;
            seen[v >> 6] |= bit;
        }
    }
    return -1;
}

/* One pass without branches (the range test vectorises; the bitmap test-and-set does not branch). */
static Py_ssize_t check_fast(const int64_t *r, Py_ssize_t n, Py_ssize_t count, uint64_t *seen) {
    uint64_t over = 0, dup = 0;
    for (Py_ssize_t b = 0; b < n; b++) over |= (uint64_t)r[b] >= (uint64_t)count;
    if (!over && seen) {
        for (Py_ssize_t b = 0; b < n; b++) {
            uint64_t v = (uint64_t)r[b], bit = 1ull << (v & 63);
            dup |= seen[v >> 6] & bit;
            seen[v >> 6] |= bit;
        }
    }
    return over || dup ? first_bad(r, n, count, seen) : -1;
}

static PyObject *check_rows(PyObject *self, PyObject *args) {
    Py_buffer rows;
    Py_ssize_t count;
    int distinct;
    if (!PyArg_ParseTuple(args, "y*np", &rows, &count, &distinct)) return NULL;
    Py_ssize_t n = rows.len / (Py_ssize_t)sizeof(int64_t), bad = -1;
    uint64_t *seen = distinct ? calloc((size_t)count / 64 + 1, sizeof(uint64_t)) : NULL;
    if (distinct && seen == NULL) {
        PyBuffer_Release(&rows);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    bad = check_fast(rows.buf, n, count < 0 ? 0 : count, seen);
    Py_END_ALLOW_THREADS
    free(seen);
    PyBuffer_Release(&rows);
    return PyLong_FromSsize_t(bad);
}

PyDoc_STRVAR(narrow_ids_doc,
             "narrow_ids(dst, at, ids) -> int\n\n"
             "Write ids (a contiguous int64 or int32 buffer) into dst[at : at + len(ids)] (a writable contiguous\n"
             "int32 buffer) as int32; -1, or the position of the first id that does not fit\n"
             "an int32 (what dst then holds is unspecified). ValueError if the ids do not fit dst, TypeError for\n"
             "other element types. Runs without the GIL.");

/* An integer element type of a buffer: 8 (int64), 4 (int32), or 0 for anything else. */
static int int_width(const Py_buffer *b) {
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (f[0] == '\0' || f[1] != '\0') return 0;
    if (b->itemsize == 8 && (*f == 'l' || *f == 'q')) return 8;
    if (b->itemsize == 4 && (*f == 'i' || *f == 'l')) return 4;
    return 0;
}

/* Nonzero unless -2**31 <= v < 2**31. */
#define OUTSIDE_INT32(v) ((uint64_t)((v) + 0x80000000ll) >> 32)

/* d[i] = (int32_t)s[i] for i < n; nonzero if some s[i] does not fit an int32. Four ids a step where SSE2 is there:
 * the low halves packed and stored, the high halves compared with the low halves' sign (a plain loop of
 * conversions runs at about a third of the speed). */
static uint64_t narrow(int32_t *d, const int64_t *s, Py_ssize_t n) {
    uint64_t over = 0;
    Py_ssize_t i = 0;
#ifdef HC_X86
    __m128i wrong = _mm_setzero_si128();
    for (; i + 4 <= n; i += 4) {
        __m128 a = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(s + i)));
        __m128 b = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(s + i + 2)));
        __m128i lo = _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
        __m128i hi = _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
        wrong = _mm_or_si128(wrong, _mm_xor_si128(hi, _mm_srai_epi32(lo, 31)));
        _mm_storeu_si128((__m128i *)(d + i), lo);
    }
    over = (uint64_t)_mm_cvtsi128_si64(wrong) | (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(wrong, wrong));
#endif
    for (; i < n; i++) {
        over |= OUTSIDE_INT32(s[i]);
        d[i] = (int32_t)s[i];
    }
    return over;
}

static PyObject *narrow_ids(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t at;
    if (!PyArg_ParseTuple(args, "OnO", &dst_obj, &at, &src_obj)) return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    int wide = int_width(&src);
    if (int_width(&dst) != 4 || wide == 0) {
        PyErr_SetString(PyExc_TypeError, "narrow_ids: an int32 destination and int64 or int32 ids needed");
        goto done;
    }
    Py_ssize_t n = src.len / wide, room = dst.len / 4;
    if (at < 0 || at > room || n > room - at) {
        PyErr_SetString(PyExc_ValueError, "narrow_ids: the ids do not fit the destination");
        goto done;
    }
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    int32_t *d = (int32_t *)dst.buf + at;
    if (wide == 4) {
        memcpy(d, src.buf, (size_t)n * 4);
    } else if (narrow(d, src.buf, n)) {
        const int64_t *s = src.buf;
        for (bad = 0; !OUTSIDE_INT32(s[bad]); bad++) {
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS, copy_rows_doc},
    {"check_rows", check_rows, METH_VARARGS, check_rows_doc},
    {"narrow_ids", narrow_ids, METH_VARARGS, narrow_ids_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hostcopy", "The CPU row copy behind swap-in and swap-out.", -1, methods,
};

PyMODINIT_FUNC PyInit__hostcopy(void) {
#ifdef HC_X86
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
