/* A block of log rows in flat memory: what an append buffer's queue (``_gather.Gather``) fills
 * and the SQLite writer (``_sqlite.Writer``) binds, with no Python object per row.
 *
 * Why: as tuples, a row was two allocations on the engine's thread (the tuple and the record's
 * bytes) and their release on the writer's, with the interpreter held, where the engine then
 * waited for it; memory one core wrote and another freed. Here a batch's records lie end to
 * end in one buffer and the other columns in an array of structs: one allocation a batch,
 * growing by doubling, released in one call.
 *
 * The type lives in ``_gather.c``; ``_sqlite.c`` reads blocks through this layout. A block is
 * written only while its queue fills it; once taken (``Gather.take``) it never changes, so the
 * writer reads it without the interpreter's lock while the batch holding it keeps it alive.
 *
 * An event the compiled encoders leave to Python (a lookup record, a case that is not plain)
 * sits in the block as the object itself (``kind`` 0) until the log encodes it at the
 * hand-over (``RowBlock.encode_objects``).
 */
#ifndef KVLEDGER_ROWBLOCK_H
#define KVLEDGER_ROWBLOCK_H

#include <Python.h>
#include <stdint.h>

/* The ``kind`` column's values by the record's kind byte (``codec.KIND_NAMES``). */
static const char *const BLOCK_KIND_NAMES[] = {NULL,      "stored", "removed", "offloaded",
                                               "onboarded", "cleared", "lookup", "release", "run"};
#define BLOCK_KINDS 9

typedef struct {
    int64_t worker;
    int64_t event_id;
    double ts;
    Py_ssize_t offset; /* the record's first byte in ``bytes``; kind 0: the index in ``objects`` */
    Py_ssize_t size;   /* the record's length in bytes */
    int32_t tier;
    unsigned char kind; /* 1-8: the record's kind byte; 0: an object still to encode */
} BlockRow;

typedef struct {
    PyObject_HEAD
    BlockRow *rows;
    Py_ssize_t n, capacity;
    unsigned char *bytes;
    Py_ssize_t used, room;
    Py_ssize_t objects_left; /* rows of kind 0 */
    PyObject *objects;       /* list, or NULL: the kind-0 rows' items */
} RowBlock;

#endif
