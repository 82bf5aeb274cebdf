/* A Mooncake trace's usual text, read into ``TraceRequest`` rows in one pass.
 *
 * Why: the trace is read at every start of ``kvledger simulate``, and through ``json`` each of
 * its hundreds of thousands of block ids goes through the decoder's generic number parser, a
 * dict per row is built and looked up, and each row's checks run in Python. On the synthetic
 * trace that was about 250 M instructions, more than a whole short simulation's imports; here
 * it is one scan of the text.
 *
 * Only the plain shape is read: ASCII text, one object a line with exactly the four fields
 * (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``) in any order, keys without
 * escapes, whole numbers where whole numbers belong, a finite timestamp, as many block ids as
 * the input length needs, and at least one row. For anything else ``read`` returns None before
 * it has built anything the caller sees, and ``kvledger.mocker.traces.load_mooncake`` reads the
 * text with ``json`` and its own checks, which name the line and what is wrong with it. So the
 * rules and their messages live in one place, and ``tests/test_trace_compiled.py`` holds the two
 * readers to the same rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const char *p;   /* the next character */
    const char *end; /* the end of the line */
} Cursor;

static void skip_space(Cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t')) c->p++;
}

static int is_digit(char ch) { return ch >= '0' && ch <= '9'; }

/* A JSON whole number without sign into ``*out``: 0 when the text there is one (and fits in 64
 * bits), -1 when it is not (a float, a sign, a leading zero, too large). */
static int read_whole(Cursor *c, uint64_t *out) {
    const char *p = c->p;
    if (p >= c->end || !is_digit(*p)) return -1;
    if (*p == '0' && p + 1 < c->end && is_digit(p[1])) return -1; /* JSON has no leading zeros */
    const char *start = p;
    uint64_t value = 0;
    while (p < c->end && is_digit(*p)) {
        value = value * 10 + (unsigned)(*p - '0'); /* 19 digits cannot overflow 64 bits */
        p++;
        if (p - start == 19 && p < c->end && is_digit(*p)) { /* the 20th, with care */
            unsigned digit = (unsigned)(*p - '0');
            if (value > (UINT64_MAX - digit) / 10) return -1;
            value = value * 10 + digit;
            p++;
            if (p < c->end && is_digit(*p)) return -1; /* 21 digits */
            break;
        }
    }
    if (p < c->end && (*p == '.' || *p == 'e' || *p == 'E')) return -1; /* a float */
    c->p = p;
    *out = value;
    return 0;
}

/* A JSON number as a finite double (what ``float()`` of ``json``'s value gives: both round the
 * decimal text correctly, and a whole number, which ``json`` reads as an int, has no negative
 * zero), or -1. */
static int read_number(Cursor *c, double *out) {
    const char *start = c->p, *p = c->p;
    int whole = 1;
    if (p < c->end && *p == '-') p++;
    if (p >= c->end || !is_digit(*p)) return -1;
    if (*p == '0') {
        p++;
    } else {
        while (p < c->end && is_digit(*p)) p++;
    }
    if (p < c->end && *p == '.') {
        whole = 0;
        p++;
        if (p >= c->end || !is_digit(*p)) return -1;
        while (p < c->end && is_digit(*p)) p++;
    }
    if (p < c->end && (*p == 'e' || *p == 'E')) {
        whole = 0;
        p++;
        if (p < c->end && (*p == '+' || *p == '-')) p++;
        if (p >= c->end || !is_digit(*p)) return -1;
        while (p < c->end && is_digit(*p)) p++;
    }
    char text[64];
    size_t n = (size_t)(p - start);
    if (n >= sizeof text) return -1;
    memcpy(text, start, n);
    text[n] = '\0';
    double value = PyOS_string_to_double(text, NULL, NULL);
    if (value == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (!isfinite(value)) return -1;
    if (whole && value == 0.0) value = 0.0; /* "-0": json's int 0 */
    c->p = p;
    *out = value;
    return 0;
}

enum { TIMESTAMP, INPUT_LENGTH, OUTPUT_LENGTH, HASH_IDS, FIELDS };
static const char *const field_names[FIELDS] = {
    "timestamp", "input_length", "output_length", "hash_ids"};

/* The field a quoted key names, its index; -1 for a key that is none of them (or escaped). */
static int read_key(Cursor *c) {
    if (c->p >= c->end || *c->p != '"') return -1;
    const char *start = ++c->p;
    while (c->p < c->end && *c->p != '"') {
        if (*c->p == '\\') return -1;
        c->p++;
    }
    if (c->p >= c->end) return -1;
    size_t n = (size_t)(c->p - start);
    c->p++;
    for (int i = 0; i < FIELDS; i++) {
        if (strlen(field_names[i]) == n && memcmp(field_names[i], start, n) == 0) return i;
    }
    return -1;
}

typedef struct {
    uint64_t *ids;
    Py_ssize_t len, cap;
} Ids;

static int read_ids(Cursor *c, Ids *ids) {
    ids->len = 0;
    if (c->p >= c->end || *c->p != '[') return -1;
    c->p++;
    skip_space(c);
    if (c->p < c->end && *c->p == ']') {
        c->p++;
        return 0;
    }
    for (;;) {
        uint64_t value;
        skip_space(c);
        if (read_whole(c, &value) < 0) return -1;
        if (ids->len == ids->cap) {
            Py_ssize_t cap = ids->cap ? 2 * ids->cap : 256;
            uint64_t *grown = PyMem_Realloc(ids->ids, (size_t)cap * sizeof *grown);
            if (grown == NULL) {
                PyErr_NoMemory();
                return -2;
            }
            ids->ids = grown;
            ids->cap = cap;
        }
        ids->ids[ids->len++] = value;
        skip_space(c);
        if (c->p < c->end && *c->p == ',') {
            c->p++;
            continue;
        }
        if (c->p < c->end && *c->p == ']') {
            c->p++;
            return 0;
        }
        return -1;
    }
}

/* One line's row, appended to ``rows``: 0 done, -1 not the plain shape, -2 an exception. */
static int read_line(Cursor *c, Ids *ids, PyTypeObject *row_type, PyObject *block_tokens,
                     uint64_t tokens, PyObject *rows) {
    double timestamp = 0.0;
    uint64_t lengths[2] = {0, 0};
    int seen[FIELDS] = {0, 0, 0, 0};
    skip_space(c);
    if (c->p >= c->end || *c->p != '{') return -1;
    c->p++;
    for (int i = 0; i < FIELDS; i++) {
        skip_space(c);
        int field = read_key(c);
        if (field < 0 || seen[field]) return -1; /* another key, or one given twice */
        seen[field] = 1;
        skip_space(c);
        if (c->p >= c->end || *c->p != ':') return -1;
        c->p++;
        skip_space(c);
        int status;
        if (field == TIMESTAMP) {
            status = read_number(c, &timestamp);
        } else if (field == HASH_IDS) {
            status = read_ids(c, ids);
        } else {
            status = read_whole(c, &lengths[field - INPUT_LENGTH]);
        }
        if (status < 0) return status;
        skip_space(c);
        if (c->p >= c->end) return -1;
        if (*c->p == (i + 1 < FIELDS ? ',' : '}')) {
            c->p++;
        } else {
            return -1;
        }
    }
    skip_space(c);
    if (c->p != c->end) return -1;
    uint64_t input = lengths[0], output = lengths[1];
    if (input == 0 || input > (uint64_t)PY_SSIZE_T_MAX) return -1;
    if ((uint64_t)ids->len != input / tokens + (input % tokens != 0)) return -1;

    PyObject *row = row_type->tp_alloc(row_type, 5);
    if (row == NULL) return -2;
    PyObject *block_ids = PyTuple_New(ids->len);
    PyObject *items[4] = {PyFloat_FromDouble(timestamp), PyLong_FromUnsignedLongLong(input),
                          PyLong_FromUnsignedLongLong(output), block_ids};
    int failed = items[0] == NULL || items[1] == NULL || items[2] == NULL || block_ids == NULL;
    for (Py_ssize_t k = 0; !failed && k < ids->len; k++) {
        PyObject *id = PyLong_FromUnsignedLongLong(ids->ids[k]);
        if (id == NULL) {
            failed = 1;
            break;
        }
        PyTuple_SET_ITEM(block_ids, k, id);
    }
    for (int k = 0; k < 4; k++) PyTuple_SET_ITEM(row, k, items[k]); /* row owns them, or NULL */
    Py_INCREF(block_tokens);
    PyTuple_SET_ITEM(row, 4, block_tokens);
    if (failed || PyList_Append(rows, row) < 0) {
        Py_DECREF(row);
        return -2;
    }
    Py_DECREF(row);
    return 0;
}

static PyObject *read_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "read(text, row_type, block_tokens)");
        return NULL;
    }
    PyObject *text = args[0];
    PyTypeObject *row_type = (PyTypeObject *)args[1];
    PyObject *block_tokens = args[2];
    unsigned long long tokens = PyLong_AsUnsignedLongLong(block_tokens);
    if (tokens == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (tokens == 0) {
        PyErr_SetString(PyExc_ValueError, "block_tokens must be positive");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(text)) Py_RETURN_NONE;
    const char *p = (const char *)PyUnicode_DATA(text);
    const char *end = p + PyUnicode_GET_LENGTH(text);
    PyObject *rows = PyList_New(0);
    if (rows == NULL) return NULL;
    Ids ids = {NULL, 0, 0};
    int status = 0;
    while (p < end) {
        const char *eol = p;
        while (eol < end && *eol != '\n' && *eol != '\r') {
            /* other line breaks and control characters: the line split is str.splitlines' */
            if ((unsigned char)*eol < 0x20 && *eol != '\t') {
                status = -1;
                break;
            }
            eol++;
        }
        if (status < 0) break;
        Cursor c = {p, eol};
        skip_space(&c);
        if (c.p < eol) {
            status = read_line(&c, &ids, row_type, block_tokens, tokens, rows);
            if (status < 0) break;
        }
        p = eol;
        if (p < end && *p == '\r') {
            p++;
            if (p < end && *p != '\n') { /* a lone CR: splitlines breaks there, so should we */
                status = -1;
                break;
            }
        }
        if (p < end) p++;
    }
    PyMem_Free(ids.ids);
    if (status == -2) {
        Py_DECREF(rows);
        return NULL;
    }
    if (status < 0 || PyList_GET_SIZE(rows) == 0) {
        Py_DECREF(rows);
        Py_RETURN_NONE;
    }
    return rows;
}

static PyMethodDef methods[] = {
    {"read", (PyCFunction)(void (*)(void))read_rows, METH_FASTCALL,
     "read(text, row_type, block_tokens): the rows of a plain Mooncake trace as row_type "
     "tuples (timestamp, input, output, block ids, block_tokens), or None for a text that is "
     "not plain (the Python reader then reads it, and names what is wrong)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_trace",
    "A plain Mooncake trace read in one pass (see kvledger.mocker.traces).", -1, methods,
};

PyMODINIT_FUNC PyInit__trace(void) { return PyModule_Create(&module); }
