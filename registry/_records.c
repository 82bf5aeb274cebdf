/* Positional constructors of the event records, compiled.
 *
 * Why: an event is a frozen, slotted, keyword-only dataclass. Its generated ``__init__`` takes
 * every field by keyword (the call builds a dict of them) and sets each through
 * ``object.__setattr__`` (the frozen class refuses plain assignment): about 21,700 instructions
 * for a Stored event built and dropped, against 2,500 through a maker. The registry builds one per transition, so wherever a worker's events
 * go somewhere (a log, a router's feed) that cost is paid for every block a pool names or
 * drops: about a tenth of a cluster simulation with the KV router.
 *
 * A maker, ``maker(cls, names)``, holds the offset of each named slot (the class's member
 * descriptors say where each lives) and, called with one value per name in that order,
 * allocates an instance and stores the values there: what ``__init__`` leaves behind, without
 * the dict or the calls. The class stays what it is: frozen, compared and shown by its
 * dataclass methods. ``registry/makers.py`` passes every field of the dataclass, so every slot is
 * filled; ``tests/test_makers_compiled.py`` holds the two ways of building to equal records.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include "fields.h" /* member_of */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;
    Py_ssize_t count;
    Py_ssize_t *offsets;
} Maker;

static void maker_dealloc(Maker *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->cls);
    PyMem_Free(self->offsets);
    PyObject_GC_Del(self);
}

static int maker_traverse(Maker *self, visitproc visit, void *arg) {
    Py_VISIT(self->cls);
    return 0;
}

static PyObject *maker_call(Maker *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_Format(PyExc_TypeError, "a %s maker takes its values by position",
                     self->cls->tp_name);
        return NULL;
    }
    if (nargs != self->count) {
        PyErr_Format(PyExc_TypeError, "a %s maker takes %zd values, got %zd", self->cls->tp_name,
                     self->count, nargs);
        return NULL;
    }
    PyObject *obj = self->cls->tp_alloc(self->cls, 0);
    if (obj == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject **slot = (PyObject **)((char *)obj + self->offsets[i]);
        Py_INCREF(args[i]);
        Py_XSETREF(*slot, args[i]);
    }
    return obj;
}

static PyTypeObject MakerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvledger.registry._records.Maker",
    .tp_basicsize = sizeof(Maker),
    .tp_dealloc = (destructor)maker_dealloc,
    .tp_vectorcall_offset = offsetof(Maker, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_traverse = (traverseproc)maker_traverse,
    .tp_doc = "Builds one record of its class from one value per slot, by position.",
};

/* The offset of ``cls``'s slot ``name``, or -1 with an exception: the name must be a writable
 * object slot that ``cls`` has (its own or a base's), not a property or a class attribute. */
static Py_ssize_t slot_offset(PyTypeObject *cls, PyObject *name) {
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "slot names must be strs");
        return -1;
    }
    PyMemberDef *member = member_of(cls, name);
    if (member == NULL) {
        PyErr_Format(PyExc_ValueError, "%s has no slot %R", cls->tp_name, name);
        return -1;
    }
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
        PyErr_Format(PyExc_ValueError, "%s.%U is not a writable object slot", cls->tp_name,
                     name);
        return -1;
    }
    return member->offset;
}

static PyObject *maker(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "maker(cls, names)");
        return NULL;
    }
    if (!PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "maker: cls must be a class");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    if (cls->tp_dictoffset != 0 || cls->tp_itemsize != 0 || cls->tp_alloc == NULL) {
        PyErr_Format(PyExc_ValueError,
                     "maker: %s must keep its fields in slots alone (no __dict__)", cls->tp_name);
        return NULL;
    }
    PyObject *names = PySequence_Tuple(args[1]);
    if (names == NULL) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(names);
    Maker *self = PyObject_GC_New(Maker, &MakerType);
    if (self == NULL) {
        Py_DECREF(names);
        return NULL;
    }
    self->vectorcall = (vectorcallfunc)maker_call;
    Py_INCREF(cls);
    self->cls = cls;
    self->count = count;
    self->offsets = PyMem_Calloc(count ? count : 1, sizeof(Py_ssize_t));
    PyObject_GC_Track(self);
    if (self->offsets == NULL) {
        Py_DECREF(names);
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t offset = slot_offset(cls, PyTuple_GET_ITEM(names, i));
        if (offset < 0) {
            Py_DECREF(names);
            Py_DECREF(self);
            return NULL;
        }
        self->offsets[i] = offset;
    }
    Py_DECREF(names);
    return (PyObject *)self;
}

static PyMethodDef methods[] = {
    {"maker", (PyCFunction)(void (*)(void))maker, METH_FASTCALL,
     "maker(cls, names): a callable that builds a cls from one value per slot in names, by "
     "position, storing each in its slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_records", "Positional constructors of records (see registry.makers).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__records(void) {
    if (PyType_Ready(&MakerType) < 0) return NULL;
    return PyModule_Create(&module);
}
