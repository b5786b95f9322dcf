/* The device tier's block table and token hashes, compiled: the twin of the Python
 * `kvatlas.core.coordinator.block_table` (same answers; tests hold them to each other).
 *
 * Owns, for one vLLM engine, the blocks its caches hold, keyed two ways:
 *
 *   - by the engine's own block hash (vLLM's, as a 64-bit key): what its events name
 *     (a removal, a store's parent);
 *   - by a content key: a chain over the block's tokens that needs no hash function or
 *     seed from the engine, so a lookup by token ids costs a few XXH3 calls per block.
 *
 *   local_i   = XXH3_64(tokens of block i as uint32 little-endian, seed)
 *               (NVIDIA Dynamo's LocalBlockHash: seed 1337, plus XXH3_64(lora name) for
 *               a LoRA; Dynamo's `/query_by_hash` takes these)
 *   content_i = XXH3_64(le64(content_{i-1}) || le64(local_i) || le64(extra_i), MIX_SEED)
 *               (content_{-1} = the parent's content key, 0 for a prompt's first block;
 *               extra_i a hash of the block's extra keys, such as the cache salt, 0 when
 *               it has none; a content key of 0 is mapped to 1: 0 means "unchained")
 *
 * The entries (block hash, content key, media mask, local hash, parent hash: 40 bytes)
 * lie dense in one array (a removal moves the last entry into the hole), found through
 * two open-addressing indexes of uint32 positions with linear probing: by block hash
 * and by content key (one entry per content key: a later block with the same content
 * takes the cell). Indexes are rebuilt at most half full once 75% of their cells are
 * used (live or removed): about 48-56 bytes a block in all. A store whose chain cannot
 * be followed (no tokens, or a parent this table does not hold and the caller could
 * not resolve) keeps the block with content 0: removals find it, lookups never match
 * it. Copies of one (block, media bit) beyond the first (vLLM may cache a hash in
 * several blocks of a group) are counted in a dict, consulted only while it is not
 * empty. No I/O, no clocks; the caller holds the lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define MIX_SEED 0x6b7661746c6173ULL /* "kvatlas" */
#define NO_POS 0xFFFFFFFFu
#define CELL_DEAD 0xFFFFFFFEu
#define MIN_CAP 1024
#define MIN_ENTRIES 256
#define MAX_CAP ((size_t)1 << 31)

typedef struct {
    uint64_t key;     /* the engine's block hash */
    uint64_t content; /* 0: unchained */
    uint64_t mask;    /* (group, medium) bits holding it */
    uint64_t local;   /* the block's local hash (0 when unchained) */
    uint64_t parent;  /* the parent's block hash; == key when it has none */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *ents;      /* dense: [0, n) live; a removal moves the last one into the hole */
    size_t n, ecap;
    uint32_t *kidx;   /* block hash -> entry position; NO_POS empty, CELL_DEAD removed */
    uint32_t *cidx;   /* content key -> entry position (one entry per content key) */
    size_t cap;       /* cells of each index, a power of two */
    size_t kused, cused; /* cells not empty (live or removed) */
    PyObject *copies; /* dict (key, bit) -> extra copies */
} Table;

static inline uint64_t mix_key(uint64_t k) {
    /* the keys are hashes already; a multiply spreads a crafted low-bit pattern */
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

static inline uint64_t chain_step(uint64_t prev, uint64_t local, uint64_t extra) {
    uint64_t buf[3] = {prev, local, extra};
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    for (int i = 0; i < 3; i++) buf[i] = __builtin_bswap64(buf[i]);
#endif
    uint64_t h = XXH3_64bits_withSeed(buf, sizeof buf, MIX_SEED);
    return h ? h : 1;
}

/* ---- the table ----------------------------------------------------------------- */

static uint32_t *cells_alloc(size_t cap) {
    uint32_t *c = PyMem_Malloc(cap * sizeof(uint32_t));
    if (c) memset(c, 0xFF, cap * sizeof(uint32_t));
    return c;
}

static size_t kcell(const Table *t, uint64_t key) {
    /* the cell of the entry with this block hash, or -1 */
    size_t m = t->cap - 1, i = mix_key(key) & m;
    for (;;) {
        uint32_t p = t->kidx[i];
        if (p == NO_POS) return (size_t)-1;
        if (p != CELL_DEAD && t->ents[p].key == key) return i;
        i = (i + 1) & m;
    }
}

static size_t ccell(const Table *t, uint64_t content) {
    /* the cell of the entry indexed under this content key, or -1 */
    size_t m = t->cap - 1, i = mix_key(content) & m;
    for (;;) {
        uint32_t p = t->cidx[i];
        if (p == NO_POS) return (size_t)-1;
        if (p != CELL_DEAD && t->ents[p].content == content) return i;
        i = (i + 1) & m;
    }
}

static void kput(Table *t, uint64_t key, uint32_t pos) {
    /* a block hash not in the index */
    size_t m = t->cap - 1, i = mix_key(key) & m;
    while (t->kidx[i] != NO_POS && t->kidx[i] != CELL_DEAD) i = (i + 1) & m;
    if (t->kidx[i] == NO_POS) t->kused++;
    t->kidx[i] = pos;
}

static void cput(Table *t, uint64_t content, uint32_t pos) {
    /* another entry already indexed under the content key gives way: the latest wins */
    size_t m = t->cap - 1, i = mix_key(content) & m, tomb = (size_t)-1;
    for (;;) {
        uint32_t p = t->cidx[i];
        if (p == NO_POS) break;
        if (p == CELL_DEAD) {
            if (tomb == (size_t)-1) tomb = i;
        } else if (t->ents[p].content == content) {
            t->cidx[i] = pos;
            return;
        }
        i = (i + 1) & m;
    }
    if (tomb != (size_t)-1) {
        t->cidx[tomb] = pos;
    } else {
        t->cidx[i] = pos;
        t->cused++;
    }
}

static int reindex(Table *t, size_t cap) {
    /* both indexes again at `cap` cells, without their removed cells; the content
     * index is rebuilt from its own cells, so which entry holds a content key stays */
    uint32_t *kidx = cells_alloc(cap), *cidx = cells_alloc(cap);
    if (!kidx || !cidx) {
        PyMem_Free(kidx);
        PyMem_Free(cidx);
        PyErr_NoMemory();
        return -1;
    }
    uint32_t *old_c = t->cidx;
    size_t old_cap = t->cap;
    PyMem_Free(t->kidx);
    t->kidx = kidx;
    t->cidx = cidx;
    t->cap = cap;
    t->kused = t->cused = 0;
    for (size_t p = 0; p < t->n; p++) kput(t, t->ents[p].key, (uint32_t)p);
    size_t m = cap - 1;
    for (size_t j = 0; j < old_cap; j++) {
        uint32_t p = old_c[j];
        if (p == NO_POS || p == CELL_DEAD) continue;
        size_t i = mix_key(t->ents[p].content) & m;
        while (cidx[i] != NO_POS) i = (i + 1) & m;
        cidx[i] = p;
        t->cused++;
    }
    PyMem_Free(old_c);
    return 0;
}

static int table_init(Table *t) {
    t->ents = PyMem_Malloc(MIN_ENTRIES * sizeof(Entry));
    t->kidx = cells_alloc(MIN_CAP);
    t->cidx = cells_alloc(MIN_CAP);
    if (!t->ents || !t->kidx || !t->cidx) {
        PyErr_NoMemory();
        return -1;
    }
    t->ecap = MIN_ENTRIES;
    t->cap = MIN_CAP;
    t->n = t->kused = t->cused = 0;
    return 0;
}

static void table_free(Table *t) {
    PyMem_Free(t->ents);
    PyMem_Free(t->kidx);
    PyMem_Free(t->cidx);
    t->ents = NULL;
    t->kidx = t->cidx = NULL;
}

static int reserve(Table *t, size_t more) {
    /* room for `more` new entries: entries grown by half, indexes under 75% of their
     * cells used (live + removed), rebuilt at most half full */
    size_t need = t->n + more;
    if (need > t->ecap) {
        size_t ecap = t->ecap + t->ecap / 2;
        if (ecap < need) ecap = need;
        Entry *ents = PyMem_Realloc(t->ents, ecap * sizeof(Entry));
        if (!ents) {
            PyErr_NoMemory();
            return -1;
        }
        t->ents = ents;
        t->ecap = ecap;
    }
    size_t used = (t->kused > t->cused ? t->kused : t->cused) + more;
    if (used * 4 <= t->cap * 3) return 0;
    size_t cap = t->cap;
    while (need * 2 > cap) cap <<= 1;
    if (cap > MAX_CAP) {
        PyErr_SetString(PyExc_MemoryError, "block table over 2**30 blocks");
        return -1;
    }
    return reindex(t, cap);
}

static size_t find_entry(const Table *t, uint64_t key) {
    size_t c = kcell(t, key);
    return c == (size_t)-1 ? (size_t)-1 : t->kidx[c];
}

static void drop_entry(Table *t, size_t p) {
    /* remove entry p: its cells marked removed, the last entry moved into its place */
    Entry *e = &t->ents[p];
    t->kidx[kcell(t, e->key)] = CELL_DEAD;
    if (e->content) {
        size_t c = ccell(t, e->content);
        if (c != (size_t)-1 && t->cidx[c] == (uint32_t)p) t->cidx[c] = CELL_DEAD;
    }
    size_t last = t->n - 1;
    if (p != last) {
        Entry moved = t->ents[last];
        t->kidx[kcell(t, moved.key)] = (uint32_t)p;
        if (moved.content) {
            size_t c = ccell(t, moved.content);
            if (c != (size_t)-1 && t->cidx[c] == (uint32_t)last) t->cidx[c] = (uint32_t)p;
        }
        t->ents[p] = moved;
    }
    t->n--;
}

/* ---- helpers -------------------------------------------------------------------- */

static int as_u64(PyObject *o, uint64_t *out) {
    /* a Python int in [-(2**63), 2**64) as its low 64 bits */
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "expected an int, got %s", Py_TYPE(o)->tp_name);
        return -1;
    }
    uint64_t v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* Tokens of full blocks as uint32 LE bytes, from a list/tuple of ints or a buffer of
 * uint32. `*n` is the number of tokens. Returns a PyMem buffer (caller frees). */
static uint32_t *tokens_of(PyObject *obj, size_t *n) {
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(obj);
        PyObject **items = PySequence_Fast_ITEMS(obj);
        uint32_t *out = PyMem_Malloc((len ? len : 1) * sizeof(uint32_t));
        if (!out) {
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < len; i++) {
            PyObject *o = items[i];
            if (!PyLong_Check(o)) {
                PyMem_Free(out);
                PyErr_SetString(PyExc_ValueError, "token ids must be ints");
                return NULL;
            }
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
            if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
                PyMem_Free(out);
                PyErr_SetString(PyExc_ValueError, "token ids must be in [0, 2**32)");
                return NULL;
            }
            out[i] = (uint32_t)v;
        }
        *n = (size_t)len;
        return out;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (view.len % 4) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "a token buffer holds whole uint32s");
        return NULL;
    }
    uint32_t *out = PyMem_Malloc(view.len ? (size_t)view.len : 1);
    if (!out) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(out, view.buf, (size_t)view.len);
    *n = (size_t)view.len / 4;
    PyBuffer_Release(&view);
    return out;
}

static inline uint64_t local_hash(const uint32_t *tokens, size_t block, uint64_t seed) {
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    uint32_t tmp[block];
    for (size_t i = 0; i < block; i++) tmp[i] = __builtin_bswap32(tokens[i]);
    tokens = tmp;
#endif
    return XXH3_64bits_withSeed(tokens, block * 4, seed);
}

/* extras: None or a sequence of ints (one per block, 0 = none); returns 0 or -1 */
static int extra_at(PyObject *extras, Py_ssize_t i, uint64_t *out) {
    *out = 0;
    if (extras == Py_None) return 0;
    if (i >= PySequence_Fast_GET_SIZE(extras)) return 0;
    return as_u64(PySequence_Fast_GET_ITEM(extras, i), out);
}

/* ---- module functions ----------------------------------------------------------- */

static PyObject *py_local_hashes(PyObject *self, PyObject *args) {
    PyObject *tokens_obj;
    Py_ssize_t block;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OnK", &tokens_obj, &block, &seed)) return NULL;
    if (block <= 0) return PyErr_Format(PyExc_ValueError, "block size %zd must be positive", block);
    size_t n;
    uint32_t *tokens = tokens_of(tokens_obj, &n);
    if (!tokens) return NULL;
    size_t blocks = n / (size_t)block;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(blocks * 8));
    if (out) {
        uint64_t *h = (uint64_t *)PyBytes_AS_STRING(out);
        for (size_t b = 0; b < blocks; b++) h[b] = local_hash(tokens + b * block, (size_t)block, seed);
    }
    PyMem_Free(tokens);
    return out;
}

static PyObject *py_chain_locals(PyObject *self, PyObject *args) {
    /* content keys from local hashes (a buffer of uint64), a root and extras */
    Py_buffer view;
    unsigned long long root;
    PyObject *extras = Py_None;
    if (!PyArg_ParseTuple(args, "y*K|O", &view, &root, &extras)) return NULL;
    PyObject *fast = NULL, *out = NULL;
    if (view.len % 8) {
        PyErr_SetString(PyExc_ValueError, "local hashes are whole uint64s");
        goto done;
    }
    if (extras != Py_None && !(fast = PySequence_Fast(extras, "extras must be a sequence"))) goto done;
    size_t n = (size_t)view.len / 8;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (!out) goto done;
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out), prev = root;
    const uint64_t *src = view.buf;
    for (size_t i = 0; i < n; i++) {
        uint64_t e;
        if (extra_at(fast ? fast : Py_None, (Py_ssize_t)i, &e) < 0) {
            Py_CLEAR(out);
            goto done;
        }
        prev = dst[i] = chain_step(prev, src[i], e);
    }
done:
    Py_XDECREF(fast);
    PyBuffer_Release(&view);
    return out;
}

static PyObject *py_content_keys(PyObject *self, PyObject *args) {
    /* content_keys(tokens, block_size, seed, root, extras=None) -> bytes of uint64 */
    PyObject *tokens_obj, *extras = Py_None;
    Py_ssize_t block;
    unsigned long long seed, root;
    if (!PyArg_ParseTuple(args, "OnKK|O", &tokens_obj, &block, &seed, &root, &extras)) return NULL;
    if (block <= 0) return PyErr_Format(PyExc_ValueError, "block size %zd must be positive", block);
    PyObject *fast = NULL;
    if (extras != Py_None && !(fast = PySequence_Fast(extras, "extras must be a sequence"))) return NULL;
    size_t n;
    uint32_t *tokens = tokens_of(tokens_obj, &n);
    if (!tokens) {
        Py_XDECREF(fast);
        return NULL;
    }
    size_t blocks = n / (size_t)block;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(blocks * 8));
    if (out) {
        uint64_t *h = (uint64_t *)PyBytes_AS_STRING(out), prev = root;
        for (size_t b = 0; b < blocks; b++) {
            uint64_t e;
            if (extra_at(fast ? fast : Py_None, (Py_ssize_t)b, &e) < 0) {
                Py_CLEAR(out);
                break;
            }
            prev = h[b] = chain_step(prev, local_hash(tokens + b * block, (size_t)block, seed), e);
        }
    }
    PyMem_Free(tokens);
    Py_XDECREF(fast);
    return out;
}

/* ---- the Table type ------------------------------------------------------------- */

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, ":BlockTable")) return NULL;
    Table *t = (Table *)type->tp_alloc(type, 0);
    if (!t) return NULL;
    t->copies = PyDict_New();
    if (!t->copies || table_init(t) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void Table_dealloc(Table *t) {
    table_free(t);
    Py_XDECREF(t->copies);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t Table_len(Table *t) { return (Py_ssize_t)t->n; }

/* (key, bit) in the copies dict: +1 (store) or -1 (remove: 1 if a copy was taken) */
static int copy_bump(Table *t, uint64_t key, uint64_t bit, int delta) {
    PyObject *k = Py_BuildValue("(KK)", (unsigned long long)key, (unsigned long long)bit);
    if (!k) return -1;
    PyObject *v = PyDict_GetItemWithError(t->copies, k);
    long n = v ? PyLong_AsLong(v) : 0;
    int taken = 0, rc = 0;
    if (PyErr_Occurred()) {
        Py_DECREF(k);
        return -1;
    }
    if (delta > 0) {
        PyObject *nv = PyLong_FromLong(n + 1);
        rc = nv ? PyDict_SetItem(t->copies, k, nv) : -1;
        Py_XDECREF(nv);
    } else if (n > 0) {
        taken = 1;
        if (n == 1) {
            rc = PyDict_DelItem(t->copies, k);
        } else {
            PyObject *nv = PyLong_FromLong(n - 1);
            rc = nv ? PyDict_SetItem(t->copies, k, nv) : -1;
            Py_XDECREF(nv);
        }
    }
    Py_DECREF(k);
    return rc < 0 ? -1 : taken;
}

static PyObject *Table_store(Table *t, PyObject *args) {
    /* store(hashes, parent, parent_content, tokens, block_size, seed, extras, bit)
     *   -> (added, unchained): blocks new to the table, and blocks kept without a chain.
     * parent: the first block's parent hash or None; parent_content: its content key, or
     * None when it could not be resolved (then, with a parent, nothing chains). */
    PyObject *hashes, *parent_obj, *pcontent_obj, *tokens_obj, *extras;
    Py_ssize_t block;
    unsigned long long seed, bit;
    if (!PyArg_ParseTuple(args, "OOOOnKOK", &hashes, &parent_obj, &pcontent_obj, &tokens_obj,
                          &block, &seed, &extras, &bit))
        return NULL;
    PyObject *hfast = PySequence_Fast(hashes, "block hashes must be a sequence");
    if (!hfast) return NULL;
    PyObject *efast = NULL, *result = NULL;
    uint32_t *tokens = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hfast);
    Py_ssize_t added = 0, unchained = 0;
    uint64_t parent = 0, prev = 0;
    int has_parent = parent_obj != Py_None, chained = 1;
    if (has_parent && as_u64(parent_obj, &parent) < 0) goto done;
    if (pcontent_obj != Py_None) {
        if (as_u64(pcontent_obj, &prev) < 0) goto done;
    } else if (has_parent) {
        chained = 0;
    }
    if (extras != Py_None && !(efast = PySequence_Fast(extras, "extras must be a sequence"))) goto done;
    size_t ntok = 0;
    if (tokens_obj == Py_None || block <= 0) {
        chained = 0;
    } else {
        if (!(tokens = tokens_of(tokens_obj, &ntok))) goto done;
        if (ntok < (size_t)n * (size_t)block) chained = 0;
    }
    if (reserve(t, (size_t)n) < 0) goto done;
    uint64_t prev_key = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key;
        if (as_u64(PySequence_Fast_GET_ITEM(hfast, i), &key) < 0) goto done;
        uint64_t local = 0, content = 0;
        if (chained) {
            uint64_t e;
            if (extra_at(efast ? efast : Py_None, i, &e) < 0) goto done;
            local = local_hash(tokens + (size_t)i * block, (size_t)block, seed);
            content = prev = chain_step(prev, local, e);
        }
        uint64_t own_parent = (i == 0 && !has_parent) ? key : prev_key;
        size_t pos = find_entry(t, key);
        if (pos != (size_t)-1) {
            Entry *en = &t->ents[pos];
            if (en->mask & bit) {
                if (copy_bump(t, key, bit, +1) < 0) goto done;
            }
            en->mask |= bit;
            if (content && !en->content) {
                /* a tokenless copy first, its chain now known */
                en->content = content;
                en->local = local;
                en->parent = own_parent;
                cput(t, content, (uint32_t)pos);
            } else if (!en->content) {
                unchained++;
            }
        } else {
            /* reserve() made room for n entries and cells */
            pos = t->n++;
            Entry *en = &t->ents[pos];
            en->key = key;
            en->mask = bit;
            en->content = content;
            en->local = local;
            en->parent = own_parent;
            kput(t, key, (uint32_t)pos);
            added++;
            if (content) {
                cput(t, content, (uint32_t)pos);
            } else {
                unchained++;
            }
        }
        prev_key = key;
    }
    result = Py_BuildValue("(nn)", added, unchained);
done:
    PyMem_Free(tokens);
    Py_DECREF(hfast);
    Py_XDECREF(efast);
    return result;
}

static PyObject *Table_remove(Table *t, PyObject *args) {
    /* remove(hashes, bit) -> blocks that left the table (no bit left) */
    PyObject *hashes;
    unsigned long long bit;
    if (!PyArg_ParseTuple(args, "OK", &hashes, &bit)) return NULL;
    PyObject *fast = PySequence_Fast(hashes, "block hashes must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key;
        if (as_u64(PySequence_Fast_GET_ITEM(fast, i), &key) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        if (PyDict_GET_SIZE(t->copies)) {
            int taken = copy_bump(t, key, bit, -1);
            if (taken < 0) {
                Py_DECREF(fast);
                return NULL;
            }
            if (taken) continue;
        }
        size_t pos = find_entry(t, key);
        if (pos == (size_t)-1) continue;
        t->ents[pos].mask &= ~bit;
        if (t->ents[pos].mask) continue;
        drop_entry(t, pos);
        gone++;
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(gone);
}

static PyObject *Table_clear(Table *t, PyObject *unused) {
    size_t had = t->n;
    table_free(t);
    PyDict_Clear(t->copies);
    if (table_init(t) < 0) return NULL;
    return PyLong_FromSize_t(had);
}

static PyObject *Table_content(Table *t, PyObject *arg) {
    /* content(hash) -> its content key, or None (absent or unchained) */
    uint64_t key;
    if (as_u64(arg, &key) < 0) return NULL;
    size_t pos = find_entry(t, key);
    if (pos == (size_t)-1 || !t->ents[pos].content) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(t->ents[pos].content);
}

static PyObject *Table_mask(Table *t, PyObject *arg) {
    uint64_t key;
    if (as_u64(arg, &key) < 0) return NULL;
    size_t pos = find_entry(t, key);
    return PyLong_FromUnsignedLongLong(pos == (size_t)-1 ? 0 : t->ents[pos].mask);
}

static inline uint64_t mask_of(const Table *t, uint64_t content, int *found) {
    size_t c = ccell(t, content);
    *found = c != (size_t)-1;
    return *found ? t->ents[t->cidx[c]].mask : 0;
}

static inline uint64_t fold(uint64_t m) {
    /* a mask's media over all of its groups (the low 4 bits' layout) */
    uint64_t out = 0;
    for (; m; m >>= 4) out |= m & 15;
    return out;
}

static int need_parse(PyObject *need, uint64_t *out, Py_ssize_t *count) {
    PyObject *fast = PySequence_Fast(need, "need must be a sequence of masks");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > 16) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "at most 16 group masks");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (as_u64(PySequence_Fast_GET_ITEM(fast, i), &out[i]) < 0) {
            Py_DECREF(fast);
            return -1;
        }
    *count = n;
    Py_DECREF(fast);
    return 0;
}

static PyObject *Table_run(Table *t, PyObject *args) {
    /* run(content_keys: buffer of uint64, need: masks) -> (n, media): the leading keys
     * whose entry's mask meets every mask in need (an empty need: held), and the media
     * (a mask folded over its groups) all n of them are held in */
    Py_buffer view;
    PyObject *need_obj;
    if (!PyArg_ParseTuple(args, "y*O", &view, &need_obj)) return NULL;
    uint64_t need[16];
    Py_ssize_t nn = 0;
    if (need_parse(need_obj, need, &nn) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint64_t *keys = view.buf;
    size_t n = (size_t)view.len / 8, i = 0;
    uint64_t media = ~(uint64_t)0;
    for (; i < n; i++) {
        int found;
        uint64_t m = mask_of(t, keys[i], &found);
        if (!found) break;
        int ok = 1;
        for (Py_ssize_t g = 0; g < nn; g++)
            if (!(m & need[g])) {
                ok = 0;
                break;
            }
        if (!ok) break;
        media &= fold(m);
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nK)", (Py_ssize_t)i, (unsigned long long)(i ? media : 0));
}

static PyObject *Table_masks(Table *t, PyObject *arg) {
    /* masks(content_keys) -> list of each key's mask (0: not held) */
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint64_t *keys = view.buf;
    size_t n = (size_t)view.len / 8;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        int found;
        PyObject *v = PyLong_FromUnsignedLongLong(mask_of(t, keys[i], &found));
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *Table_items(Table *t, PyObject *unused) {
    /* [(hash, content, mask, local, parent or None)] in table order */
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out && i < t->n; i++) {
        Entry *e = &t->ents[i];
        PyObject *item;
        if (e->parent == e->key)
            item = Py_BuildValue("(KKKKO)", e->key, e->content, e->mask, e->local, Py_None);
        else
            item = Py_BuildValue("(KKKKK)", e->key, e->content, e->mask, e->local, e->parent);
        if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

static PyObject *Table_nbytes(Table *t, void *closure) {
    return PyLong_FromSize_t(t->ecap * sizeof(Entry) + 2 * t->cap * sizeof(uint32_t));
}

static PyMethodDef table_methods[] = {
    {"store", (PyCFunction)Table_store, METH_VARARGS, NULL},
    {"remove", (PyCFunction)Table_remove, METH_VARARGS, NULL},
    {"clear", (PyCFunction)Table_clear, METH_NOARGS, NULL},
    {"content", (PyCFunction)Table_content, METH_O, NULL},
    {"mask", (PyCFunction)Table_mask, METH_O, NULL},
    {"run", (PyCFunction)Table_run, METH_VARARGS, NULL},
    {"masks", (PyCFunction)Table_masks, METH_O, NULL},
    {"items", (PyCFunction)Table_items, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef table_getset[] = {
    {"nbytes", (getter)Table_nbytes, NULL, "bytes the table's arrays take", NULL},
    {NULL},
};

static PySequenceMethods table_seq = {.sq_length = (lenfunc)Table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvatlas.core._blocks.BlockTable",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Table_new,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = table_methods,
    .tp_getset = table_getset,
    .tp_as_sequence = &table_seq,
};

/* ---- msgpack arrays of ints, read without Python ints --------------------------
 *
 * vLLM's events carry each block's hash and the blocks' token ids as msgpack arrays
 * of ints; decoding them into Python ints and converting them back was most of an
 * event's cost. These read the raw msgpack of one array (msgspec.Raw) directly. */

typedef struct {
    const uint8_t *p, *end;
} Reader;

static int rd_bytes(Reader *r, size_t n, const uint8_t **out) {
    if ((size_t)(r->end - r->p) < n) return -1;
    *out = r->p;
    r->p += n;
    return 0;
}

static uint64_t be(const uint8_t *b, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v = v << 8 | b[i];
    return v;
}

/* the array's length, or -1 (not an array, or truncated) */
static Py_ssize_t rd_array(Reader *r) {
    const uint8_t *b;
    if (rd_bytes(r, 1, &b) < 0) return -1;
    if ((*b & 0xF0) == 0x90) return *b & 0x0F;
    if (*b == 0xDC && rd_bytes(r, 2, &b) == 0) return (Py_ssize_t)be(b, 2);
    if (*b == 0xDD && rd_bytes(r, 4, &b) == 0) return (Py_ssize_t)be(b, 4);
    return -1;
}

/* One element: an int (its low 64 bits in *v, *neg for a negative one; 0) or, with
 * `bins`, a bin's low 64 bits big-endian (1); -1 for anything else. */
static int rd_int(Reader *r, uint64_t *v, int *neg, int bins) {
    const uint8_t *b, *d;
    *neg = 0;
    if (rd_bytes(r, 1, &b) < 0) return -1;
    uint8_t t = *b;
    if (t <= 0x7F) {
        *v = t;
        return 0;
    }
    if (t >= 0xE0) {
        *v = (uint64_t)(int64_t)(int8_t)t;
        *neg = 1;
        return 0;
    }
    size_t width = 0;
    int is_signed = 0;
    switch (t) {
    case 0xCC: width = 1; break;
    case 0xCD: width = 2; break;
    case 0xCE: width = 4; break;
    case 0xCF: width = 8; break;
    case 0xD0: width = 1; is_signed = 1; break;
    case 0xD1: width = 2; is_signed = 1; break;
    case 0xD2: width = 4; is_signed = 1; break;
    case 0xD3: width = 8; is_signed = 1; break;
    case 0xC4: case 0xC5: case 0xC6: {
        if (!bins) return -1;
        size_t lw = t == 0xC4 ? 1 : t == 0xC5 ? 2 : 4;
        if (rd_bytes(r, lw, &d) < 0) return -1;
        size_t n = (size_t)be(d, lw);
        if (n == 0 || rd_bytes(r, n, &d) < 0) return -1;
        *v = n > 8 ? be(d + n - 8, 8) : be(d, n);
        return 1;
    }
    default: return -1;
    }
    if (rd_bytes(r, width, &d) < 0) return -1;
    uint64_t u = be(d, width);
    if (is_signed && width < 8 && (u >> (8 * width - 1))) u |= ~(uint64_t)0 << (8 * width);
    *v = u;
    *neg = is_signed && (int64_t)u < 0;
    return 0;
}

static PyObject *py_msgpack_hashes(PyObject *self, PyObject *arg) {
    /* msgpack_hashes(raw) -> tuple of 64-bit keys: ints in [-(2**63), 2**64) as their
     * low 64 bits, bins (raw digests) as their last 8 bytes big-endian; ValueError for
     * anything else, a trailing byte included */
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *out = NULL;
    Py_ssize_t n = rd_array(&r);
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "block_hashes is not an array");
        goto done;
    }
    out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        uint64_t v;
        int neg;
        if (rd_int(&r, &v, &neg, 1) < 0) {
            PyErr_SetString(PyExc_ValueError, "a block hash is neither a 64-bit int nor bytes");
            Py_CLEAR(out);
            break;
        }
        PyObject *o = PyLong_FromUnsignedLongLong(v);
        if (!o) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, o);
    }
    if (out && r.p != r.end) {
        PyErr_SetString(PyExc_ValueError, "bytes after the block hashes");
        Py_CLEAR(out);
    }
done:
    PyBuffer_Release(&view);
    return out;
}

static PyObject *py_msgpack_tokens(PyObject *self, PyObject *arg) {
    /* msgpack_tokens(raw) -> the token ids as uint32 little-endian bytes (None for nil);
     * ValueError for anything but an array of ints in [0, 2**32) */
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *out = NULL;
    if (view.len == 1 && *r.p == 0xC0) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t n = rd_array(&r);
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "token_ids is not an array");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (!out) goto done;
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        /* the common encodings read in place; the rest through rd_int */
        size_t left = (size_t)(r.end - r.p);
        uint8_t t = left ? *r.p : 0xC1;
        if (t <= 0x7F) {
            v = t;
            r.p += 1;
        } else if (t == 0xCE && left >= 5) {
            v = (uint64_t)r.p[1] << 24 | (uint64_t)r.p[2] << 16 | (uint64_t)r.p[3] << 8 | r.p[4];
            r.p += 5;
        } else if (t == 0xCD && left >= 3) {
            v = (uint64_t)r.p[1] << 8 | r.p[2];
            r.p += 3;
        } else if (t == 0xCC && left >= 2) {
            v = r.p[1];
            r.p += 2;
        } else {
            int neg;
            if (rd_int(&r, &v, &neg, 0) < 0 || neg || v > 0xFFFFFFFFULL) {
                PyErr_SetString(PyExc_ValueError, "token ids must be ints in [0, 2**32)");
                Py_CLEAR(out);
                goto done;
            }
        }
        dst[4 * i] = (uint8_t)v;
        dst[4 * i + 1] = (uint8_t)(v >> 8);
        dst[4 * i + 2] = (uint8_t)(v >> 16);
        dst[4 * i + 3] = (uint8_t)(v >> 24);
    }
    if (r.p != r.end) {
        PyErr_SetString(PyExc_ValueError, "bytes after the token ids");
        Py_CLEAR(out);
    }
done:
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"local_hashes", py_local_hashes, METH_VARARGS, NULL},
    {"content_keys", py_content_keys, METH_VARARGS, NULL},
    {"chain_locals", py_chain_locals, METH_VARARGS, NULL},
    {"msgpack_hashes", py_msgpack_hashes, METH_O, NULL},
    {"msgpack_tokens", py_msgpack_tokens, METH_O, NULL},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvatlas.core._blocks",
    "The device tier's block table and token hashes (see kvatlas.core.coordinator.block_table).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__blocks(void) {
    if (PyType_Ready(&TableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "BlockTable", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
