/* csrc/wire.c: protobuf repeated varint fields as columns (no Python int per value). */
#ifndef KVT_WIRE_H
#define KVT_WIRE_H

#include <Python.h>

PyObject *kvt_py_varints_field(PyObject *m, PyObject *args);
PyObject *kvt_py_varints_column(PyObject *m, PyObject *args);

#endif
