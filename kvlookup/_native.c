/*
 * kvlookup._native: the controller's hot path in C (plain CPython C API, no other dependency).
 *
 * decode_tokens(body) -> bytearray | None
 *     The token ids of a /lookup body that is exactly {"tokens": [<ints>]} (JSON whitespace
 *     allowed between tokens), packed as native-endian uint32 (4 bytes an id). Each id must be
 *     plain decimal digits (no sign, fraction, exponent or leading zero) below 2^32. Anything
 *     else returns None: the caller then runs its own decoder, which gives the errors.
 *
 * decode_mp_ids(body) -> (bytearray, start, end, members) | None
 *     The token_ids of a JSON object body (LMCache MP's tokens-form /directory/lookup): its
 *     top-level member "token_ids" must be an array of ids as decode_tokens takes them (at least
 *     one); they come packed as big-endian uint32 (what the MP chunk hash reads), with the
 *     offsets [start, end) of the array in the body and the count of top-level members (the
 *     caller decodes the rest of the body itself, with the array cut out, and checks that no
 *     member repeats). Other members' values are skipped (strings with their escapes, nested
 *     arrays and objects by depth). None for anything else (not an object, a key with an escape,
 *     no or a repeated token_ids, an id decode_tokens would refuse, bytes after the object).
 *
 * chain(prefix, tokens, size, tail, extra=<absent>) -> list[int]
 *     The chain h_i = hash((h_{i-1}, tuple(chunk_i))) or, with extra, hash((h_{i-1},
 *     tuple(chunk_i), extra)), h_-1 = prefix, over chunks of `size` tokens (the trailing partial
 *     chunk too when `tail` is true): the values CPython's own tuple hash gives. tokens: a
 *     buffer of uint32 (format "I", e.g. array('I')) or any sequence (each item hashed with
 *     PyObject_Hash, as tuple() + hash() would).
 *
 * The tuple hash is CPython's xxHash-based one (Objects/tupleobject.c since 3.8) and an int's
 * hash is its value modulo 2^61 - 1 with its sign, -1 becoming -2 (Python/pyhash.c facts).
 * kvlookup.native checks this module against the interpreter's own hash() before using it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if SIZEOF_PY_HASH_T != 8
#error "kvlookup._native supports 64-bit hashes only (the pure-Python path serves other builds)"
#endif

#define PRIME_1 11400714785074694791ULL
#define PRIME_2 14029467366897019727ULL
#define PRIME_5 2870177450012600261ULL
#define LEN_MIX 3527539ULL
#define MODULUS ((1ULL << 61) - 1)

typedef uint64_t u64;

static inline u64 rotl31(u64 x) { return (x << 31) | (x >> 33); }

static inline u64 lane(u64 acc, u64 h) {
    acc += h * PRIME_2;
    acc = rotl31(acc);
    return acc * PRIME_1;
}

static inline Py_hash_t finish(u64 acc, u64 len) {
    acc += len ^ (PRIME_5 ^ LEN_MIX);
    if (acc == (u64)-1) {
        return 1546275796;
    }
    return (Py_hash_t)acc;
}

/* hash() of the Python int whose value is v (a previous link of the chain). */
static inline Py_hash_t int_hash(Py_hash_t v) {
    u64 mag = v < 0 ? (u64)0 - (u64)v : (u64)v;
    Py_hash_t r = (Py_hash_t)(mag % MODULUS);
    if (v < 0) {
        r = -r;
    }
    return r == -1 ? -2 : r;
}

/* Tuple hash of n uint32 ids: hash(int x) == x for 0 <= x < 2^32. */
static Py_hash_t hash_u32(const uint32_t *ids, Py_ssize_t n) {
    u64 acc = PRIME_5;
    for (Py_ssize_t i = 0; i < n; i++) {
        acc = lane(acc, ids[i]);
    }
    return finish(acc, (u64)n);
}

/* Tuple hash of the n items of seq (a list or tuple) from start; -1 with an exception set when one
 * is unhashable. An item's __hash__ may run Python code that changes a list under us: each item
 * is held while it is hashed and the size checked before each read. */
static Py_hash_t hash_items(PyObject *seq, Py_ssize_t start, Py_ssize_t n) {
    u64 acc = PRIME_5;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (start + i >= PySequence_Fast_GET_SIZE(seq)) {
            PyErr_SetString(PyExc_RuntimeError, "chain: tokens changed size while being hashed");
            return -1;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(seq, start + i);
        Py_hash_t h;
        if (PyLong_CheckExact(item)) {
            h = PyObject_Hash(item);  /* runs no Python code */
        } else {
            Py_INCREF(item);
            h = PyObject_Hash(item);
            Py_DECREF(item);
        }
        if (h == -1) {
            return -1;
        }
        acc = lane(acc, (u64)h);
    }
    return finish(acc, (u64)n);
}

/* One link: hash((parent, chunk[, extra])) from the lanes' hashes. */
static inline Py_hash_t chain_link(Py_hash_t parent_hash, Py_hash_t chunk_hash, int has_extra, Py_hash_t extra_hash) {
    u64 acc = lane(PRIME_5, (u64)parent_hash);
    acc = lane(acc, (u64)chunk_hash);
    if (has_extra) {
        acc = lane(acc, (u64)extra_hash);
        return finish(acc, 3);
    }
    return finish(acc, 2);
}

static int is_u32_buffer(Py_buffer *view) {
    return view->itemsize == 4 && view->format != NULL && strcmp(view->format, "I") == 0
        && PyBuffer_IsContiguous(view, 'C');
}

static PyObject *native_chain(PyObject *self, PyObject *args) {
    PyObject *prefix, *tokens, *extra = NULL;
    Py_ssize_t size;
    int tail;
    if (!PyArg_ParseTuple(args, "OOnp|O:chain", &prefix, &tokens, &size, &tail, &extra)) {
        return NULL;
    }
    if (size < 1) {
        PyErr_SetString(PyExc_ValueError, "chain: size must be >= 1");
        return NULL;
    }
    Py_hash_t parent = PyObject_Hash(prefix);
    if (parent == -1) {
        return NULL;
    }
    Py_hash_t extra_hash = 0;
    if (extra != NULL && (extra_hash = PyObject_Hash(extra)) == -1) {
        return NULL;
    }
    Py_buffer view;
    const uint32_t *ids = NULL;
    PyObject *seq = NULL;
    Py_ssize_t n;
    if (PyObject_CheckBuffer(tokens) && PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        if (is_u32_buffer(&view)) {
            ids = (const uint32_t *)view.buf;
            n = view.len / 4;
        } else {
            PyBuffer_Release(&view);
        }
    } else {
        PyErr_Clear();
    }
    if (ids == NULL) {
        seq = PySequence_Fast(tokens, "chain: tokens must be a uint32 buffer or a sequence");
        if (seq == NULL) {
            return NULL;
        }
        n = PySequence_Fast_GET_SIZE(seq);
    }
    Py_ssize_t full = n / size;
    Py_ssize_t count = full + ((tail && n % size) ? 1 : 0);
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t start = i * size;
        Py_ssize_t len = i < full ? size : n - start;
        Py_hash_t chunk = ids ? hash_u32(ids + start, len) : hash_items(seq, start, len);
        if (chunk == -1) {
            Py_DECREF(out);
            goto fail;
        }
        Py_hash_t h = chain_link(parent, chunk, extra != NULL, extra_hash);
        PyObject *value = PyLong_FromSsize_t(h);
        if (value == NULL) {
            Py_DECREF(out);
            goto fail;
        }
        PyList_SET_ITEM(out, i, value);
        parent = int_hash(h);
    }
    if (ids) {
        PyBuffer_Release(&view);
    }
    Py_XDECREF(seq);
    return out;
fail:
    if (ids) {
        PyBuffer_Release(&view);
    }
    Py_XDECREF(seq);
    return NULL;
}

/* ---- decode_tokens ---- */

static inline const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {
        p++;
    }
    return p;
}

static inline const char *expect(const char *p, const char *end, const char *lit, size_t n) {
    if ((size_t)(end - p) < n || memcmp(p, lit, n) != 0) {
        return NULL;
    }
    return p + n;
}

/* Up to 11 leading digits of p as a number (*v) and where they end: digit count = end - p.
 * Eight bytes at a time where they are readable (SWAR, little-endian, GCC/Clang); a byte loop
 * otherwise and for ids of 9+ digits. */
static inline const char *scan_digits_slow(const char *p, const char *end, u64 *v) {
    const char *start = p;
    u64 acc = 0;
    unsigned d;
    while (p < end && p - start < 11 && (d = (unsigned)(unsigned char)*p - '0') < 10) {
        acc = acc * 10 + d;
        p++;
    }
    *v = acc;
    return p;
}

#if PY_LITTLE_ENDIAN && defined(__GNUC__)
#define ONES 0x0101010101010101ULL
static inline const char *scan_id(const char *p, const char *end, u64 *v) {
    if (end - p < 8) {
        return scan_digits_slow(p, end, v);
    }
    u64 x;
    memcpy(&x, p, 8);
    u64 high = x & (0x80 * ONES), low = x & (0x7F * ONES);
    u64 above_9 = (low + 0x46 * ONES) & (0x80 * ONES);  /* low byte > '9' */
    u64 from_0 = (low + 0x50 * ONES) & (0x80 * ONES);   /* low byte >= '0' */
    u64 other = high | above_9 | (~from_0 & (0x80 * ONES));
    if (other == 0) {  /* 8 digits or more: rare for token ids */
        return scan_digits_slow(p, end, v);
    }
    int n = __builtin_ctzll(other) / 8;
    if (n == 0) {
        *v = 0;
        return p;
    }
    x -= 0x30 * ONES;
    x <<= 64 - 8 * n;  /* the n digits in the top bytes, zeros (leading zeros) below */
    x = (x * 10 + (x >> 8)) & 0x00FF00FF00FF00FFULL;
    x = (x * 100 + (x >> 16)) & 0x0000FFFF0000FFFFULL;
    x = (x * 10000 + (x >> 32)) & 0xFFFFFFFFULL;
    *v = x;
    return p + n;
}
#else
static inline const char *scan_id(const char *p, const char *end, u64 *v) { return scan_digits_slow(p, end, v); }
#endif

/* Parse {"tokens": [ids]} into out (room for every id); the id count, or -1: not this shape. */
static Py_ssize_t parse_body(const char *p, const char *end, uint32_t *out) {
    p = skip_ws(p, end);
    if ((p = expect(p, end, "{", 1)) == NULL) return -1;
    p = skip_ws(p, end);
    if ((p = expect(p, end, "\"tokens\"", 8)) == NULL) return -1;
    p = skip_ws(p, end);
    if ((p = expect(p, end, ":", 1)) == NULL) return -1;
    p = skip_ws(p, end);
    if ((p = expect(p, end, "[", 1)) == NULL) return -1;
    p = skip_ws(p, end);
    Py_ssize_t n = 0;
    if (p < end && *p == ']') {
        p++;
    } else {
        for (;;) {
            const char *digits = p;
            u64 v;
            p = scan_id(p, end, &v);
            Py_ssize_t len = p - digits;
            /* no digit, more than 10 (an overflow of v is caught here too), a leading zero, >= 2^32 */
            if (len == 0 || len > 10 || (*digits == '0' && len > 1) || v > 0xFFFFFFFFULL) return -1;
            out[n++] = (uint32_t)v;
            if (p < end && *p == ',') {  /* the common separator first */
                p++;
            } else {
                p = skip_ws(p, end);
                if (p < end && *p == ']') {
                    p++;
                    break;
                }
                if (p >= end || *p != ',') return -1;  /* '.', 'e', '-' after digits, or anything else */
                p++;
            }
            if (p < end && *p == ' ') p++;  /* ", " */
            p = skip_ws(p, end);
        }
    }
    p = skip_ws(p, end);
    if ((p = expect(p, end, "}", 1)) == NULL) return -1;
    p = skip_ws(p, end);
    return p == end ? n : -1;
}

static PyObject *native_decode_tokens(PyObject *self, PyObject *arg) {
    Py_buffer body;
    if (PyObject_GetBuffer(arg, &body, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    /* every id takes a digit and a separator but the last: at most len/2 + 1 ids */
    Py_ssize_t room = body.len / 2 + 1;
    PyObject *packed = PyByteArray_FromStringAndSize(NULL, room * 4);
    if (packed == NULL) {
        PyBuffer_Release(&body);
        return NULL;
    }
    const char *start = (const char *)body.buf;
    Py_ssize_t n = parse_body(start, start + body.len, (uint32_t *)PyByteArray_AS_STRING(packed));
    PyBuffer_Release(&body);
    if (n < 0) {
        Py_DECREF(packed);
        Py_RETURN_NONE;
    }
    if (PyByteArray_Resize(packed, n * 4) != 0) {
        Py_DECREF(packed);
        return NULL;
    }
    return packed;
}

/* ---- decode_mp_ids ---- */

/* Past the JSON string starting at p (at its '"'); NULL when it does not end. */
static const char *skip_string(const char *p, const char *end) {
    p++;
    while (p < end) {
        const char *q = memchr(p, '"', (size_t)(end - p));
        if (q == NULL) return NULL;
        const char *b = q;  /* an odd run of backslashes before it escapes it */
        while (b > p && b[-1] == '\\') b--;
        if (((q - b) & 1) == 0) return q + 1;
        p = q + 1;
    }
    return NULL;
}

/* Past one JSON value at p (not validated: the caller's decoder checks the rest); NULL when unbalanced. */
static const char *skip_value(const char *p, const char *end) {
    int depth = 0;
    while (p < end) {
        char c = *p;
        if (c == '"') {
            if ((p = skip_string(p, end)) == NULL) return NULL;
            if (depth == 0) return p;
            continue;
        }
        if (c == '[' || c == '{') {
            depth++;
        } else if (c == ']' || c == '}') {
            if (depth == 0) return p;  /* the end of the enclosing object: the value ended before */
            depth--;
            if (depth == 0) return p + 1;
        } else if (c == ',' && depth == 0) {
            return p;
        }
        p++;
    }
    return depth == 0 ? p : NULL;
}

/* The ids of the array at p ('['), big-endian, into out; the count (>= 1) and *after, or -1. */
static Py_ssize_t parse_ids_be(const char *p, const char *end, uint32_t *out, const char **after) {
    if ((p = expect(p, end, "[", 1)) == NULL) return -1;
    p = skip_ws(p, end);
    Py_ssize_t n = 0;
    for (;;) {
        const char *digits = p;
        u64 v;
        p = scan_id(p, end, &v);
        Py_ssize_t len = p - digits;
        if (len == 0 || len > 10 || (*digits == '0' && len > 1) || v > 0xFFFFFFFFULL) return -1;
        out[n++] = __builtin_bswap32((uint32_t)v);
        if (p < end && *p == ',') {
            p++;
        } else {
            p = skip_ws(p, end);
            if (p < end && *p == ']') {
                *after = p + 1;
                return n;
            }
            if (p >= end || *p != ',') return -1;
            p++;
        }
        if (p < end && *p == ' ') p++;
        p = skip_ws(p, end);
    }
}

static PyObject *native_decode_mp_ids(PyObject *self, PyObject *arg) {
    Py_buffer body;
    if (PyObject_GetBuffer(arg, &body, PyBUF_SIMPLE) != 0) {
        return NULL;
    }
    PyObject *packed = PyByteArray_FromStringAndSize(NULL, (body.len / 2 + 1) * 4);
    if (packed == NULL) {
        PyBuffer_Release(&body);
        return NULL;
    }
    const char *start = (const char *)body.buf, *end = start + body.len, *p = start;
    const char *a0 = NULL, *a1 = NULL;
    Py_ssize_t n = -1, members = 0;
    p = skip_ws(p, end);
    if ((p = expect(p, end, "{", 1)) == NULL) goto none;
    p = skip_ws(p, end);
    if (p < end && *p == '}') goto none;  /* {}: no token_ids */
    for (;;) {
        if (p >= end || *p != '"') goto none;
        const char *k = p + 1, *kend = skip_string(p, end);
        if (kend == NULL || memchr(k, '\\', (size_t)(kend - 1 - k)) != NULL) goto none;
        members++;
        int ids = (kend - 1 - k) == 9 && memcmp(k, "token_ids", 9) == 0;
        p = skip_ws(kend, end);
        if ((p = expect(p, end, ":", 1)) == NULL) goto none;
        p = skip_ws(p, end);
        if (ids) {
            if (a0 != NULL) goto none;  /* a repeated token_ids */
            a0 = p;
            n = parse_ids_be(p, end, (uint32_t *)PyByteArray_AS_STRING(packed), &a1);
            if (n < 0) goto none;
            p = a1;
        } else if ((p = skip_value(p, end)) == NULL) {
            goto none;
        }
        p = skip_ws(p, end);
        if (p < end && *p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (p < end && *p == '}') break;
        goto none;
    }
    p = skip_ws(p + 1, end);
    if (p != end || a0 == NULL) goto none;
    PyBuffer_Release(&body);
    if (PyByteArray_Resize(packed, n * 4) != 0) {
        Py_DECREF(packed);
        return NULL;
    }
    return Py_BuildValue("(Nnnn)", packed, (Py_ssize_t)(a0 - start), (Py_ssize_t)(a1 - start), members);
none:
    PyBuffer_Release(&body);
    Py_DECREF(packed);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"chain", native_chain, METH_VARARGS,
     "chain(prefix, tokens, size, tail, extra=<absent>) -> list[int]: CPython tuple-hash chunk chain."},
    {"decode_mp_ids", native_decode_mp_ids, METH_O,
     "decode_mp_ids(body) -> (bytearray, start, end, members) | None: big-endian uint32 token_ids of a JSON object."},
    {"decode_tokens", native_decode_tokens, METH_O,
     "decode_tokens(body) -> bytearray | None: the uint32 ids of a {\"tokens\": [ints]} body, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvlookup._native",
    "kvlookup's hot path in C: /lookup body decode and the CPython tuple-hash chunk chains.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
