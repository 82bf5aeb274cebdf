/* The SQLite log's two hot paths, compiled: the writer's batch commit (``Writer``: one
 * transaction of single-row INSERTs run with the interpreter's lock released for the whole
 * batch) and replay's read (``Reader``: a chunk of rows stepped without the lock into a few flat
 * arrays, never a Python object per row).
 *
 * Why the writer: Python's sqlite3 gives the GIL up around each statement it steps and must
 * take it back to bind the next one. Beside a producer thread that runs flat out (an engine
 * appending one event at a time), every take waits up to the switch interval, so the writer's
 * pace, and
 * with it the back-pressure the producer feels, was set by those waits rather than by SQLite:
 * a 512-row INSERT thread beside a spinning one did 46k rows/s against 466k alone. Here the
 * rows are read into C once, with the lock held (a pointer and a length per column: nothing
 * is copied), then the lock is given up once and every row is bound and stepped without it.
 *
 * Why the reader: replay folds whole chunks of rows with array operations
 * (``events/chunk_decode.py``), but Python's sqlite3 hands each row over as a tuple of an int,
 * a float and a bytes object, four objects a row that replay only takes apart again: building
 * and reading them was most of a replay's time. Here each chunk comes back as five buffers:
 * the positions (int64), the ``ts`` column (float64), the payloads end to end, where each ends
 * (int64), and each payload's CRC-32 (uint32, zlib's polynomial: what a version-3 record's
 * checksum check needs, computed while its bytes are at hand).
 *
 * Which SQLite: the one Python's own ``sqlite3`` module runs, found by its symbols in the
 * ``_sqlite3`` extension already loaded (or in what that extension links to), never a second
 * copy: two copies of SQLite in one process keep separate POSIX lock tables, and one closing
 * a file drops the other's locks (SQLite's "How To Corrupt" notes, 2.2.1). Nothing is linked
 * at build time, so no SQLite headers are needed either; the few calls used are declared
 * below with SQLite's stable C signatures.
 *
 * Errors are raised as ``sqlite3``'s own exception classes with SQLite's own message, chosen
 * by the result code as ``sqlite3`` chooses them, so the log's outage and failure handling
 * (``events/log/core.py``, which looks at PEP 249 categories and the driver's words) treats
 * both writers alike. A row that is not exactly (int, int, str, int, float, bytes) is refused
 * with TypeError before anything is written. A batch's item is such a row or a block of rows
 * (events/log/rowblock.h: an append buffer's batch in flat memory), bound from its arrays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "../crc32.h"
#include "rowblock.h"
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* SQLite's C API: the handful of entry points and codes used here. */
typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;
#define SQLITE_OK 0
#define SQLITE_ERROR 1
#define SQLITE_INTERNAL 2
#define SQLITE_PERM 3
#define SQLITE_ABORT 4
#define SQLITE_BUSY 5
#define SQLITE_LOCKED 6
#define SQLITE_NOMEM 7
#define SQLITE_READONLY 8
#define SQLITE_INTERRUPT 9
#define SQLITE_IOERR 10
#define SQLITE_CORRUPT 11
#define SQLITE_NOTFOUND 12
#define SQLITE_FULL 13
#define SQLITE_CANTOPEN 14
#define SQLITE_PROTOCOL 15
#define SQLITE_EMPTY 16
#define SQLITE_SCHEMA 17
#define SQLITE_TOOBIG 18
#define SQLITE_CONSTRAINT 19
#define SQLITE_MISMATCH 20
#define SQLITE_MISUSE 21
#define SQLITE_RANGE 25
#define SQLITE_ROW 100
#define SQLITE_DONE 101
#define SQLITE_OPEN_READONLY 0x00000001
#define SQLITE_OPEN_READWRITE 0x00000002
#define SQLITE_STATIC ((void (*)(void *))0)

static struct {
    int (*open_v2)(const char *, sqlite3 **, int, const char *);
    int (*close_v2)(sqlite3 *);
    int (*busy_timeout)(sqlite3 *, int);
    int (*exec)(sqlite3 *, const char *, void *, void *, char **);
    int (*prepare_v2)(sqlite3 *, const char *, int, sqlite3_stmt **, const char **);
    int (*bind_int64)(sqlite3_stmt *, int, long long);
    int (*bind_double)(sqlite3_stmt *, int, double);
    int (*bind_text)(sqlite3_stmt *, int, const char *, int, void (*)(void *));
    int (*bind_blob)(sqlite3_stmt *, int, const void *, int, void (*)(void *));
    int (*step)(sqlite3_stmt *);
    int (*reset)(sqlite3_stmt *);
    int (*finalize)(sqlite3_stmt *);
    int (*errcode)(sqlite3 *);
    const char *(*errmsg)(sqlite3 *);
    int (*get_autocommit)(sqlite3 *);
    int (*libversion_number)(void);
    long long (*column_int64)(sqlite3_stmt *, int);
    double (*column_double)(sqlite3_stmt *, int);
    const void *(*column_blob)(sqlite3_stmt *, int);
    int (*column_bytes)(sqlite3_stmt *, int);
    int (*column_count)(sqlite3_stmt *);
} api;

static PyObject *sqlite_module; /* ``sqlite3``: its exception classes */

/* sqlite3's own choice of exception class for a result code (Modules/_sqlite/util.c). */
static PyObject *error_class(int code) {
    const char *name;
    switch (code & 0xFF) {
    case SQLITE_INTERNAL:
    case SQLITE_NOTFOUND:
        name = "InternalError";
        break;
    case SQLITE_NOMEM:
        return PyExc_MemoryError;
    case SQLITE_ERROR:
    case SQLITE_PERM:
    case SQLITE_ABORT:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_READONLY:
    case SQLITE_INTERRUPT:
    case SQLITE_IOERR:
    case SQLITE_FULL:
    case SQLITE_CANTOPEN:
    case SQLITE_PROTOCOL:
    case SQLITE_EMPTY:
    case SQLITE_SCHEMA:
        name = "OperationalError";
        break;
    case SQLITE_CORRUPT:
        name = "DatabaseError";
        break;
    case SQLITE_TOOBIG:
        name = "DataError";
        break;
    case SQLITE_CONSTRAINT:
    case SQLITE_MISMATCH:
        name = "IntegrityError";
        break;
    case SQLITE_MISUSE:
    case SQLITE_RANGE:
        name = "InterfaceError";
        break;
    default:
        name = "DatabaseError";
    }
    PyObject *cls = PyObject_GetAttrString(sqlite_module, name);
    if (cls == NULL) return NULL;
    Py_DECREF(cls); /* the module keeps it alive */
    return cls;
}

/* Raise the error for ``code`` with ``message`` (SQLite's words); returns NULL. */
static PyObject *raise_error(int code, const char *message) {
    PyObject *cls = error_class(code);
    if (cls != NULL) PyErr_SetString(cls, message);
    return NULL;
}

/* A failed call's result code (the connection's extended code where it has one), its message
 * copied into ``message``: what ``raise_error`` turns into sqlite3's exception once the GIL is
 * back (the message buffer outlives the connection's own). */
static int failure(sqlite3 *db, int rc, char *message, size_t size) {
    snprintf(message, size, "%s", api.errmsg(db));
    return api.errcode(db) != SQLITE_OK ? api.errcode(db) : rc;
}

/* -- a connection: what the writer and the reader share ------------------------------------- */

/* One connection and its one prepared statement (the writer's INSERT, the reader's SELECT);
 * ``done``: the reader stepped its statement to the end. */
typedef struct {
    PyObject_HEAD
    sqlite3 *db;
    sqlite3_stmt *stmt;
    int done;
} Connection;

static void close_connection(Connection *self) {
    sqlite3 *db = self->db;
    sqlite3_stmt *st = self->stmt;
    self->db = NULL;
    self->stmt = NULL;
    if (db == NULL) return;
    Py_BEGIN_ALLOW_THREADS
    if (st != NULL) api.finalize(st);
    api.close_v2(db); /* the last connection to a WAL file checkpoints it */
    Py_END_ALLOW_THREADS
}

/* Open ``path`` with ``flags``, run each of ``pragmas`` (NULL-terminated) and prepare ``sql``:
 * 0, or -1 with sqlite3's error raised (a ValueError where ``columns`` is not -1 and the
 * statement has another number of columns) and nothing left open. */
static int open_connection(Connection *self, const char *path, int flags, int busy_ms,
                           const char *const *pragmas, const char *sql, int columns) {
    close_connection(self);
    self->done = 0;
    char message[512];
    sqlite3 *db = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = api.open_v2(path, &db, flags, NULL);
    if (db != NULL) {
        self->db = db;
        if (rc == SQLITE_OK) rc = api.busy_timeout(db, busy_ms);
        for (const char *const *pragma = pragmas; rc == SQLITE_OK && *pragma; pragma++)
            rc = api.exec(db, *pragma, NULL, NULL, NULL);
        if (rc == SQLITE_OK) rc = api.prepare_v2(db, sql, -1, &self->stmt, NULL);
        if (rc != SQLITE_OK) rc = failure(db, rc, message, sizeof message);
    } else {
        snprintf(message, sizeof message, "out of memory opening %s", path);
    }
    Py_END_ALLOW_THREADS
    if (rc == SQLITE_OK && columns >= 0 && api.column_count(self->stmt) != columns) {
        close_connection(self);
        PyErr_SetString(PyExc_ValueError, "the reader's SELECT must name id, ts and payload");
        return -1;
    }
    if (rc != SQLITE_OK) {
        close_connection(self);
        raise_error(rc, message);
        return -1;
    }
    return 0;
}

/* 1 when open; 0 with sqlite3's error for a closed connection raised. */
static int check_open(Connection *self) {
    if (self->db != NULL) return 1;
    raise_error(SQLITE_MISUSE, "Cannot operate on a closed database.");
    return 0;
}

static PyObject *Connection_close(Connection *self, PyObject *Py_UNUSED(ignored)) {
    close_connection(self);
    Py_RETURN_NONE;
}

static void Connection_dealloc(Connection *self) {
    close_connection(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Connection_enter(Connection *self, PyObject *Py_UNUSED(ignored)) {
    return Py_NewRef(self);
}

static PyObject *Connection_exit(Connection *self, PyObject *Py_UNUSED(args)) {
    close_connection(self);
    Py_RETURN_FALSE;
}

static PyMethodDef Connection_methods[] = {
    {"close", (PyCFunction)Connection_close, METH_NOARGS, "Close the connection (again: no-op)."},
    {"__enter__", (PyCFunction)Connection_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Connection_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ConnectionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvledger.events.log._sqlite.Connection",
    .tp_basicsize = sizeof(Connection),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A connection to a log file and its one statement (the Writer's, the Reader's).",
    .tp_dealloc = (destructor)Connection_dealloc,
    .tp_methods = Connection_methods,
};

/* -- the writer ---------------------------------------------------------------------------- */

/* A log row's columns, read out of its tuple: what the INSERT binds. */
typedef struct {
    long long worker, event_id, tier;
    double ts;
    const char *kind, *payload;
    Py_ssize_t kind_len, payload_len;
} Row;

static int as_int64(PyObject *obj, long long *out) {
    if (!PyLong_CheckExact(obj)) return 0;
    *out = PyLong_AsLongLong(obj);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "Python int too large to convert to SQLite INTEGER");
        return -1;
    }
    return 1;
}

/* Fill ``row`` from a log row tuple; 0 with TypeError or OverflowError set when it is not one. */
static int read_row(PyObject *item, Row *row) {
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 6) goto wrong;
    PyObject *kind = PyTuple_GET_ITEM(item, 2), *ts = PyTuple_GET_ITEM(item, 4);
    PyObject *payload = PyTuple_GET_ITEM(item, 5);
    if (!PyUnicode_CheckExact(kind) || !PyFloat_CheckExact(ts) || !PyBytes_CheckExact(payload))
        goto wrong;
    int ok = as_int64(PyTuple_GET_ITEM(item, 0), &row->worker);
    if (ok > 0) ok = as_int64(PyTuple_GET_ITEM(item, 1), &row->event_id);
    if (ok > 0) ok = as_int64(PyTuple_GET_ITEM(item, 3), &row->tier);
    if (ok < 0) return 0;
    if (ok == 0) goto wrong;
    row->kind = PyUnicode_AsUTF8AndSize(kind, &row->kind_len); /* cached in the str */
    if (row->kind == NULL) return 0;
    row->ts = PyFloat_AS_DOUBLE(ts);
    row->payload = PyBytes_AS_STRING(payload);
    row->payload_len = PyBytes_GET_SIZE(payload);
    if (row->payload_len > INT32_MAX || row->kind_len > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a log row's column is over 2 GiB");
        return 0;
    }
    return 1;
wrong:
    PyErr_Format(PyExc_TypeError,
                 "a log row is a tuple (worker: int, event_id: int, kind: str, tier: int, "
                 "ts: float, payload: bytes), got %R",
                 item);
    return 0;
}

/* Bind and step every row, inside BEGIN ... COMMIT; SQLITE_OK or the failing call's code,
 * with the transaction rolled back and the message copied into ``message``. Runs without
 * the GIL: it reads only ``rows`` and the connection. */
static int insert_all(Connection *self, const Row *rows, Py_ssize_t n, char *message, size_t size) {
    sqlite3 *db = self->db;
    sqlite3_stmt *st = self->stmt;
    int rc = api.exec(db, "BEGIN", NULL, NULL, NULL);
    for (Py_ssize_t i = 0; rc == SQLITE_OK && i < n; i++) {
        const Row *r = &rows[i];
        rc = api.bind_int64(st, 1, r->worker);
        if (rc == SQLITE_OK) rc = api.bind_int64(st, 2, r->event_id);
        if (rc == SQLITE_OK) rc = api.bind_text(st, 3, r->kind, (int)r->kind_len, SQLITE_STATIC);
        if (rc == SQLITE_OK) rc = api.bind_int64(st, 4, r->tier);
        if (rc == SQLITE_OK) rc = api.bind_double(st, 5, r->ts);
        if (rc == SQLITE_OK)
            rc = api.bind_blob(st, 6, r->payload, (int)r->payload_len, SQLITE_STATIC);
        if (rc == SQLITE_OK) {
            rc = api.step(st);
            rc = rc == SQLITE_DONE ? SQLITE_OK : rc;
        }
        int reset = api.reset(st);
        if (rc == SQLITE_OK) rc = reset;
    }
    if (rc == SQLITE_OK) rc = api.exec(db, "COMMIT", NULL, NULL, NULL);
    if (rc == SQLITE_OK) return rc;
    rc = failure(db, rc, message, size);
    if (!api.get_autocommit(db)) api.exec(db, "ROLLBACK", NULL, NULL, NULL);
    return rc;
}

/* ``_gather.RowBlock`` (NULL where that module is not built: no block can come then). */
static PyTypeObject *block_type(void) {
    static PyTypeObject *type;
    if (type == NULL) {
        PyObject *module = PyImport_ImportModule("kvledger.events.log._gather");
        if (module == NULL) {
            PyErr_Clear();
            return NULL;
        }
        PyObject *found = PyObject_GetAttrString(module, "RowBlock");
        Py_DECREF(module);
        if (found == NULL || !PyType_Check(found)) {
            Py_XDECREF(found);
            PyErr_Clear();
            return NULL;
        }
        type = (PyTypeObject *)found; /* kept: the module stays loaded */
    }
    return type;
}

/* The block of rows ``item`` is, NULL when it is none (no exception). */
static RowBlock *as_block(PyObject *item) {
    if (PyTuple_CheckExact(item)) return NULL;
    PyTypeObject *type = block_type();
    return type != NULL && Py_IS_TYPE(item, type) ? (RowBlock *)item : NULL;
}

/* Fill ``rows`` from a block's; 0 with TypeError when some row is still an object. */
static int read_block(RowBlock *block, Row *rows) {
    if (block->objects_left > 0) {
        PyErr_SetString(PyExc_TypeError, "a block of log rows holds events not yet encoded");
        return 0;
    }
    for (Py_ssize_t i = 0; i < block->n; i++) {
        const BlockRow *b = &block->rows[i];
        Row *row = &rows[i];
        if (b->kind == 0 || b->kind >= BLOCK_KINDS || b->size > INT32_MAX) {
            PyErr_SetString(PyExc_TypeError, "a block of log rows holds a row it cannot bind");
            return 0;
        }
        row->worker = b->worker;
        row->event_id = b->event_id;
        row->tier = b->tier;
        row->ts = b->ts;
        row->kind = BLOCK_KIND_NAMES[b->kind];
        row->kind_len = (Py_ssize_t)strlen(row->kind);
        row->payload = (const char *)block->bytes + b->offset;
        row->payload_len = b->size;
    }
    return 1;
}

static PyObject *Writer_commit(Connection *self, PyObject *batch) {
    if (!check_open(self)) return NULL;
    if (!PyList_CheckExact(batch)) {
        PyErr_SetString(PyExc_TypeError, "commit takes a list of log rows");
        return NULL;
    }
    Py_ssize_t items = PyList_GET_SIZE(batch), n = 0;
    for (Py_ssize_t i = 0; i < items; i++) {
        RowBlock *block = as_block(PyList_GET_ITEM(batch, i));
        n += block != NULL ? block->n : 1;
    }
    if (n == 0) Py_RETURN_NONE;
    Row *rows = PyMem_Malloc((size_t)n * sizeof(Row));
    if (rows == NULL) return PyErr_NoMemory();
    /* the rows' objects stay alive through ``batch``, which the caller holds through the call
     * and no other thread holds at all, and the tuple items it references are immutable, as is
     * a block once its queue handed it over: their buffers are read below without the GIL */
    for (Py_ssize_t i = 0, at = 0; i < items; i++) {
        PyObject *item = PyList_GET_ITEM(batch, i);
        RowBlock *block = as_block(item);
        int ok = block != NULL ? read_block(block, &rows[at]) : read_row(item, &rows[at]);
        if (!ok) {
            PyMem_Free(rows);
            return NULL;
        }
        at += block != NULL ? block->n : 1;
    }
    char message[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = insert_all(self, rows, n, message, sizeof message);
    Py_END_ALLOW_THREADS
    PyMem_Free(rows);
    if (rc != SQLITE_OK) return raise_error(rc, message);
    Py_RETURN_NONE;
}

/* Writer(path, synchronous, busy_timeout_ms, insert_sql): a connection to an existing log
 * file, in WAL mode at the durability's ``synchronous`` level, with ``insert_sql`` (one row,
 * six ``?`` parameters in the row's column order) prepared. */
static int Writer_init(Connection *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"path", "synchronous", "busy_timeout_ms", "insert_sql", NULL};
    const char *path, *synchronous, *insert_sql;
    int busy_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ssis", names, &path, &synchronous, &busy_ms,
                                     &insert_sql))
        return -1;
    if (strcmp(synchronous, "OFF") && strcmp(synchronous, "NORMAL") &&
        strcmp(synchronous, "FULL")) {
        PyErr_Format(PyExc_ValueError, "synchronous must be OFF, NORMAL or FULL, got %s",
                     synchronous);
        return -1;
    }
    char pragma[64];
    snprintf(pragma, sizeof pragma, "PRAGMA synchronous=%s", synchronous);
    const char *const pragmas[] = {"PRAGMA journal_mode=WAL", pragma, NULL};
    return open_connection(self, path, SQLITE_OPEN_READWRITE, busy_ms, pragmas, insert_sql, -1);
}

static PyMethodDef Writer_methods[] = {
    {"commit", (PyCFunction)Writer_commit, METH_O,
     "Insert the rows as one transaction, the GIL released while SQLite works."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvledger.events.log._sqlite.Writer",
    .tp_basicsize = sizeof(Connection),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A connection that commits a batch of log rows with the GIL released.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Writer_init,
    .tp_methods = Writer_methods,
};

/* -- the reader ---------------------------------------------------------------------------- */

/* Reader(path, sql, busy_timeout_ms): a read-only connection to the log file at ``path``, with
 * ``sql`` (a SELECT of id, ts, payload, in the order to read) prepared; nothing read yet. */
static int Reader_init(Connection *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"path", "sql", "busy_timeout_ms", NULL};
    const char *path, *sql;
    int busy_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ssi", names, &path, &sql, &busy_ms)) return -1;
    const char *const pragmas[] = {NULL};
    return open_connection(self, path, SQLITE_OPEN_READONLY, busy_ms, pragmas, sql, 3);
}

typedef struct {
    int64_t *positions, *ends;
    double *ts;
    uint32_t *crcs;
    unsigned char *data;
    size_t rows, size, room;
} Chunk;

static void free_chunk(Chunk *c) {
    free(c->positions);
    free(c->ends);
    free(c->ts);
    free(c->crcs);
    free(c->data);
}

/* Step up to ``max_rows`` rows into ``c`` (no GIL): SQLITE_DONE at the end, SQLITE_ROW when
 * the chunk is full, SQLITE_NOMEM, or the failing step's code with its message copied. */
static int step_rows(Connection *self, Chunk *c, size_t max_rows, char *message, size_t size) {
    sqlite3_stmt *st = self->stmt;
    while (c->rows < max_rows) {
        int rc = api.step(st);
        if (rc == SQLITE_DONE) return rc;
        if (rc != SQLITE_ROW) return failure(self->db, rc, message, size);
        const unsigned char *payload = api.column_blob(st, 2);
        size_t n = (size_t)api.column_bytes(st, 2);
        if (c->size + n > c->room) {
            size_t room = c->room ? c->room : 1 << 20;
            while (room < c->size + n) room *= 2;
            unsigned char *data = realloc(c->data, room);
            if (data == NULL) return SQLITE_NOMEM;
            c->data = data;
            c->room = room;
        }
        if (n) memcpy(c->data + c->size, payload, n);
        size_t i = c->rows++;
        c->positions[i] = api.column_int64(st, 0);
        c->ts[i] = api.column_double(st, 1);
        c->crcs[i] = n ? record_crc(payload, n) : 0;
        c->size += n;
        c->ends[i] = (int64_t)c->size;
    }
    return SQLITE_ROW;
}

/* read(max_rows): the next chunk of up to ``max_rows`` rows as five bytes objects (positions
 * int64, ts float64, the payloads end to end, their end offsets int64, their CRC-32s uint32,
 * all native-endian), or None once every row was read. */
static PyObject *Reader_read(Connection *self, PyObject *arg) {
    Py_ssize_t max_rows = PyLong_AsSsize_t(arg);
    if (max_rows == -1 && PyErr_Occurred()) return NULL;
    if (max_rows < 1) {
        PyErr_SetString(PyExc_ValueError, "max_rows must be at least 1");
        return NULL;
    }
    if (!check_open(self)) return NULL;
    if (self->done) Py_RETURN_NONE;
    Chunk c = {0};
    size_t n = (size_t)max_rows;
    c.positions = malloc(n * sizeof(int64_t));
    c.ends = malloc(n * sizeof(int64_t));
    c.ts = malloc(n * sizeof(double));
    c.crcs = malloc(n * sizeof(uint32_t));
    if (!c.positions || !c.ends || !c.ts || !c.crcs) {
        free_chunk(&c);
        return PyErr_NoMemory();
    }
    char message[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = step_rows(self, &c, n, message, sizeof message);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (rc == SQLITE_NOMEM) {
        PyErr_NoMemory();
    } else if (rc != SQLITE_ROW && rc != SQLITE_DONE) {
        raise_error(rc, message);
    } else {
        self->done = rc == SQLITE_DONE;
        if (c.rows == 0) {
            out = Py_NewRef(Py_None);
        } else {
            /* no payload bytes at all (damaged rows) leave ``data`` NULL, which y# makes None */
            const char *data = c.data != NULL ? (const char *)c.data : "";
            out = Py_BuildValue("(y#y#y#y#y#)", (char *)c.positions,
                                (Py_ssize_t)(c.rows * sizeof(int64_t)), (char *)c.ts,
                                (Py_ssize_t)(c.rows * sizeof(double)), data,
                                (Py_ssize_t)c.size, (char *)c.ends,
                                (Py_ssize_t)(c.rows * sizeof(int64_t)), (char *)c.crcs,
                                (Py_ssize_t)(c.rows * sizeof(uint32_t)));
        }
    }
    free_chunk(&c);
    return out;
}

static PyMethodDef Reader_methods[] = {
    {"read", (PyCFunction)Reader_read, METH_O,
     "The next chunk of rows as five flat buffers, or None at the end."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvledger.events.log._sqlite.Reader",
    .tp_basicsize = sizeof(Connection),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A read-only connection that reads log rows a chunk at a time into flat buffers.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_methods = Reader_methods,
};

/* Resolve the API from the SQLite that ``_sqlite3`` runs; 0 with ImportError set if not. */
static int bind_api(void) {
    PyObject *ext = PyImport_ImportModule("_sqlite3");
    if (ext == NULL) return 0;
    PyObject *file = PyObject_GetAttrString(ext, "__file__");
    Py_DECREF(ext);
    void *handle;
    if (file == NULL) { /* built into the interpreter: its symbols are the program's */
        PyErr_Clear();
        handle = dlopen(NULL, RTLD_NOW);
    } else {
        const char *path = PyUnicode_AsUTF8(file);
        handle = path == NULL ? NULL : dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        Py_DECREF(file);
        if (PyErr_Occurred()) return 0;
    }
    if (handle == NULL) {
        PyErr_Format(PyExc_ImportError, "the sqlite3 module's library is not loaded: %s",
                     dlerror());
        return 0;
    }
    struct {
        void **slot;
        const char *name;
    } wanted[] = {
        {(void **)&api.open_v2, "sqlite3_open_v2"},
        {(void **)&api.close_v2, "sqlite3_close_v2"},
        {(void **)&api.busy_timeout, "sqlite3_busy_timeout"},
        {(void **)&api.exec, "sqlite3_exec"},
        {(void **)&api.prepare_v2, "sqlite3_prepare_v2"},
        {(void **)&api.bind_int64, "sqlite3_bind_int64"},
        {(void **)&api.bind_double, "sqlite3_bind_double"},
        {(void **)&api.bind_text, "sqlite3_bind_text"},
        {(void **)&api.bind_blob, "sqlite3_bind_blob"},
        {(void **)&api.step, "sqlite3_step"},
        {(void **)&api.reset, "sqlite3_reset"},
        {(void **)&api.finalize, "sqlite3_finalize"},
        {(void **)&api.errcode, "sqlite3_extended_errcode"},
        {(void **)&api.errmsg, "sqlite3_errmsg"},
        {(void **)&api.get_autocommit, "sqlite3_get_autocommit"},
        {(void **)&api.libversion_number, "sqlite3_libversion_number"},
        {(void **)&api.column_int64, "sqlite3_column_int64"},
        {(void **)&api.column_double, "sqlite3_column_double"},
        {(void **)&api.column_blob, "sqlite3_column_blob"},
        {(void **)&api.column_bytes, "sqlite3_column_bytes"},
        {(void **)&api.column_count, "sqlite3_column_count"},
    };
    for (size_t i = 0; i < sizeof wanted / sizeof wanted[0]; i++) {
        *wanted[i].slot = dlsym(handle, wanted[i].name);
        if (*wanted[i].slot == NULL) {
            PyErr_Format(PyExc_ImportError, "%s is not exported by the sqlite3 module's SQLite",
                         wanted[i].name);
            return 0;
        }
    }
    return 1;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvledger.events.log._sqlite",
    .m_doc = "The SQLite log's batch commit and chunk read, without the GIL (see the source).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__sqlite(void) {
    sqlite_module = PyImport_ImportModule("sqlite3");
    if (sqlite_module == NULL || !bind_api()) return NULL;
    WriterType.tp_base = ReaderType.tp_base = &ConnectionType;
    if (PyType_Ready(&ConnectionType) < 0 || PyType_Ready(&WriterType) < 0 ||
        PyType_Ready(&ReaderType) < 0)
        return NULL;
    make_crc_table();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Writer", (PyObject *)&WriterType) < 0 ||
        PyModule_AddObjectRef(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddObjectRef(m, "Connection", (PyObject *)&ConnectionType) < 0 ||
        PyModule_AddIntConstant(m, "sqlite_version_number", api.libversion_number()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
