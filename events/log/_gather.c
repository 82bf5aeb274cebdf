/* ``Gather``: an ``AppendBuffer``'s queue, and the producer's side of its hand-over, compiled.
 *
 * Why: an engine hands its log every event it makes, one call each. In Python that call takes
 * the buffer's lock, checks that the buffer is open, reads the clock and extends a list (about
 * a microsecond an event on the engine's thread), and the events then wait in the list until
 * their batch is full. Waiting events are live objects the collector tracks: a batch of 256
 * brought a young collection about once a batch, 17 ms of a 0.3 s engine-off simulation
 * (bench/simulate_bench.py). Here the call encodes the event at once (``kinds``: the record
 * kind of each type the compiled encoders take, events/records.h) into the batch's block of
 * rows (events/log/rowblock.h: the records end to end in one buffer, no Python object per
 * row), with the interpreter held: an atomic step for every other Python thread, so no lock
 * is needed. The event itself is kept only while someone wants the events (``keep_events``:
 * the log has commit sinks). An event no compiled encoder takes is queued as it is, and
 * encoded (or refused) in Python at the hand-over (``RowBlock.encode_objects``).
 *
 * The rules are ``AppendBuffer``'s: an item joins the queue behind every earlier one; the
 * queue is handed over (``on_full()``) once it holds ``batch_size`` items or its oldest has
 * waited ``max_hold`` seconds; the first item of an empty queue sets ``since`` and calls
 * ``on_start(now)``; while ``blocked`` (the buffer closed, or a failed hand-over to report)
 * every call goes to ``slow(events)``, the buffer's Python path. ``take()`` empties the queue,
 * handing its block over; the buffer calls it under its own lock. ``since`` is on ``time.monotonic()``'s clock
 * (CLOCK_MONOTONIC, which Python reads on Linux).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>
#include <limits.h>
#include <string.h>
#include "../records.h"
#include "rowblock.h"

/* -- a block of rows ------------------------------------------------------------------------ */

static PyTypeObject RowBlockType;
static PyObject *kind_names[BLOCK_KINDS]; /* the kind column's values, interned */

#define FIRST_ROWS 1024
#define FIRST_BYTES 4096

/* An empty block with room for ``rows`` rows and ``bytes`` bytes of records. */
static RowBlock *block_new(Py_ssize_t rows, Py_ssize_t bytes) {
    RowBlock *block = PyObject_New(RowBlock, &RowBlockType);
    if (block == NULL) return NULL;
    block->n = block->used = block->objects_left = 0;
    block->objects = NULL;
    block->capacity = rows;
    block->room = bytes;
    block->rows = PyMem_RawMalloc((size_t)rows * sizeof(BlockRow));
    block->bytes = PyMem_RawMalloc((size_t)bytes);
    if (block->rows == NULL || block->bytes == NULL) {
        Py_DECREF(block);
        PyErr_NoMemory();
        return NULL;
    }
    return block;
}

static void block_dealloc(RowBlock *self) {
    PyMem_RawFree(self->rows);
    PyMem_RawFree(self->bytes);
    Py_XDECREF(self->objects);
    PyObject_Free(self);
}

/* The next row's slot, the array grown when full; NULL with MemoryError. */
static BlockRow *block_next_row(RowBlock *self) {
    if (self->n == self->capacity) {
        if (self->capacity > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(BlockRow)) {
            PyErr_NoMemory();
            return NULL;
        }
        BlockRow *rows = PyMem_RawRealloc(self->rows, 2 * (size_t)self->capacity * sizeof(BlockRow));
        if (rows == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->rows = rows;
        self->capacity *= 2;
    }
    return &self->rows[self->n];
}

/* ``size`` bytes at the end of the records, the buffer grown by doubling; NULL with
 * MemoryError. Nothing counts as used until the row that holds them is added. */
static unsigned char *block_reserve(RowBlock *self, Py_ssize_t size) {
    if (size > PY_SSIZE_T_MAX / 2 - self->used) {
        PyErr_NoMemory();
        return NULL;
    }
    if (self->used + size > self->room) {
        Py_ssize_t room = self->room;
        while (self->used + size > room) room *= 2;
        unsigned char *bytes = PyMem_RawRealloc(self->bytes, (size_t)room);
        if (bytes == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->bytes = bytes;
        self->room = room;
    }
    return self->bytes + self->used;
}

/* Where a compiled encoder writes a record into a block (records.h's ``RecordOut``). */
typedef struct {
    RecordOut out;
    RowBlock *block;
    Py_ssize_t size;
} BlockOut;

static unsigned char *reserve_in_block(RecordOut *out, Py_ssize_t size) {
    BlockOut *self = (BlockOut *)out;
    self->size = size;
    return block_reserve(self->block, size);
}

/* Queue ``item`` as an object, to be encoded at the hand-over; -1 with an exception. */
static int block_add_object(RowBlock *self, PyObject *item) {
    BlockRow *row = block_next_row(self);
    if (row == NULL) return -1;
    if (self->objects == NULL && (self->objects = PyList_New(0)) == NULL) return -1;
    if (PyList_Append(self->objects, item) < 0) return -1;
    row->kind = 0;
    row->offset = PyList_GET_SIZE(self->objects) - 1;
    row->size = 0;
    self->objects_left++;
    self->n++;
    return 0;
}

/* Take the newest row back (its item's queueing failed after it was added). */
static void block_drop_last(RowBlock *self) {
    BlockRow *row = &self->rows[--self->n];
    if (row->kind == 0) {
        self->objects_left--;
        Py_ssize_t k = PyList_GET_SIZE(self->objects);
        PyList_SetSlice(self->objects, k - 1, k, NULL);
    } else {
        self->used -= row->size;
    }
}

/* Row ``i`` as the log's tuple (worker, event_id, kind, tier, ts, payload), or its object. */
static PyObject *block_row(RowBlock *self, Py_ssize_t i) {
    const BlockRow *row = &self->rows[i];
    if (row->kind == 0) return Py_NewRef(PyList_GET_ITEM(self->objects, row->offset));
    PyObject *worker = PyLong_FromLongLong(row->worker);
    PyObject *event_id = PyLong_FromLongLong(row->event_id);
    PyObject *tier = PyLong_FromLong(row->tier);
    PyObject *ts = PyFloat_FromDouble(row->ts);
    PyObject *payload = PyBytes_FromStringAndSize((const char *)self->bytes + row->offset, row->size);
    PyObject *tuple = NULL;
    if (worker != NULL && event_id != NULL && tier != NULL && ts != NULL && payload != NULL) {
        tuple = PyTuple_Pack(6, worker, event_id, kind_names[row->kind], tier, ts, payload);
        if (tuple != NULL) PyObject_GC_UnTrack(tuple); /* as the compiled rows (_speedups.c) */
    }
    Py_XDECREF(worker);
    Py_XDECREF(event_id);
    Py_XDECREF(tier);
    Py_XDECREF(ts);
    Py_XDECREF(payload);
    return tuple;
}

static Py_ssize_t block_len(RowBlock *self) { return self->n; }

static PyObject *block_item(RowBlock *self, Py_ssize_t i) {
    if (i < 0 || i >= self->n) {
        PyErr_SetString(PyExc_IndexError, "row index out of range");
        return NULL;
    }
    return block_row(self, i);
}

static PyObject *block_subscript(RowBlock *self, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        return block_item(self, i < 0 ? i + self->n : i);
    }
    if (!PySlice_Check(key)) {
        PyErr_Format(PyExc_TypeError, "row indices must be integers or slices, not %.200s",
                     Py_TYPE(key)->tp_name);
        return NULL;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(key, &start, &stop, &step) < 0) return NULL;
    Py_ssize_t count = PySlice_AdjustIndices(self->n, &start, &stop, step);
    PyObject *list = PyList_New(count);
    if (list == NULL) return NULL;
    for (Py_ssize_t k = 0, i = start; k < count; k++, i += step) {
        PyObject *row = block_row(self, i);
        if (row == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k, row);
    }
    return list;
}

/* The kind byte of a kind column's value, 0 when it names none. */
static unsigned char kind_code(PyObject *kind) {
    for (int k = 1; k < BLOCK_KINDS; k++)
        if (kind == kind_names[k] || PyUnicode_Compare(kind, kind_names[k]) == 0) return (unsigned char)k;
    PyErr_Clear();
    return 0;
}

static int row_int64(PyObject *obj, int64_t *out);

/* ``encode_objects(to_row)``: each row still an object becomes the row ``to_row(object)``
 * makes (the log's Python encoder, which raises what it raises for a bad event: the rows
 * encoded before it stay encoded). A row that is not (int, int, str, int, float, bytes) in the
 * columns' ranges stays an object, for the log's checks of a general batch. */
static PyObject *block_encode_objects(RowBlock *self, PyObject *to_row) {
    for (Py_ssize_t i = 0; i < self->n && self->objects_left > 0; i++) {
        BlockRow *row = &self->rows[i];
        if (row->kind != 0) continue;
        PyObject *made = PyObject_CallOneArg(to_row, PyList_GET_ITEM(self->objects, row->offset));
        if (made == NULL) return NULL;
        int64_t worker, event_id, tier;
        unsigned char kind = 0;
        if (PyTuple_CheckExact(made) && PyTuple_GET_SIZE(made) == 6 &&
            row_int64(PyTuple_GET_ITEM(made, 0), &worker) &&
            row_int64(PyTuple_GET_ITEM(made, 1), &event_id) &&
            PyUnicode_CheckExact(PyTuple_GET_ITEM(made, 2)) &&
            row_int64(PyTuple_GET_ITEM(made, 3), &tier) && tier >= INT32_MIN && tier <= INT32_MAX &&
            PyFloat_CheckExact(PyTuple_GET_ITEM(made, 4)) &&
            PyBytes_CheckExact(PyTuple_GET_ITEM(made, 5)))
            kind = kind_code(PyTuple_GET_ITEM(made, 2));
        if (kind != 0) {
            PyObject *payload = PyTuple_GET_ITEM(made, 5);
            Py_ssize_t size = PyBytes_GET_SIZE(payload);
            unsigned char *at = block_reserve(self, size);
            if (at == NULL) {
                Py_DECREF(made);
                return NULL;
            }
            memcpy(at, PyBytes_AS_STRING(payload), (size_t)size);
            /* the object stays in the list (its index is other rows' too): only unreferenced */
            row->worker = worker;
            row->event_id = event_id;
            row->tier = (int32_t)tier;
            row->ts = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(made, 4));
            row->offset = self->used;
            row->size = size;
            row->kind = kind;
            self->used += size;
            self->objects_left--;
        }
        Py_DECREF(made);
    }
    Py_RETURN_NONE;
}

#define MOST_RUNS 8

/* ``runs()``: ``((worker, first, last), ...)`` in the order the workers first come, when every
 * row is encoded and each worker's ids follow each other (a transition stream and its lookup
 * stream, say: an engine's step logs both); None otherwise, or for more than eight workers. */
static PyObject *block_runs(RowBlock *self, PyObject *Py_UNUSED(ignored)) {
    if (self->n == 0 || self->objects_left > 0) Py_RETURN_NONE;
    int64_t worker[MOST_RUNS], first[MOST_RUNS], last[MOST_RUNS];
    int runs = 0;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        const BlockRow *row = &self->rows[i];
        int k = 0;
        while (k < runs && worker[k] != row->worker) k++;
        if (k == runs) {
            if (runs == MOST_RUNS) Py_RETURN_NONE;
            worker[k] = row->worker;
            first[k] = last[k] = row->event_id;
            runs++;
        } else if (last[k] == INT64_MAX || row->event_id != last[k] + 1) {
            Py_RETURN_NONE;
        } else {
            last[k] = row->event_id;
        }
    }
    PyObject *all = PyTuple_New(runs);
    for (int k = 0; all != NULL && k < runs; k++) {
        PyObject *run = Py_BuildValue("(LLL)", (long long)worker[k], (long long)first[k],
                                      (long long)last[k]);
        if (run == NULL) Py_CLEAR(all);
        else PyTuple_SET_ITEM(all, k, run);
    }
    return all;
}

static PyObject *block_objects_left(RowBlock *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->objects_left);
}

static PyMethodDef block_methods[] = {
    {"encode_objects", (PyCFunction)block_encode_objects, METH_O,
     "Encode the rows still held as objects with ``to_row`` (the log's Python encoder)."},
    {"runs", (PyCFunction)block_runs, METH_NOARGS,
     "((worker, first_id, last_id), ...) when each worker's ids follow each other, or None."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef block_getset[] = {
    {"objects_left", (getter)block_objects_left, NULL, "Rows still held as objects.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods block_as_sequence = {
    .sq_length = (lenfunc)block_len,
    .sq_item = (ssizeargfunc)block_item,
};

static PyMappingMethods block_as_mapping = {
    .mp_length = (lenfunc)block_len,
    .mp_subscript = (binaryfunc)block_subscript,
};

static PyTypeObject RowBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvledger.events.log._gather.RowBlock",
    .tp_doc = "A batch's log rows in flat memory (events/log/rowblock.h), read as a sequence of "
              "row tuples (and the events still to encode).",
    .tp_basicsize = sizeof(RowBlock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)block_dealloc,
    .tp_methods = block_methods,
    .tp_getset = block_getset,
    .tp_as_sequence = &block_as_sequence,
    .tp_as_mapping = &block_as_mapping,
};

/* -- the queue ------------------------------------------------------------------------------ */

static RecordsAPI *records; /* the compiled encoders (events/_speedups.c), once a queue uses them */

typedef struct {
    PyObject_HEAD
    RowBlock *block;  /* the queued rows: each event's record, or the event itself */
    PyObject *events; /* list: the events of the newest items, while keep_events */
    PyObject *kinds;  /* dict: event type -> the record kind its compiled encoder writes */
    int keep_events;
    Py_ssize_t batch_size;
    double max_hold;
    double since;
    int blocked;
    PyObject *on_full;  /* () -> None: hand over what waits */
    PyObject *on_start; /* (now) -> None: the first item of a batch came */
    PyObject *slow;     /* (events) -> None: the buffer's Python path, while blocked */
} Gather;

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int gather_init(Gather *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"kinds",   "batch_size", "max_hold", "on_full",
                               "on_start", "slow",      NULL};
    PyObject *kinds, *on_full, *on_start, *slow;
    Py_ssize_t batch_size;
    double max_hold;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!ndOOO:Gather", keywords, &PyDict_Type, &kinds,
                                     &batch_size, &max_hold, &on_full, &on_start, &slow))
        return -1;
    if (batch_size < 1) {
        PyErr_Format(PyExc_ValueError, "batch_size must be at least 1, got %zd", batch_size);
        return -1;
    }
    if (!(max_hold > 0)) {
        PyErr_SetString(PyExc_ValueError, "max_hold must be a positive number of seconds");
        return -1;
    }
    if (!PyCallable_Check(on_full) || !PyCallable_Check(on_start) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "on_full, on_start and slow must be callables");
        return -1;
    }
    if (PyDict_GET_SIZE(kinds) != 0 && records == NULL) {
        records = PyCapsule_Import(RECORDS_CAPSULE, 0);
        if (records == NULL) return -1;
        if (records->version != RECORDS_API_VERSION) {
            records = NULL;
            PyErr_SetString(PyExc_ImportError, "kvledger.events._speedups is of another build");
            return -1;
        }
    }
    Py_XSETREF(self->kinds, Py_NewRef(kinds));
    Py_XSETREF(self->on_full, Py_NewRef(on_full));
    Py_XSETREF(self->on_start, Py_NewRef(on_start));
    Py_XSETREF(self->slow, Py_NewRef(slow));
    self->batch_size = batch_size;
    self->max_hold = max_hold;
    return 0;
}

/* Set when the buffer's cycle is broken (tp_clear): a call after that has no buffer. */
static int detached(Gather *self) {
    if (self->on_full != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "this Gather's append buffer is gone");
    return 1;
}

/* One event onto the queue: its record, or itself; and itself beside it while keep_events. */
static int queue_one(Gather *self, PyObject *event) {
    RowBlock *block = self->block;
    PyObject *kind = PyDict_GetItemWithError(self->kinds, (PyObject *)Py_TYPE(event));
    if (kind == NULL && PyErr_Occurred()) return -1;
    int encoded = 0;
    if (kind != NULL) {
        long code = PyLong_AsLong(kind);
        if (code == -1 && PyErr_Occurred()) return -1;
        BlockRow *row = block_next_row(block);
        if (row == NULL) return -1;
        BlockOut out = {{reserve_in_block}, block, 0};
        RecordColumns columns;
        encoded = records->encode(event, (int)code, &out.out, &columns);
        if (encoded < 0) return -1;
        if (encoded > 0) {
            row->worker = columns.worker;
            row->event_id = columns.event_id;
            row->ts = columns.ts;
            row->tier = columns.tier;
            row->offset = block->used;
            row->size = out.size;
            row->kind = code == KIND_STORED_WITHOUT_TOKENS ? KIND_STORED : (unsigned char)code;
            block->used += out.size;
            block->n++;
        }
    }
    if (!encoded && block_add_object(block, event) < 0) return -1;
    if (self->keep_events && PyList_Append(self->events, event) < 0) {
        block_drop_last(block); /* take the item back: the two align */
        return -1;
    }
    return 0;
}

/* What follows the queue's growth, ``starts`` when it was empty before. */
static PyObject *after_adding(Gather *self, int starts, double now) {
    if (detached(self)) return NULL;
    if (self->block->n >= self->batch_size || now - self->since >= self->max_hold)
        return PyObject_CallNoArgs(self->on_full);
    if (starts) {
        PyObject *at = PyFloat_FromDouble(now);
        if (at == NULL) return NULL;
        PyObject *done = PyObject_CallOneArg(self->on_start, at);
        Py_DECREF(at);
        return done;
    }
    Py_RETURN_NONE;
}

static PyObject *gather_extend(Gather *self, PyObject *events) {
    if (self->blocked) return detached(self) ? NULL : PyObject_CallOneArg(self->slow, events);
    PyObject *seq = PySequence_Fast(events, "events must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    double now = monotonic_now();
    int starts = self->block->n == 0;
    if (starts) self->since = now;
    PyObject **given = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* an encoder's error: the events before it are queued, as separate calls would be */
        if (queue_one(self, given[i]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return after_adding(self, starts, now);
}

static PyObject *gather_call(Gather *self, PyObject *args, PyObject *kwds) {
    PyObject *event;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "Gather() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "Gather", 1, 1, &event)) return NULL;
    if (self->blocked) {
        if (detached(self)) return NULL;
        PyObject *one = PyTuple_Pack(1, event);
        if (one == NULL) return NULL;
        PyObject *done = PyObject_CallOneArg(self->slow, one);
        Py_DECREF(one);
        return done;
    }
    double now = monotonic_now();
    int starts = self->block->n == 0;
    if (queue_one(self, event) < 0) return NULL;
    if (starts) self->since = now;
    return after_adding(self, starts, now);
}

/* ``(block, events)``, emptying the queue: ``events`` are those of the newest rows. The next
 * block starts with the room this one took, so a steady producer's blocks do not grow. */
static PyObject *gather_take(Gather *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t rows = self->batch_size < FIRST_ROWS ? self->batch_size : FIRST_ROWS;
    Py_ssize_t bytes = self->block->used > FIRST_BYTES ? self->block->used : FIRST_BYTES;
    RowBlock *block = block_new(rows, bytes);
    PyObject *events = PyList_New(0);
    PyObject *taken = block == NULL || events == NULL ? NULL
                                                      : PyTuple_Pack(2, self->block, self->events);
    if (taken == NULL) {
        Py_XDECREF(block);
        Py_XDECREF(events);
        return NULL;
    }
    Py_SETREF(self->block, block);
    Py_SETREF(self->events, events);
    return taken;
}

static PyObject *gather_keep(Gather *self, PyObject *keep) {
    int flag = PyObject_IsTrue(keep);
    if (flag < 0) return NULL;
    self->keep_events = flag;
    /* from here on, events again only for the newest items: the ones kept so far would not be */
    if (!flag && PyList_SetSlice(self->events, 0, PyList_GET_SIZE(self->events), NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static Py_ssize_t gather_len(Gather *self) { return self->block->n; }

static int gather_traverse(Gather *self, visitproc visit, void *arg) {
    if (self->block != NULL) Py_VISIT(self->block->objects);
    Py_VISIT(self->events);
    Py_VISIT(self->kinds);
    Py_VISIT(self->on_full);
    Py_VISIT(self->on_start);
    Py_VISIT(self->slow);
    return 0;
}

static int gather_clear(Gather *self) {
    /* the callbacks hold the buffer; the block and the list stay, so a late call finds them */
    Py_CLEAR(self->kinds);
    Py_CLEAR(self->on_full);
    Py_CLEAR(self->on_start);
    Py_CLEAR(self->slow);
    return 0;
}

static void gather_dealloc(Gather *self) {
    PyObject_GC_UnTrack(self);
    gather_clear(self);
    Py_CLEAR(self->block);
    Py_CLEAR(self->events);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *gather_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Gather *self = (Gather *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->block = block_new(FIRST_ROWS, FIRST_BYTES);
    self->events = PyList_New(0);
    self->kinds = PyDict_New();
    if (self->block == NULL || self->events == NULL || self->kinds == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyMethodDef gather_methods[] = {
    {"extend", (PyCFunction)gather_extend, METH_O,
     "Queue ``events`` (a list or tuple) behind every earlier one."},
    {"take", (PyCFunction)gather_take, METH_NOARGS,
     "``(block, events)``, emptying the queue; the events are those of the newest rows."},
    {"keep", (PyCFunction)gather_keep, METH_O,
     "Keep each event beside its row from now on (True), or no more (False)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef gather_members[] = {
    {"since", T_DOUBLE, offsetof(Gather, since), READONLY,
     "When the oldest queued item came (``time.monotonic()``); stale while none waits."},
    {"blocked", T_BOOL, offsetof(Gather, blocked), 0,
     "True: every call goes to ``slow`` (the buffer's own checks)."},
    {"keep_events", T_BOOL, offsetof(Gather, keep_events), READONLY, NULL},
    {"batch_size", T_PYSSIZET, offsetof(Gather, batch_size), READONLY, NULL},
    {"max_hold", T_DOUBLE, offsetof(Gather, max_hold), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods gather_as_sequence = {.sq_length = (lenfunc)gather_len};

static PyTypeObject GatherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvledger.events.log._gather.Gather",
    .tp_doc = "An append buffer's queue of log rows and the producer's side of its hand-over.",
    .tp_basicsize = sizeof(Gather),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = gather_new,
    .tp_init = (initproc)gather_init,
    .tp_dealloc = (destructor)gather_dealloc,
    .tp_traverse = (traverseproc)gather_traverse,
    .tp_clear = (inquiry)gather_clear,
    .tp_call = (ternaryfunc)gather_call,
    .tp_methods = gather_methods,
    .tp_members = gather_members,
    .tp_as_sequence = &gather_as_sequence,
};

/* An exact int in the int64 range read into ``out``; 0 for anything else (no exception). */
static int row_int(PyObject *obj, long long *out) {
    if (!PyLong_CheckExact(obj)) return 0;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (!overflow && !(*out == -1 && PyErr_Occurred())) return 1;
    PyErr_Clear();
    return 0;
}

static int row_int64(PyObject *obj, int64_t *out) {
    long long value;
    if (!row_int(obj, &value)) return 0;
    *out = (int64_t)value;
    return 1;
}

/* ``run_of(rows)``: ``(worker, first_id, last_id)`` when ``rows`` is a non-empty list of log
 * row tuples of one worker whose event ids follow each other, the shape every emitter's batch
 * has (a block of rows says so itself: ``RowBlock.runs``); None otherwise (another sequence, an item that is not a six-tuple, ids that are not
 * plain ints in the int64 range, several workers, a gap or a repeat), for the log's Python
 * checks to decide. The log's id check of a batch is then one comparison of ``first_id``; in
 * Python it was a loop over the rows (``LogCore._accept_run``), a tenth of what logging cost
 * an engine-off simulation's thread. */
static PyObject *run_of(PyObject *Py_UNUSED(module), PyObject *rows) {
    if (!PyList_CheckExact(rows) || PyList_GET_SIZE(rows) == 0) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(rows);
    long long worker = 0, id = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        long long w, e;
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 6 ||
            !row_int(PyTuple_GET_ITEM(row, 0), &w) || !row_int(PyTuple_GET_ITEM(row, 1), &e)) {
            Py_RETURN_NONE;
        }
        if (i == 0) {
            worker = w;
            id = e;
        } else if (w != worker || id == LLONG_MAX || e != id + 1) {
            Py_RETURN_NONE;
        } else {
            id = e;
        }
    }
    PyObject *head = PyList_GET_ITEM(rows, 0), *tail = PyList_GET_ITEM(rows, n - 1);
    return PyTuple_Pack(3, PyTuple_GET_ITEM(head, 0), PyTuple_GET_ITEM(head, 1),
                        PyTuple_GET_ITEM(tail, 1));
}

static PyMethodDef module_methods[] = {
    {"run_of", run_of, METH_O,
     "(worker, first_id, last_id) of a list of one worker's rows with consecutive ids, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvledger.events.log._gather",
    "An append buffer's queue, compiled (see events/log/buffer.py).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gather(void) {
    if (PyType_Ready(&GatherType) < 0 || PyType_Ready(&RowBlockType) < 0) return NULL;
    for (int k = 1; k < BLOCK_KINDS; k++)
        if ((kind_names[k] = PyUnicode_InternFromString(BLOCK_KIND_NAMES[k])) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Gather", (PyObject *)&GatherType) < 0 ||
        PyModule_AddObjectRef(m, "RowBlock", (PyObject *)&RowBlockType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
