/* The blake3 prefix chain of `kvatlas.core.keys`, with the official BLAKE3 C library.
 *
 * Owns `chain(tokens, chunk_size, prefix, memo=None)`, the compiled twin of
 * `keys._python_chain` (the loop over the `blake3` package, which serves where this
 * module was not built): `tokens` is a buffer of little-endian uint32 token ids (4 bytes
 * each), and the answer is the hashes of its full chunks, 32 bytes each, concatenated:
 *
 *     h_1 = blake3(prefix || uint32_be(tokens of chunk 1))
 *     h_i = blake3(h_{i-1} || uint32_be(tokens of chunk i))
 *
 * A trailing partial chunk has no hash. It validates only its own arguments (a positive
 * chunk size, a whole number of tokens); the tokens' range is the caller's. No I/O.
 * And `ChainMemo`, the memo of recent links `chain` may be given (below): the only
 * state here, owned by whoever made it. setup.py builds it with the BLAKE3 C library
 * vendored in third_party/blake3 where a C compiler is found; its assembly for SSE2,
 * SSE4.1, AVX2 and AVX-512 is chosen at run time by the library's own dispatch.
 *
 * Each link needs the one before it: the chain costs its compressions, one after
 * another (docs/benchmarks.md has the figures); a link found in a memo skips them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blake3.h"

#define HASH_BYTES 32
/* Tokens converted to big-endian at once, on the stack. */
#define BLOCK_TOKENS 1024
/* Inputs longer than this are hashed without the GIL (a body that big is handled in the
 * HTTP server's thread pool). A shorter one takes under ~1.5 ms, and giving the GIL away
 * on the event loop's thread risks waiting a switch interval (5 ms) to get it back. */
#define RELEASE_GIL_BYTES (1 << 20)

/* ---- the memo of links ------------------------------------------------------------
 *
 * A lookup of a prompt seen before (a request the engine's scheduler asks about again
 * while it waits, the next turn of a chat, a shared system prompt) hashes the same links
 * again: ~1.4 us of dependent compressions each. A `ChainMemo` remembers recent links
 * as (parent hash, the chunk's token bytes) -> hash, and `chain` takes a link's hash
 * from it when both match byte for byte (memcmp: a fingerprint only picks the slot, so a
 * collision, crafted or not, can only cost a miss, never a wrong hash). 0.1-0.2 us a link
 * found, ~0.15 us more a link missed. Only links whose parent is a 32-byte hash go
 * through it (a chain's first link with a prefix of another length never does).
 *
 * Sets of MEMO_WAYS links, the least recently used link of a set replaced. Each set's
 * tags, stamps and ghosts share one cache line (`meta`: a miss reads that line only);
 * each link's slot holds its parent, its hash and its tokens. A link missed is admitted
 * only when it was missed before (its fingerprint is among its set's `ghost`s, the
 * fingerprints of recent misses): copying 1 KiB of tokens into cold memory for every
 * link of every new prompt cost a prompt never seen again ~25% more than no memo (a
 * one-off script); now 9-14% (`bench.coordinator_bench`), and a prompt is found from
 * its third lookup on. A lock guards the memo, because a chain over a big input runs
 * without the GIL; a call that finds the lock taken hashes without the memo rather than
 * wait (counted as busy). */
#define MEMO_WAYS 4
#define SLOT_PARENT 0
#define SLOT_HASH 32
#define SLOT_TOKENS 64
#define TAG_USED 0x8000000000000000ULL
#ifndef MEMO_TAG_MASK
/* The fingerprint bits a tag keeps. Tests build the module with a mask of 0: every tag
 * is equal (and every link lands in set 0), so only the byte comparison tells links
 * apart, and a link missed twice is always admitted (its ghost always matches). */
#define MEMO_TAG_MASK 0xFFFFFFFFFFFFFFFFULL
#endif

#define MEMO_GHOSTS 2

typedef struct {
    uint64_t tag[MEMO_WAYS];     /* the fingerprint, top bit set; 0: empty */
    uint32_t stamp[MEMO_WAYS];   /* the last use (the clock's low bits: ages wrap) */
    uint64_t ghost[MEMO_GHOSTS]; /* fingerprints of links missed, not admitted */
} MemoSet;                       /* 64 bytes: one cache line */
_Static_assert(sizeof(MemoSet) == 64, "a set's meta is one cache line");

typedef struct {
    PyObject_HEAD
    size_t chunk_size;    /* tokens per link */
    size_t sets;          /* a power of two */
    size_t slot_bytes;    /* SLOT_TOKENS + 4 * chunk_size, rounded up to 8 */
    MemoSet *meta;        /* sets of them, aligned to 64 bytes in meta_block */
    void *meta_block;
    unsigned char *slots; /* sets * MEMO_WAYS slots */
    uint32_t *keys;       /* the fingerprint's: 8 + chunk_size + 1 random words */
    uint32_t clock;       /* stamps */
    PyThread_type_lock lock;
    unsigned long long hits, misses, busy;
} ChainMemo;

static uint32_t read32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The set picker of (parent, tokens): NH, a universal hash over the words with the
 * memo's random keys (a sum of 32x32-bit products, which compilers vectorize), then a
 * final mix. Not a hash anyone may rely on: `memo_find` compares the bytes themselves,
 * so a collision, crafted or not, costs a miss and nothing else. */
static uint64_t fingerprint(const ChainMemo *m, const unsigned char *parent,
                            const unsigned char *tokens) {
    const uint32_t *k = m->keys;
    size_t n = m->chunk_size, i;
    uint64_t h = 0;
    for (i = 0; i < 8; i += 2)
        h += (uint64_t)(uint32_t)(read32(parent + 4 * i) + k[i]) *
             (uint32_t)(read32(parent + 4 * i + 4) + k[i + 1]);
    k += 8;
    for (i = 0; i + 2 <= n; i += 2)
        h += (uint64_t)(uint32_t)(read32(tokens + 4 * i) + k[i]) *
             (uint32_t)(read32(tokens + 4 * i + 4) + k[i + 1]);
    if (i < n) h += (uint64_t)(uint32_t)(read32(tokens + 4 * i) + k[i]) * (k[i + 1] | 1);
    h ^= h >> 33;
    h *= 0xC2B2AE3D27D4EB4FULL;
    h ^= h >> 29;
    h *= 0x165667B19E3779F9ULL;
    h ^= h >> 32;
    return (h & MEMO_TAG_MASK) | TAG_USED;
}

static MemoSet *memo_set(ChainMemo *m, uint64_t tag, unsigned char **slots) {
    size_t set = (size_t)(tag & (m->sets - 1));
    *slots = m->slots + set * MEMO_WAYS * m->slot_bytes;
    return m->meta + set;
}

/* The way of the set holding the link (parent, tokens) whose fingerprint is tag, or -1. */
static int memo_find(ChainMemo *m, uint64_t tag, const unsigned char *parent,
                     const unsigned char *tokens, MemoSet **set, unsigned char **slots) {
    *set = memo_set(m, tag, slots);
    for (int w = 0; w < MEMO_WAYS; w++) {
        const unsigned char *slot = *slots + (size_t)w * m->slot_bytes;
        if ((*set)->tag[w] == tag && memcmp(slot + SLOT_PARENT, parent, HASH_BYTES) == 0 &&
            memcmp(slot + SLOT_TOKENS, tokens, 4 * m->chunk_size) == 0)
            return w;
    }
    return -1;
}

/* Remember the link in its set's empty or least recently used way. */
static void memo_put(ChainMemo *m, MemoSet *set, unsigned char *slots, uint64_t tag,
                     const unsigned char *parent, const unsigned char *tokens,
                     const unsigned char *hash) {
    int victim = 0;
    uint32_t oldest = 0;
    unsigned char *slot;
    for (int w = 0; w < MEMO_WAYS; w++) {
        uint32_t age = m->clock - set->stamp[w];
        if (set->tag[w] == 0) {
            victim = w;
            break;
        }
        if (age >= oldest) {
            oldest = age;
            victim = w;
        }
    }
    set->tag[victim] = tag;
    set->stamp[victim] = ++m->clock;
    slot = slots + (size_t)victim * m->slot_bytes;
    memcpy(slot + SLOT_PARENT, parent, HASH_BYTES);
    memcpy(slot + SLOT_HASH, hash, HASH_BYTES);
    memcpy(slot + SLOT_TOKENS, tokens, 4 * m->chunk_size);
}

/* The chain of n_chunks links into out; through `memo` where it is not NULL (the caller
 * holds its lock), counting the links it found there in *hits and missed in *misses. */
static void chain_span(const unsigned char *tokens, size_t n_chunks, size_t chunk_size,
                       const unsigned char *prefix, size_t prefix_len, unsigned char *out,
                       ChainMemo *memo, size_t *hits, size_t *misses) {
    blake3_hasher hasher;
    uint32_t block[BLOCK_TOKENS];
    const unsigned char *prev = prefix;
    size_t prev_len = prefix_len;
    for (size_t c = 0; c < n_chunks; c++) {
        const unsigned char *src = tokens + 4 * c * chunk_size;
        unsigned char *dst = out + HASH_BYTES * c;
        int memoized = memo != NULL && prev_len == HASH_BYTES;
        uint64_t tag = 0;
        MemoSet *set = NULL;
        unsigned char *slots = NULL;
        if (memoized) {
            int way;
            tag = fingerprint(memo, prev, src);
            way = memo_find(memo, tag, prev, src, &set, &slots);
            if (way >= 0) {
                set->stamp[way] = ++memo->clock;
                memcpy(dst, slots + (size_t)way * memo->slot_bytes + SLOT_HASH, HASH_BYTES);
                ++*hits;
                prev = dst;
                continue;
            }
            ++*misses;
            if (set->ghost[0] != tag && set->ghost[1] != tag) {
                /* first seen: remember the fingerprint only, in place of the older */
                set->ghost[1] = set->ghost[0];
                set->ghost[0] = tag;
                memoized = 0;
            }
        }
        blake3_hasher_init(&hasher);
        blake3_hasher_update(&hasher, prev, prev_len);
        for (size_t done = 0; done < chunk_size;) {
            size_t take = chunk_size - done < BLOCK_TOKENS ? chunk_size - done : BLOCK_TOKENS;
            for (size_t t = 0; t < take; t++) {
                const unsigned char *b = src + 4 * (done + t);
                /* Little-endian in, big-endian bytes out, whatever this machine's order. */
                unsigned char *d = (unsigned char *)&block[t];
                d[0] = b[3];
                d[1] = b[2];
                d[2] = b[1];
                d[3] = b[0];
            }
            blake3_hasher_update(&hasher, block, 4 * take);
            done += take;
        }
        blake3_hasher_finalize(&hasher, dst, HASH_BYTES);
        if (memoized) memo_put(memo, set, slots, tag, prev, src, dst);
        prev = dst;
        prev_len = HASH_BYTES;
    }
}

static PyTypeObject ChainMemoType;

static PyObject *chain(PyObject *module, PyObject *args) {
    Py_buffer tokens, prefix;
    Py_ssize_t chunk_size;
    size_t n_chunks, hits = 0, misses = 0;
    PyObject *out, *memo_arg = Py_None;
    ChainMemo *memo = NULL;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*ny*|O:chain", &tokens, &chunk_size, &prefix, &memo_arg))
        return NULL;
    if (chunk_size <= 0 || tokens.len % 4) {
        PyBuffer_Release(&tokens);
        PyBuffer_Release(&prefix);
        PyErr_SetString(PyExc_ValueError,
                        chunk_size <= 0 ? "the chunk size must be positive"
                                        : "tokens must be whole little-endian uint32s");
        return NULL;
    }
    if (memo_arg != Py_None) {
        if (!PyObject_TypeCheck(memo_arg, &ChainMemoType)) {
            PyErr_SetString(PyExc_TypeError, "memo must be a ChainMemo or None");
        } else if (((ChainMemo *)memo_arg)->chunk_size != (size_t)chunk_size) {
            PyErr_Format(PyExc_ValueError, "the memo holds links of %zu tokens, not %zd",
                         ((ChainMemo *)memo_arg)->chunk_size, chunk_size);
        } else {
            memo = (ChainMemo *)memo_arg;
        }
        if (memo == NULL) {
            PyBuffer_Release(&tokens);
            PyBuffer_Release(&prefix);
            return NULL;
        }
        if (!PyThread_acquire_lock(memo->lock, NOWAIT_LOCK)) {
            memo->busy++; /* another thread's big chain holds it: hash without */
            memo = NULL;
        }
    }
    n_chunks = (size_t)(tokens.len / 4) / (size_t)chunk_size;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(HASH_BYTES * n_chunks));
    if (out != NULL) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        if (tokens.len > RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS;
            chain_span(tokens.buf, n_chunks, (size_t)chunk_size, prefix.buf, (size_t)prefix.len,
                       dst, memo, &hits, &misses);
            Py_END_ALLOW_THREADS;
        } else {
            chain_span(tokens.buf, n_chunks, (size_t)chunk_size, prefix.buf, (size_t)prefix.len,
                       dst, memo, &hits, &misses);
        }
    }
    if (memo != NULL) {
        memo->hits += hits;
        memo->misses += misses;
        PyThread_release_lock(memo->lock);
    }
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&prefix);
    return out;
}

/* ---- ChainMemo, the Python type ----------------------------------------------------- */

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static PyObject *memo_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"chunk_size", "max_bytes", "seed", NULL};
    Py_ssize_t chunk_size, max_bytes;
    Py_buffer seed;
    size_t slot_bytes, set_bytes, sets = 1, n_keys, i;
    uint64_t state = 0;
    ChainMemo *m;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nny*:ChainMemo", names, &chunk_size,
                                     &max_bytes, &seed))
        return NULL;
    if (seed.len != 32) {
        PyBuffer_Release(&seed);
        PyErr_SetString(PyExc_ValueError, "the seed must be 32 bytes");
        return NULL;
    }
    for (i = 0; i < 32; i += 8) { /* the seed's four words, each stirred in */
        uint64_t word;
        memcpy(&word, (const unsigned char *)seed.buf + i, 8);
        state ^= word;
        state = splitmix64(&state);
    }
    PyBuffer_Release(&seed);
    if (chunk_size <= 0 || chunk_size > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "the chunk size must be in [1, 2**24]");
        return NULL;
    }
    slot_bytes = (SLOT_TOKENS + 4 * (size_t)chunk_size + 7) & ~(size_t)7;
    set_bytes = sizeof(MemoSet) + MEMO_WAYS * slot_bytes;
    if (max_bytes < 0 || (size_t)max_bytes < set_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "a memo of %zd-token links needs at least %zu bytes (one set of %d links)",
                     chunk_size, set_bytes, MEMO_WAYS);
        return NULL;
    }
    while (2 * sets * set_bytes <= (size_t)max_bytes) sets *= 2;
    m = (ChainMemo *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    m->chunk_size = (size_t)chunk_size;
    m->sets = sets;
    m->slot_bytes = slot_bytes;
    /* calloc: the pages are mapped as the memo fills, not at once */
    m->meta_block = PyMem_RawCalloc(sets + 1, sizeof(MemoSet));
    m->meta = (MemoSet *)(((uintptr_t)m->meta_block + 63) & ~(uintptr_t)63);
    m->slots = PyMem_RawCalloc(sets * MEMO_WAYS, slot_bytes);
    n_keys = 8 + (size_t)chunk_size + 1;
    m->keys = PyMem_RawMalloc(n_keys * sizeof(uint32_t));
    m->lock = PyThread_allocate_lock();
    if (m->meta_block == NULL || m->slots == NULL || m->keys == NULL || m->lock == NULL) {
        Py_DECREF(m);
        return PyErr_NoMemory();
    }
    for (i = 0; i < n_keys; i++) m->keys[i] = (uint32_t)splitmix64(&state);
    return (PyObject *)m;
}

static void memo_dealloc(ChainMemo *m) {
    PyMem_RawFree(m->meta_block);
    PyMem_RawFree(m->slots);
    PyMem_RawFree(m->keys);
    if (m->lock != NULL) PyThread_free_lock(m->lock);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *memo_stats(ChainMemo *m, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("{sKsKsKsnsn}", "hits", m->hits, "misses", m->misses, "busy", m->busy,
                         "links", (Py_ssize_t)(m->sets * MEMO_WAYS), "bytes",
                         (Py_ssize_t)(m->sets * (sizeof(MemoSet) + MEMO_WAYS * m->slot_bytes)));
}

static PyObject *memo_clear(ChainMemo *m, PyObject *unused) {
    (void)unused;
    /* Waits for a chain running without the GIL: clear is rare (tests, a reset). */
    Py_BEGIN_ALLOW_THREADS;
    PyThread_acquire_lock(m->lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS;
    memset(m->meta, 0, m->sets * sizeof(MemoSet));
    m->clock = 0;
    PyThread_release_lock(m->lock);
    Py_RETURN_NONE;
}

static PyObject *memo_chunk_size(ChainMemo *m, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(m->chunk_size);
}

static PyMethodDef memo_methods[] = {
    {"stats", (PyCFunction)memo_stats, METH_NOARGS,
     "stats() -> dict: links found (hits) and missed (misses) since it was made, calls that "
     "found it busy (busy), and its size in links and bytes."},
    {"clear", (PyCFunction)memo_clear, METH_NOARGS, "clear(): forget every link."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef memo_getset[] = {
    {"chunk_size", (getter)memo_chunk_size, NULL, "Tokens per link.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ChainMemoType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvatlas.core._chain.ChainMemo",
    .tp_basicsize = sizeof(ChainMemo),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ChainMemo(chunk_size, max_bytes, seed): recent links of the chain, as "
              "(parent, tokens) -> hash, in at most max_bytes; seed: 32 bytes.",
    .tp_new = memo_new,
    .tp_dealloc = (destructor)memo_dealloc,
    .tp_methods = memo_methods,
    .tp_getset = memo_getset,
};

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(tokens, chunk_size, prefix, memo=None) -> bytes: the blake3 prefix chain of the "
     "full chunks of tokens (little-endian uint32 bytes), 32 bytes per chunk, concatenated; "
     "links found in memo (a ChainMemo) are taken from it, the others put there."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvatlas.core._chain",
    "The blake3 prefix chain of token chunks, with the BLAKE3 C library.", -1, methods,
};

PyMODINIT_FUNC PyInit__chain(void) {
    PyObject *module;
    if (PyType_Ready(&ChainMemoType) < 0) return NULL;
    module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    Py_INCREF(&ChainMemoType);
    if (PyModule_AddObject(module, "ChainMemo", (PyObject *)&ChainMemoType) < 0) {
        Py_DECREF(&ChainMemoType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
