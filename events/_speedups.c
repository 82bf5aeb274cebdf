/* The log's hot encoders, compiled: ``stored``, ``removed``, ``offloaded`` and ``onboarded``
 * return the same version-3 record, byte for byte, as ``codec``'s Python encoders.
 *
 * Why: every event an engine hands its log is encoded on the engine's thread. A stored event
 * of twenty blocks costs the Python encoder about 6 us, most of it converting the hash words
 * to C integers one call argument at a time (struct.pack with forty-odd arguments) and
 * flattening the block pairs first. Here the same work is a loop over the tuples.
 *
 * Only the plain case is handled: exact ints in range, a float ts, tuples or lists of blocks.
 * For anything else (a bool for an id, a negative id, an out-of-range word, a malformed block
 * or token list) these return None and ``codec`` runs the Python encoder, which raises the
 * error it always raised. So the checks and their messages live in one place, and a record
 * this module writes is one the Python encoder would have written.
 *
 * The layout is ``codec``'s docstring's: a fixed 40-byte header, the body, the checksum tag
 * 0xce and the CRC-32 (zlib's polynomial: events/crc32.h) of everything before it,
 * little-endian.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "crc32.h"
#include "records.h"
#include <stdint.h>
#include <string.h>

/* The fields read, by their index in ``field_names`` (registry/fields.h reads them) */
enum { F_WORKER_ID, F_EVENT_ID, F_DP_RANK, F_TIER, F_TS, F_PARENT_HASH, F_BLOCKS, F_TOKEN_IDS,
       F_SEQUENCE_HASHES, F_SRC_TIER, FIELD_NAMES };
#define FIELD_CACHE
#include "../registry/fields.h"

#define NIL 0xC0
#define UINT64 0xCF
#define INT64 0xD3
#define FLOAT64 0xCB
#define BIN32 0xC6
#define CHECK_TAG 0xCE
#define VERSION 3
#define HEADER_BYTES 40
#define STORED_ARRAY (0x90 + 7 + 3 + 1)
#define REMOVED_ARRAY (0x90 + 7 + 1 + 1)
#define COPIED_ARRAY (0x90 + 7 + 3 + 1)

/* Big-endian stores. Where the compiler has a byte swap, one swap and one store: GCC does not
 * merge the byte loop once it is inlined into the block loops, where it took a third of a
 * stored event's encoding. */
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static inline unsigned char *put_u64(unsigned char *p, uint64_t v) {
    v = __builtin_bswap64(v);
    memcpy(p, &v, 8);
    return p + 8;
}

static inline unsigned char *put_u32(unsigned char *p, uint32_t v) {
    v = __builtin_bswap32(v);
    memcpy(p, &v, 4);
    return p + 4;
}
#else
static inline unsigned char *put_u64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
    return p + 8;
}

static inline unsigned char *put_u32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
    return p + 4;
}
#endif

/* An exact int in 0..2**64-1; 0 when ``obj`` is anything else (no exception set).
 *
 * Before 3.12 an int is its signed digit count and its 30-bit digits, and a u64 is at most
 * three of them: read in place, a hash word costs a few instructions where the calls below
 * (sign, bit length, the masked conversion) cost about seventy, a fifth of a logged
 * simulation's encoding. Elsewhere (3.12's tagged layout, 15-bit digits) those calls run:
 * range by sign and bit length, then the masked conversion, as PyLong_AsUnsignedLongLong goes
 * through a generic byte-array conversion on 3.11, three times slower for a hash word. */
static inline int as_u64(PyObject *obj, uint64_t *out) {
    if (!PyLong_CheckExact(obj)) return 0;
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    const digit *d = ((PyLongObject *)obj)->ob_digit;
    switch (Py_SIZE(obj)) { /* negative for a negative int */
    case 0:
        *out = 0;
        return 1;
    case 1:
        *out = d[0];
        return 1;
    case 2:
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30;
        return 1;
    case 3:
        if (d[2] >> 4) return 0; /* 65 bits or more */
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
        return 1;
    default:
        return 0;
    }
#else
    if (_PyLong_Sign(obj) < 0 || _PyLong_NumBits(obj) > 64) return 0;
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(obj);
    return 1;
#endif
}

/* An exact int in the int64 range; 0 otherwise. */
static inline int as_i64(PyObject *obj, int64_t *out) {
    if (!PyLong_CheckExact(obj)) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = (int64_t)v;
    return 1;
}

typedef struct {
    PyObject *values[5]; /* worker_id, event_id, dp_rank, tier, ts: new references */
    int64_t worker_id;
    uint64_t event_id;
    int64_t dp_rank;
    unsigned char tier;
    double ts;
} Head;

static void release_head(Head *head) {
    for (int i = 0; i < 5; i++) Py_CLEAR(head->values[i]);
}

/* 1: the header's fields read; 0: not the plain case; -1: an exception (attribute missing).
 * The caller releases the head whatever this returns. */
static int read_head(PyObject *event, Head *head) {
    PyObject **values = head->values;
    for (int i = 0; i < 5; i++) values[i] = NULL;
    for (int i = 0; i < 5; i++) { /* F_WORKER_ID .. F_TS */
        values[i] = field(event, i);
        if (values[i] == NULL) return -1;
    }
    if (!as_i64(values[0], &head->worker_id)) return 0;
    if (!as_u64(values[1], &head->event_id)) return 0;
    if (!as_i64(values[2], &head->dp_rank)) return 0;
    /* a Tier (an int subclass) or a plain int naming one, as ``tier in _TIERS`` accepts */
    if (!PyLong_Check(values[3])) return 0;
    long tier = PyLong_AsLong(values[3]);
    if (tier < 1 || tier > 4) {
        PyErr_Clear();
        return 0;
    }
    head->tier = (unsigned char)tier;
    if (!PyFloat_CheckExact(values[4])) return 0;
    head->ts = PyFloat_AS_DOUBLE(values[4]);
    /* a NaN ts is a record's but not a log row's (SQLite stores it as NULL): left to Python,
     * whose row refuses it and whose record writes it */
    return head->ts == head->ts;
}

static unsigned char *put_head(unsigned char *p, unsigned char array, unsigned char kind,
                               const Head *head) {
    uint64_t ts_bits;
    memcpy(&ts_bits, &head->ts, sizeof ts_bits);
    *p++ = array;
    *p++ = VERSION;
    *p++ = kind;
    *p++ = INT64;
    p = put_u64(p, (uint64_t)head->worker_id);
    *p++ = UINT64;
    p = put_u64(p, head->event_id);
    *p++ = INT64;
    p = put_u64(p, (uint64_t)head->dp_rank);
    *p++ = head->tier;
    *p++ = FLOAT64;
    return put_u64(p, ts_bits);
}

/* The checksum field at ``p``: its tag, then the CRC-32 of the record from ``start`` up to
 * and including that tag (the CRC-32 of a whole record is then codec.CHECK_RESIDUE). */
static void put_check(unsigned char *start, unsigned char *p) {
    *p++ = CHECK_TAG;
    uint32_t crc = record_crc(start, (size_t)(p - start));
    p[0] = (unsigned char)crc;
    p[1] = (unsigned char)(crc >> 8);
    p[2] = (unsigned char)(crc >> 16);
    p[3] = (unsigned char)(crc >> 24);
}

static int is_sequence(PyObject *obj) { return PyTuple_CheckExact(obj) || PyList_CheckExact(obj); }

/* Each kind's record after its header is read, written where ``out`` reserves: 1, 0 where the
 * Python encoder is to run (what was written then does not count), or -1 with an exception. */
typedef int (*RecordWriter)(PyObject *event, const Head *head, RecordOut *out);

/* A stored event's record; with ``keep_tokens`` 0, as if its token ids were None (what a log
 * that must not hold prompts stores). */
static int stored_record_of(PyObject *event, const Head *head, RecordOut *out, int keep_tokens) {
    PyObject *parent = field(event, F_PARENT_HASH);
    PyObject *blocks = field(event, F_BLOCKS);
    PyObject *tokens = field(event, F_TOKEN_IDS);
    int result = -1;
    if (parent == NULL || blocks == NULL || tokens == NULL) goto done;

    uint64_t parent_hash = 0;
    int has_parent = parent != Py_None;
    if (has_parent && !as_u64(parent, &parent_hash)) goto slow;
    if (!is_sequence(blocks)) goto slow;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    if (n == 0 || n > 0x0FFFFFFF) goto slow;

    /* token ids: None, or n tuples of u32; their bin holds a count per block, then the ids */
    Py_ssize_t token_words = 0;
    int has_tokens = keep_tokens && tokens != Py_None;
    if (has_tokens) {
        if (!PyTuple_CheckExact(tokens) || PyTuple_GET_SIZE(tokens) != n) goto slow;
        token_words = n;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *ids = PyTuple_GET_ITEM(tokens, i);
            if (!PyTuple_CheckExact(ids)) goto slow;
            token_words += PyTuple_GET_SIZE(ids);
        }
        if (token_words > 0x3FFFFFFF) goto slow; /* the bin's u32 length */
    }

    Py_ssize_t size = HEADER_BYTES + (has_parent ? 9 : 1) + 5 + 16 * n +
                      (has_tokens ? 5 + 4 * token_words : 1) + 5;
    unsigned char *start = out->reserve(out, size);
    if (start == NULL) goto done;
    unsigned char *p = put_head(start, STORED_ARRAY, 1, head);
    if (has_parent) {
        *p++ = UINT64;
        p = put_u64(p, parent_hash);
    } else {
        *p++ = NIL;
    }
    *p++ = BIN32;
    p = put_u32(p, (uint32_t)(16 * n));
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = items[i];
        if (!is_sequence(block) || PySequence_Fast_GET_SIZE(block) != 2) goto slow;
        PyObject **pair = PySequence_Fast_ITEMS(block);
        uint64_t seq, local;
        if (!as_u64(pair[0], &seq) || !as_u64(pair[1], &local)) goto slow;
        p = put_u64(p, seq);
        p = put_u64(p, local);
    }
    if (has_tokens) {
        *p++ = BIN32;
        p = put_u32(p, (uint32_t)(4 * token_words));
        for (Py_ssize_t i = 0; i < n; i++)
            p = put_u32(p, (uint32_t)PyTuple_GET_SIZE(PyTuple_GET_ITEM(tokens, i)));
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *ids = PyTuple_GET_ITEM(tokens, i);
            Py_ssize_t m = PyTuple_GET_SIZE(ids);
            for (Py_ssize_t j = 0; j < m; j++) {
                uint64_t id;
                if (!as_u64(PyTuple_GET_ITEM(ids, j), &id) || id > 0xFFFFFFFFu) goto slow;
                p = put_u32(p, (uint32_t)id);
            }
        }
    } else {
        *p++ = NIL;
    }
    put_check(start, p);
    result = 1;
    goto done;
slow: /* not the plain case: the Python encoder runs */
    result = 0;
done:
    Py_XDECREF(parent);
    Py_XDECREF(blocks);
    Py_XDECREF(tokens);
    return result;
}

static int stored_record(PyObject *event, const Head *head, RecordOut *out) {
    return stored_record_of(event, head, out, 1);
}

static int stored_record_without_tokens(PyObject *event, const Head *head, RecordOut *out) {
    return stored_record_of(event, head, out, 0);
}

static int removed_record(PyObject *event, const Head *head, RecordOut *out) {
    PyObject *hashes = field(event, F_SEQUENCE_HASHES);
    if (hashes == NULL) return -1;
    int result = -1;
    if (!is_sequence(hashes)) goto slow;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (n == 0 || n > 0x1FFFFFFF) goto slow;
    unsigned char *start = out->reserve(out, HEADER_BYTES + 5 + 8 * n + 5);
    if (start == NULL) goto done;
    unsigned char *p = put_head(start, REMOVED_ARRAY, 2, head);
    *p++ = BIN32;
    p = put_u32(p, (uint32_t)(8 * n));
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t word;
        if (!as_u64(items[i], &word)) goto slow;
        p = put_u64(p, word);
    }
    put_check(start, p);
    result = 1;
    goto done;
slow: /* not the plain case: the Python encoder runs */
    result = 0;
done:
    Py_DECREF(hashes);
    return result;
}

/* An offloaded (kind 3) or onboarded (kind 4) event: the source tier, then a bin of
 * (seq, local, parent) words, then nil, or where some block has no parent a bin of one root
 * flag a block (its parent word is then 0). */
static int copied_record(PyObject *event, const Head *head, RecordOut *out, unsigned char kind) {
    PyObject *src = field(event, F_SRC_TIER);
    PyObject *blocks = field(event, F_BLOCKS);
    int result = -1;
    if (src == NULL || blocks == NULL) goto done;
    if (!PyLong_Check(src)) goto slow;
    long src_tier = PyLong_AsLong(src);
    if (src_tier < 1 || src_tier > 4 || src_tier == head->tier) {
        PyErr_Clear();
        goto slow;
    }
    if (!is_sequence(blocks)) goto slow;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    if (n == 0 || n > 0x0AAAAAAA) goto slow;
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    int has_roots = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = items[i]; /* a BlockInfo: a tuple of three */
        if (!PyTuple_Check(block) || PyTuple_GET_SIZE(block) != 3) goto slow;
        if (PyTuple_GET_ITEM(block, 2) == Py_None) has_roots = 1;
    }
    Py_ssize_t size = HEADER_BYTES + 1 + 5 + 24 * n + (has_roots ? 5 + n : 1) + 5;
    unsigned char *start = out->reserve(out, size);
    if (start == NULL) goto done;
    unsigned char *p = put_head(start, COPIED_ARRAY, kind, head);
    *p++ = (unsigned char)src_tier;
    *p++ = BIN32;
    p = put_u32(p, (uint32_t)(24 * n));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = items[i];
        PyObject *parent = PyTuple_GET_ITEM(block, 2);
        uint64_t seq, local, parent_hash = 0;
        if (!as_u64(PyTuple_GET_ITEM(block, 0), &seq) ||
            !as_u64(PyTuple_GET_ITEM(block, 1), &local) ||
            (parent != Py_None && !as_u64(parent, &parent_hash)))
            goto slow;
        p = put_u64(p, seq);
        p = put_u64(p, local);
        p = put_u64(p, parent_hash);
    }
    if (has_roots) {
        *p++ = BIN32;
        p = put_u32(p, (uint32_t)n);
        for (Py_ssize_t i = 0; i < n; i++) *p++ = PyTuple_GET_ITEM(items[i], 2) == Py_None;
    } else {
        *p++ = NIL;
    }
    put_check(start, p);
    result = 1;
    goto done;
slow: /* not the plain case: the Python encoder runs */
    result = 0;
done:
    Py_XDECREF(src);
    Py_XDECREF(blocks);
    return result;
}

static int offloaded_record(PyObject *event, const Head *head, RecordOut *out) {
    return copied_record(event, head, out, 3);
}

static int onboarded_record(PyObject *event, const Head *head, RecordOut *out) {
    return copied_record(event, head, out, 4);
}

/* A record in a bytes object of its own: what ``codec`` and the row functions return. */
typedef struct {
    RecordOut out;
    PyObject *bytes;
} BytesOut;

static unsigned char *reserve_bytes(RecordOut *out, Py_ssize_t size) {
    BytesOut *self = (BytesOut *)out;
    Py_XSETREF(self->bytes, PyBytes_FromStringAndSize(NULL, size));
    return self->bytes == NULL ? NULL : (unsigned char *)PyBytes_AS_STRING(self->bytes);
}

/* The header read into ``head`` (which the caller releases), then the record ``write`` makes:
 * bytes, None where the Python encoder is to run, or NULL with an exception. */
static PyObject *write_record(PyObject *event, RecordWriter write, Head *head) {
    int ok = read_head(event, head);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_None);
    BytesOut out = {{reserve_bytes}, NULL};
    ok = write(event, head, &out.out);
    if (ok > 0) return out.bytes;
    Py_XDECREF(out.bytes);
    return ok < 0 ? NULL : Py_NewRef(Py_None);
}

/* An event's record: bytes, or None where the Python encoder is to run. */
static PyObject *record_of(PyObject *event, RecordWriter write) {
    Head head;
    PyObject *record = write_record(event, write, &head);
    release_head(&head);
    return record;
}

/* An event's log row, (worker, event_id, kind, tier, ts, payload) as ``rows.to_row`` makes
 * it, or None where the Python encoder is to run. */
static PyObject *row_of(PyObject *event, RecordWriter write, PyObject *kind) {
    Head head;
    PyObject *record = write_record(event, write, &head);
    PyObject *row = record;
    if (record != NULL && record != Py_None) {
        PyObject *tier = PyLong_FromLong(head.tier);
        row = tier == NULL ? NULL
                           : PyTuple_Pack(6, head.values[0], head.values[1], kind, tier,
                                          head.values[4], record);
        /* ints, a str, a float and bytes: no cycle can pass through it, which the collector
         * would find at its first look and untrack it then. A row waits in the log's queue
         * until its commit, through several young collections; tracked, each walked it, and
         * the survivors it promoted brought the full collections sooner (a logged simulation
         * spent 5% of its samples in the collector, against 1.6% unlogged). */
        if (row != NULL) PyObject_GC_UnTrack(row);
        Py_XDECREF(tier);
        Py_DECREF(record);
    }
    release_head(&head);
    return row;
}

/* ``RecordsAPI.encode`` (records.h): the record written where ``out`` reserves, for an append
 * buffer's queue, with the row's other columns as C values. */
static int encode_into(PyObject *event, int kind, RecordOut *out, RecordColumns *columns) {
    static const RecordWriter writers[] = {
        NULL, stored_record, removed_record, offloaded_record, onboarded_record,
        stored_record_without_tokens,
    };
    if (kind < KIND_STORED || kind > KIND_STORED_WITHOUT_TOKENS) {
        PyErr_Format(PyExc_ValueError, "no compiled encoder for record kind %d", kind);
        return -1;
    }
    Head head;
    int ok = read_head(event, &head);
    if (ok > 0 && head.event_id > (uint64_t)INT64_MAX) ok = 0; /* the Python path refuses it */
    if (ok > 0) ok = writers[kind](event, &head, out);
    if (ok > 0) {
        columns->worker = head.worker_id;
        columns->event_id = (int64_t)head.event_id;
        columns->ts = head.ts;
        columns->tier = head.tier;
    }
    release_head(&head);
    return ok;
}

static RecordsAPI records_api = {RECORDS_API_VERSION, encode_into};

static PyObject *s_stored, *s_removed, *s_offloaded, *s_onboarded; /* the kind column's values */

static PyObject *stored(PyObject *Py_UNUSED(module), PyObject *event) {
    return record_of(event, stored_record);
}

static PyObject *stored_row(PyObject *Py_UNUSED(module), PyObject *event) {
    return row_of(event, stored_record, s_stored);
}

static PyObject *stored_row_without_tokens(PyObject *Py_UNUSED(module), PyObject *event) {
    return row_of(event, stored_record_without_tokens, s_stored);
}

static PyObject *removed(PyObject *Py_UNUSED(module), PyObject *event) {
    return record_of(event, removed_record);
}

static PyObject *removed_row(PyObject *Py_UNUSED(module), PyObject *event) {
    return row_of(event, removed_record, s_removed);
}

static PyObject *offloaded(PyObject *Py_UNUSED(module), PyObject *event) {
    return record_of(event, offloaded_record);
}

static PyObject *offloaded_row(PyObject *Py_UNUSED(module), PyObject *event) {
    return row_of(event, offloaded_record, s_offloaded);
}

static PyObject *onboarded(PyObject *Py_UNUSED(module), PyObject *event) {
    return record_of(event, onboarded_record);
}

static PyObject *onboarded_row(PyObject *Py_UNUSED(module), PyObject *event) {
    return row_of(event, onboarded_record, s_onboarded);
}

#define RECORD_DOC(kind) "A " kind " event's version-3 record, or None where the Python encoder must run."
#define ROW_DOC(kind) "A " kind " event's log row, or None where the Python encoder must run."
static PyMethodDef methods[] = {
    {"stored", stored, METH_O, RECORD_DOC("Stored")},
    {"removed", removed, METH_O, RECORD_DOC("Removed")},
    {"offloaded", offloaded, METH_O, RECORD_DOC("Offloaded")},
    {"onboarded", onboarded, METH_O, RECORD_DOC("Onboarded")},
    {"stored_row", stored_row, METH_O, ROW_DOC("Stored")},
    {"stored_row_without_tokens", stored_row_without_tokens, METH_O,
     "A Stored event's log row with its token ids left out, or None where the Python encoder "
     "must run."},
    {"removed_row", removed_row, METH_O, ROW_DOC("Removed")},
    {"offloaded_row", offloaded_row, METH_O, ROW_DOC("Offloaded")},
    {"onboarded_row", onboarded_row, METH_O, ROW_DOC("Onboarded")},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvledger.events._speedups",
    "Compiled encoders of the log's hot record kinds (see codec).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    make_crc_table();
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(field_names[F_WORKER_ID], "worker_id");
    INTERN(field_names[F_EVENT_ID], "event_id");
    INTERN(field_names[F_DP_RANK], "dp_rank");
    INTERN(field_names[F_TIER], "tier");
    INTERN(field_names[F_TS], "ts");
    INTERN(field_names[F_PARENT_HASH], "parent_hash");
    INTERN(field_names[F_BLOCKS], "blocks");
    INTERN(field_names[F_TOKEN_IDS], "token_ids");
    INTERN(field_names[F_SEQUENCE_HASHES], "sequence_hashes");
    INTERN(field_names[F_SRC_TIER], "src_tier");
    INTERN(s_stored, "stored");
    INTERN(s_removed, "removed");
    INTERN(s_offloaded, "offloaded");
    INTERN(s_onboarded, "onboarded");
#undef INTERN
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *api = PyCapsule_New(&records_api, RECORDS_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(m, "records_api", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
