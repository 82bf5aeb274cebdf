/* How the compiled encoders (events/_speedups.c) hand a record to whoever asked for it.
 *
 * A record is written where its caller says: ``codec`` wants a bytes object per record, an
 * append buffer's queue (events/log/_gather.c) wants it at the end of the one buffer a batch's
 * records share, so that queueing an event makes no Python object at all. The encoder asks
 * ``out->reserve(out, size)`` once, for the record's exact size, and writes it there; it may
 * still find the event is not the plain case after that, and then nothing it wrote counts.
 *
 * The queue reaches the encoders through a capsule (``RECORDS_CAPSULE``), the C-API way one
 * extension calls another without linking to it.
 */
#ifndef KVLEDGER_RECORDS_H
#define KVLEDGER_RECORDS_H

#include <Python.h>
#include <stdint.h>

typedef struct RecordOut RecordOut;
struct RecordOut {
    /* ``size`` bytes to write the record into; NULL with an exception set (no memory) */
    unsigned char *(*reserve)(RecordOut *out, Py_ssize_t size);
};

/* The record kinds, as the record's kind byte numbers them; STORED_WITHOUT_TOKENS is a stored
 * event written with its token ids left out (the ``token_ids`` setting off). */
enum { KIND_STORED = 1, KIND_REMOVED, KIND_OFFLOADED, KIND_ONBOARDED, KIND_STORED_WITHOUT_TOKENS };

/* The columns of a record's log row besides the kind and the record itself. */
typedef struct {
    int64_t worker;
    int64_t event_id;
    double ts;
    unsigned char tier;
} RecordColumns;

/* ``encode(event, kind, out, columns)``: 1 with the record written into what ``out`` reserved
 * and ``columns`` filled; 0 where the event is not the plain case (its Python encoder is to
 * run; an id past int64 included: the log's columns are signed); -1 with an exception. */
typedef struct {
    int version;
    int (*encode)(PyObject *event, int kind, RecordOut *out, RecordColumns *columns);
} RecordsAPI;

#define RECORDS_API_VERSION 1
#define RECORDS_CAPSULE "kvledger.events._speedups.records_api"

#endif
