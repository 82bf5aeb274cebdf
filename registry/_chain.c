/* A block chain's sequence hashes, compiled: XXH3-64 of each (parent, local) pair.
 *
 * Why: a sequence hash is XXH3-64 of 16 bytes (the parent's hash and the block's local hash,
 * little-endian u64s) under a seed. Through Python each costs a ``struct`` pack into a new
 * bytes object and a call into the xxhash package that parses its arguments by keyword, about
 * 650 instructions for a hash that is a dozen; a request of a Mooncake trace chains dozens of
 * blocks, and the simulator chains every request as it arrives (8% of a cluster run's Python).
 *
 * Only XXH3-64's path for inputs of 9 to 16 bytes is needed, for exactly 16: the inputs' two
 * words mixed with four words of the algorithm's default secret and the seed, one 64x64->128
 * multiply folded to 64 bits, and the final avalanche. ``tests/test_hashing_compiled.py`` holds
 * it to the xxhash package on drawn values and seeds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Words 3 to 6 of XXH3's default secret (its bytes 24 to 55, read little-endian): the ones
 * the 9-16 byte path reads. */
#define SECRET_24 0x1f67b3b7a4a44072ULL
#define SECRET_32 0x78e5c0cc4ee679cbULL
#define SECRET_40 0x2172ffcc7dd05a82ULL
#define SECRET_48 0x8e2443f7744608b8ULL
#define PRIME_MX1 0x165667919E3779F9ULL

static uint64_t fold64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

/* XXH3-64 of the 16 bytes ``low`` then ``high`` (each little-endian) under ``seed``. */
static uint64_t pair_hash(uint64_t low, uint64_t high, uint64_t seed) {
    uint64_t flip1 = (SECRET_24 ^ SECRET_32) + seed;
    uint64_t flip2 = (SECRET_40 ^ SECRET_48) - seed;
    uint64_t lo = low ^ flip1, hi = high ^ flip2;
    uint64_t acc = 16 + __builtin_bswap64(lo) + hi + fold64(lo, hi);
    acc ^= acc >> 37;
    acc *= PRIME_MX1;
    return acc ^ (acc >> 32);
}

/* A u64 from a Python int, or -1 with an exception (OverflowError for a negative or too
 * large one, TypeError for what is not an int), as ``struct``'s "Q" refuses them. */
static int as_u64(PyObject *obj, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a hash must be an int, not %.50s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = value;
    return 0;
}

static PyObject *pair(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    uint64_t low, high, seed;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pair(low, high, seed)");
        return NULL;
    }
    if (as_u64(args[0], &low) < 0 || as_u64(args[1], &high) < 0 || as_u64(args[2], &seed) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(pair_hash(low, high, seed));
}

static PyObject *chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    uint64_t seed, prev = 0;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain(local_hashes, parent, seed)");
        return NULL;
    }
    PyObject *locals = PySequence_Fast(args[0], "local hashes must be a sequence");
    if (locals == NULL) return NULL;
    int has_parent = args[1] != Py_None;
    if ((has_parent && as_u64(args[1], &prev) < 0) || as_u64(args[2], &seed) < 0) {
        Py_DECREF(locals);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(locals);
    PyObject **items = PySequence_Fast_ITEMS(locals);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(locals);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t local;
        if (as_u64(items[i], &local) < 0) {
            Py_DECREF(out);
            Py_DECREF(locals);
            return NULL;
        }
        /* the first block of a sequence is named by its local hash alone */
        prev = (i == 0 && !has_parent) ? local : pair_hash(prev, local, seed);
        PyObject *value = PyLong_FromUnsignedLongLong(prev);
        if (value == NULL) {
            Py_DECREF(out);
            Py_DECREF(locals);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
    }
    Py_DECREF(locals);
    return out;
}

static PyMethodDef methods[] = {
    {"pair", (PyCFunction)(void (*)(void))pair, METH_FASTCALL,
     "pair(low, high, seed): XXH3-64 of the two u64s packed little-endian (16 bytes)."},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(local_hashes, parent, seed): the sequence hashes of consecutive blocks after the "
     "prefix named parent (None: the first block is named by its local hash)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chain", "Sequence hashes of block chains (see registry.hashing).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__chain(void) { return PyModule_Create(&module); }
