/* The shared index's bindings (csrc/index.c), listed in native.c's method table. */
#ifndef KVT_INDEX_H
#define KVT_INDEX_H

#include <Python.h>

/* The header's flags word. */
#define KVT_IDX_SUPERSEDED 1u     /* a newer table replaced this one: map that */
#define KVT_IDX_MISS_NOT_FINAL 2u /* a miss here may be a hit below DRAM: ask the daemon */

PyObject *kvt_py_index_format(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_many(PyObject *m, PyObject *args);
PyObject *kvt_py_index_remove(PyObject *m, PyObject *args);
PyObject *kvt_py_index_get(PyObject *m, PyObject *args);
PyObject *kvt_py_index_lookup(PyObject *m, PyObject *args);
PyObject *kvt_py_index_copy(PyObject *m, PyObject *args);
PyObject *kvt_py_index_info(PyObject *m, PyObject *args);
PyObject *kvt_py_index_set_flags(PyObject *m, PyObject *args);
PyObject *kvt_py_index_fingerprint(PyObject *m, PyObject *arg);
PyObject *kvt_py_index_fingerprints(PyObject *m, PyObject *args);

#endif
