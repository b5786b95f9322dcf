/* The blake3 prefix chain of `kvatlas.core.keys`, with the official BLAKE3 C library.
 *
 * Owns one function, `chain(tokens, chunk_size, prefix)`, the compiled twin of
 * `keys._python_chain` (the loop over the `blake3` package, which serves where this
 * module was not built): `tokens` is a buffer of little-endian uint32 token ids (4 bytes
 * each), and the answer is the hashes of its full chunks, 32 bytes each, concatenated:
 *
 *     h_1 = blake3(prefix || uint32_be(tokens of chunk 1))
 *     h_i = blake3(h_{i-1} || uint32_be(tokens of chunk i))
 *
 * A trailing partial chunk has no hash. It validates only its own arguments (a positive
 * chunk size, a whole number of tokens); the tokens' range is the caller's. No I/O, no
 * state. setup.py builds it where the BLAKE3 C sources are installed (Debian's
 * librust-blake3-dev) and a C compiler is found; its assembly for SSE2, SSE4.1, AVX2 and
 * AVX-512 is chosen at run time by the library's own dispatch.
 *
 * Speed: ~1.4 us per 256-token link here (~185 us for 32,768 tokens, against ~240 us
 * for the Python loop at best): the compressions themselves, since each link needs the
 * one before it.
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

static void chain_span(const unsigned char *tokens, size_t n_chunks, size_t chunk_size,
                       const unsigned char *prefix, size_t prefix_len, unsigned char *out) {
    blake3_hasher hasher;
    uint32_t block[BLOCK_TOKENS];
    const unsigned char *prev = prefix;
    size_t prev_len = prefix_len;
    for (size_t c = 0; c < n_chunks; c++) {
        const unsigned char *src = tokens + 4 * c * chunk_size;
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
        blake3_hasher_finalize(&hasher, out + HASH_BYTES * c, HASH_BYTES);
        prev = out + HASH_BYTES * c;
        prev_len = HASH_BYTES;
    }
}

static PyObject *chain(PyObject *module, PyObject *args) {
    Py_buffer tokens, prefix;
    Py_ssize_t chunk_size;
    size_t n_chunks;
    PyObject *out;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*ny*:chain", &tokens, &chunk_size, &prefix)) return NULL;
    if (chunk_size <= 0 || tokens.len % 4) {
        PyBuffer_Release(&tokens);
        PyBuffer_Release(&prefix);
        PyErr_SetString(PyExc_ValueError,
                        chunk_size <= 0 ? "the chunk size must be positive"
                                        : "tokens must be whole little-endian uint32s");
        return NULL;
    }
    n_chunks = (size_t)(tokens.len / 4) / (size_t)chunk_size;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(HASH_BYTES * n_chunks));
    if (out != NULL) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        if (tokens.len > RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS;
            chain_span(tokens.buf, n_chunks, (size_t)chunk_size, prefix.buf, (size_t)prefix.len,
                       dst);
            Py_END_ALLOW_THREADS;
        } else {
            chain_span(tokens.buf, n_chunks, (size_t)chunk_size, prefix.buf, (size_t)prefix.len,
                       dst);
        }
    }
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&prefix);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(tokens, chunk_size, prefix) -> bytes: the blake3 prefix chain of the full "
     "chunks of tokens (little-endian uint32 bytes), 32 bytes per chunk, concatenated."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvatlas.core._chain",
    "The blake3 prefix chain of token chunks, with the BLAKE3 C library.", -1, methods,
};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module_def); }
