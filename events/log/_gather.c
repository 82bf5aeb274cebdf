/* ``Gather``: an ``AppendBuffer``'s queue, and the producer's side of its hand-over, compiled.
 *
 * Why: an engine hands its log every event it makes, one call each. In Python that call takes
 * the buffer's lock, checks that the buffer is open, reads the clock and extends a list (about
 * a microsecond an event on the engine's thread), and the events then wait in the list until
 * their batch is full. Waiting events are live objects the collector tracks: a batch of 256
 * brought a young collection about once a batch, 17 ms of a 0.3 s engine-off simulation
 * (bench/simulate_bench.py). Here the call encodes the event into its log row at once
 * (``rows``: the compiled row functions, by exact type) and appends the row, which the
 * collector does not track, to a list, with the interpreter held: an atomic step for every
 * other Python thread, so no lock is needed. The event itself is kept only while someone
 * wants the events (``keep_events``: the log has commit sinks). An event no compiled function
 * encodes is queued as it is, and encoded (or refused) in Python at the hand-over.
 *
 * The rules are ``AppendBuffer``'s: an item joins the queue behind every earlier one; the
 * queue is handed over (``on_full()``) once it holds ``batch_size`` items or its oldest has
 * waited ``max_hold`` seconds; the first item of an empty queue sets ``since`` and calls
 * ``on_start(now)``; while ``blocked`` (the buffer closed, or a failed hand-over to report)
 * every call goes to ``slow(events)``, the buffer's Python path. ``take()`` empties the queue;
 * the buffer calls it under its own lock. ``since`` is on ``time.monotonic()``'s clock
 * (CLOCK_MONOTONIC, which Python reads on Linux).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>
#include <limits.h>

typedef struct {
    PyObject_HEAD
    PyObject *items;  /* list: each event's log row, or the event where no compiled row is */
    PyObject *events; /* list: the events of the newest items, while keep_events */
    PyObject *rows;   /* dict: event type -> its compiled row function (row or None) */
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
    static char *keywords[] = {"rows",    "batch_size", "max_hold", "on_full",
                               "on_start", "slow",      NULL};
    PyObject *rows, *on_full, *on_start, *slow;
    Py_ssize_t batch_size;
    double max_hold;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!ndOOO:Gather", keywords, &PyDict_Type, &rows,
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
    Py_XSETREF(self->rows, Py_NewRef(rows));
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

/* One event onto the queue: its row, or itself; and itself beside it while keep_events. */
static int queue_one(Gather *self, PyObject *event) {
    PyObject *row = NULL;
    PyObject *encode = PyDict_GetItemWithError(self->rows, (PyObject *)Py_TYPE(event));
    if (encode == NULL && PyErr_Occurred()) return -1;
    if (encode != NULL) {
        row = PyObject_CallOneArg(encode, event);
        if (row == NULL) return -1;
        if (row == Py_None) Py_CLEAR(row);
    }
    int failed = PyList_Append(self->items, row != NULL ? row : event);
    Py_XDECREF(row);
    if (failed) return -1;
    if (self->keep_events && PyList_Append(self->events, event) < 0) {
        Py_ssize_t n = PyList_GET_SIZE(self->items); /* take the item back: the two align */
        PyList_SetSlice(self->items, n - 1, n, NULL);
        return -1;
    }
    return 0;
}

/* What follows the queue's growth, ``starts`` when it was empty before. */
static PyObject *after_adding(Gather *self, int starts, double now) {
    if (detached(self)) return NULL;
    if (PyList_GET_SIZE(self->items) >= self->batch_size || now - self->since >= self->max_hold)
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
    int starts = PyList_GET_SIZE(self->items) == 0;
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
    int starts = PyList_GET_SIZE(self->items) == 0;
    if (queue_one(self, event) < 0) return NULL;
    if (starts) self->since = now;
    return after_adding(self, starts, now);
}

/* ``(items, events)``, emptying the queue: ``events`` are those of the newest items. */
static PyObject *gather_take(Gather *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *items = PyList_New(0), *events = PyList_New(0);
    if (items == NULL || events == NULL) {
        Py_XDECREF(items);
        Py_XDECREF(events);
        return NULL;
    }
    PyObject *taken = PyTuple_Pack(2, self->items, self->events);
    if (taken == NULL) {
        Py_DECREF(items);
        Py_DECREF(events);
        return NULL;
    }
    Py_SETREF(self->items, items);
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

static Py_ssize_t gather_len(Gather *self) { return PyList_GET_SIZE(self->items); }

static int gather_traverse(Gather *self, visitproc visit, void *arg) {
    Py_VISIT(self->items);
    Py_VISIT(self->events);
    Py_VISIT(self->rows);
    Py_VISIT(self->on_full);
    Py_VISIT(self->on_start);
    Py_VISIT(self->slow);
    return 0;
}

static int gather_clear(Gather *self) {
    /* the callbacks hold the buffer; the lists stay, so a late call finds them */
    Py_CLEAR(self->rows);
    Py_CLEAR(self->on_full);
    Py_CLEAR(self->on_start);
    Py_CLEAR(self->slow);
    return 0;
}

static void gather_dealloc(Gather *self) {
    PyObject_GC_UnTrack(self);
    gather_clear(self);
    Py_CLEAR(self->items);
    Py_CLEAR(self->events);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *gather_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Gather *self = (Gather *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->items = PyList_New(0);
    self->events = PyList_New(0);
    self->rows = PyDict_New();
    if (self->items == NULL || self->events == NULL || self->rows == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyMethodDef gather_methods[] = {
    {"extend", (PyCFunction)gather_extend, METH_O,
     "Queue ``events`` (a list or tuple) behind every earlier one."},
    {"take", (PyCFunction)gather_take, METH_NOARGS,
     "``(items, events)``, emptying the queue; the events are those of the newest items."},
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
    return !overflow && !(*out == -1 && PyErr_Occurred());
}

/* ``run_of(rows)``: ``(worker, first_id, last_id)`` when ``rows`` is a non-empty list of log
 * row tuples of one worker whose event ids follow each other, the shape every emitter's batch
 * has; None otherwise (another sequence, an item that is not a six-tuple, ids that are not
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
            PyErr_Clear();
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
    if (PyType_Ready(&GatherType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Gather", (PyObject *)&GatherType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
