/* ``RouterIndex.apply``'s usual cases, compiled: a Stored chain new to everyone that starts a
 * run or goes on with one, and a Removed that names the end of a run from its last block back.
 *
 * Why: a KV router's index folds every event every worker emits, about nine blocks each, and
 * on a short-prompt trace that fold costs more than the queries. In Python most of an event's
 * cost is the dispatch and bookkeeping around a few dict and list operations (the id check, the
 * place lookup, the chain's two lists, the disjointness test): here they are one C call over the
 * same ``_Node`` objects and dicts the Python methods use.
 *
 * Only those cases are handled. For everything else (another event kind, a keyword argument, an
 * id that is not the next one, a place seen for the first time, a malformed event) the Python
 * ``apply`` runs the whole event, before anything changed; inside a handled event, what is not
 * the usual shape (a chain that meets known blocks, a parent in the middle of a run or not yet
 * known, a removal across runs or of blocks others hold too) goes to the Python method that does
 * it (``_store``, ``_grow``, ``_drop``, ``_unhold``, ``_adopt``). So the tree's rules live in
 * one place, and ``tests/test_index_compiled.py`` holds this to the Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The fields read, the events' and the index's own, by their index in ``field_names``
 * (registry/fields.h reads them where their classes keep them) */
enum {
    F_EVENT_ID, F_WORKER_ID, F_DP_RANK, F_TIER, F_PARENT_HASH, F_BLOCKS, F_SEQUENCE_HASHES, F_LAST_EVENT_ID, F_PLACES, F_NODE_OF, F_ROOT, F_ORPHANS, F_LIVE, F_SEQS, F_LOCALS, F_BITS, F_CHILDREN, F_PARENT,
    FIELD_NAMES
};
#define FIELD_CACHE
#include "fields.h"

static PyObject *s_store, *s_grow, *s_drop, *s_unhold, *s_adopt; /* the Python methods */

/* What ``bind`` was given: the tree's node class, the two event kinds handled here and the
 * Python ``apply`` that does the rest. */
static PyObject *node_type, *stored_type, *removed_type, *python_apply;

/* A dict store and delete with the key's hash known. 3.13 keeps the calls that take it to the
 * interpreter (not declared for extensions): there the plain calls run, which hash again. */
#if PY_VERSION_HEX >= 0x030D0000
static int set_known_hash(PyObject *d, PyObject *key, PyObject *value, Py_hash_t hash) {
    (void)hash;
    return PyDict_SetItem(d, key, value);
}
static int del_known_hash(PyObject *d, PyObject *key, Py_hash_t hash) {
    (void)hash;
    return PyDict_DelItem(d, key);
}
#else
#define set_known_hash _PyDict_SetItem_KnownHash
#define del_known_hash _PyDict_DelItem_KnownHash
#endif

static int is_sequence(PyObject *obj) { return PyTuple_CheckExact(obj) || PyList_CheckExact(obj); }

/* 1: ``a & b`` is not 0; 0: it is; -1: an exception. */
static int overlaps(PyObject *a, PyObject *b) {
    PyObject *both = PyNumber_And(a, b);
    if (both == NULL) return -1;
    int out = PyObject_IsTrue(both);
    Py_DECREF(both);
    return out;
}

/* ``obj.name += delta`` for an int attribute. */
static int add_to(PyObject *obj, int name, Py_ssize_t delta) {
    PyObject *value = field(obj, name);
    if (value == NULL) return -1;
    PyObject *step = PyLong_FromSsize_t(delta);
    if (step == NULL) {
        Py_DECREF(value);
        return -1;
    }
    PyObject *sum = PyNumber_Add(value, step);
    Py_DECREF(value);
    Py_DECREF(step);
    if (sum == NULL) return -1;
    int rc = PyObject_SetAttr(obj, field_names[name], sum);
    Py_DECREF(sum);
    return rc;
}

/* ``self.<name>(*args)``, its result dropped. */
static int call_method(PyObject *self, PyObject *name, PyObject **args, size_t nargs) {
    PyObject *stack[6];
    stack[0] = self;
    for (size_t i = 0; i < nargs; i++) stack[i + 1] = args[i];
    PyObject *out = PyObject_VectorcallMethod(name, stack, nargs + 1, NULL);
    if (out == NULL) return -1;
    Py_DECREF(out);
    return 0;
}

/* ``apply``'s usual Stored: a chain under the root or the end of a run, none of whose blocks
 * the tree has. 1: the chain was added (``_grow``'s work); 0: a block of it is known, or named
 * twice, and nothing was added (``_store``'s case); 2: its parent is not known or not a run's
 * end, and nothing was done (``apply``'s Python steps are to run); -1: an exception. */
static int grow(PyObject *self, PyObject *node_of, PyObject *bit, PyObject *where,
                PyObject *parent, PyObject *seqs, PyObject *locals) {
    PyObject *host; /* borrowed from node_of, or a new reference to the root */
    int rc = -1;
    if (parent == Py_None) {
        host = field(self, F_ROOT);
        if (host == NULL) return -1;
    } else {
        host = PyDict_GetItemWithError(node_of, parent);
        if (host == NULL) return PyErr_Occurred() ? -1 : 2; /* an orphan: _grow hosts it */
        Py_INCREF(host);
    }
    PyObject *host_seqs = NULL, *host_bits = NULL, *host_children = NULL, *node = NULL;
    host_seqs = field(host, F_SEQS);
    if (host_seqs == NULL) goto done;
    if (!PyList_CheckExact(host_seqs)) {
        rc = 2;
        goto done;
    }
    if (parent != Py_None) {
        Py_ssize_t len = PyList_GET_SIZE(host_seqs);
        int last = len ? PyObject_RichCompareBool(PyList_GET_ITEM(host_seqs, len - 1), parent, Py_EQ)
                       : 0;
        if (last < 0) goto done;
        if (!last) { /* the chain leaves a run in its middle: a split, or another's link */
            rc = 2;
            goto done;
        }
    }
    host_bits = field(host, F_BITS);
    host_children = field(host, F_CHILDREN);
    if (host_bits == NULL || host_children == NULL) goto done;
    if (!PyDict_CheckExact(host_children)) {
        rc = 2;
        goto done;
    }
    int extend = 0;
    if (PyDict_GET_SIZE(host_children) == 0) {
        extend = PyObject_RichCompareBool(host_bits, bit, Py_EQ);
        if (extend < 0) goto done;
    }
    if (extend) {
        node = host;
        Py_INCREF(node);
    } else {
        PyObject *args[4] = {seqs, locals, bit, Py_None};
        node = PyObject_Vectorcall(node_type, args, 4, NULL);
        if (node == NULL) goto done;
    }
    /* each block in, where the tree did not have it: one lookup a block does the test for
     * known blocks and for a block named twice, and the rare miss takes them out again */
    Py_ssize_t n = PyList_GET_SIZE(seqs);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t before = PyDict_GET_SIZE(node_of);
        if (PyDict_SetDefault(node_of, PyList_GET_ITEM(seqs, i), node) == NULL) goto done;
        if (PyDict_GET_SIZE(node_of) == before) { /* known, or named twice */
            for (Py_ssize_t j = 0; j < i; j++) {
                PyObject *back = PyList_GET_ITEM(seqs, j);
                int there = PyDict_Contains(node_of, back); /* (named twice: gone already) */
                if (there < 0 || (there && PyDict_DelItem(node_of, back) < 0)) goto done;
            }
            rc = 0;
            goto done;
        }
    }
    if (extend) {
        Py_ssize_t end = PyList_GET_SIZE(host_seqs);
        if (PyList_SetSlice(host_seqs, end, end, seqs) < 0) goto done;
        PyObject *host_locals = field(host, F_LOCALS);
        if (host_locals == NULL) goto done;
        end = PyObject_Length(host_locals);
        int failed = end < 0 || PySequence_SetSlice(host_locals, end, end, locals) < 0;
        Py_DECREF(host_locals);
        if (failed) goto done;
    } else {
        if (PySet_Add(where, node) < 0) goto done;
        PyObject *first = PyList_GET_ITEM(locals, 0);
        int taken = PyDict_Contains(host_children, first);
        if (taken < 0) goto done;
        if (!taken) {
            if (PyDict_SetItem(host_children, first, node) < 0) goto done;
            if (PyObject_SetAttr(node, field_names[F_PARENT], host) < 0) goto done;
        }
    }
    if (add_to(self, F_LIVE, n) < 0) goto done;
    PyObject *orphans = field(self, F_ORPHANS);
    if (orphans == NULL) goto done;
    if (PyObject_Length(orphans)) { /* a list first: adopting splits the node */
        PyObject *adopted = PyList_New(0);
        int failed = adopted == NULL;
        for (Py_ssize_t i = 0; !failed && i < n; i++) {
            PyObject *seq = PyList_GET_ITEM(seqs, i);
            int waiting = PyDict_Contains(orphans, seq);
            failed = waiting < 0 || (waiting && PyList_Append(adopted, seq) < 0);
        }
        for (Py_ssize_t i = 0; !failed && i < PyList_GET_SIZE(adopted); i++) {
            PyObject *seq = PyList_GET_ITEM(adopted, i);
            failed = call_method(self, s_adopt, &seq, 1) < 0;
        }
        Py_XDECREF(adopted);
        if (failed) {
            Py_DECREF(orphans);
            goto done;
        }
    }
    Py_DECREF(orphans);
    rc = 1;
done:
    Py_DECREF(host);
    Py_XDECREF(host_seqs);
    Py_XDECREF(host_bits);
    Py_XDECREF(host_children);
    Py_XDECREF(node);
    return rc;
}

/* A Stored chain of ``n`` >= 1 blocks, as ``apply`` folds it. */
static int fold_stored(PyObject *self, PyObject *bit, PyObject *where, PyObject *parent,
                       PyObject *seqs, PyObject *locals) {
    PyObject *node_of = field(self, F_NODE_OF);
    if (node_of == NULL) return -1;
    int rc = -1;
    PyObject *args[5] = {bit, where, parent, seqs, locals};
    int grown = PyDict_CheckExact(node_of) ? grow(self, node_of, bit, where, parent, seqs, locals)
                                           : 2; /* (never: the Python steps then) */
    if (grown < 0) goto done;
    if (grown == 2) { /* apply's own steps: _grow where the chain is new to everyone */
        int known = 0;
        Py_ssize_t n = PyList_GET_SIZE(seqs);
        for (Py_ssize_t i = 0; i < n && !known; i++) {
            known = PySequence_Contains(node_of, PyList_GET_ITEM(seqs, i));
            if (known < 0) goto done;
        }
        grown = 0;
        if (!known) {
            PyObject *out = PyObject_VectorcallMethod(
                s_grow, (PyObject *[]){self, bit, where, parent, seqs, locals}, 6, NULL);
            if (out == NULL) goto done;
            grown = PyObject_IsTrue(out);
            Py_DECREF(out);
            if (grown < 0) goto done;
        }
    }
    rc = grown ? 0 : call_method(self, s_store, args, 5);
done:
    Py_DECREF(node_of);
    return rc;
}

/* ``_unhold``'s usual case: ``node``'s blocks ``start:end`` (0 < start, end its run's length)
 * held by this slot alone, with nothing below: they go for good. Anything else: ``_unhold``. */
static int unhold(PyObject *self, PyObject *node_of, PyObject *bit, PyObject *where,
                  PyObject *node, Py_ssize_t start, Py_ssize_t end) {
    PyObject *run = field(node, F_SEQS);
    PyObject *bits = field(node, F_BITS);
    PyObject *children = field(node, F_CHILDREN);
    PyObject *run_locals = NULL;
    int rc = -1, alone = 0;
    if (run == NULL || bits == NULL || children == NULL) goto done;
    if (start > 0 && PyList_CheckExact(run) && end == PyList_GET_SIZE(run) &&
        PyDict_CheckExact(children) && PyDict_GET_SIZE(children) == 0) {
        alone = PyObject_RichCompareBool(bits, bit, Py_EQ);
        if (alone < 0) goto done;
    }
    if (!alone) {
        PyObject *from = PyLong_FromSsize_t(start), *to = PyLong_FromSsize_t(end);
        if (from != NULL && to != NULL) {
            PyObject *args[5] = {bit, where, node, from, to};
            rc = call_method(self, s_unhold, args, 5);
        }
        Py_XDECREF(from);
        Py_XDECREF(to);
        goto done;
    }
    for (Py_ssize_t i = start; i < end; i++)
        if (PyDict_DelItem(node_of, PyList_GET_ITEM(run, i)) < 0) goto done;
    run_locals = field(node, F_LOCALS);
    if (run_locals == NULL) goto done;
    if (PyList_SetSlice(run, start, end, NULL) < 0) goto done;
    if (PySequence_DelSlice(run_locals, start, PY_SSIZE_T_MAX) < 0) goto done;
    rc = add_to(self, F_LIVE, start - end);
done:
    Py_XDECREF(run);
    Py_XDECREF(bits);
    Py_XDECREF(children);
    Py_XDECREF(run_locals);
    return rc;
}

/* Where ``seq`` is in the list ``run`` (a run's blocks are distinct), looked for at ``guess``
 * first: a removal names a run's last block, and a run it found is where it was unless a
 * split or a join moved it. -1 with an exception where it is not there. */
static Py_ssize_t index_of(PyObject *run, PyObject *seq, Py_ssize_t guess) {
    if (PyList_CheckExact(run) && 0 <= guess && guess < PyList_GET_SIZE(run)) {
        int same = PyObject_RichCompareBool(PyList_GET_ITEM(run, guess), seq, Py_EQ);
        if (same < 0) return -1;
        if (same) return guess;
    }
    return PySequence_Index(run, seq);
}

/* A run of blocks a Removed names: ``node``'s blocks ``lo:hi``. */
typedef struct {
    PyObject *node;
    Py_ssize_t lo, hi;
} Piece;

/* A Removed event's blocks, as ``_drop`` folds them: the runs of consecutive blocks it names
 * (each found by its first block, then the rest of its run compared from there back, or on),
 * then each cleared, found again by its first block as the tree changes, through ``unhold``.
 * A stream that names one run twice goes to ``_drop``, before anything changed. */
static int fold_removed(PyObject *self, PyObject *bit, PyObject *where, PyObject *names) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(names);
    PyObject **items = PySequence_Fast_ITEMS(names);
    PyObject *node_of = field(self, F_NODE_OF);
    if (node_of == NULL) return -1;
    Piece *found = PyMem_Calloc((size_t)n, sizeof(Piece));
    PyObject *firsts = PyList_New(0);
    Py_ssize_t count = 0;
    int rc = -1, twice = !PyDict_CheckExact(node_of); /* (never: the Python path then) */
    if (found == NULL || firsts == NULL) {
        if (found == NULL) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n && !twice;) {
        PyObject *seq = items[i];
        PyObject *node = PyDict_GetItemWithError(node_of, seq);
        if (node == NULL) {
            if (PyErr_Occurred()) goto done;
            i++;
            continue;
        }
        PyObject *bits = field(node, F_BITS);
        if (bits == NULL) goto done;
        int held = overlaps(bits, bit);
        Py_DECREF(bits);
        if (held < 0) goto done;
        if (!held) {
            i++;
            continue;
        }
        PyObject *run = field(node, F_SEQS);
        if (run == NULL) goto done;
        if (!PyList_CheckExact(run)) {
            Py_DECREF(run);
            twice = 1;
            break;
        }
        Py_ssize_t len = PyList_GET_SIZE(run);
        Py_ssize_t at = index_of(run, seq, len - 1);
        if (at < 0) {
            Py_DECREF(run);
            goto done;
        }
        /* back towards the run's start, then (one block only) on towards its end */
        Py_ssize_t taken = 1, lo = at, hi = at + 1;
        Py_ssize_t k = at + 1 < n - i ? at + 1 : n - i;
        while (taken < k) {
            int same = PyObject_RichCompareBool(PyList_GET_ITEM(run, at - taken), items[i + taken],
                                                Py_EQ);
            if (same < 0) {
                Py_DECREF(run);
                goto done;
            }
            if (!same) break;
            taken++;
        }
        lo = at + 1 - taken;
        k = len - at < n - i ? len - at : n - i;
        if (taken == 1) {
            while (taken < k) {
                int same = PyObject_RichCompareBool(PyList_GET_ITEM(run, at + taken),
                                                    items[i + taken], Py_EQ);
                if (same < 0) {
                    Py_DECREF(run);
                    goto done;
                }
                if (!same) break;
                taken++;
            }
            hi = at + taken;
        }
        for (Py_ssize_t j = 0; j < count && !twice; j++) twice = found[j].node == node;
        if (!twice) {
            Py_INCREF(node);
            found[count++] = (Piece){node, lo, hi};
            if (PyList_Append(firsts, PyList_GET_ITEM(run, lo)) < 0) {
                Py_DECREF(run);
                goto done;
            }
        }
        Py_DECREF(run);
        i += taken;
    }
    if (twice) { /* overlaps to merge per node: _drop */
        PyObject *args[3] = {bit, where, names};
        rc = call_method(self, s_drop, args, 3);
        goto done;
    }
    if (count == 1) {
        rc = unhold(self, node_of, bit, where, found[0].node, found[0].lo, found[0].hi);
        goto done;
    }
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *first = PyList_GET_ITEM(firsts, j);
        PyObject *node = PyDict_GetItemWithError(node_of, first);
        if (node == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, first);
            goto done;
        }
        Py_INCREF(node);
        PyObject *run = field(node, F_SEQS);
        Py_ssize_t at = run == NULL ? -1 : index_of(run, first, found[j].lo);
        Py_XDECREF(run);
        int failed = at < 0 || unhold(self, node_of, bit, where, node, at,
                                      at + found[j].hi - found[j].lo) < 0;
        Py_DECREF(node);
        if (failed) goto done;
    }
    rc = 0;
done:
    for (Py_ssize_t j = 0; j < count; j++) Py_DECREF(found[j].node);
    PyMem_Free(found);
    Py_XDECREF(firsts);
    Py_DECREF(node_of);
    return rc;
}

/* The chain of a Stored event's blocks as two new lists; 0 where a block is not a pair of two
 * (the Python path raises its error), -1 an exception. */
static int split_blocks(PyObject *blocks, PyObject **seqs, PyObject **locals) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    *seqs = PyList_New(n);
    *locals = PyList_New(n);
    if (*seqs == NULL || *locals == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = items[i];
        if (!is_sequence(pair) || PySequence_Fast_GET_SIZE(pair) != 2) {
            Py_CLEAR(*seqs);
            Py_CLEAR(*locals);
            return 0;
        }
        PyObject *seq = PySequence_Fast_ITEMS(pair)[0], *local = PySequence_Fast_ITEMS(pair)[1];
        Py_INCREF(seq);
        Py_INCREF(local);
        PyList_SET_ITEM(*seqs, i, seq);
        PyList_SET_ITEM(*locals, i, local);
    }
    return 1;
fail:
    Py_CLEAR(*seqs);
    Py_CLEAR(*locals);
    return -1;
}

/* The Python apply, given the same arguments. */
static PyObject *python_path(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    PyObject *stack[8];
    Py_ssize_t total = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    if (total > 7) {
        PyErr_SetString(PyExc_TypeError, "apply() takes an event and strict=");
        return NULL;
    }
    stack[0] = self;
    for (Py_ssize_t i = 0; i < total; i++) stack[i + 1] = args[i];
    return PyObject_Vectorcall(python_apply, stack, (size_t)nargs + 1, kwnames);
}

/* RouterIndex.apply(event, *, strict=True) */
static PyObject *apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                       PyObject *kwnames) {
    if (kwnames != NULL || nargs != 1) return python_path(self, args, nargs, kwnames);
    PyObject *event = args[0];
    PyTypeObject *kind = Py_TYPE(event);
    if (kind != (PyTypeObject *)stored_type && kind != (PyTypeObject *)removed_type)
        return python_path(self, args, nargs, kwnames);

    PyObject *worker = NULL, *event_id = NULL, *dp_rank = NULL, *tier = NULL, *last = NULL;
    PyObject *places = NULL, *key = NULL, *bit = NULL, *where = NULL, *body = NULL;
    PyObject *parent = NULL, *seqs = NULL, *locals = NULL, *result = NULL;
    worker = field(event, F_WORKER_ID);
    event_id = field(event, F_EVENT_ID);
    dp_rank = field(event, F_DP_RANK);
    tier = field(event, F_TIER);
    last = field(self, F_LAST_EVENT_ID);
    places = field(self, F_PLACES);
    if (!worker || !event_id || !dp_rank || !tier || !last || !places) goto done;
    if (!PyDict_CheckExact(last) || !PyDict_CheckExact(places) || !PyLong_CheckExact(event_id))
        goto python;

    /* the usual case: the worker's next id, at a place seen before */
    PyObject *previous = PyDict_GetItemWithError(last, worker);
    if (previous == NULL && PyErr_Occurred()) goto done;
    long long expected = 0;
    int overflow = 0;
    if (previous != NULL) {
        if (!PyLong_CheckExact(previous)) goto python;
        expected = PyLong_AsLongLongAndOverflow(previous, &overflow) + 1;
        if (overflow) goto python;
    }
    long long id = PyLong_AsLongLongAndOverflow(event_id, &overflow);
    if (overflow || id != expected) goto python;
    key = PyTuple_Pack(3, worker, dp_rank, tier);
    if (key == NULL) goto done;
    PyObject *place = PyDict_GetItemWithError(places, key);
    if (place == NULL) {
        if (PyErr_Occurred()) goto done;
        goto python; /* _place makes it */
    }
    if (!PyTuple_CheckExact(place) || PyTuple_GET_SIZE(place) != 2) goto python;
    bit = PyTuple_GET_ITEM(place, 0);
    where = PyTuple_GET_ITEM(place, 1);
    Py_INCREF(bit);
    Py_INCREF(where);
    if (!PySet_CheckExact(where)) goto python;

    if (kind == (PyTypeObject *)stored_type) {
        body = field(event, F_BLOCKS);
        parent = field(event, F_PARENT_HASH);
        if (body == NULL || parent == NULL) goto done;
        if (!is_sequence(body)) goto python;
        if (PySequence_Fast_GET_SIZE(body)) {
            int split = split_blocks(body, &seqs, &locals);
            if (split < 0) goto done;
            if (!split) goto python;
        }
        if (PyDict_SetItem(last, worker, event_id) < 0) goto done;
        if (seqs != NULL && fold_stored(self, bit, where, parent, seqs, locals) < 0) goto done;
    } else {
        body = field(event, F_SEQUENCE_HASHES);
        if (body == NULL) goto done;
        if (!is_sequence(body)) goto python;
        if (PyDict_SetItem(last, worker, event_id) < 0) goto done;
        if (PySequence_Fast_GET_SIZE(body) && fold_removed(self, bit, where, body) < 0) goto done;
    }
    result = Py_True;
    Py_INCREF(result);
    goto done;
python: /* not the usual case, and nothing changed yet */
    result = python_path(self, args, nargs, kwnames);
done:
    Py_XDECREF(worker);
    Py_XDECREF(event_id);
    Py_XDECREF(dp_rank);
    Py_XDECREF(tier);
    Py_XDECREF(last);
    Py_XDECREF(places);
    Py_XDECREF(key);
    Py_XDECREF(bit);
    Py_XDECREF(where);
    Py_XDECREF(body);
    Py_XDECREF(parent);
    Py_XDECREF(seqs);
    Py_XDECREF(locals);
    return result;
}

static PyMethodDef apply_def = {
    "apply", (PyCFunction)(void (*)(void))apply, METH_FASTCALL | METH_KEYWORDS,
    "Fold one event in; False (and no change) for a repeat.",
};

static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "bind(index, node, stored, removed, python_apply)");
        return NULL;
    }
    if (!PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2]) ||
        !PyType_Check(args[3]) || !PyCallable_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "bind: four classes and a function");
        return NULL;
    }
    Py_INCREF(args[1]);
    Py_XSETREF(node_type, args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(stored_type, args[2]);
    Py_INCREF(args[3]);
    Py_XSETREF(removed_type, args[3]);
    Py_INCREF(args[4]);
    Py_XSETREF(python_apply, args[4]);
    return PyDescr_NewMethod((PyTypeObject *)args[0], &apply_def);
}

/* count and uncount: ``counts[key]`` one up (from 0) or one down (gone at 0, KeyError for a
 * key not there) for each key, in order. One loop serves both. */
static PyObject *tally(PyObject *const *args, Py_ssize_t nargs, int down, const char *usage) {
    if (nargs != 2 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    PyObject *counts = args[0];
    PyObject *keys = PySequence_Fast(args[1], "keys must be iterable");
    if (keys == NULL) return NULL;
    PyObject *one = PyLong_FromLong(1);
    int failed = one == NULL;
    Py_ssize_t n = failed ? 0 : PySequence_Fast_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        /* the key's hash once for the lookup and the store (a u64 hash's is a loop over its
         * digits, and a prompt's blocks pass here twice a request) */
        Py_hash_t hash = PyObject_Hash(key);
        if (hash == -1) {
            failed = 1;
            break;
        }
        PyObject *held = _PyDict_GetItem_KnownHash(counts, key, hash);
        if (held == NULL && (PyErr_Occurred() || down)) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            failed = 1;
            break;
        }
        PyObject *now = held == NULL ? Py_NewRef(one)
                        : down       ? PyNumber_Subtract(held, one)
                                     : PyNumber_Add(held, one);
        int keep = now == NULL ? -1 : down ? PyObject_IsTrue(now) : 1;
        failed = keep < 0 || (keep ? set_known_hash(counts, key, now, hash)
                                   : del_known_hash(counts, key, hash)) < 0;
        Py_XDECREF(now);
    }
    Py_XDECREF(one);
    Py_DECREF(keys);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *count(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    return tally(args, nargs, 0, "count(counts: dict, keys)");
}

static PyObject *uncount(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    return tally(args, nargs, 1, "uncount(counts: dict, keys)");
}

static PyMethodDef methods[] = {
    {"count", (PyCFunction)(void (*)(void))count, METH_FASTCALL,
     "count(counts, keys): counts[key] = counts.get(key, 0) + 1 for each key (a router's "
     "active blocks, request by request)."},
    {"uncount", (PyCFunction)(void (*)(void))uncount, METH_FASTCALL,
     "uncount(counts, keys): counts[key] - 1 for each key, the key gone at 0; KeyError for a "
     "key not there."},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(index, node, stored, removed, python_apply): the compiled apply, as a method of "
     "index (the RouterIndex class), that leaves what it does not handle to python_apply."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvledger.registry._index",
    "RouterIndex.apply's usual cases, compiled (see registry/index.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__index(void) {
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(field_names[F_EVENT_ID], "event_id");
    INTERN(field_names[F_WORKER_ID], "worker_id");
    INTERN(field_names[F_DP_RANK], "dp_rank");
    INTERN(field_names[F_TIER], "tier");
    INTERN(field_names[F_PARENT_HASH], "parent_hash");
    INTERN(field_names[F_BLOCKS], "blocks");
    INTERN(field_names[F_SEQUENCE_HASHES], "sequence_hashes");
    INTERN(field_names[F_LAST_EVENT_ID], "last_event_id");
    INTERN(field_names[F_PLACES], "_places");
    INTERN(field_names[F_NODE_OF], "_node_of");
    INTERN(field_names[F_ROOT], "_root");
    INTERN(field_names[F_ORPHANS], "_orphans");
    INTERN(field_names[F_LIVE], "_live");
    INTERN(field_names[F_SEQS], "seqs");
    INTERN(field_names[F_LOCALS], "locals");
    INTERN(field_names[F_BITS], "bits");
    INTERN(field_names[F_CHILDREN], "children");
    INTERN(field_names[F_PARENT], "parent");
    INTERN(s_store, "_store");
    INTERN(s_grow, "_grow");
    INTERN(s_drop, "_drop");
    INTERN(s_unhold, "_unhold");
    INTERN(s_adopt, "_adopt");
#undef INTERN
    return PyModule_Create(&module);
}
