/* kvtier._native: the store's per-byte hot loops, in C, without the GIL.
 *
 * - crc32c / crc32c_many: CRC-32C (Castagnoli, as the crc32c package and iSCSI compute it): carry-less multiply
 *   folding (VPCLMULQDQ) and the SSE4.2 instruction over three streams at once where the CPU has them, the
 *   instruction alone where it has only SSE4.2, a table otherwise.
 * - reply_plan: where each shard of a GET reply lands (the client's receive plan), in one pass.
 * - recv_to_files: receive a PUT payload from a socket in cache-sized pieces, checksum each shard while it
 *   is hot and write it into its slab slot, runs of adjacent slots whole in one pwritev: no page of the slab
 *   is mapped or faulted, and the page cache never zero-fills a folio that a write covers only in part.
 * - send_all: send a list of buffers completely (sendmsg, resuming partial sends); a Scatter among them sends
 *   its (address, length) pieces, e.g. shards straight from a node's slab mappings or a client's blocks.
 *   send_some: the same without waiting, from a byte offset on (a non-blocking socket driven by a selector).
 * - recv_scatter: receive a reply's payload into (address, length) pieces, checksumming each shard in 1 MiB
 *   steps while it is hot (end-to-end: the client checks what the node stored); crc32c_pieces: the same
 *   checksums over memory already in place. recv_many: the same over many sockets at once (poll), returning
 *   to Python once per finished reply rather than once per socket buffer's worth of bytes. recv_heads: one
 *   small reply's header and metadata from each of many sockets, in one call (a round of MATCH requests);
 *   recv_head: a server's receive of a request's header and small metadata in one call.
 * - ec_encode_stripes: ISA-L's ec_encode_data over many stripes in one call (codec.py passes its address).
 * - bytearray_uninit: a bytearray whose bytes are not zeroed first (they are about to be overwritten).
 * - live_flags: a node's answer to MATCH (with the GIL: it reads Python objects), one lookup per key in its block
 *   index; in Python this cost ~0.7 us a key, half the node's CPU on a 100-key MATCH.
 *
 * Socket calls follow Python's socket timeout semantics: the timeout bounds each wait for the socket to
 * become ready (-1: wait forever), and expiry raises TimeoutError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_X86 1
#include <immintrin.h>
#endif

/* ---- CRC-32C ------------------------------------------------------------------------------------- */

#define POLY 0x82f63b78u
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256

static uint32_t crc_table[8][256];
static uint32_t crc_long[4][256];  /* shift a crc over LONG_BLOCK zero bytes */
static uint32_t crc_short[4][256]; /* ... over SHORT_BLOCK zero bytes */
static int have_hw;
/* The implementations, slowest first: a table (any CPU), the SSE4.2 crc32 instruction over three streams, carry-less
 * multiplication folding 32 bytes a step (VPCLMULQDQ on AVX2), both at once on parts of a long buffer (hybrid).
 * crc_level is the best this CPU has. On the AMD EPYC
 * of the development VM, over one hot buffer: crc32 11.6 / 21.7 / 24.5 GB/s at 6.4 KiB / 64 KiB / 1 MiB, vpclmul
 * 14.1 / 23.7 / 25.4 (16-byte PCLMULQDQ folding reached 9-13 GB/s there, slower than the crc32 instruction). */
enum { CRC_TABLE, CRC_INSN, CRC_VPCLMUL, CRC_HYBRID, CRC_LEVELS };
static const char *const crc_names[CRC_LEVELS] = {"table", "crc32", "vpclmul", "hybrid"};
static int crc_level;
#define FOLD_MIN 256 /* shorter buffers go through the crc32 instruction: folding has a fixed cost */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends len zero bytes to a crc (len a power of two). */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32], row = 1;
    odd[0] = POLY;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* 2 zero bits */
    gf2_square(odd, even); /* 4 zero bits */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

#ifdef KV_X86
/* Folding (Intel, "Fast CRC computation for generic polynomials using PCLMULQDQ"): a 128-bit accumulator that
 * stands D bytes before the next 16 input bytes is carried over them as lo * (x^(8D+32) mod P) xor hi *
 * (x^(8D-32) mod P), both products at most 96 bits; the constants in the bit-reflected form the instruction
 * multiplies (reflected 32 bits, shifted left by one). The last accumulator's 16 bytes, run through the crc32
 * instruction from a zero state, give the crc of everything folded (the crc is linear; the start state was
 * xored into the first 4 bytes). */
static uint64_t fold_16[2], fold_32[2], fold_128[2];

static uint64_t xpow_mod(unsigned n) {
    uint32_t r = 1; /* x^0; P = 0x1edc6f41 (+ x^32), not reflected */
    while (n--) r = (r << 1) ^ (r & 0x80000000u ? 0x1edc6f41u : 0);
    uint32_t reflected = 0;
    for (int b = 0; b < 32; b++) reflected |= ((r >> b) & 1u) << (31 - b);
    return (uint64_t)reflected << 1;
}

/* hybrid: the folding and the crc32 instruction use different execution units, so a block of HY_FOLD folded bytes
 * and three crc32 streams of HY_LANE bytes each after it are worked in one loop, and their crcs joined: the crc so
 * far is carried over a lane's bytes by multiplying it by x^(8 HY_LANE - 33) (lane_shift) and xoring the lane's own
 * crc (started from zero). 16 steps of 128 folded and 3 x 56 instruction bytes. On the development VM's EPYC
 * (one hot buffer): 15.6 / 34.7 / 32.9 GB/s at 6.4 KiB / 102 KiB / 1 MiB, vpclmul alone 14.1 / 24.4 / 25.5 (lanes of
 * 512 or 768 bytes measured within 5 % of that). */
#define HY_FOLD 2048
#define HY_LANE 896
#define HY_BLOCK (HY_FOLD + 3 * HY_LANE)
static uint64_t lane_shift;

static void fold_constants(void) {
    uint64_t *tables[] = {fold_16, fold_32, fold_128};
    unsigned distance[] = {16, 32, 128};
    for (int i = 0; i < 3; i++) {
        tables[i][0] = xpow_mod(8 * distance[i] + 32);
        tables[i][1] = xpow_mod(8 * distance[i] - 32);
    }
    lane_shift = xpow_mod(8 * HY_LANE - 33) >> 1;
}

__attribute__((target("sse4.2,pclmul"))) static inline __m128i fold128(__m128i acc, __m128i k, __m128i next) {
    __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00), hi = _mm_clmulepi64_si128(acc, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* The crc of a folded accumulator, then the last len (< 16) bytes. */
__attribute__((target("sse4.2,pclmul"))) static uint32_t fold_finish(__m128i acc, const unsigned char *p, size_t len) {
    uint64_t crc = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(acc));
    crc = _mm_crc32_u64(crc, (uint64_t)_mm_extract_epi64(acc, 1));
    if (len >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        crc = _mm_crc32_u64(crc, word);
        p += 8;
        len -= 8;
    }
    while (len--) crc = _mm_crc32_u8((uint32_t)crc, *p++);
    return (uint32_t)crc ^ 0xffffffffu;
}

#define LOAD128(p) _mm_loadu_si128((const __m128i *)(p))

__attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq"))) static inline __m256i fold256(__m256i acc, __m256i k,
                                                                                        __m256i next) {
    __m256i lo = _mm256_clmulepi64_epi128(acc, k, 0x00), hi = _mm256_clmulepi64_epi128(acc, k, 0x11);
    return _mm256_xor_si256(_mm256_xor_si256(lo, hi), next);
}

#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))

/* len >= 128: four 32-byte accumulators 128 bytes apart, then one, then its two halves. */
__attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq"))) static uint32_t crc_vpclmul(uint32_t crc,
                                                                                   const unsigned char *p, size_t len) {
    __m256i y0 = _mm256_xor_si256(LOAD256(p), _mm256_set_epi64x(0, 0, 0, (long long)(crc ^ 0xffffffffu)));
    __m256i y1 = LOAD256(p + 32), y2 = LOAD256(p + 64), y3 = LOAD256(p + 96);
    __m256i k = _mm256_broadcastsi128_si256(LOAD128(fold_128));
    for (p += 128, len -= 128; len >= 128; p += 128, len -= 128) {
        y0 = fold256(y0, k, LOAD256(p));
        y1 = fold256(y1, k, LOAD256(p + 32));
        y2 = fold256(y2, k, LOAD256(p + 64));
        y3 = fold256(y3, k, LOAD256(p + 96));
    }
    k = _mm256_broadcastsi128_si256(LOAD128(fold_32));
    y0 = fold256(fold256(fold256(y0, k, y1), k, y2), k, y3);
    for (; len >= 32; p += 32, len -= 32) y0 = fold256(y0, k, LOAD256(p));
    __m128i x = fold128(_mm256_castsi256_si128(y0), LOAD128(fold_16), _mm256_extracti128_si256(y0, 1));
    if (len >= 16) {
        x = fold128(x, LOAD128(fold_16), LOAD128(p));
        p += 16;
        len -= 16;
    }
    return fold_finish(x, p, len);
}

/* The raw crc (no final inversion) of HY_BLOCK bytes from raw state crc; see HY_FOLD. */
__attribute__((target("sse4.2,pclmul,avx2,vpclmulqdq"))) static uint32_t crc_hybrid_block(uint32_t crc,
                                                                                        const unsigned char *p) {
    const unsigned char *lanes = p + HY_FOLD;
    __m256i y0 = _mm256_xor_si256(LOAD256(p), _mm256_set_epi64x(0, 0, 0, (long long)crc));
    __m256i y1 = LOAD256(p + 32), y2 = LOAD256(p + 64), y3 = LOAD256(p + 96);
    __m256i k = _mm256_broadcastsi128_si256(LOAD128(fold_128));
    uint64_t c0 = 0, c1 = 0, c2 = 0, w0, w1, w2;
    for (int step = 0; step < HY_FOLD / 128; step++) {
        if (step) {
            const unsigned char *f = p + 128 * step;
            y0 = fold256(y0, k, LOAD256(f));
            y1 = fold256(y1, k, LOAD256(f + 32));
            y2 = fold256(y2, k, LOAD256(f + 64));
            y3 = fold256(y3, k, LOAD256(f + 96));
        }
        for (int q = 0; q < HY_LANE / 128; q++) { /* HY_LANE / 16 bytes of each lane a step */
            const unsigned char *at = lanes + HY_LANE / 16 * step + 8 * q;
            memcpy(&w0, at, 8);
            memcpy(&w1, at + HY_LANE, 8);
            memcpy(&w2, at + 2 * HY_LANE, 8);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
    }
    k = _mm256_broadcastsi128_si256(LOAD128(fold_32));
    y0 = fold256(fold256(fold256(y0, k, y1), k, y2), k, y3);
    __m128i x = fold128(_mm256_castsi256_si128(y0), LOAD128(fold_16), _mm256_extracti128_si256(y0, 1));
    uint32_t state = fold_finish(x, p, 0) ^ 0xffffffffu;
    const uint32_t lane[3] = {(uint32_t)c0, (uint32_t)c1, (uint32_t)c2};
    for (int i = 0; i < 3; i++) {
        __m128i moved = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)state), _mm_cvtsi64_si128((long long)lane_shift), 0);
        state = (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(moved)) ^ lane[i];
    }
    return state;
}
#endif

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = n;
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ POLY : crc >> 1;
        crc_table[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++) crc_table[k][n] = (crc_table[k - 1][n] >> 8) ^ crc_table[0][crc_table[k - 1][n] & 0xff];
    zeros_table(crc_long, LONG_BLOCK);
    zeros_table(crc_short, SHORT_BLOCK);
#ifdef KV_X86
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2") != 0;
    crc_level = have_hw ? CRC_INSN : CRC_TABLE;
    if (have_hw && __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("vpclmulqdq"))
        crc_level = CRC_HYBRID;
    fold_constants();
#endif
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c = crc ^ 0xffffffffu;
    while (len && ((uintptr_t)p & 7)) {
        c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c ^= word; /* little-endian machines only: x86-64, aarch64 */
        c = crc_table[7][c & 0xff] ^ crc_table[6][(c >> 8) & 0xff] ^ crc_table[5][(c >> 16) & 0xff] ^
            crc_table[4][(c >> 24) & 0xff] ^ crc_table[3][(c >> 32) & 0xff] ^ crc_table[2][(c >> 40) & 0xff] ^
            crc_table[1][(c >> 48) & 0xff] ^ crc_table[0][c >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return (uint32_t)c ^ 0xffffffffu;
}

#ifdef KV_X86
/* Three independent streams over 3 x block bytes hide the instruction's latency; shifting merges them. */
__attribute__((target("sse4.2"))) static uint64_t crc_hw_streams(uint64_t crc0, const unsigned char **next,
                                                                  size_t *len, size_t block, uint32_t zeros[][256]) {
    const unsigned char *p = *next;
    while (*len >= 3 * block) {
        const unsigned char *end = p + block;
        uint64_t crc1 = 0, crc2 = 0;
        do {
            crc0 = _mm_crc32_u64(crc0, *(const uint64_t *)p);
            crc1 = _mm_crc32_u64(crc1, *(const uint64_t *)(p + block));
            crc2 = _mm_crc32_u64(crc2, *(const uint64_t *)(p + 2 * block));
            p += 8;
        } while (p < end);
        crc0 = shift(zeros, (uint32_t)crc0) ^ crc1;
        crc0 = shift(zeros, (uint32_t)crc0) ^ crc2;
        p += 2 * block;
        *len -= 3 * block;
    }
    *next = p;
    return crc0;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *next, size_t len) {
    uint64_t crc0 = crc ^ 0xffffffffu, word;
    while (len && ((uintptr_t)next & 7)) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    crc0 = crc_hw_streams(crc0, &next, &len, LONG_BLOCK, crc_long);
    crc0 = crc_hw_streams(crc0, &next, &len, SHORT_BLOCK, crc_short);
    while (len >= 8) {
        memcpy(&word, next, 8);
        crc0 = _mm_crc32_u64(crc0, word);
        next += 8;
        len -= 8;
    }
    while (len--) crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
    return (uint32_t)crc0 ^ 0xffffffffu;
}
#endif

#ifdef KV_X86
static uint32_t crc_hybrid(uint32_t crc, const unsigned char *p, size_t len) {
    uint32_t state = crc ^ 0xffffffffu;
    for (; len >= HY_BLOCK; p += HY_BLOCK, len -= HY_BLOCK) state = crc_hybrid_block(state, p);
    crc = state ^ 0xffffffffu;
    return len >= FOLD_MIN ? crc_vpclmul(crc, p, len) : crc_hw(crc, p, len);
}
#endif

static uint32_t crc_with(int level, uint32_t crc, const void *buf, size_t len) {
#ifdef KV_X86
    if (level == CRC_HYBRID && len >= HY_BLOCK) return crc_hybrid(crc, (const unsigned char *)buf, len);
    if (level >= CRC_VPCLMUL && len >= FOLD_MIN) return crc_vpclmul(crc, (const unsigned char *)buf, len);
    if (level >= CRC_INSN) return crc_hw(crc, (const unsigned char *)buf, len);
#endif
    return crc_sw(crc, (const unsigned char *)buf, len);
}

static uint32_t crc32c_update(uint32_t crc, const void *buf, size_t len) { return crc_with(crc_level, crc, buf, len); }

static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int crc = 0;
    const char *impl = NULL;
    if (!PyArg_ParseTuple(args, "y*|Iz:crc32c", &view, &crc, &impl)) return NULL;
    int level = crc_level;
    if (impl) {
        for (level = crc_level; level >= 0 && strcmp(impl, crc_names[level]); level--) {}
        if (level < 0) {
            PyBuffer_Release(&view);
            return PyErr_Format(PyExc_ValueError, "crc32c implementation %s is not available on this CPU", impl);
        }
    }
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS;
    out = crc_with(level, crc, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(out);
}

/* Buffers of a sequence, acquired together (released by release_views). */
static Py_buffer *acquire_views(PyObject *seq, Py_ssize_t *count, int writable) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of buffers");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!views) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &views[i], flags) < 0) {
            for (Py_ssize_t j = 0; j < i; j++) PyBuffer_Release(&views[j]);
            PyMem_Free(views);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *count = n;
    return views;
}

static void release_views(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

static PyObject *py_crc32c_many(PyObject *self, PyObject *seq) {
    Py_ssize_t n;
    Py_buffer *views = acquire_views(seq, &n, 0);
    if (!views) return NULL;
    uint32_t *crcs = PyMem_Malloc((n ? n : 1) * sizeof(uint32_t));
    if (!crcs) {
        release_views(views, n);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) crcs[i] = crc32c_update(0, views[i].buf, (size_t)views[i].len);
    Py_END_ALLOW_THREADS;
    release_views(views, n);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (!v) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(crcs);
    return out;
}

/* ---- sockets ------------------------------------------------------------------------------------- */

/* Wait until fd is ready for events; 0, or -1 with errno (ETIMEDOUT on expiry). Called without the GIL. */
static int wait_ready(int fd, short events, int timeout_ms) {
    struct pollfd p = {.fd = fd, .events = events};
    for (;;) {
        int r = poll(&p, 1, timeout_ms);
        if (r > 0) return 0;
        if (r == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        if (errno != EINTR) return -1;
    }
}

/* errno of a failed socket call -> the Python exception Python's socket module would raise. */
static PyObject *socket_error(int err, int eof) {
    if (eof) return PyErr_Format(PyExc_ConnectionResetError, "the peer closed the connection mid-frame");
    if (err == ETIMEDOUT) return PyErr_Format(PyExc_TimeoutError, "timed out");
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

typedef struct {
    int64_t fd; /* slab file, or -1: receive and drop */
    int64_t offset;
    int64_t length;
    int64_t stride; /* bytes of the slot (>= length): its tail after the shard is written as zeros */
} segment_t;

#define WRITE_IOV 1024
static const unsigned char zero_tail[1 << 16];

/* Consecutive file ranges gathered into one pwritev: a run of slots that are adjacent in one slab file is
 * written as one range that covers every slot whole (each shard, then its slot's tail from zero_tail), so
 * the page cache gets whole folios and never zero-fills a fresh one around a partial write. */
typedef struct {
    int fd;
    int64_t start, end; /* file range gathered so far */
    int count;
    struct iovec iov[WRITE_IOV];
} run_t;

static int run_flush(run_t *run) {
    int64_t at = run->start;
    struct iovec *iov = run->iov;
    int left = run->count;
    run->count = 0;
    while (left > 0) {
        ssize_t r = pwritev(run->fd, iov, left, at);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? errno : EIO;
        at += r;
        while (left > 0 && (size_t)r >= iov->iov_len) {
            r -= (ssize_t)iov->iov_len;
            iov++;
            left--;
        }
        if (left > 0) {
            iov->iov_base = (char *)iov->iov_base + r;
            iov->iov_len -= (size_t)r;
        }
    }
    return 0;
}

/* Add [base, base + len) at file offset `at` of fd to the run, flushing first if it does not continue it. */
static int run_add(run_t *run, int fd, int64_t at, const void *base, size_t len) {
    if (!len) return 0;
    if (run->count && (run->fd != fd || run->end != at || run->count == WRITE_IOV)) {
        int err = run_flush(run);
        if (err) return err;
    }
    if (!run->count) {
        run->fd = fd;
        run->start = run->end = at;
    }
    run->iov[run->count].iov_base = (void *)base;
    run->iov[run->count].iov_len = len;
    run->count++;
    run->end += (int64_t)len;
    return 0;
}

static PyObject *py_recv_to_files(PyObject *self, PyObject *args) {
    int sock, timeout_ms;
    Py_buffer plan, scratch;
    if (!PyArg_ParseTuple(args, "iiy*w*:recv_to_files", &sock, &timeout_ms, &plan, &scratch)) return NULL;
    PyObject *out = NULL;
    run_t *run = NULL;
    if (plan.len % (Py_ssize_t)sizeof(segment_t) || scratch.len < 4096) {
        PyErr_SetString(PyExc_ValueError,
                        "plan must hold (fd, offset, length, stride) int64 rows; scratch >= 4 KiB");
        goto done;
    }
    Py_ssize_t n = plan.len / (Py_ssize_t)sizeof(segment_t);
    const segment_t *segs = plan.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (segs[i].length < 0 || segs[i].offset < 0 || segs[i].stride < segs[i].length) {
            PyErr_SetString(PyExc_ValueError, "bad row in plan: negative offset or length, or stride < length");
            goto done;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, (n ? n : 0) * (Py_ssize_t)sizeof(uint32_t));
    run = PyMem_Malloc(sizeof(run_t));
    if (!out || !run) {
        Py_CLEAR(out);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    run->count = 0;
    uint32_t *crcs = (uint32_t *)PyBytes_AS_STRING(out);
    memset(crcs, 0, (size_t)n * sizeof(uint32_t));
    int64_t remaining = 0;
    for (Py_ssize_t i = 0; i < n; i++) remaining += segs[i].length;
    int err = 0, eof = 0, written_err = 0;
    Py_BEGIN_ALLOW_THREADS;
    unsigned char *buf = scratch.buf;
    size_t cap = (size_t)scratch.len;
    Py_ssize_t seg = 0;
    int64_t seg_done = 0; /* bytes of segs[seg] already handled */
    while (seg < n && segs[seg].length == 0) seg++;
    while (remaining > 0) {
        size_t want = remaining < (int64_t)cap ? (size_t)remaining : cap;
        size_t got = 0;
        while (got < want) {
            ssize_t r = recv(sock, buf + got, want - got, MSG_DONTWAIT);
            if (r > 0) {
                got += (size_t)r;
                continue;
            }
            if (r == 0) {
                eof = 1;
                break;
            }
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                err = errno;
                break;
            }
            if (got >= 65536 || got == want) break; /* work on what arrived while more is on its way */
            if (wait_ready(sock, POLLIN, timeout_ms) < 0) {
                err = errno;
                break;
            }
        }
        remaining -= (int64_t)got;
        /* checksum what arrived shard by shard, gather it into runs of adjacent slots, write them */
        size_t pos = 0;
        while (pos < got && seg < n) {
            const segment_t *s = &segs[seg];
            size_t take = (size_t)(s->length - seg_done);
            if (take > got - pos) take = got - pos;
            crcs[seg] = crc32c_update(crcs[seg], buf + pos, take);
            if (s->fd >= 0 && !written_err) {
                written_err = run_add(run, (int)s->fd, s->offset + seg_done, buf + pos, take);
                int64_t tail = s->stride - s->length; /* a long tail breaks the run instead: its folios are whole */
                if (!written_err && seg_done + (int64_t)take == s->length && tail <= (int64_t)sizeof(zero_tail))
                    written_err = run_add(run, (int)s->fd, s->offset + s->length, zero_tail,
                                          (size_t)tail);
            }
            pos += take;
            seg_done += (int64_t)take;
            while (seg < n && seg_done == segs[seg].length) {
                seg++;
                seg_done = 0;
            }
        }
        if (run->count && !written_err) written_err = run_flush(run); /* the scratch buffer is reused next */
        run->count = 0;
        if (eof || err) break;
    }
    if (!err && !eof && written_err) err = written_err;
    Py_END_ALLOW_THREADS;
    if (eof || err) {
        Py_CLEAR(out);
        socket_error(err, eof);
    }
done:
    PyMem_Free(run);
    PyBuffer_Release(&plan);
    PyBuffer_Release(&scratch);
    return out;
}

#define IOV_BATCH 1024
#define IOV_SCATTER 64 /* pieces one recv_scatter call offers the kernel */

/* ---- Scatter: bytes spread over memory, sent as one payload ------------------------------------ */

/* Scatter(plan, keep): an int64 (address, length) plan of pieces that send_all sends in order as if they were one
 * buffer (len() is their total), and the object that keeps every address valid while the Scatter lives (a node
 * passes views of its slab mappings: a mapping with views cannot be closed). */
typedef struct {
    PyObject_HEAD
    Py_buffer plan;
    Py_ssize_t rows;
    Py_ssize_t total;
    PyObject *keep;
} ScatterObject;

static PyTypeObject ScatterType;

static int scatter_init(ScatterObject *self, PyObject *args, PyObject *kwds) {
    Py_buffer plan;
    PyObject *keep;
    if (!PyArg_ParseTuple(args, "y*O:Scatter", &plan, &keep)) return -1;
    if (plan.len % (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyBuffer_Release(&plan);
        PyErr_SetString(PyExc_ValueError, "plan must hold (address, length) int64 pairs");
        return -1;
    }
    const int64_t *rows = plan.buf;
    Py_ssize_t n = plan.len / (Py_ssize_t)(2 * sizeof(int64_t)), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[2 * i + 1] < 0) {
            PyBuffer_Release(&plan);
            PyErr_SetString(PyExc_ValueError, "negative length in plan");
            return -1;
        }
        total += (Py_ssize_t)rows[2 * i + 1];
    }
    if (self->plan.obj) PyBuffer_Release(&self->plan);
    self->plan = plan;
    self->rows = n;
    self->total = total;
    Py_INCREF(keep);
    Py_XSETREF(self->keep, keep);
    return 0;
}

static void scatter_dealloc(ScatterObject *self) {
    if (self->plan.obj) PyBuffer_Release(&self->plan);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t scatter_len(ScatterObject *self) { return self->total; }

static PySequenceMethods scatter_as_sequence = {.sq_length = (lenfunc)scatter_len};

static PyTypeObject ScatterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier.kvstore._native.Scatter",
    .tp_basicsize = sizeof(ScatterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)scatter_init,
    .tp_dealloc = (destructor)scatter_dealloc,
    .tp_as_sequence = &scatter_as_sequence,
    .tp_doc = "Scatter(plan, keep): int64 (address, length) pieces that send_all sends as one payload; keep holds\n"
              "whatever keeps the addresses valid. len() is the total length.",
};

/* The pieces of a sequence of buffers and Scatters, in order, as an iovec array: plain buffers are acquired
 * (release_pieces releases them), a Scatter's rows are its pieces (its keep holds their memory while the
 * sequence holds the Scatter); empty pieces are left out. */
typedef struct {
    PyObject *fast;
    Py_buffer *views;
    struct iovec *iov;
    Py_ssize_t k;
} pieces_t;

static void release_pieces(pieces_t *p) {
    if (p->views)
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(p->fast); i++)
            if (p->views[i].obj) PyBuffer_Release(&p->views[i]);
    PyMem_Free(p->views);
    PyMem_Free(p->iov);
    Py_XDECREF(p->fast);
}

static int collect_pieces(PyObject *seq, pieces_t *p) {
    *p = (pieces_t){0};
    p->fast = PySequence_Fast(seq, "expected a sequence of buffers");
    if (!p->fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(p->fast), pieces = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(p->fast, i);
        pieces += Py_IS_TYPE(item, &ScatterType) ? ((ScatterObject *)item)->rows : 1;
    }
    p->views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    p->iov = PyMem_Malloc((pieces ? pieces : 1) * sizeof(struct iovec));
    if (!p->views || !p->iov) {
        release_pieces(p);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(p->fast, i);
        if (Py_IS_TYPE(item, &ScatterType)) {
            const ScatterObject *sc = (const ScatterObject *)item;
            const int64_t *rows = sc->plan.buf;
            for (Py_ssize_t r = 0; r < sc->rows; r++) {
                if (!rows[2 * r + 1]) continue;
                p->iov[p->k].iov_base = (void *)(uintptr_t)rows[2 * r];
                p->iov[p->k].iov_len = (size_t)rows[2 * r + 1];
                p->k++;
            }
            continue;
        }
        if (PyObject_GetBuffer(item, &p->views[i], PyBUF_C_CONTIGUOUS) < 0) {
            release_pieces(p);
            return -1;
        }
        if (p->views[i].len) {
            p->iov[p->k].iov_base = p->views[i].buf;
            p->iov[p->k].iov_len = (size_t)p->views[i].len;
            p->k++;
        }
    }
    return 0;
}

/* Drop the first n bytes of iov[*first..k) in place (advancing *first past whole pieces). */
static void skip_pieces(struct iovec *iov, Py_ssize_t k, Py_ssize_t *first, size_t n) {
    while (*first < k && n >= iov[*first].iov_len) n -= iov[(*first)++].iov_len;
    if (n && *first < k) {
        iov[*first].iov_base = (char *)iov[*first].iov_base + n;
        iov[*first].iov_len -= n;
    }
}

/* sendmsg the pieces, IOV_BATCH at a time, resuming partial sends. With wait, a full socket is waited on (each
 * wait bounded by timeout_ms, -1: forever) until all is sent; without, sending stops as soon as the socket takes
 * less than it was offered (the next call would only get EAGAIN). Returns the bytes sent; *err is the errno that
 * stopped it early (EAGAIN without wait when nothing was sent), else 0. Called without the GIL. */
static size_t send_pieces(int sock, struct iovec *iov, Py_ssize_t k, int wait, int timeout_ms, int *err) {
    Py_ssize_t first = 0;
    size_t total = 0;
    *err = 0;
    while (first < k) {
        struct msghdr msg = {0};
        msg.msg_iov = iov + first;
        msg.msg_iovlen = (size_t)(k - first < IOV_BATCH ? k - first : IOV_BATCH);
        size_t asked = 0;
        for (size_t i = 0; !wait && i < msg.msg_iovlen; i++) asked += iov[first + (Py_ssize_t)i].iov_len;
        ssize_t r = sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (wait && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                if (wait_ready(sock, POLLOUT, timeout_ms) < 0) {
                    *err = errno;
                    break;
                }
                continue;
            }
            *err = errno;
            break;
        }
        total += (size_t)r;
        skip_pieces(iov, k, &first, (size_t)r);
        if (!wait && (size_t)r < asked) break;
    }
    return total;
}

static PyObject *py_send_all(PyObject *self, PyObject *args) {
    int sock, timeout_ms;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iiO:send_all", &sock, &timeout_ms, &seq)) return NULL;
    pieces_t p;
    if (collect_pieces(seq, &p) < 0) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS;
    send_pieces(sock, p.iov, p.k, 1, timeout_ms, &err);
    Py_END_ALLOW_THREADS;
    release_pieces(&p);
    if (err) return socket_error(err, 0);
    Py_RETURN_NONE;
}

/* send_some(sock_fd, buffers, skip) -> int: what send_all sends, from byte skip on, without waiting. */
static PyObject *py_send_some(PyObject *self, PyObject *args) {
    int sock;
    long long skip;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iOL:send_some", &sock, &seq, &skip)) return NULL;
    if (skip < 0) {
        PyErr_SetString(PyExc_ValueError, "negative skip");
        return NULL;
    }
    pieces_t p;
    if (collect_pieces(seq, &p) < 0) return NULL;
    Py_ssize_t first = 0;
    skip_pieces(p.iov, p.k, &first, (size_t)skip);
    int err = 0;
    size_t sent = 0;
    if (first < p.k) {
        Py_BEGIN_ALLOW_THREADS;
        sent = send_pieces(sock, p.iov + first, p.k - first, 0, 0, &err);
        Py_END_ALLOW_THREADS;
    }
    release_pieces(&p);
    if (sent == 0 && err) {
        errno = err;
        return PyErr_SetFromErrno(err == EAGAIN || err == EWOULDBLOCK ? PyExc_BlockingIOError : PyExc_OSError);
    }
    return PyLong_FromSize_t(sent); /* an error after some bytes shows again on the next call */
}

/* bytes one checksummed recvmsg takes: checksummed at once, from cache (measured on a loopback stream of 100 KiB
 * shards: +0.05 CPU s/GB over no checksum at 1 MiB steps and above, +0.1 at 64-256 KiB, where the extra system
 * calls cost more than the cache saves) */
#define RECV_HOT (1 << 20)

/* One socket's receive into a plan of pieces: where it stands, and how it ended. */
typedef struct {
    int fd;
    const int64_t *rows; /* NULL: a socket only watched (recv_many returns once it is readable) */
    Py_ssize_t n;        /* rows */
    int cols;            /* 2: (address, length); 3: (address, length, shard), checksummed into crcs */
    uint32_t *crcs;
    Py_ssize_t row;      /* the piece the next byte lands in, and how far into it */
    int64_t off;
    ssize_t total;       /* bytes received by this call */
    int err;             /* errno of a failed recvmsg (EAGAIN: drained), or -1: the peer closed */
    int64_t done;        /* bytes of the plan received before this call */
    int64_t *progress;   /* NULL, or where done + total is published after each piece is checksummed */
} plan_recv;

/* Position st at ``done`` bytes into its plan. */
static void plan_seek(plan_recv *st, int64_t done) {
    st->row = 0;
    st->off = done;
    while (st->row < st->n && st->off >= st->rows[st->cols * st->row + 1])
        st->off -= st->rows[st->cols * st->row++ + 1];
}

/* Non-blocking recvmsg calls into st's plan until the socket is drained (err EAGAIN), the plan is full (row == n),
 * the peer closed (err -1) or a call failed. Runs without the GIL: touches no Python object. */
static void plan_receive(plan_recv *st) {
    const int64_t *rows = st->rows;
    int cols = st->cols;
    while (st->row < st->n) {
        struct iovec iov[IOV_SCATTER];
        int k = 0;
        size_t asked = 0;
        for (Py_ssize_t i = st->row; i < st->n && k < IOV_SCATTER && (cols == 2 || asked < RECV_HOT); i++) {
            int64_t skip = i == st->row ? st->off : 0;
            size_t len = (size_t)(rows[cols * i + 1] - skip);
            if (cols == 3 && asked + len > RECV_HOT) len = RECV_HOT - asked;
            if (!len) continue;
            iov[k].iov_base = (char *)(uintptr_t)rows[cols * i] + skip;
            iov[k].iov_len = len;
            asked += len;
            k++;
        }
        if (!k) { /* only empty pieces left */
            st->row = st->n;
            break;
        }
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)k;
        ssize_t r;
        do {
            r = recvmsg(st->fd, &msg, MSG_DONTWAIT);
        } while (r < 0 && errno == EINTR);
        if (r <= 0) {
            st->err = r < 0 ? errno : -1;
            break;
        }
        st->total += r;
        for (size_t left = (size_t)r; left;) { /* checksum what landed, piece by piece */
            const int64_t *at = rows + cols * st->row;
            size_t take = (size_t)(at[1] - st->off);
            if (take > left) take = left;
            if (cols == 3 && at[2] >= 0)
                st->crcs[at[2]] = crc32c_update(st->crcs[at[2]], (char *)(uintptr_t)at[0] + st->off, take);
            st->off += (int64_t)take;
            left -= take;
            if (st->off == at[1]) {
                st->row++;
                st->off = 0;
            }
        }
        if (st->progress) /* another thread may read it while this one receives on: bytes before it are final */
            __atomic_store_n(st->progress, st->done + (int64_t)st->total, __ATOMIC_RELEASE);
        if ((size_t)r < asked) { /* the socket is drained: do not pay for an EAGAIN */
            st->err = EAGAIN;
            break;
        }
    }
}

/* Take plan (int64 rows), crcs (None, or a writable uint32 array) and progress (None, or a writable int64 cell) for
 * st, checked; 0, or -1 with an exception set (the caller releases the buffers taken, also on failure). */
static int plan_take(plan_recv *st, Py_buffer *plan, Py_buffer *crcbuf, PyObject *crc_obj, long long done,
                     Py_buffer *cell, PyObject *progress_obj) {
    st->cols = crc_obj == Py_None ? 2 : 3;
    if (st->cols == 3 && PyObject_GetBuffer(crc_obj, crcbuf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (progress_obj != Py_None) {
        if (PyObject_GetBuffer(progress_obj, cell, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
        if (cell->len < (Py_ssize_t)sizeof(int64_t) || ((uintptr_t)cell->buf & (sizeof(int64_t) - 1))) {
            PyErr_SetString(PyExc_ValueError, "progress must be a writable, aligned int64 cell");
            return -1;
        }
        st->progress = cell->buf;
    }
    st->done = done;
    st->n = plan->len / (Py_ssize_t)(st->cols * sizeof(int64_t));
    st->rows = plan->buf;
    st->crcs = crcbuf->buf;
    if (plan->len % (Py_ssize_t)(st->cols * sizeof(int64_t)) || done < 0) {
        PyErr_SetString(PyExc_ValueError, "plan must hold int64 (address, length[, shard]) rows");
        return -1;
    }
    Py_ssize_t ncrc = crcbuf->len / (Py_ssize_t)sizeof(uint32_t);
    for (Py_ssize_t i = 0; st->cols == 3 && i < st->n; i++)
        if (st->rows[3 * i + 2] >= ncrc) {
            PyErr_SetString(PyExc_ValueError, "plan names a shard beyond crcs");
            return -1;
        }
    plan_seek(st, done);
    return 0;
}

/* recv_scatter(sock_fd, plan, done, crcs=None, progress=None) -> int: non-blocking recvmsg calls into the plan's
 * pieces, starting done bytes into them, until nothing more is waiting or the plan is full. Without crcs the plan
 * holds (address, length) rows; with crcs (a writable uint32 array) (address, length, shard) rows, and each piece's
 * bytes are folded into crcs[shard] (shard -1: not checked) right after they land. progress (a writable int64
 * cell): the bytes of the plan received so far (done and more), stored after each recvmsg's bytes are checksummed,
 * for another thread to watch while this one receives. The caller guarantees that every address stays valid and
 * writable. */
static PyObject *py_recv_scatter(PyObject *self, PyObject *args) {
    plan_recv st = {0};
    Py_buffer plan, crcbuf = {0}, cell = {0};
    long long done;
    PyObject *crc_obj = Py_None, *progress_obj = Py_None;
    if (!PyArg_ParseTuple(args, "iy*L|OO:recv_scatter", &st.fd, &plan, &done, &crc_obj, &progress_obj)) return NULL;
    PyObject *result = NULL;
    if (plan_take(&st, &plan, &crcbuf, crc_obj, done, &cell, progress_obj) == 0) {
        Py_BEGIN_ALLOW_THREADS;
        plan_receive(&st);
        Py_END_ALLOW_THREADS;
        if (st.total == 0 && st.err > 0) {
            errno = st.err;
            PyErr_SetFromErrno(st.err == EAGAIN || st.err == EWOULDBLOCK ? PyExc_BlockingIOError : PyExc_OSError);
        } else {
            result = PyLong_FromSsize_t(st.total); /* an error after some bytes shows again on the next call */
        }
    }
    PyBuffer_Release(&plan);
    if (crcbuf.obj) PyBuffer_Release(&crcbuf);
    if (cell.obj) PyBuffer_Release(&cell);
    return result;
}

#define RECV_MANY_MAX 256

/* The items of a call over many sockets (at most RECV_MANY_MAX), as a fast sequence; NULL with an exception set. */
static PyObject *socket_items(PyObject *items, const char *name, Py_ssize_t *m) {
    PyObject *seq = PySequence_Fast(items, "expected a sequence, an item per socket");
    if (!seq) return NULL;
    *m = PySequence_Fast_GET_SIZE(seq);
    if (*m > RECV_MANY_MAX) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s takes at most %d sockets", name, RECV_MANY_MAX);
        return NULL;
    }
    return seq;
}

/* A frame head of head_size bytes whose uint32 at length_at announces up to max_length more: 1, else 0 with an
 * exception set. */
static int head_layout_ok(Py_ssize_t head_size, Py_ssize_t length_at, Py_ssize_t max_length) {
    if (head_size > 0 && length_at >= 0 && length_at + 4 <= head_size && max_length >= 0) return 1;
    PyErr_SetString(PyExc_ValueError, "a frame head's length must lie within the head");
    return 0;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* recv_many(items, timeout_ms) -> list[(received, err)]: the receive of many sockets in one call without the GIL.
 * items: (sock_fd, plan, done, crcs[, progress]) each as recv_scatter takes them, or (sock_fd, None, 0, None) for a
 * socket only watched. Receives into every plan as data arrives (poll), until a plan is full, a watched socket is readable, a
 * socket failed or closed, or timeout_ms passed. Per item: bytes received, and 0, -1 (the peer closed) or the errno
 * of a failed recvmsg. One thread then serves a whole read's sockets with a return to Python per reply, not per
 * socket buffer's worth of bytes (a Unix socket holds ~200 KiB: 12,000 returns for a 2.4 GB read). */
static PyObject *py_recv_many(PyObject *self, PyObject *args) {
    PyObject *items;
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "Oi:recv_many", &items, &timeout_ms)) return NULL;
    Py_ssize_t m;
    PyObject *seq = socket_items(items, "recv_many", &m);
    if (!seq) return NULL;
    plan_recv st[RECV_MANY_MAX];
    Py_buffer plans[RECV_MANY_MAX], crcbufs[RECV_MANY_MAX], cells[RECV_MANY_MAX];
    memset(st, 0, sizeof(plan_recv) * (size_t)m);
    memset(plans, 0, sizeof(Py_buffer) * (size_t)m);
    memset(crcbufs, 0, sizeof(Py_buffer) * (size_t)m);
    memset(cells, 0, sizeof(Py_buffer) * (size_t)m);
    PyObject *result = NULL;
    Py_ssize_t taken = 0;
    for (; taken < m; taken++) {
        PyObject *plan_obj, *crc_obj, *progress_obj = Py_None;
        long long done;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, taken), "iOLO|O:recv_many item", &st[taken].fd,
                              &plan_obj, &done, &crc_obj, &progress_obj))
            goto out;
        if (plan_obj == Py_None) continue; /* watched only */
        if (PyObject_GetBuffer(plan_obj, &plans[taken], PyBUF_C_CONTIGUOUS) < 0) goto out;
        if (plan_take(&st[taken], &plans[taken], &crcbufs[taken], crc_obj, done, &cells[taken], progress_obj) < 0) {
            taken++;
            goto out;
        }
    }
    Py_BEGIN_ALLOW_THREADS;
    struct pollfd pfds[RECV_MANY_MAX];
    int64_t deadline = now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    int stop = 0;
    for (Py_ssize_t i = 0; i < m; i++) /* what is already waiting */
        if (st[i].rows) {
            plan_receive(&st[i]);
            if (st[i].row >= st[i].n || (st[i].err && st[i].err != EAGAIN)) stop = 1;
        }
    while (!stop) {
        for (Py_ssize_t i = 0; i < m; i++) {
            pfds[i].fd = st[i].fd;
            pfds[i].events = POLLIN;
            pfds[i].revents = 0;
        }
        int64_t left = deadline - now_ms();
        if (left <= 0) break;
        int r = poll(pfds, (nfds_t)m, (int)left);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        for (Py_ssize_t i = 0; i < m; i++) {
            if (!pfds[i].revents) continue;
            if (!st[i].rows) { /* a watched socket has something: Python reads it */
                stop = 1;
                continue;
            }
            plan_receive(&st[i]);
            if (st[i].row >= st[i].n || (st[i].err && st[i].err != EAGAIN)) stop = 1;
        }
    }
    Py_END_ALLOW_THREADS;
    result = PyList_New(m);
    for (Py_ssize_t i = 0; result && i < m; i++) {
        int err = st[i].err == EAGAIN || st[i].err == EWOULDBLOCK ? 0 : st[i].err;
        PyObject *pair = Py_BuildValue("(ni)", st[i].total, err);
        if (!pair) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, pair);
    }
out:
    for (Py_ssize_t i = 0; i < taken; i++) {
        if (plans[i].obj) PyBuffer_Release(&plans[i]);
        if (crcbufs[i].obj) PyBuffer_Release(&crcbufs[i]);
        if (cells[i].obj) PyBuffer_Release(&cells[i]);
    }
    Py_DECREF(seq);
    return result;
}

/* The receive of one frame head: head_size bytes, then as many more as the uint32 at length_at of them says. */
enum { HEAD_CLOSED = -2, HEAD_FAILED = -1, HEAD_RECEIVING = 0, HEAD_WHOLE = 1, HEAD_ALONE = 2 };
typedef struct {
    int fd;
    int state; /* HEAD_*: ALONE is the head without its metadata (longer than max_length: the caller's to take) */
    int err;   /* the errno of HEAD_FAILED */
    size_t got, want;
    char *buf; /* head_size bytes, then grown to the whole frame head */
} head_recv;

/* Receive what h still wants until it is whole, the socket has nothing more (EAGAIN: a non-blocking socket empty,
 * or a blocking one's receive timeout passed; h stays HEAD_RECEIVING), the peer closed or a recv failed. flags:
 * MSG_DONTWAIT, or 0 on a blocking socket. Called without the GIL. */
static void head_receive(head_recv *h, int flags, size_t head_size, size_t length_at, size_t max_length) {
    while (h->state == HEAD_RECEIVING) {
        ssize_t k = recv(h->fd, h->buf + h->got, h->want - h->got, flags);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                h->state = HEAD_FAILED;
                h->err = errno;
            }
            return;
        }
        if (k == 0) {
            h->state = HEAD_CLOSED;
            return;
        }
        h->got += (size_t)k;
        if (h->got < h->want) continue;
        if (h->want > head_size) {
            h->state = HEAD_WHOLE;
            return;
        }
        uint32_t length;
        memcpy(&length, h->buf + length_at, sizeof length); /* little-endian, as x86 and the wire are */
        if (length > max_length) {
            h->state = HEAD_ALONE;
            return;
        }
        char *grown = length ? realloc(h->buf, head_size + length) : h->buf;
        if (!grown) {
            h->state = HEAD_FAILED;
            h->err = ENOMEM;
            return;
        }
        h->buf = grown;
        h->want += length;
        if (!length) h->state = HEAD_WHOLE;
    }
}

/* recv_head(fd, head_size, length_at, max_length) -> (bytes, state): a server's receive of the next frame's head on
 * a blocking socket, without the GIL: head_size bytes, then as many as the uint32 at length_at says if at most
 * max_length. state: 1 the head and its metadata are whole; 2 the head alone is (its metadata is longer than
 * max_length: the caller receives it); 0 the socket's receive timeout passed first; -1 the peer closed first. The
 * bytes are what arrived. Raises OSError when a recv fails otherwise. */
static PyObject *py_recv_head(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t head_size, length_at, max_length;
    if (!PyArg_ParseTuple(args, "innn:recv_head", &fd, &head_size, &length_at, &max_length)) return NULL;
    if (!head_layout_ok(head_size, length_at, max_length)) return NULL;
    head_recv h = {.fd = fd, .want = (size_t)head_size, .buf = malloc((size_t)head_size)};
    if (!h.buf) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS;
    head_receive(&h, 0, (size_t)head_size, (size_t)length_at, (size_t)max_length);
    Py_END_ALLOW_THREADS;
    PyObject *out = NULL;
    if (h.state == HEAD_FAILED) {
        errno = h.err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        out = Py_BuildValue("(y#i)", h.buf, (Py_ssize_t)h.got, h.state == HEAD_CLOSED ? -1 : h.state);
    }
    free(h.buf);
    return out;
}

/* Send what a non-blocking socket takes now of buf past *sent (advanced): 0 (all of it sent, or the socket is full
 * for now), or the errno of a failed send. Called without the GIL. */
static int send_more(int fd, const char *buf, size_t len, size_t *sent) {
    while (*sent < len) {
        ssize_t k = send(fd, buf + *sent, len - *sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno;
        }
        *sent += (size_t)k;
    }
    return 0;
}

/* recv_heads(fds, timeout_ms, head_size, length_at, max_length, sends=None, quiet_ms=-1) -> list[bytes | int | None]:
 * on each socket (non-blocking) one frame's head, without the GIL: head_size bytes, then as many as the
 * little-endian uint32 at byte length_at of them says (not more than max_length: else the head alone). sends: per
 * socket a bytes-like object sent whole first (the request the head answers: as fast as the socket takes it), or
 * None. Per socket the bytes, or -1 (the peer closed first), the errno of a failed send or recv, None when
 * timeout_ms passed with its request sent and no byte of the head come (the stream is in step: the head may still
 * be received), or ETIMEDOUT when it passed with the request sent in part or part of the head received (the stream
 * is out of step). quiet_ms: once a head is whole, a socket whose request is out and that has received nothing
 * quiet_ms later is left (None) without waiting longer, while the heads begun are waited for until timeout_ms (the
 * caller has the whole heads' payloads to receive meanwhile; before any head is whole it has nothing to do). A whole
 * round of requests (MATCH to every primary, a read's GET_SHARDS to each node) and their replies' heads in one
 * call. */
static PyObject *py_recv_heads(PyObject *self, PyObject *args) {
    PyObject *fds, *sends_obj = Py_None;
    int timeout_ms, quiet_ms = -1;
    Py_ssize_t head_size, length_at, max_length;
    if (!PyArg_ParseTuple(args, "Oinnn|Oi:recv_heads", &fds, &timeout_ms, &head_size, &length_at, &max_length,
                          &sends_obj, &quiet_ms))
        return NULL;
    if (!head_layout_ok(head_size, length_at, max_length)) return NULL;
    Py_ssize_t m;
    PyObject *seq = socket_items(fds, "recv_heads", &m);
    if (!seq) return NULL;
    PyObject *sends = NULL;
    if (sends_obj != Py_None) {
        sends = PySequence_Fast(sends_obj, "sends: expected a sequence, an item per socket");
        if (!sends) {
            Py_DECREF(seq);
            return NULL;
        }
        if (PySequence_Fast_GET_SIZE(sends) != m) {
            PyErr_SetString(PyExc_ValueError, "recv_heads: sends must have an item per socket");
            Py_DECREF(sends);
            Py_DECREF(seq);
            return NULL;
        }
    }
    head_recv st[RECV_MANY_MAX];
    Py_buffer out_bufs[RECV_MANY_MAX];
    size_t sent[RECV_MANY_MAX]; /* bytes of each request sent */
    memset(out_bufs, 0, sizeof(Py_buffer) * (size_t)m);
    memset(sent, 0, sizeof(size_t) * (size_t)m);
    PyObject *result = NULL;
    Py_ssize_t taken = 0;
    for (; taken < m; taken++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, taken));
        if (fd == -1 && PyErr_Occurred()) goto out;
        st[taken] = (head_recv){.fd = (int)fd, .want = (size_t)head_size, .buf = malloc((size_t)head_size)};
        if (!st[taken].buf) {
            PyErr_NoMemory();
            goto out;
        }
        PyObject *send_obj = sends ? PySequence_Fast_GET_ITEM(sends, taken) : Py_None;
        if (send_obj != Py_None && PyObject_GetBuffer(send_obj, &out_bufs[taken], PyBUF_SIMPLE) < 0) {
            taken++;
            goto out;
        }
    }
    Py_BEGIN_ALLOW_THREADS;
    struct pollfd pfds[RECV_MANY_MAX];
    int64_t deadline = now_ms() + (timeout_ms > 0 ? timeout_ms : 0), quiet_until = deadline;
    int quiet_started = quiet_ms < 0; /* (without a quiet time, the sockets that got nothing wait until timeout_ms) */
    for (;;) { /* each socket: its request out (as fast as it takes it), then its head in */
        nfds_t waiting = 0;
        int quiet = now_ms() >= quiet_until, nothing_yet = 0; /* quiet: a socket that got nothing is left as it is */
        for (Py_ssize_t i = 0; i < m; i++) {
            size_t out_len = (size_t)out_bufs[i].len;
            if (st[i].state == HEAD_RECEIVING && sent[i] < out_len) {
                int err = send_more(st[i].fd, out_bufs[i].buf, out_len, &sent[i]);
                if (err) st[i] = (head_recv){.fd = st[i].fd, .state = HEAD_FAILED, .err = err, .buf = st[i].buf};
                else if (sent[i] < out_len) pfds[waiting++] = (struct pollfd){.fd = st[i].fd, .events = POLLOUT};
                if (err || sent[i] < out_len) continue;
            }
            head_receive(&st[i], MSG_DONTWAIT, (size_t)head_size, (size_t)length_at, (size_t)max_length);
            if (!quiet_started && (st[i].state == HEAD_WHOLE || st[i].state == HEAD_ALONE)) {
                quiet_started = 1; /* the first head whole: the quiet time starts */
                int64_t until = now_ms() + quiet_ms;
                quiet_until = until < deadline ? until : deadline;
            }
            if (st[i].state != HEAD_RECEIVING || (quiet && !st[i].got)) continue;
            nothing_yet |= !st[i].got;
            pfds[waiting++] = (struct pollfd){.fd = st[i].fd, .events = POLLIN};
        }
        if (!waiting) break;
        int64_t left = (nothing_yet ? quiet_until : deadline) - now_ms();
        int r = left > 0 ? poll(pfds, waiting, (int)left) : 0;
        if (r < 0 && errno == EINTR) continue;
        if (r == 0 && nothing_yet) continue; /* the quiet time is over: from now on only the heads begun */
        if (r <= 0) {
            int err = r < 0 ? errno : ETIMEDOUT;
            for (Py_ssize_t i = 0; i < m; i++)
                if (st[i].state == HEAD_RECEIVING &&
                    (err != ETIMEDOUT || st[i].got || sent[i] < (size_t)out_bufs[i].len)) /* out of step */
                    st[i] = (head_recv){.fd = st[i].fd, .state = HEAD_FAILED, .err = err, .buf = st[i].buf};
            break; /* (a socket that sent all and received nothing at a timeout stays HEAD_RECEIVING: in step) */
        }
    }
    Py_END_ALLOW_THREADS;
    result = PyList_New(m);
    for (Py_ssize_t i = 0; result && i < m; i++) {
        int state = st[i].state;
        PyObject *item;
        if (state == HEAD_WHOLE || state == HEAD_ALONE) item = PyBytes_FromStringAndSize(st[i].buf, (Py_ssize_t)st[i].got);
        else if (state == HEAD_RECEIVING) item = Py_NewRef(Py_None); /* nothing came: in step */
        else item = PyLong_FromLong(state == HEAD_CLOSED ? -1 : st[i].err);
        if (!item) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, item);
    }
out:
    for (Py_ssize_t i = 0; i < taken; i++) {
        free(st[i].buf);
        if (out_bufs[i].obj) PyBuffer_Release(&out_bufs[i]);
    }
    Py_XDECREF(sends);
    Py_DECREF(seq);
    return result;
}

/* crc32c_pieces(plan) -> bytes: the CRC-32C of each (address, length) row of an int64 plan, as little-endian
 * uint32s, without the GIL. The caller guarantees that every address is valid. */
static PyObject *py_crc32c_pieces(PyObject *self, PyObject *arg) {
    Py_buffer plan;
    if (PyObject_GetBuffer(arg, &plan, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (plan.len % (Py_ssize_t)(2 * sizeof(int64_t))) {
        PyBuffer_Release(&plan);
        PyErr_SetString(PyExc_ValueError, "plan must hold (address, length) int64 pairs");
        return NULL;
    }
    Py_ssize_t n = plan.len / (Py_ssize_t)(2 * sizeof(int64_t));
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint32_t));
    if (out) {
        const int64_t *rows = plan.buf;
        uint32_t *crcs = (uint32_t *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t i = 0; i < n; i++)
            crcs[i] = crc32c_update(0, (const void *)(uintptr_t)rows[2 * i], (size_t)rows[2 * i + 1]);
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&plan);
    return out;
}

/* reply_plan(blocks, index, lens, fits, base, length, data_shards) -> (plan, scratch, parked): where each shard of a
 * GET reply lands, in payload order, as int64 (address, length, shard) rows (shard: the shard's number among those
 * that fit, -1 for one that does not; empty pieces left out). A data shard that fits (fits[i], index < data_shards)
 * lands at base[block] + index * len, the bytes of it beyond length[block] (the zero padding of a tail shard) in
 * scratch; any other shard lands whole in scratch, a new bytearray; parked holds, per shard, its offset in scratch
 * (-1: none). blocks, index, lens, base, length: int64 arrays; fits: bool. */
static PyObject *py_reply_plan(PyObject *self, PyObject *args) {
    Py_buffer in[6] = {{0}};
    long long data_shards;
    PyObject *objs[6];
    if (!PyArg_ParseTuple(args, "OOOOOOL:reply_plan", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &data_shards))
        return NULL;
    PyObject *plan = NULL, *scratch = NULL, *parked = NULL, *out = NULL;
    for (int i = 0; i < 6; i++)
        if (PyObject_GetBuffer(objs[i], &in[i], PyBUF_C_CONTIGUOUS) < 0) goto done;
    Py_ssize_t n = in[0].len / 8, blocks_known = in[4].len / 8;
    if (in[1].len != n * 8 || in[2].len != n * 8 || in[3].len != n || in[5].len != blocks_known * 8 || in[0].len % 8) {
        PyErr_SetString(PyExc_ValueError, "reply_plan: blocks, index, lens (int64), fits (bool) must match");
        goto done;
    }
    const int64_t *block = in[0].buf, *index = in[1].buf, *len = in[2].buf, *base = in[4].buf, *length = in[5].buf;
    const unsigned char *fits = in[3].buf;
    int64_t scratch_len = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (len[i] < 0 || (fits[i] && (block[i] < 0 || block[i] >= blocks_known))) {
            PyErr_SetString(PyExc_ValueError, "reply_plan: a shard names no known block or a negative length");
            goto done;
        }
        if (fits[i] && index[i] < data_shards) {
            int64_t held = length[block[i]] - index[i] * len[i];
            scratch_len += len[i] - (held < 0 ? 0 : held > len[i] ? len[i] : held);
        } else {
            scratch_len += len[i];
        }
    }
    plan = PyBytes_FromStringAndSize(NULL, 2 * n * 3 * (Py_ssize_t)sizeof(int64_t));
    scratch = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)scratch_len);
    parked = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (!plan || !scratch || !parked) goto done;
    int64_t *rows = (int64_t *)PyBytes_AS_STRING(plan), *at = (int64_t *)PyBytes_AS_STRING(parked);
    int64_t scratch_base = (int64_t)(uintptr_t)PyByteArray_AS_STRING(scratch), off = 0, checked = 0;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t shard = fits[i] ? checked++ : -1;
        at[i] = -1;
        if (fits[i] && index[i] < data_shards) {
            int64_t start = index[i] * len[i], held = length[block[i]] - start;
            held = held < 0 ? 0 : held > len[i] ? len[i] : held;
            if (held) {
                rows[3 * k] = base[block[i]] + start, rows[3 * k + 1] = held, rows[3 * k + 2] = shard;
                k++;
            }
            if (len[i] - held) {
                rows[3 * k] = scratch_base + off, rows[3 * k + 1] = len[i] - held, rows[3 * k + 2] = shard;
                k++;
                off += len[i] - held;
            }
        } else {
            at[i] = off;
            if (len[i]) {
                rows[3 * k] = scratch_base + off, rows[3 * k + 1] = len[i], rows[3 * k + 2] = shard;
                k++;
            }
            off += len[i];
        }
    }
    if (_PyBytes_Resize(&plan, k * 3 * (Py_ssize_t)sizeof(int64_t)) < 0) goto done;
    out = PyTuple_Pack(3, plan, scratch, parked);
done:
    for (int i = 0; i < 6; i++)
        if (in[i].obj) PyBuffer_Release(&in[i]);
    Py_XDECREF(plan);
    Py_XDECREF(scratch);
    Py_XDECREF(parked);
    return out;
}

static PyObject *py_addresses(PyObject *self, PyObject *seq) {
    Py_ssize_t n;
    Py_buffer *views = acquire_views(seq, &n, 1);
    if (!views) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out) {
        int64_t *at = (int64_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) at[i] = (int64_t)(uintptr_t)views[i].buf;
    }
    release_views(views, n);
    return out;
}

/* ---- erasure coding: many stripes per call ------------------------------------------------------- */

/* ISA-L's ec_encode_data(len, k, rows, gftbls, data, coding), found by the caller (codec.py loads ISA-L). */
typedef void (*ec_encode_fn)(int, int, int, unsigned char *, unsigned char **, unsigned char **);

/* ec_encode_stripes(fn, tables, k, pointers, sizes): fn once per row of an int64 pointer table (k data addresses,
 * then the outputs) over sizes[row] bytes, without the GIL: no Python call per stripe. */
static PyObject *py_ec_encode_stripes(PyObject *self, PyObject *args) {
    unsigned long long fn, tables;
    int k;
    Py_buffer pointers, sizes;
    if (!PyArg_ParseTuple(args, "KKiy*y*:ec_encode_stripes", &fn, &tables, &k, &pointers, &sizes)) return NULL;
    Py_ssize_t n = sizes.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t cols = n ? pointers.len / (Py_ssize_t)sizeof(int64_t) / n : 0;
    const int64_t *size = sizes.buf;
    int ok = fn && tables && k > 0 && cols > k && sizes.len % (Py_ssize_t)sizeof(int64_t) == 0 &&
             pointers.len == n * cols * (Py_ssize_t)sizeof(int64_t);
    for (Py_ssize_t r = 0; ok && r < n; r++) ok = size[r] > 0 && size[r] <= INT32_MAX;
    if (n && !ok) {
        PyBuffer_Release(&pointers);
        PyBuffer_Release(&sizes);
        PyErr_SetString(PyExc_ValueError, "need an n x (k + outputs) int64 pointer table and n sizes of 1..2^31-1");
        return NULL;
    }
    ec_encode_fn encode = (ec_encode_fn)(uintptr_t)fn;
    unsigned char **row = pointers.buf; /* int64 addresses are pointers on the 64-bit platforms ISA-L runs on */
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < n; r++, row += cols)
        encode((int)size[r], k, (int)(cols - k), (unsigned char *)(uintptr_t)tables, row, row + k);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&pointers);
    PyBuffer_Release(&sizes);
    Py_RETURN_NONE;
}

static PyObject *py_bytearray_uninit(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative size");
        return NULL;
    }
    return PyByteArray_FromStringAndSize(NULL, n);
}

/* ---- placement: which group and node a key belongs to -------------------------------------------- */

/* Jump consistent hash (Lamping and Veach, 2014) of key into [0, buckets): the reference loop, in doubles as the
 * paper's. */
static int64_t jump(uint64_t key, int64_t buckets) {
    int64_t b = -1, j = 0;
    while (j < buckets) {
        b = j;
        key = key * 2862933555777941757ULL + 1;
        j = (int64_t)((double)(b + 1) * ((double)(1LL << 31) / (double)((key >> 33) + 1)));
    }
    return b < 0 ? 0 : b;
}

/* jump_hash(h, buckets, out): out[i] = jump(h[i], buckets) for h a buffer of uint64 and out of int64, as many. */
static PyObject *py_jump_hash(PyObject *self, PyObject *args) {
    Py_buffer h, out;
    long long buckets;
    if (!PyArg_ParseTuple(args, "y*Lw*:jump_hash", &h, &buckets, &out)) return NULL;
    PyObject *result = NULL;
    if (h.len % 8 || out.len != h.len || buckets < 1) {
        PyErr_SetString(PyExc_ValueError, "jump_hash takes n uint64 keys, n int64 outputs and buckets >= 1");
    } else {
        const uint64_t *key = h.buf;
        int64_t *bucket = out.buf;
        for (Py_ssize_t i = 0; i < h.len / 8; i++) bucket[i] = jump(key[i], buckets);
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&h);
    PyBuffer_Release(&out);
    return result;
}

#define MAX_NODE_IDS 65536 /* node ids are 0..65535 (kvtier.kvstore.cluster.config.MAX_NODE_ID) */

/* primary_runs(blob, klen, groups, slots) -> (order, runs, rows): each key's primary, the keys sorted by it. blob:
 * n keys of klen bytes; groups: int64 node ids, slots a group. A key's primary is groups[jump(h, G)][h % slots], h
 * its first 8 bytes (little-endian). order: the key indexes sorted by primary, stably (int64 bytes); runs: per
 * primary, ascending, (node, lo, hi) of order; rows: the keys in that order, concatenated. One call for what a
 * MATCH's fan-out needs, instead of a numpy pass per step. */
static PyObject *py_primary_runs(PyObject *self, PyObject *args) {
    Py_buffer blob, groups;
    Py_ssize_t klen, slots;
    if (!PyArg_ParseTuple(args, "y*ny*n:primary_runs", &blob, &klen, &groups, &slots)) return NULL;
    PyObject *order = NULL, *runs = NULL, *rows = NULL, *result = NULL;
    int32_t *primary = NULL, *count = NULL;
    Py_ssize_t n = klen >= 8 ? blob.len / klen : 0, cells = groups.len / (Py_ssize_t)sizeof(int64_t);
    if (klen < 8 || blob.len % klen || slots < 1 || groups.len % (Py_ssize_t)sizeof(int64_t) || !cells ||
        cells % slots) {
        PyErr_SetString(PyExc_ValueError, "primary_runs takes keys of at least 8 bytes and a groups x slots table");
        goto done;
    }
    const int64_t *table = groups.buf;
    int32_t top = 0; /* the largest node id of the table */
    for (Py_ssize_t c = 0; c < cells; c++) {
        if (table[c] < 0 || table[c] >= MAX_NODE_IDS) {
            PyErr_Format(PyExc_ValueError, "node id %lld is out of range", (long long)table[c]);
            goto done;
        }
        if (table[c] > top) top = (int32_t)table[c];
    }
    primary = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    count = calloc((size_t)top + 2, sizeof(int32_t)); /* count[node + 1]: keys of node, then where its run ends */
    if (!primary || !count) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *key = blob.buf;
    int64_t n_groups = cells / slots;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h;
        memcpy(&h, key + i * klen, sizeof h); /* little-endian, as x86 is */
        primary[i] = (int32_t)table[jump(h, n_groups) * slots + (int64_t)(h % (uint64_t)slots)];
        count[primary[i] + 1]++;
    }
    if (!(runs = PyList_New(0))) goto done;
    for (int32_t node = 0; node <= top; node++) { /* count[node] becomes where node's run starts */
        int32_t size = count[node + 1];
        count[node + 1] = count[node] + size;
        if (!size) continue;
        PyObject *run = Py_BuildValue("(iii)", node, count[node], count[node + 1]);
        if (!run || PyList_Append(runs, run) < 0) {
            Py_XDECREF(run);
            goto done;
        }
        Py_DECREF(run);
    }
    order = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    rows = PyBytes_FromStringAndSize(NULL, n * klen);
    if (!order || !rows) goto done;
    int64_t *at = (int64_t *)PyBytes_AS_STRING(order);
    char *row = PyBytes_AS_STRING(rows);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t to = count[primary[i]]++;
        at[to] = i;
        memcpy(row + (Py_ssize_t)to * klen, key + i * klen, (size_t)klen);
    }
    result = PyTuple_Pack(3, order, runs, rows);
done:
    Py_XDECREF(order);
    Py_XDECREF(runs);
    Py_XDECREF(rows);
    free(primary);
    free(count);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&groups);
    return result;
}

/* ---- MATCH: liveness of many keys in the block index --------------------------------------------- */

/* live_flags(entries, prefix, blob, klen, oldest) -> bytes: per key of blob (klen bytes each), 1 if entries (a dict:
 * prefix + key -> an object with ttl_class and created) holds it with created >= oldest[ttl_class], else 0. oldest
 * is looked up once per run of keys of one class (a mapping that may work the value out on first use). */
static PyObject *py_live_flags(PyObject *self, PyObject *args) {
    static PyObject *s_ttl_class, *s_created;
    PyObject *entries, *oldest;
    Py_buffer prefix, blob;
    Py_ssize_t klen;
    if (!s_ttl_class && !(s_ttl_class = PyUnicode_InternFromString("ttl_class"))) return NULL;
    if (!s_created && !(s_created = PyUnicode_InternFromString("created"))) return NULL;
    if (!PyArg_ParseTuple(args, "O!y*y*nO", &PyDict_Type, &entries, &prefix, &blob, &klen, &oldest)) return NULL;
    PyObject *out = NULL, *cls = NULL;
    double oldest_of_cls = 0.0;
    if (klen <= 0 || blob.len % klen) {
        PyErr_SetString(PyExc_ValueError, "the keys blob is not a whole number of keys of klen bytes");
        goto done;
    }
    Py_ssize_t n = blob.len / klen;
    if (!(out = PyBytes_FromStringAndSize(NULL, n))) goto done;
    char *flags = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize(NULL, prefix.len + klen);
        if (!key) goto fail;
        memcpy(PyBytes_AS_STRING(key), prefix.buf, prefix.len);
        memcpy(PyBytes_AS_STRING(key) + prefix.len, (const char *)blob.buf + i * klen, klen);
        PyObject *entry = PyDict_GetItemWithError(entries, key);
        Py_DECREF(key);
        flags[i] = 0;
        if (!entry) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        Py_INCREF(entry);
        PyObject *entry_cls = PyObject_GetAttr(entry, s_ttl_class);
        PyObject *created = entry_cls ? PyObject_GetAttr(entry, s_created) : NULL;
        Py_DECREF(entry);
        if (!created) {
            Py_XDECREF(entry_cls);
            goto fail;
        }
        if (entry_cls != cls) {
            PyObject *limit = PyObject_GetItem(oldest, entry_cls);
            double value = limit ? PyFloat_AsDouble(limit) : -1.0;
            Py_XDECREF(limit);
            if (!limit || (value == -1.0 && PyErr_Occurred())) {
                Py_DECREF(entry_cls);
                Py_DECREF(created);
                goto fail;
            }
            Py_XSETREF(cls, entry_cls);
            oldest_of_cls = value;
        } else {
            Py_DECREF(entry_cls);
        }
        double when = PyFloat_AsDouble(created);
        Py_DECREF(created);
        if (when == -1.0 && PyErr_Occurred()) goto fail;
        flags[i] = when >= oldest_of_cls;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(cls);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&blob);
    return out;
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(data, crc=0, impl=None) -> int: CRC-32C of data, continuing from crc; impl names one of CRC_IMPLS\n"
     "(default: the fastest)."},
    {"crc32c_many", py_crc32c_many, METH_O, "crc32c_many(buffers) -> list[int]: CRC-32C of each buffer."},
    {"recv_to_files", py_recv_to_files, METH_VARARGS,
     "recv_to_files(sock_fd, timeout_ms, plan, scratch) -> bytes: receive exactly the plan's bytes.\n\n"
     "plan holds int64 rows (fd, offset, length, stride), one per shard, in payload order; each shard is\n"
     "written at offset of fd and the rest of its slot (stride - length bytes, if at most 64 KiB) as zeros, slots\n"
     "adjacent in a file in one pwritev (fd -1: received and dropped). Returns the shards' CRC-32Cs as\n"
     "little-endian uint32s. scratch is reused to receive in pieces. Raises TimeoutError, ConnectionResetError (peer closed) or OSError; after an error the\n"
     "stream is out of step and the connection must be closed."},
    {"crc32c_pieces", py_crc32c_pieces, METH_O,
     "crc32c_pieces(plan) -> bytes: CRC-32C of each (address, length) row of an int64 plan, as little-endian\n"
     "uint32s. The caller keeps every address valid."},
    {"send_all", py_send_all, METH_VARARGS,
     "send_all(sock_fd, timeout_ms, buffers): send every byte of buffers (sendmsg, partial sends resumed); an item\n"
     "may be a Scatter, whose pieces are sent in its place."},
    {"send_some", py_send_some, METH_VARARGS,
     "send_some(sock_fd, buffers, skip) -> int: send what send_all would, starting skip bytes in, without waiting:\n"
     "sendmsg calls until the socket takes less than offered or all is sent; bytes sent. Raises BlockingIOError\n"
     "when the socket takes nothing, OSError when the connection failed before any byte was sent."},
    {"recv_scatter", py_recv_scatter, METH_VARARGS,
     "recv_scatter(sock_fd, plan, done, crcs=None) -> int: non-blocking recvmsg calls into the pieces of plan,\n"
     "skipping the first done bytes of them, until nothing more is waiting or the plan is full; bytes received,\n"
     "0 when the peer closed. plan holds int64 (address, length) rows, or with crcs (a writable uint32 array)\n"
     "(address, length, shard) rows, each piece folded into crcs[shard] (-1: none) in 1 MiB steps, while hot.\n"
     "Raises BlockingIOError when nothing is waiting. The caller keeps every address valid and writable."},
    {"recv_many", py_recv_many, METH_VARARGS,
     "recv_many(items, timeout_ms) -> list[(received, err)]: recv_scatter over many sockets at once, without the GIL:\n"
     "items are (sock_fd, plan, done, crcs), or (sock_fd, None, 0, None) for a socket only watched. Receives as data\n"
     "arrives until a plan is full, a watched socket is readable, a socket failed or timeout_ms passed; per item the\n"
     "bytes received and 0, -1 (the peer closed) or the errno of a failed recvmsg."},
    {"reply_plan", py_reply_plan, METH_VARARGS,
     "reply_plan(blocks, index, lens, fits, base, length, data_shards) -> (plan, scratch, parked): where each shard\n"
     "of a GET reply lands, as int64 (address, length, shard) rows in payload order (see csrc/native.c)."},
    {"addresses", py_addresses, METH_O,
     "addresses(buffers) -> bytes: the start address of each writable, C-contiguous buffer as int64s (valid\n"
     "while the caller keeps the buffer exported, e.g. through a memoryview, so it cannot move or be freed)."},
    {"ec_encode_stripes", py_ec_encode_stripes, METH_VARARGS,
     "ec_encode_stripes(fn, tables, k, pointers, sizes): call ISA-L's ec_encode_data at address fn once per row of\n"
     "an int64 pointer table (k inputs, then the outputs) over sizes[row] bytes (int64), without the GIL. The caller\n"
     "keeps every address valid and the outputs writable."},
    {"bytearray_uninit", py_bytearray_uninit, METH_O,
     "bytearray_uninit(n) -> bytearray of n bytes, not zeroed (for buffers about to be overwritten)."},
    {"recv_head", py_recv_head, METH_VARARGS,
     "recv_head(fd, head_size, length_at, max_length) -> (bytes, state): the next frame's head on a blocking socket,\n"
     "without the GIL; state 1 whole with its metadata, 2 the head alone (metadata over max_length), 0 the receive\n"
     "timeout passed first, -1 the peer closed first; the bytes are what arrived."},
    {"recv_heads", py_recv_heads, METH_VARARGS,
     "recv_heads(fds, timeout_ms, head_size, length_at, max_length, sends=None, quiet_ms=-1) -> list[bytes | int |\n"
     "None]: on each non-blocking socket one frame's head (head_size bytes, then the uint32 at length_at more, if at\n"
     "most max_length), without the GIL, after sending it sends[i] whole (if given and not None); per socket the\n"
     "bytes, or -1 (peer closed), an errno (of the send too; EAGAIN: sent only in part), ETIMEDOUT (part of a head:\n"
     "out of step), or None (nothing came by timeout_ms, or by quiet_ms: in step)."},
    {"jump_hash", py_jump_hash, METH_VARARGS,
     "jump_hash(h, buckets, out): out[i] = the jump consistent hash of the uint64 h[i] into range(buckets) (out:\n"
     "int64, as many as h)."},
    {"primary_runs", py_primary_runs, METH_VARARGS,
     "primary_runs(blob, klen, groups, slots) -> (order, runs, rows): each key's primary (groups[jump(h, G)][h %\n"
     "slots], h its first 8 bytes), the key indexes sorted by it stably (int64 bytes), (node, lo, hi) per primary\n"
     "ascending, and the keys in that order (bytes)."},
    {"live_flags", py_live_flags, METH_VARARGS,
     "live_flags(entries, prefix, blob, klen, oldest) -> bytes: per key of blob (keys of klen bytes, concatenated),\n"
     "1 if the dict entries holds prefix + key with created >= oldest[ttl_class], else 0 (the answer to MATCH)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier.kvstore._native",
                                    "The store's per-byte hot loops in C (see csrc/native.c).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    crc_init();
    if (PyType_Ready(&ScatterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "HW_CRC", have_hw) < 0) Py_CLEAR(m);
    if (m && PyModule_AddIntConstant(m, "MAX_SOCKETS", RECV_MANY_MAX) < 0) Py_CLEAR(m); /* a recv_many/heads call */
    PyObject *impls = PyTuple_New(crc_level + 1);
    for (int i = 0; impls && i <= crc_level; i++) PyTuple_SET_ITEM(impls, i, PyUnicode_FromString(crc_names[i]));
    if (m && (!impls || PyModule_AddObjectRef(m, "CRC_IMPLS", impls) < 0)) Py_CLEAR(m);
    Py_XDECREF(impls);
    if (m && PyModule_AddObjectRef(m, "Scatter", (PyObject *)&ScatterType) < 0) Py_CLEAR(m);
    return m;
}
