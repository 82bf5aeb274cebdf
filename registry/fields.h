/* An event's fields read where its class keeps them: the compiled encoders and the router
 * index's fold read eight or so named fields of every event, and PyObject_GetAttr costs about
 * two hundred instructions for each (the attribute's name looked up along the class's MRO,
 * then its member descriptor's call), a fifth of encoding a stored event.
 *
 * The records are slotted dataclasses: each field is a member descriptor on the class, and
 * its value sits at a fixed offset in the instance. ``field`` finds that offset once per class
 * and field, and then reads the value there. It falls back to PyObject_GetAttr, which gives
 * the same answer or raises the same error, wherever the shortcut could differ:
 * - the field is not a plain object slot of the class (a property, a class attribute, an
 *   instance dict's entry, a slot of another kind);
 * - the class has its own attribute access (``__getattribute__`` or ``__getattr__``);
 * - the slot is empty (its AttributeError is GetAttr's to raise);
 * - the class changed since the offset was found (its version tag moved: an attribute set or
 *   deleted on it or on a base), or has none;
 * - the class is not among the last few the cache holds (eight).
 *
 * A file that reads fields this way defines FIELD_CACHE and FIELD_NAMES (the number of names
 * it reads) before it includes this, and fills ``field_names`` (interned strings, one
 * reference each) before the first call.
 */
#ifndef KVLEDGER_FIELDS_H
#define KVLEDGER_FIELDS_H

#include <Python.h>
#include <structmember.h>

/* The member (a slot's kind, offset and flags) that ``type``'s attribute ``name`` names, its
 * own or a base's; NULL where ``name`` is anything else (a property, a method, a class
 * attribute, nothing). Borrowed from the class; no exception set. Also what the record makers
 * (registry/_records.c) find their slots by, which include this file without the rest. */
static PyMemberDef *member_of(PyTypeObject *type, PyObject *name) {
    PyObject *descr = _PyType_Lookup(type, name); /* borrowed; no exception set */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) return NULL;
    return ((PyMemberDescrObject *)descr)->d_member;
}

#ifdef FIELD_CACHE
#define FIELD_CLASSES 8

typedef struct {
    PyTypeObject *type; /* a strong reference: an offset outliving its class would be wrong */
    unsigned int version;
    Py_ssize_t offset[FIELD_NAMES]; /* 0: not looked for yet; -1: not a plain slot */
} FieldClass;

static PyObject *field_names[FIELD_NAMES];
static FieldClass field_classes[FIELD_CLASSES];
static int field_class_count, field_class_next;

/* The offset of ``name``'s value in instances of ``type``, or -1 where GetAttr must read it. */
static Py_ssize_t field_offset(PyTypeObject *type, PyObject *name) {
    PyMemberDef *member = member_of(type, name);
    if (member == NULL || member->type != T_OBJECT_EX || member->offset <= 0) return -1;
    return member->offset;
}

/* The class's entry, made on its first event; NULL where the cache cannot serve it. */
static FieldClass *field_class(PyTypeObject *type) {
    for (int i = 0; i < field_class_count; i++)
        if (field_classes[i].type == type) {
            FieldClass *known = &field_classes[i];
            if (known->version == type->tp_version_tag) return known;
            /* changed since: look the offsets up again (the class's new version is set by
             * the next lookup, as the interpreter's own attribute cache does) */
            memset(known->offset, 0, sizeof known->offset);
            if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) return NULL;
            known->version = type->tp_version_tag;
            return known;
        }
    if (type->tp_getattro != PyObject_GenericGetAttr) return NULL;
    /* a version tag is what tells a changed class: without one, no cache */
    _PyType_Lookup(type, field_names[0]);
    if (!PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) return NULL;
    /* when full, the entries are reused in turn: a process that makes many classes (a test
     * suite) keeps the ones it uses now */
    FieldClass *entry = &field_classes[field_class_count < FIELD_CLASSES
                                           ? field_class_count++
                                           : field_class_next++ % FIELD_CLASSES];
    Py_XSETREF(entry->type, (PyTypeObject *)Py_NewRef((PyObject *)type));
    entry->version = type->tp_version_tag;
    memset(entry->offset, 0, sizeof entry->offset);
    return entry;
}

/* ``getattr(event, field_names[name])``: a new reference, or NULL with an exception. */
static inline PyObject *field(PyObject *event, int name) {
    FieldClass *cls = field_class(Py_TYPE(event));
    if (cls != NULL) {
        Py_ssize_t offset = cls->offset[name];
        if (offset == 0) offset = cls->offset[name] = field_offset(Py_TYPE(event), field_names[name]);
        if (offset > 0) {
            PyObject *value = *(PyObject **)((char *)event + offset);
            if (value != NULL) return Py_NewRef(value);
        }
    }
    return PyObject_GetAttr(event, field_names[name]);
}
#endif /* FIELD_CACHE */

#endif
