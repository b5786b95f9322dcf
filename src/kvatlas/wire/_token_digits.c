/* The digits of a JSON array of token ids, read into little-endian uint32 bytes.
 *
 * Owns one function, `parse(body, start, end)`, the compiled twin of
 * `json_tokens._parse_digits` (the numpy parse, which serves where this module was not
 * built): it reads `body[start:end]`, the inside of a JSON array, and answers the tokens
 * as bytes of little-endian uint32 (4 per token), or None unless the span is exactly
 * `ws* N (ws* , ws* N)* ws*` (or only whitespace) with every N a JSON integer without
 * sign, fraction, exponent or leading zero, below 2**32. None sends the caller to
 * msgspec's exact decode, which then answers (the tokens, or the error): this module
 * must never accept a span msgspec would read otherwise, and does no other validation,
 * no I/O and keeps no state.
 *
 * Speed: ~6 ns per token here (~0.2 ms for 32,768 tokens, against ~0.7 ms for the numpy
 * parse and ~0.9 ms for msgspec building Python ints). Each number's first 8 bytes are
 * read as one word and converted with three multiply-shift steps (SWAR), so that its
 * length costs no branch per digit. Where SSE2 is (x86-64), the layouts encoders write
 * (numbers of up to 7 digits separated by "," or ", ") are read by `parse_blocks`, whose
 * numbers do not wait on each other: 10-20% faster (~175-190 us for 32,768 tokens,
 * against 200-225 us, best of 300, for sequential and random ids in both layouts).
 * Where the CPU has AVX-512 (F, BW, CD; chosen at import), `parse_blocks512` reads
 * those layouts (numbers of up to 8 digits) eight numbers at a time, another ~2.8x
 * (57-83 us against 157-233 us for 32,768 random ids: `bench.coordinator_bench`'s
 * in-process row, medians of 300).
 * Anything else, or anything they are not sure of, `parse_span` reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ZEROS 0x3030303030303030ULL      /* "0" in every byte */
#define PAST_NINE 0x7676767676767676ULL  /* + this sets a byte's top bit if it is > 9 */
#define TOPS 0x8080808080808080ULL
#define MAX_TOKEN 0xFFFFFFFFULL
/* Spans longer than this are parsed without the GIL (a body that big is parsed in the
 * HTTP server's thread pool). A shorter one takes under ~1 ms: less than the switch
 * interval (5 ms) after which a waiting thread asks for the GIL anyway, and giving the
 * GIL away on the event loop's thread risks waiting that long to get it back. */
#define RELEASE_GIL_BYTES (1 << 20)

static int is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The tokens of p[0:n] into out (room for cap), or -1 when the span is not exactly a
 * list of plain integers below 2**32. Bytes up to p[lim - 1] (lim >= n) may be read. */
static Py_ssize_t parse_span(const unsigned char *p, size_t n, size_t lim, unsigned char *out,
                             size_t cap) {
    size_t i = 0, k = 0;
    while (i < n && is_space(p[i])) i++;
    if (i == n) return 0;
    for (;;) {
        uint64_t value;
        size_t first = i, len;
        if (i >= n || k == cap) return -1;
        if (i + 8 <= lim) {
            /* The number's digits up to the first byte that is not one, at most 8. */
            uint64_t word, x, junk;
            memcpy(&word, p + i, 8);
#if PY_BIG_ENDIAN
            word = __builtin_bswap64(word);
#endif
            x = word - ZEROS; /* bytes before the first non-digit become 0-9 */
            junk = (x | (x + PAST_NINE)) & TOPS;
            len = junk ? (size_t)__builtin_ctzll(junk) >> 3 : 8;
            if (len == 0) return -1;
            if (len > n - i) len = n - i;
            /* The first digit at the top of the word, then 8 digits to their value. */
            x <<= 64 - 8 * len;
            x = (x * 10 + (x >> 8)) & 0x00FF00FF00FF00FFULL;
            x = (x * 100 + (x >> 16)) & 0x0000FFFF0000FFFFULL;
            x = (x * 10000 + (x >> 32)) & 0xFFFFFFFFULL;
            value = x;
            i += len;
        } else {
            value = 0;
            len = 0;
        }
        /* Beyond 8 digits (or within the last 8 bytes of the body), one at a time. */
        while (i < n && (unsigned char)(p[i] - '0') <= 9 && len <= 10) {
            value = value * 10 + (unsigned char)(p[i] - '0');
            i++;
            len++;
        }
        if (len == 0 || len > 10 || (len > 1 && p[first] == '0') || value > MAX_TOKEN) return -1;
        out[4 * k] = (unsigned char)value;
        out[4 * k + 1] = (unsigned char)(value >> 8);
        out[4 * k + 2] = (unsigned char)(value >> 16);
        out[4 * k + 3] = (unsigned char)(value >> 24);
        k++;
        while (i < n && is_space(p[i])) i++;
        if (i == n) return (Py_ssize_t)k;
        if (p[i] != ',') return -1;
        i++;
        while (i < n && is_space(p[i])) i++;
    }
}


#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_BLOCK_PARSE 1
/* Number starts taken from each 64-byte word without a branch: token ids of 4-7 digits
 * and their separators put 8-11 numbers in 64 bytes. */
#define STARTS_AT_ONCE 12
/* Words whose numbers are converted together (2 KiB of JSON, at most 1,024 numbers). */
#define BATCH_WORDS 32

/* Bits set in x, without the POPCNT instruction (not in the x86-64 baseline). */
static size_t popcount64(uint64_t x) {
    x -= (x >> 1) & 0x5555555555555555ULL;
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (size_t)((x * 0x0101010101010101ULL) >> 56);
}

/* The digit, comma, space and '0' bits of the 16 bytes at p (bit i: byte i). */
static void classify16(const unsigned char *p, uint64_t *d, uint64_t *c, uint64_t *s,
                       uint64_t *z, int shift) {
    __m128i x = _mm_loadu_si128((const __m128i *)p);
    __m128i v = _mm_sub_epi8(x, _mm_set1_epi8('0'));
    __m128i dig = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(9)), v);
    *d |= (uint64_t)(unsigned)_mm_movemask_epi8(dig) << shift;
    *c |= (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_set1_epi8(','))) << shift;
    *s |= (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_set1_epi8(' '))) << shift;
    *z |= (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_set1_epi8('0'))) << shift;
}

/* The layout encoders write, on the masks of `words` 64-byte words (each array with a
 * zero word past the end): every comma right after a digit, every space right after a
 * comma, every comma followed by a digit or a space, every space by a digit (so the span
 * begins and ends with a digit, and between two numbers lies exactly "," or ", "), and
 * no number of more than one digit begins with '0'. 0 when the span is laid out
 * otherwise; else 1, with mark[k] (the '0' bytes on entry) overwritten by the bits of
 * the numbers' first digits, or with `ends` their last digits. */
static int check_layout(const uint64_t *digit, const uint64_t *comma, const uint64_t *space,
                        uint64_t *mark, size_t words, int ends) {
    uint64_t d_before = 0, c_before = 0;
    for (size_t k = 0; k < words; k++) {
        uint64_t d = digit[k], c = comma[k], s = space[k];
        uint64_t prev_d = d << 1 | d_before, prev_c = c << 1 | c_before;
        uint64_t next_d = d >> 1 | digit[k + 1] << 63;
        uint64_t next_s = s >> 1 | space[k + 1] << 63;
        uint64_t starts = d & ~prev_d;
        if ((c & ~prev_d) | (s & ~prev_c) | (c & ~(next_d | next_s)) | (s & ~next_d) |
            (starts & mark[k] & next_d))
            return 0;
        mark[k] = ends ? d & ~next_d : starts;
        d_before = d >> 63;
        c_before = c >> 63;
    }
    return 1;
}

/* The positions of the bits of w (a word of marks at byte `base`) into dst, in order:
 * STARTS_AT_ONCE of them whatever w holds (slots past its count are written over next),
 * so that no branch depends on how many numbers a word holds; beyond, one at a time
 * (numbers of 1-3 digits). The caller counts them (its own popcount). */
static inline void mark_positions(uint64_t w, size_t base, int64_t *dst) {
    size_t j;
    for (j = 0; j < STARTS_AT_ONCE; j++) {
        dst[j] = (int64_t)(base + (size_t)__builtin_ctzll(w | 1ULL << 63));
        w &= w - 1;
    }
    for (j = STARTS_AT_ONCE; w; j++) {
        dst[j] = (int64_t)(base + (size_t)__builtin_ctzll(w));
        w &= w - 1;
    }
}

/* The tokens of p[0:n] in the layouts encoders write (numbers separated by "," or ", ",
 * nothing else; n > 0, no whitespace at either end), or -2 for anything else, which the
 * caller then reads with `parse_span` (so this never has to refuse, only to be sure
 * when it answers). Bytes up to p[lim - 1] may be read.
 *
 * Why: `parse_span` walks the span number by number, and where one number ends decides
 * where the next begins, so its time is that chain of dependent steps (~6 ns a token).
 * Here the bytes are first classified 64 at a time into bit masks (SSE2), the layout is
 * checked on the masks, and each number's start comes from its mask bit: the numbers'
 * conversions no longer wait on each other. */
static Py_ssize_t parse_blocks(const unsigned char *p, size_t n, size_t lim, unsigned char *out,
                               size_t cap) {
    size_t words = (n + 63) / 64, k, count = 0;
    uint64_t *digit, *comma, *space, *zero;
    int64_t starts[32 * BATCH_WORDS + STARTS_AT_ONCE];
    Py_ssize_t result = -2;
    /* One zero word past the end of each: the bits "after" the last byte. */
    digit = PyMem_RawMalloc(4 * (words + 1) * sizeof(uint64_t));
    if (digit == NULL) return -2;
    comma = digit + words + 1;
    space = comma + words + 1;
    zero = space + words + 1;
    for (k = 0; k < words; k++) {
        uint64_t d = 0, c = 0, s = 0, z = 0, valid;
        const unsigned char *b = p + 64 * k;
        unsigned char pad[64];
        if (64 * k + 64 > n) { /* the last block: the bytes past the span read as 0 */
            memset(pad, 0, sizeof(pad));
            memcpy(pad, b, n - 64 * k);
            b = pad;
            valid = (1ULL << (n - 64 * k)) - 1;
        } else {
            valid = ~0ULL;
        }
        classify16(b, &d, &c, &s, &z, 0);
        classify16(b + 16, &d, &c, &s, &z, 16);
        classify16(b + 32, &d, &c, &s, &z, 32);
        classify16(b + 48, &d, &c, &s, &z, 48);
        if (valid & ~(d | c | s)) goto done; /* a byte other than a digit, ',' or ' ' */
        digit[k] = d;
        comma[k] = c;
        space[k] = s;
        zero[k] = z;
    }
    digit[words] = comma[words] = space[words] = zero[words] = 0;
    if (!check_layout(digit, comma, space, zero, words, 0)) goto done; /* zero: starts */
    /* Each batch of words: its numbers' starts as positions, then each number on its own. */
    for (k = 0; k < words; k += BATCH_WORDS) {
        size_t last = k + BATCH_WORDS < words ? k + BATCH_WORDS : words, m = 0, j, w_at;
        for (w_at = k; w_at < last; w_at++) {
            mark_positions(zero[w_at], 64 * w_at, starts + m);
            m += popcount64(zero[w_at]);
        }
        if (count + m > cap) goto done;
        for (j = 0; j < m; j++) {
            size_t i = (size_t)starts[j], len;
            uint32_t token;
            if (i + 8 > lim) { /* within the body's last 8 bytes: a digit at a time */
                for (token = 0, len = 0; i + len < n && (unsigned char)(p[i + len] - '0') <= 9;
                     len++)
                    token = token * 10 + (unsigned char)(p[i + len] - '0');
            } else {
                uint64_t word, x, junk;
                memcpy(&word, p + i, 8);
                x = word - ZEROS;
                junk = (x | (x + PAST_NINE)) & TOPS;
                if (!junk) goto done; /* 8 digits or more: `parse_span` reads those */
                len = (size_t)__builtin_ctzll(junk) >> 3;
                if (len > n - i) len = n - i;
                x <<= 64 - 8 * len;
                x = (x * 10 + (x >> 8)) & 0x00FF00FF00FF00FFULL;
                x = (x * 100 + (x >> 16)) & 0x0000FFFF0000FFFFULL;
                x = (x * 10000 + (x >> 32)) & 0xFFFFFFFFULL;
                token = (uint32_t)x;
            }
            memcpy(out + 4 * (count + j), &token, 4); /* SSE2: x86, little-endian */
        }
        count += m;
    }
    result = (Py_ssize_t)count;
done:
    PyMem_RawFree(digit);
    return result;
}
#endif

#if defined(HAVE_BLOCK_PARSE) && defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PARSE 1
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512cd,popcnt,bmi,bmi2")))
/* Set at import where the CPU (and the OS) has AVX-512 F, BW and CD (and POPCNT, BMI1
 * and BMI2, which every CPU with those has). */
static int have_avx512 = 0;

/* `parse_blocks` on AVX-512 (F, BW, CD): the same layouts, answers and refusals, with
 * the numbers converted eight at a time (and numbers of 8 digits too). Each number is
 * read as the 8 bytes that end with its last digit (eight loads into one vector: a
 * gather took 2.5x as long on the development VM's AMD EPYC, in a one-off harness), so
 * only the numbers' ends are needed: the digits above the first other byte from the top
 * are the number, at most the bytes back to the span's start, and a number of 8 digits
 * whose byte before is a digit too is longer, which `parse_span` reads. Needs `before`
 * >= 8 (else -2): the bytes before p that may be read (the array's '[' and the key
 * before it, in a lookup body). */
AVX512_TARGET static Py_ssize_t parse_blocks512(const unsigned char *p, size_t n, size_t before,
                                               unsigned char *out, size_t cap) {
    size_t words = (n + 63) / 64, k, count = 0;
    uint64_t *digit, *comma, *space, *ends;
    int64_t at[32 * BATCH_WORDS + STARTS_AT_ONCE + 8];
    Py_ssize_t result = -2;
    const __m512i zeros = _mm512_set1_epi8('0'), ten = _mm512_set1_epi8(10);
    const __m512i tens = _mm512_set1_epi16(0x010A); /* bytes 10, 1: pairs of digits */
    const __m512i hundreds = _mm512_set1_epi32(0x00010064); /* 100, 1: pairs of pairs */
    if (before < 8) return -2;
    digit = PyMem_RawMalloc(4 * (words + 1) * sizeof(uint64_t));
    if (digit == NULL) return -2;
    comma = digit + words + 1;
    space = comma + words + 1;
    ends = space + words + 1;
    for (k = 0; k < words; k++) {
        const unsigned char *b = p + 64 * k;
        uint64_t valid = 64 * k + 64 > n ? (1ULL << (n - 64 * k)) - 1 : ~0ULL, d, c, s, z;
        __m512i x = _mm512_maskz_loadu_epi8(valid, b); /* never past the span */
        d = _mm512_cmplt_epu8_mask(_mm512_sub_epi8(x, zeros), ten) & valid;
        c = _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8(','));
        s = _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8(' '));
        z = _mm512_cmpeq_epi8_mask(x, zeros);
        if (valid & ~(d | c | s)) goto done; /* a byte other than a digit, ',' or ' ' */
        digit[k] = d;
        comma[k] = c;
        space[k] = s;
        ends[k] = z; /* the zeros until the check below has read them */
    }
    digit[words] = comma[words] = space[words] = ends[words] = 0;
    if (!check_layout(digit, comma, space, ends, words, 1)) goto done; /* ends: ends */
    for (k = 0; k < words; k += BATCH_WORDS) {
        size_t last = k + BATCH_WORDS < words ? k + BATCH_WORDS : words, m = 0, j, w_at;
        for (w_at = k; w_at < last; w_at++) { /* the ends' positions */
            mark_positions(ends[w_at], 64 * w_at, at + m);
            m += (size_t)__builtin_popcountll(ends[w_at]);
        }
        if (count + m > cap) goto done;
        if (m == 0) continue; /* 2 KiB of one number's digits: longer than 8, refused below */
        for (j = m; j < m + 8; j++) at[j] = at[m - 1]; /* a last group of fewer than 8 */
        for (j = 0; j < m; j += 8) {
            __m512i e = _mm512_loadu_si512((const void *)(at + j));
            uint64_t words8[8];
            __m512i t;
            for (int q = 0; q < 8; q++) memcpy(&words8[q], p + at[j + (size_t)q] - 7, 8);
            t = _mm512_sub_epi8(_mm512_loadu_si512((const void *)words8), zeros); /* 0-9 */
            __mmask64 other = _mm512_cmpge_epu8_mask(t, ten);
            /* The digits above the highest other byte (0x80 there: lzcnt finds it), at
             * most back to the span's start: 1-8 of them. */
            __m512i lz = _mm512_lzcnt_epi64(_mm512_maskz_mov_epi8(other, _mm512_set1_epi8(-128)));
            __m512i len = _mm512_min_epi64(
                _mm512_srli_epi64(_mm512_add_epi64(lz, _mm512_set1_epi64(1)), 3),
                _mm512_add_epi64(e, _mm512_set1_epi64(1)));
            __m512i keep = _mm512_sllv_epi64(_mm512_set1_epi64(-1),
                                             _mm512_sub_epi64(_mm512_set1_epi64(64),
                                                              _mm512_slli_epi64(len, 3)));
            __m512i v = _mm512_and_si512(t, keep); /* leading bytes zero, digits on top */
            __mmask8 full = _mm512_cmpeq_epi64_mask(len, _mm512_set1_epi64(8));
            uint32_t tokens[8];
            v = _mm512_madd_epi16(_mm512_maddubs_epi16(v, tens), hundreds);
            v = _mm512_add_epi64(_mm512_mul_epu32(v, _mm512_set1_epi64(10000)),
                                 _mm512_srli_epi64(v, 32));
            while (full) { /* 8 digits: longer if the byte before is a digit too */
                int lane = __builtin_ctz(full);
                int64_t before_at = at[j + (size_t)lane] - 8;
                full &= (__mmask8)(full - 1);
                if (before_at >= 0 && (digit[before_at >> 6] >> (before_at & 63) & 1)) goto done;
            }
            if (j + 8 <= m) {
                _mm256_storeu_si256((__m256i *)(out + 4 * (count + j)), _mm512_cvtepi64_epi32(v));
            } else {
                _mm256_storeu_si256((__m256i *)tokens, _mm512_cvtepi64_epi32(v));
                memcpy(out + 4 * (count + j), tokens, 4 * (m - j));
            }
        }
        count += m;
    }
    result = (Py_ssize_t)count;
done:
    PyMem_RawFree(digit);
    return result;
}
#endif

/* The tokens of p[0:n] (see `parse_span`), by the fastest reader that can be sure. */
static Py_ssize_t parse_tokens(const unsigned char *p, size_t n, size_t before, size_t lim,
                               unsigned char *out, size_t cap) {
#ifdef HAVE_BLOCK_PARSE
    size_t lead = 0, last = n;
    while (lead < n && is_space(p[lead])) lead++;
    while (last > lead && is_space(p[last - 1])) last--;
    if (last > lead) {
        Py_ssize_t got;
#ifdef HAVE_AVX512_PARSE
        /* Where it can run it reads every layout the SSE2 reader does (and 8 digits):
         * what it leaves, the SSE2 reader would leave too. */
        if (have_avx512 && before + lead >= 8)
            got = parse_blocks512(p + lead, last - lead, before + lead, out, cap);
        else
#endif
            got = parse_blocks(p + lead, last - lead, lim - lead, out, cap);
        if (got != -2) return got;
    }
#else
    (void)before;
#endif
    return parse_span(p, n, lim, out, cap);
}

static PyObject *parse(PyObject *module, PyObject *args) {
    Py_buffer body;
    Py_ssize_t start, end, got;
    size_t cap, n, lim;
    const unsigned char *span;
    unsigned char *dst;
    PyObject *out;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*nn:parse", &body, &start, &end)) return NULL;
    if (start < 0 || end < start || end > body.len) {
        PyBuffer_Release(&body);
        PyErr_SetString(PyExc_ValueError, "the span must lie inside the body");
        return NULL;
    }
    /* A token takes at least 2 bytes (a digit and a comma) but the last. */
    cap = (size_t)(end - start + 1) / 2;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * cap));
    if (out == NULL) {
        PyBuffer_Release(&body);
        return NULL;
    }
    span = (const unsigned char *)body.buf + start;
    n = (size_t)(end - start);
    lim = (size_t)(body.len - start);
    dst = (unsigned char *)PyBytes_AS_STRING(out);
    if (n > RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS;
        got = parse_tokens(span, n, (size_t)start, lim, dst, cap);
        Py_END_ALLOW_THREADS;
    } else {
        got = parse_tokens(span, n, (size_t)start, lim, dst, cap);
    }
    PyBuffer_Release(&body);
    if (got < 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&out, 4 * got) < 0) return NULL;
    return out;
}

#ifdef HAVE_BLOCK_PARSE
/* For tests: `parse_blocks` (or with avx512 true, `parse_blocks512`) alone, on the span
 * without its outer whitespace; None where it leaves the span to `parse_span`. */
static PyObject *parse_layout(PyObject *module, PyObject *args) {
    Py_buffer body;
    Py_ssize_t start, end, got = -2;
    size_t lim;
    int avx512 = 0;
    const unsigned char *p;
    PyObject *out;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*nn|p:parse_layout", &body, &start, &end, &avx512)) return NULL;
#ifdef HAVE_AVX512_PARSE
    if (avx512 && !have_avx512) {
#else
    if (avx512) {
#endif
        PyBuffer_Release(&body);
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no AVX-512 (F, BW, CD)");
        return NULL;
    }
    if (start < 0 || end < start || end > body.len) {
        PyBuffer_Release(&body);
        PyErr_SetString(PyExc_ValueError, "the span must lie inside the body");
        return NULL;
    }
    p = (const unsigned char *)body.buf;
    while (start < end && is_space(p[start])) start++;
    while (end > start && is_space(p[end - 1])) end--;
    lim = (size_t)(body.len - start);
    out = PyBytes_FromStringAndSize(NULL, 4 * ((end - start + 1) / 2));
    if (out != NULL && end > start) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        size_t n = (size_t)(end - start), cap = (size_t)(end - start + 1) / 2;
#ifdef HAVE_AVX512_PARSE
        if (avx512)
            got = parse_blocks512(p + start, n, (size_t)start, dst, cap);
        else
#endif
            got = parse_blocks(p + start, n, lim, dst, cap);
    }
    PyBuffer_Release(&body);
    if (out == NULL) return NULL;
    if (got < 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&out, 4 * got) < 0) return NULL;
    return out;
}
#endif

static PyMethodDef methods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(body, start, end) -> bytes | None: the JSON integers in body[start:end] as "
     "little-endian uint32, or None unless the span is exactly plain integers below 2**32 "
     "separated by commas."},
#ifdef HAVE_BLOCK_PARSE
    {"parse_layout", parse_layout, METH_VARARGS,
     "parse_layout(body, start, end, avx512=False) -> bytes | None: for tests, the block "
     "reader of the layouts encoders write alone (its AVX-512 twin with avx512, where "
     "HAVE_AVX512 says the CPU has it); None where parse leaves the span to its general "
     "reader."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvatlas.wire._token_digits",
    "The digits of a JSON token_ids array, read into little-endian uint32 bytes.", -1, methods,
};

PyMODINIT_FUNC PyInit__token_digits(void) {
    PyObject *module;
#ifdef HAVE_AVX512_PARSE
    __builtin_cpu_init();
    have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("popcnt") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
#endif
    module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
#ifdef HAVE_AVX512_PARSE
    if (PyModule_AddIntConstant(module, "HAVE_AVX512", have_avx512) < 0) {
#else
    if (PyModule_AddIntConstant(module, "HAVE_AVX512", 0) < 0) {
#endif
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
