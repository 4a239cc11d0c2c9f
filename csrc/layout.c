/*
 * kvtier._native.LAYOUT and .FIELDS: csrc/layout.h as Python reads it.
 *
 *   LAYOUT  {name: int} of every constant of layout.h, the KVT_ prefix dropped
 *           ("SLOT_KEY": 40, "PAGE_BYTES": 16384, ...)
 *   FIELDS  {"slot_entry" | "ssd_entry" | "commit_record":
 *            {field: (offset, bytes, kind)}} from layout.h's field tables, kind
 *           "u" (a little-endian unsigned integer) or "s" (a byte string)
 *
 * Python's one source for those numbers (kvtier._page, kvtierd.layout);
 * tests/unit/test_layout_header.py fails when a constant of the header is missing
 * here or differs from what a C compiler reads in the header.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "layout.h"

static int
add_constants(PyObject *module)
{
    static const struct {
        const char *name;
        unsigned long long value;
    } constants[] = {
#define F(x) {#x, (unsigned long long)(KVT_##x)}
        /* the slot ref */
        F(REF_SHIFT), F(REF_SLOT_MASK), F(REF_SEGMENT_MASK),
        /* the DRAM slot entry */
        F(SLOT_TABLE_OFFSET), F(SLOT_BYTES), F(SLOT_STATE), F(SLOT_KEY_LEN), F(SLOT_FLAGS),
        F(SLOT_LENGTH), F(SLOT_CHECKSUM), F(SLOT_GENERATION), F(SLOT_EPOCH), F(SLOT_KEY),
        F(SLOT_ENTRY_SUM), F(SLOT_LAST_ACCESS), F(SLOT_MAX_KEY), F(SLOT_SUM_FROM),
        F(SLOT_SUM_TO), F(SLOT_SEED_MUL), F(SLOT_HAS_CHECKSUM), F(ST_FREE), F(ST_RESERVED),
        F(ST_COMMITTED), F(ST_DOOMED), F(MAX_GENERATION), F(MAX_ACCESS_SEQ),
        /* the SSD slot entry */
        F(SSD_ENTRY), F(SSD_STATE), F(SSD_KEY_LEN), F(SSD_NS_LEN), F(SSD_LENGTH),
        F(SSD_CHECKSUM), F(SSD_BLOCK_BYTES), F(SSD_MODEL_HASH), F(SSD_SEQ), F(SSD_KEY_AT),
        F(SSD_MAX_KEY), F(SSD_NS_AT), F(SSD_NAME), F(SSD_ENTRY_SUM), F(SSD_FIELD),
        /* the session page and its commit records */
        F(IDX_HEADER_BYTES), F(IDX_ENTRY_BYTES), F(IDX_MAX_PROBE), F(IDX_SUPERSEDED),
        F(IDX_MISS_NOT_FINAL),
        F(PAGE_BYTES), F(PAGE_COUNTERS), F(PAGE_COUNTERS_N), F(PAGE_HAZARD_HI),
        F(PAGE_RING_HEAD), F(PAGE_MAX_LEASES), F(PAGE_MAX_RESERVATIONS),
        F(PAGE_LOCAL_RESERVATIONS), F(PAGE_MAX_HAZARDS), F(MAX_HAZARDS_SET), F(PAGE_RING),
        F(PAGE_RING_N), F(PAGE_HAZARDS), F(PAGE_SERIALS), F(PAGE_HAZARDS_N), F(HAZARD_BIT),
        F(WPAGE_BYTES), F(W_HEAD), F(W_DONE), F(W_WAITERS), F(W_WANT), F(W_GRANTS),
        F(W_GRANTS_N), F(GRANT_VALID), F(GRANT_TAKEN), F(GRANT_SEGMENT_MASK), F(W_RING),
        F(W_RECORD), F(W_RING_N), F(W_KEY_MAX), F(R_GRANT), F(R_LENGTH), F(R_CHECKSUM),
        F(R_KEYLEN), F(R_FLAGS), F(R_RESULT), F(R_KEY), F(R_WORD), F(W_HAS_SUM), F(W_LAST),
        F(W_COMMITTED), F(W_EXISTS), F(W_INVALID), F(W_LOST), F(W_FAILED),
#undef F
    };
    PyObject *out = PyDict_New();

    if (out == NULL)
        return -1;
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(constants[i].value);

        if (v == NULL || PyDict_SetItemString(out, constants[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObjectRef(module, "LAYOUT", out) < 0) {
        Py_DECREF(out);
        return -1;
    }
    Py_DECREF(out);
    return 0;
}

/* One field table as {field: (offset, bytes, kind)}, added to into under its name. */
typedef struct {
    const char *name;
    int offset, bytes;
    char kind;
} kvt_field;

static int
add_record(PyObject *into, const char *record, const kvt_field *fields, size_t n)
{
    PyObject *table = PyDict_New();

    if (table == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = Py_BuildValue("(iiC)", fields[i].offset, fields[i].bytes,
                                    (int)fields[i].kind);

        if (v == NULL || PyDict_SetItemString(table, fields[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(table);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyDict_SetItemString(into, record, table) < 0) {
        Py_DECREF(table);
        return -1;
    }
    Py_DECREF(table);
    return 0;
}

#define KVT_FIELD_ROW_(name, off, n, kind) {#name, (off), (n), (kind)},
static const kvt_field slot_fields[] = {KVT_SLOT_FIELDS(KVT_FIELD_ROW_)};
static const kvt_field ssd_fields[] = {KVT_SSD_FIELDS(KVT_FIELD_ROW_)};
static const kvt_field record_fields[] = {KVT_RECORD_FIELDS(KVT_FIELD_ROW_)};
#undef KVT_FIELD_ROW_

int
kvt_layout_init(PyObject *module)
{
    PyObject *fields;

    if (add_constants(module) < 0)
        return -1;
    fields = PyDict_New();
    if (fields == NULL)
        return -1;
    if (add_record(fields, "slot_entry", slot_fields, sizeof slot_fields / sizeof *slot_fields) < 0
        || add_record(fields, "ssd_entry", ssd_fields, sizeof ssd_fields / sizeof *ssd_fields) < 0
        || add_record(fields, "commit_record", record_fields,
                      sizeof record_fields / sizeof *record_fields) < 0
        || PyModule_AddObjectRef(module, "FIELDS", fields) < 0) {
        Py_DECREF(fields);
        return -1;
    }
    Py_DECREF(fields);
    return 0;
}
