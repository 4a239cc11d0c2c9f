/*
 * Protocol buffers' repeated integer fields as columns: no Python int per element.
 *
 * A Reserve of 4096 keys answers 8192 slot numbers, and the Commit that follows
 * sends 8192 lengths and checksums.  Built or read through the protobuf runtime's
 * Python API, each of them is a Python int made and converted (~300 us a
 * message of 4096, a tenth of the daemon's whole cost per block); here a column
 * (a C-contiguous buffer of unsigned integers) goes straight to or from the wire
 * format, which the runtime then merges or has serialized in C:
 *
 *   varints_field(field, values)   the encoding of values (a buffer of u8, u32 or
 *                                  u64) as the packed repeated field number field:
 *                                  bytes to MergeFromString into a message (b"" for
 *                                  no values: proto3 omits an empty packed field)
 *   varints_column(message, field) the values of repeated varint field number field
 *                                  of a serialized message (packed or not, in any
 *                                  number of pieces, as a parser must accept): the
 *                                  u64 of each, as bytes
 *
 * The message is input that may come from anywhere: every length and varint is
 * bounded before it is used, and anything malformed raises ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "wire.h"

/* Wire types (protobuf encoding). */
#define WT_VARINT 0
#define WT_I64 1
#define WT_LEN 2
#define WT_I32 5

/* The longest varint: 10 bytes for 64 bits. */
#define VARINT_MAX 10

static size_t
put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* One varint from [*p, end): 0 and *p moved past it, or -1 (cut short, or longer than
 * 10 bytes, or over 64 bits). */
static int
get_varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    const uint8_t *q = *p;
    for (int shift = 0; shift < 70; shift += 7) {
        if (q >= end)
            return -1;
        uint8_t b = *q++;
        if (shift == 63 && (b & 0x7e) != 0)
            return -1; /* bits past the 64th */
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *p = q;
            *out = v;
            return 0;
        }
    }
    return -1;
}

static uint64_t
item(const Py_buffer *b, Py_ssize_t i)
{
    switch (b->itemsize) {
    case 1:
        return ((const uint8_t *)b->buf)[i];
    case 4:
        return ((const uint32_t *)b->buf)[i];
    default:
        return ((const uint64_t *)b->buf)[i];
    }
}

PyObject *
kvt_py_varints_field(PyObject *Py_UNUSED(m), PyObject *args)
{
    unsigned int field;
    PyObject *obj;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "IO:varints_field", &field, &obj))
        return NULL;
    if (PyObject_GetBuffer(obj, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    PyObject *out = NULL;
    if (field == 0 || field > 536870911u) {
        PyErr_SetString(PyExc_ValueError, "field must be 1..2**29-1");
        goto done;
    }
    /* (the format's last character: a byte-order prefix is allowed, the machine's) */
    const char *fmt = b.format != NULL ? b.format : "B";
    char code = fmt[0] != '\0' ? fmt[strlen(fmt) - 1] : 'B';
    if (!((b.itemsize == 1 && code == 'B') || (b.itemsize == 4 && (code == 'I' || code == 'L'))
          || (b.itemsize == 8 && (code == 'L' || code == 'Q')))) {
        PyErr_SetString(PyExc_ValueError, "values must be unsigned integers of 1, 4 or 8 bytes");
        goto done;
    }
    Py_ssize_t n = b.len / b.itemsize;
    if (n == 0) {
        out = PyBytes_FromStringAndSize(NULL, 0);
        goto done;
    }
    size_t body = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = item(&b, i);
        size_t k = 1;
        while (v >= 0x80) {
            v >>= 7;
            k++;
        }
        body += k;
    }
    uint8_t head[2 * VARINT_MAX];
    size_t h = put_varint(head, ((uint64_t)field << 3) | WT_LEN);
    h += put_varint(head + h, body);
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(h + body));
    if (out == NULL)
        goto done;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    memcpy(p, head, h);
    p += h;
    for (Py_ssize_t i = 0; i < n; i++)
        p += put_varint(p, item(&b, i));
done:
    PyBuffer_Release(&b);
    return out;
}

/* Skip the value of a field of wire type wt at *p: 0, or -1 when it does not fit. */
static int
skip_value(const uint8_t **p, const uint8_t *end, unsigned wt)
{
    uint64_t v;
    switch (wt) {
    case WT_VARINT:
        return get_varint(p, end, &v);
    case WT_I64:
        if (end - *p < 8)
            return -1;
        *p += 8;
        return 0;
    case WT_LEN:
        if (get_varint(p, end, &v) < 0 || v > (uint64_t)(end - *p))
            return -1;
        *p += v;
        return 0;
    case WT_I32:
        if (end - *p < 4)
            return -1;
        *p += 4;
        return 0;
    default: /* groups (3, 4) are not in our messages; 6 and 7 are no wire type */
        return -1;
    }
}

PyObject *
kvt_py_varints_column(PyObject *Py_UNUSED(m), PyObject *args)
{
    unsigned int field;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*I:varints_column", &b, &field))
        return NULL;
    const uint8_t *start = b.buf, *end = start + b.len, *p;
    PyObject *out = NULL;
    Py_ssize_t n = 0;
    /* Two passes: count, then decode into an exact allocation (a value takes at least
     * one byte, so the count is bounded by the message's length). */
    for (int pass = 0; pass < 2; pass++) {
        uint64_t *col = pass ? (uint64_t *)PyBytes_AS_STRING(out) : NULL;
        Py_ssize_t k = 0;
        p = start;
        while (p < end) {
            uint64_t tag, v;
            if (get_varint(&p, end, &tag) < 0 || (tag >> 3) == 0 || tag >> 32)
                goto malformed;
            unsigned wt = (unsigned)(tag & 7);
            if ((tag >> 3) != field) {
                if (skip_value(&p, end, wt) < 0)
                    goto malformed;
                continue;
            }
            if (wt == WT_VARINT) {
                if (get_varint(&p, end, &v) < 0)
                    goto malformed;
                if (col)
                    col[k] = v;
                k++;
            } else if (wt == WT_LEN) {
                uint64_t len;
                if (get_varint(&p, end, &len) < 0 || len > (uint64_t)(end - p))
                    goto malformed;
                const uint8_t *q = p, *stop = p + len;
                while (q < stop) {
                    if (get_varint(&q, stop, &v) < 0)
                        goto malformed;
                    if (col)
                        col[k] = v;
                    k++;
                }
                p = stop;
            } else {
                goto malformed;
            }
        }
        if (!pass) {
            n = k;
            out = PyBytes_FromStringAndSize(NULL, n * 8);
            if (out == NULL)
                goto done;
        }
    }
    goto done;
malformed:
    Py_CLEAR(out);
    PyErr_SetString(PyExc_ValueError, "not a well-formed protobuf message (or field "
                                      "not a varint)");
done:
    PyBuffer_Release(&b);
    return out;
}
