/* The block pool's per-block loops, compiled: ``match``, the all-new pass of ``register``,
 * ``release``, ``take`` (``_take_free``), ``drop`` and ``oldest`` (LRU victims) run over the
 * very lists, dict and OrderedDict that ``pool.BlockPool`` keeps.
 *
 * Why: every block an engine touches passes through these loops a few times per request, and
 * each pass is a handful of list and dict operations that the interpreter spends most of its
 * time dispatching (bench/registry_bench.py: about 1 us of Python per block over match,
 * allocate, register and release). Here the same operations are direct calls into the list,
 * dict and OrderedDict implementations.
 *
 * The state stays in the pool's Python objects, so everything else of the pool (events,
 * copies between tiers, adoption, the policies, every query) reads and changes it as before,
 * and a pool can go back to its Python loops at any call. Only the plain case is handled:
 * exact ints for slots and hashes, slots within the lists, tuples of two for blocks.
 * ``register``'s and ``release``'s loops stop at the first block that is anything else (or that
 * the Python loop must refuse, deduplicate or place below the never-used slots) and return how
 * far they got; the pool's Python loop carries on from there, so every check, error message
 * and rollback lives in one place, pool.py. ``match``, ``take`` and ``drop`` cannot stop
 * half-way (their Python loops have no such cases): for an odd slot they use the generic
 * item protocol, which does what the Python loop's subscripts do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ``slot`` as an index into a list of ``size`` items, or -1 where it is not the plain case
 * (not an exact int, or outside 0..size-1: negative indexes count from the end in Python). */
static inline Py_ssize_t plain_index(PyObject *slot, Py_ssize_t size) {
    if (!PyLong_CheckExact(slot)) return -1;
    Py_ssize_t index = PyLong_AsSsize_t(slot);
    if (index < 0 || index >= size) {
        PyErr_Clear(); /* an overflow: left to the generic path, which raises IndexError */
        return -1;
    }
    return index;
}

/* ``items[slot]``: a new reference, or NULL with an exception set. */
static inline PyObject *get_at(PyObject *items, PyObject *slot) {
    Py_ssize_t index = plain_index(slot, PyList_GET_SIZE(items));
    if (index < 0) return PyObject_GetItem(items, slot);
    PyObject *item = PyList_GET_ITEM(items, index);
    Py_INCREF(item);
    return item;
}

/* ``items[slot] = value`` (``value`` borrowed): 0, or -1 with an exception set. */
static inline int set_at(PyObject *items, PyObject *slot, PyObject *value) {
    Py_ssize_t index = plain_index(slot, PyList_GET_SIZE(items));
    if (index < 0) return PyObject_SetItem(items, slot, value);
    Py_INCREF(value);
    PyList_SetItem(items, index, value); /* steals value, drops the old item */
    return 0;
}

/* A refcount as the pool keeps it (an int) into ``*out``: 0, or -1 with an exception set. */
static inline int count_of(PyObject *count, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(count);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int check_args(const char *name, Py_ssize_t nargs, Py_ssize_t expected) {
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected,
                     nargs);
        return -1;
    }
    return 0;
}

static int check_list(const char *name, const char *what, PyObject *obj) {
    if (!PyList_CheckExact(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a list, not %.100s", name, what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* One matched block: ``ref[slot] += 1``, reviving it first at a count of zero (out of the
 * LRU ``queue``, or onto ``revived`` for the policy to hear of). 0, or -1 on an error. */
static int take_match(PyObject *ref, PyObject *queue, PyObject *revived, PyObject *slot) {
    PyObject *item = get_at(ref, slot);
    if (item == NULL) return -1;
    Py_ssize_t count;
    int failed = count_of(item, &count);
    Py_DECREF(item);
    if (failed) return -1;
    if (!count) {
        if (queue != Py_None ? PyObject_DelItem(queue, slot) : PyList_Append(revived, slot))
            return -1;
    }
    PyObject *bumped = PyLong_FromSsize_t(count + 1);
    if (bumped == NULL) return -1;
    failed = set_at(ref, slot, bumped);
    Py_DECREF(bumped);
    return failed;
}

/* match(by_hash, ref, queue, revived, sequence_hashes) -> slots */
static PyObject *match(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (check_args("match", nargs, 5) || check_list("match", "ref", args[1]) ||
        check_list("match", "revived", args[3]))
        return NULL;
    PyObject *by_hash = args[0], *ref = args[1], *queue = args[2], *revived = args[3];
    PyObject *hashes = args[4];
    if (!PyDict_CheckExact(by_hash)) {
        PyErr_SetString(PyExc_TypeError, "match(): by_hash must be a dict");
        return NULL;
    }
    PyObject *slots = PyList_New(0);
    if (slots == NULL) return NULL;
    if (PyList_CheckExact(hashes) || PyTuple_CheckExact(hashes)) {
        /* the size is read again at every step: a key's __eq__ could change a list */
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(hashes); i++) {
            PyObject *seq = PySequence_Fast_GET_ITEM(hashes, i);
            Py_INCREF(seq);
            PyObject *slot = PyDict_GetItemWithError(by_hash, seq); /* borrowed */
            Py_DECREF(seq);
            if (slot == NULL) {
                if (PyErr_Occurred()) goto fail;
                break;
            }
            Py_INCREF(slot);
            int failed = take_match(ref, queue, revived, slot) || PyList_Append(slots, slot);
            Py_DECREF(slot);
            if (failed) goto fail;
        }
        return slots;
    }
    /* any other iterable: taken one item at a time, so nothing past the first miss is read */
    PyObject *it = PyObject_GetIter(hashes);
    if (it == NULL) goto fail;
    PyObject *seq;
    while ((seq = PyIter_Next(it)) != NULL) {
        PyObject *slot = PyDict_GetItemWithError(by_hash, seq);
        Py_DECREF(seq);
        if (slot == NULL) break;
        Py_INCREF(slot);
        int failed = take_match(ref, queue, revived, slot) || PyList_Append(slots, slot);
        Py_DECREF(slot);
        if (failed) {
            Py_DECREF(it);
            goto fail;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) goto fail;
    return slots;
fail:
    Py_DECREF(slots);
    return NULL;
}

/* name_new(ref, hashes, local_of, parent_of, by_hash, slots, blocks, parent_hash) -> named
 *
 * ``register``'s first pass: names slots[i] with blocks[i] while each block is new and its slot
 * mutable, and returns how many it named. It stops (before changing anything of that block)
 * at a slot the pool must refuse, at a block the pool holds already, and at anything but the
 * plain case; the pool's loop goes on from there. */
static PyObject *name_new(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (check_args("name_new", nargs, 8)) return NULL;
    for (int i = 0; i < 4; i++) {
        if (check_list("name_new", "a slot column", args[i])) return NULL;
    }
    PyObject *ref = args[0], *hashes = args[1], *local_of = args[2], *parent_of = args[3];
    PyObject *by_hash = args[4], *slots = args[5], *blocks = args[6], *parent = args[7];
    if (!PyDict_CheckExact(by_hash)) {
        PyErr_SetString(PyExc_TypeError, "name_new(): by_hash must be a dict");
        return NULL;
    }
    Py_ssize_t named = 0;
    if (!(PyList_CheckExact(slots) || PyTuple_CheckExact(slots)) ||
        !(PyList_CheckExact(blocks) || PyTuple_CheckExact(blocks)))
        return PyLong_FromSsize_t(0);
    Py_ssize_t size = PyList_GET_SIZE(ref);
    if (PyList_GET_SIZE(hashes) != size || PyList_GET_SIZE(local_of) != size ||
        PyList_GET_SIZE(parent_of) != size)
        return PyLong_FromSsize_t(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(slots);
    if (PySequence_Fast_GET_SIZE(blocks) < n) n = PySequence_Fast_GET_SIZE(blocks);
    Py_INCREF(parent);
    for (; named < n; named++) {
        PyObject *block = PySequence_Fast_GET_ITEM(blocks, named);
        if (!PyTuple_CheckExact(block) || PyTuple_GET_SIZE(block) != 2) break;
        PyObject *seq = PyTuple_GET_ITEM(block, 0), *local = PyTuple_GET_ITEM(block, 1);
        if (!PyLong_CheckExact(seq)) break;
        PyObject *slot = PySequence_Fast_GET_ITEM(slots, named);
        Py_ssize_t index = plain_index(slot, size);
        if (index < 0) break;
        if (PyList_GET_ITEM(hashes, index) != Py_None) break;
        int in_use = PyObject_IsTrue(PyList_GET_ITEM(ref, index));
        if (in_use < 0) goto fail;
        if (!in_use) break;
        /* held across the lookup, which compares keys: a key's __eq__ could change a list */
        Py_INCREF(block);
        Py_INCREF(slot);
        PyObject *holder = PyDict_SetDefault(by_hash, seq, slot); /* borrowed */
        int known = 0;
        if (holder != NULL && holder != slot) {
            /* held already, unless the holder is an equal int (as ``!=`` in pool.py sees it) */
            Py_ssize_t other = PyLong_CheckExact(holder) ? PyLong_AsSsize_t(holder) : -1;
            if (other == -1 && PyErr_Occurred()) PyErr_Clear();
            known = other != index;
        }
        int failed = holder == NULL;
        if (!failed && !known) {
            Py_INCREF(seq);
            failed = PyList_SetItem(hashes, index, seq);
            Py_INCREF(local);
            failed = PyList_SetItem(local_of, index, local) || failed;
            /* hands over the reference held to the parent, and takes one to this block */
            failed = PyList_SetItem(parent_of, index, parent) || failed;
            Py_INCREF(seq);
            parent = seq;
        }
        Py_DECREF(slot);
        Py_DECREF(block);
        if (failed) goto fail;
        if (known) break;
    }
    Py_DECREF(parent);
    return PyLong_FromSsize_t(named);
fail:
    Py_DECREF(parent);
    return NULL;
}

/* release(ref, hashes, free, inactive, order, unused) -> done
 *
 * Drops one reference per slot of ``order``, in order; at zero a registered slot goes into
 * ``inactive`` (the LRU queue, or the dict the pool hands its policy) and a never-registered
 * one onto ``free``. Stops, before changing anything of that slot, at a slot released more
 * often than taken, at a never-registered slot reaching zero while ``unused`` (``fresh_first``
 * keeps never-used slots on top of the free stack) and at anything but the plain case, and
 * returns how many slots it released: the pool's loop goes on from there. */
static PyObject *release(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (check_args("release", nargs, 6) || check_list("release", "ref", args[0]) ||
        check_list("release", "hashes", args[1]) || check_list("release", "free", args[2]) ||
        check_list("release", "order", args[4]))
        return NULL;
    PyObject *ref = args[0], *hashes = args[1], *free = args[2], *inactive = args[3];
    PyObject *order = args[4];
    int unused = PyObject_IsTrue(args[5]);
    if (unused < 0) return NULL;
    Py_ssize_t size = PyList_GET_SIZE(ref);
    if (PyList_GET_SIZE(hashes) != size) return PyLong_FromSsize_t(0);
    Py_ssize_t done = 0;
    for (; done < PyList_GET_SIZE(order); done++) {
        PyObject *slot = PyList_GET_ITEM(order, done);
        Py_ssize_t index = plain_index(slot, size);
        if (index < 0) break;
        Py_ssize_t count;
        if (count_of(PyList_GET_ITEM(ref, index), &count)) return NULL;
        count -= 1;
        if (count < 0) break;
        int registered = PyList_GET_ITEM(hashes, index) != Py_None;
        if (!count && !registered && unused) break;
        Py_INCREF(slot); /* the order list could lose it in what follows */
        PyObject *dropped = PyLong_FromSsize_t(count);
        int failed = dropped == NULL || PyList_SetItem(ref, index, dropped);
        if (!failed && !count) {
            failed = registered ? PyObject_SetItem(inactive, slot, Py_None)
                                : PyList_Append(free, slot);
        }
        Py_DECREF(slot);
        if (failed) return NULL;
    }
    return PyLong_FromSsize_t(done);
}

/* take(ref, slots): ``ref[slot] = 1`` for each slot, as ``_take_free`` hands them out. */
static PyObject *take(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (check_args("take", nargs, 2) || check_list("take", "ref", args[0]) ||
        check_list("take", "slots", args[1]))
        return NULL;
    PyObject *ref = args[0], *slots = args[1];
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
        PyObject *slot = PyList_GET_ITEM(slots, i);
        Py_INCREF(slot);
        int failed = set_at(ref, slot, one);
        Py_DECREF(slot);
        if (failed) {
            Py_DECREF(one);
            return NULL;
        }
    }
    Py_DECREF(one);
    Py_RETURN_NONE;
}

/* drop(by_hash, hashes, slots) -> the hashes of ``slots``, unnamed (``_drop``'s loop). */
static PyObject *drop(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (check_args("drop", nargs, 3) || check_list("drop", "hashes", args[1]) ||
        check_list("drop", "slots", args[2]))
        return NULL;
    PyObject *by_hash = args[0], *hashes = args[1], *slots = args[2];
    PyObject *gone = PyList_New(0);
    if (gone == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
        PyObject *slot = PyList_GET_ITEM(slots, i);
        Py_INCREF(slot);
        PyObject *seq = get_at(hashes, slot);
        int failed = seq == NULL;
        if (!failed && seq == Py_None) {
            PyErr_SetNone(PyExc_AssertionError); /* as the assert in pool.py raises it */
            failed = 1;
        }
        failed = failed || PyObject_DelItem(by_hash, seq) || set_at(hashes, slot, Py_None) ||
                 PyList_Append(gone, seq);
        Py_XDECREF(seq);
        Py_DECREF(slot);
        if (failed) {
            Py_DECREF(gone);
            return NULL;
        }
    }
    return gone;
}

/* oldest(queue, count) -> up to ``count`` keys taken off the front of ``queue``: the LRU
 * policy's victims (``popitem(False)`` once per victim, without a method call per victim). */
static PyObject *oldest(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (check_args("oldest", nargs, 2)) return NULL;
    PyObject *queue = args[0];
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t held = PyObject_Length(queue);
    if (held < 0) return NULL;
    if (count > held) count = held;
    if (count < 0) count = 0;
    PyObject *victims = PyList_New(0);
    if (victims == NULL) return NULL;
    if (count) {
        /* the keys first, then the deletions: an OrderedDict's iterator refuses a change */
        PyObject *it = PyObject_GetIter(queue);
        if (it == NULL) goto fail;
        PyObject *key;
        while (PyList_GET_SIZE(victims) < count && (key = PyIter_Next(it)) != NULL) {
            int failed = PyList_Append(victims, key);
            Py_DECREF(key);
            if (failed) break;
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) goto fail;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(victims); i++) {
            if (PyObject_DelItem(queue, PyList_GET_ITEM(victims, i))) goto fail;
        }
    }
    return victims;
fail:
    Py_DECREF(victims);
    return NULL;
}

static PyMethodDef methods[] = {
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL,
     "Take a reference on the longest cached prefix of the hashes given; returns its slots."},
    {"name_new", (PyCFunction)(void (*)(void))name_new, METH_FASTCALL,
     "Name mutable slots with new blocks up to the first that is not one; returns how many."},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "Drop one reference per slot up to the first the pool's loop must see; returns how many."},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "Set each slot's refcount to one."},
    {"drop", (PyCFunction)(void (*)(void))drop, METH_FASTCALL,
     "Unname slots; returns their hashes."},
    {"oldest", (PyCFunction)(void (*)(void))oldest, METH_FASTCALL,
     "Take up to count keys off the front of an ordered dict; returns them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvledger.registry._pool",
    "Compiled per-block loops of the block pool (see pool).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pool(void) { return PyModule_Create(&module); }
