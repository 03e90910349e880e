/* module.c: the CPython extension ddpc._C, the only file of the core that includes Python.h.
 * Multi-phase init with per-module state (exception types); one function maps a ddpc_status to a
 * Python exception; every blocking core call runs with the GIL released, in slices that check for
 * signals, so Ctrl-C works. Pointers and streams cross this boundary as integers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <math.h>

#include "ddpc.h"

/* ---------------------------------------------------------------- module state and errors */

typedef struct {
    PyObject *DistributedError;   /* base: RuntimeError */
    PyObject *TimeoutError;       /* DistributedError + builtin TimeoutError */
    PyObject *PeerError;          /* a rank died or aborted */
    PyObject *MismatchError;      /* ranks disagree */
    PyObject *AuthError;          /* store token refused */
    PyTypeObject *StoreType;
    PyTypeObject *StoreServerType;
    PyTypeObject *GroupType;
    PyTypeObject *WorkType;
    PyTypeObject *ReducerType;
    PyTypeObject *SamplerType;
    PyTypeObject *GradHooksType;
    PyTypeObject *GradHookType;
} ModState;

static PyModuleDef ddpc_module;

static ModState *state_of_module(PyObject *m) { return (ModState *)PyModule_GetState(m); }

static ModState *state_of_type(PyTypeObject *tp) {
    PyObject *m = PyType_GetModuleByDef(tp, &ddpc_module);
    return m ? state_of_module(m) : NULL;
}

/* Raises the exception for st with the core's thread-local message. An interrupt whose Python
 * exception (KeyboardInterrupt) is already set is passed through unchanged. */
static PyObject *raise_status(ModState *s, ddpc_status st) {
    if (st == DDPC_ERR_INTERRUPTED && PyErr_Occurred()) return NULL;
    const char *msg = ddpc_last_error();
    PyObject *exc;
    switch (st) {
    case DDPC_ERR_INVALID: exc = PyExc_ValueError; break;
    case DDPC_ERR_NOMEM: exc = PyExc_MemoryError; break;
    case DDPC_ERR_TIMEOUT: exc = s->TimeoutError; break;
    case DDPC_ERR_PEER: exc = s->PeerError; break;
    case DDPC_ERR_MISMATCH: exc = s->MismatchError; break;
    case DDPC_ERR_AUTH: exc = s->AuthError; break;
    case DDPC_ERR_NOTFOUND: exc = PyExc_KeyError; break;
    case DDPC_ERR_INTERRUPTED: exc = PyExc_KeyboardInterrupt; break;
    default: exc = s->DistributedError; break;
    }
    PyErr_SetString(exc, msg);
    return NULL;
}

/* Runs PyErr_CheckSignals from a core wait loop. The caller released the GIL with
 * Py_BEGIN_ALLOW_THREADS, so we take it back for the check only. */
static int interrupt_hook(void) {
    PyGILState_STATE gs = PyGILState_Ensure();
    int r = PyErr_CheckSignals();
    PyGILState_Release(gs);
    return r != 0;
}

/* Wraps a blocking core call: GIL released, interrupt checks enabled on this thread. */
#define DDPC_NOGIL(st, call)                 \
    do {                                     \
        Py_BEGIN_ALLOW_THREADS               \
        ddpc_thread_set_interruptible(1);    \
        (st) = (call);                       \
        ddpc_thread_set_interruptible(0);    \
        Py_END_ALLOW_THREADS                 \
    } while (0)

/* O& converter: a timeout in seconds (int or float) or a datetime.timedelta, as torch's store
 * takes it, into int64 milliseconds, -1 for none (float('inf')). NaN and negative values are a
 * ValueError: NaN would convert to an undefined int64. */
static int timeout_ms_converter(PyObject *o, void *out) {
    double v;
    if (PyObject_HasAttrString(o, "total_seconds")) {
        PyObject *r = PyObject_CallMethod(o, "total_seconds", NULL);
        if (!r) return 0;
        v = PyFloat_AsDouble(r);
        Py_DECREF(r);
    } else if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o))) {
        PyErr_Format(PyExc_TypeError,
                     "timeout must be a number of seconds or a datetime.timedelta, got %.100s",
                     Py_TYPE(o)->tp_name);
        return 0;
    } else {
        v = PyFloat_AsDouble(o);
    }
    if (v == -1.0 && PyErr_Occurred()) return 0;
    if (isnan(v) || v < 0) {
        PyErr_Format(PyExc_ValueError, "timeout must be a number of seconds >= 0 "
                     "(float('inf') waits without end), got %R", o);
        return 0;
    }
    double ms = v * 1000.0;
    *(int64_t *)out = ms > 9.0e15 ? -1 : (int64_t)ms;
    return 1;
}

/* ---------------------------------------------------------------- Store / StoreServer */

typedef struct {
    PyObject_HEAD
    DdpcStoreServer *srv;
} StoreServerObject;

static PyObject *StoreServer_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"host", "port", "token", NULL};
    const char *host = "127.0.0.1";
    int port = 0;
    const char *token = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "zis", kwlist, &host, &port, &token)) return NULL;
    ModState *s = state_of_type(tp);
    if (!s) return NULL;
    StoreServerObject *self = (StoreServerObject *)tp->tp_alloc(tp, 0);
    if (!self) return NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_server_start(host, port, token, &self->srv));
    if (st != DDPC_OK) {
        Py_DECREF(self);
        return raise_status(s, st);
    }
    return (PyObject *)self;
}

static void store_server_stop(StoreServerObject *self) {
    if (self->srv) {
        DdpcStoreServer *srv = self->srv;
        self->srv = NULL;
        Py_BEGIN_ALLOW_THREADS
        ddpc_store_server_stop(srv);
        Py_END_ALLOW_THREADS
    }
}

static void StoreServer_dealloc(StoreServerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    store_server_stop(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *StoreServer_port(StoreServerObject *self, void *closure) {
    (void)closure;
    if (!self->srv) return PyLong_FromLong(-1);
    return PyLong_FromLong(ddpc_store_server_port(self->srv));
}

static PyObject *StoreServer_stop(StoreServerObject *self, PyObject *unused) {
    (void)unused;
    store_server_stop(self);
    Py_RETURN_NONE;
}

static PyGetSetDef StoreServer_getset[] = {
    {"port", (getter)StoreServer_port, NULL, "the TCP port the server listens on", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef StoreServer_methods[] = {
    {"stop", (PyCFunction)StoreServer_stop, METH_NOARGS, "stop serving and close all clients"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot StoreServer_slots[] = {
    {Py_tp_new, StoreServer_new},
    {Py_tp_dealloc, StoreServer_dealloc},
    {Py_tp_getset, StoreServer_getset},
    {Py_tp_methods, StoreServer_methods},
    {Py_tp_doc, "StoreServer(host, port, token): the rendezvous store served by this process"},
    {0, NULL},
};

static PyType_Spec StoreServer_spec = {
    "ddpc._C.StoreServer", sizeof(StoreServerObject), 0, Py_TPFLAGS_DEFAULT, StoreServer_slots,
};

typedef struct {
    PyObject_HEAD
    DdpcStore *c;
} StoreObject;

static PyObject *Store_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"host", "port", "token", "rank", "timeout", NULL};
    const char *host = NULL;
    int port = 0;
    const char *token = NULL;
    int rank = -1;
    int64_t timeout_ms = 60000;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "zis|iO&", kwlist, &host, &port, &token, &rank,
                                     timeout_ms_converter, &timeout_ms))
        return NULL;
    ModState *s = state_of_type(tp);
    if (!s) return NULL;
    StoreObject *self = (StoreObject *)tp->tp_alloc(tp, 0);
    if (!self) return NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_connect(host, port, token, rank, timeout_ms, &self->c));
    if (st != DDPC_OK) {
        Py_DECREF(self);
        return raise_status(s, st);
    }
    return (PyObject *)self;
}

static void Store_dealloc(StoreObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->c) ddpc_store_close(self->c);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int store_ready(StoreObject *self) {
    if (self->c) return 1;
    PyErr_SetString(PyExc_ValueError, "the store connection is closed");
    return 0;
}

static PyObject *Store_close(StoreObject *self, PyObject *unused) {
    (void)unused;
    if (self->c) {
        ddpc_store_close(self->c);
        self->c = NULL;
    }
    Py_RETURN_NONE;
}

/* set(key, value) through `set`: ddpc_store_set, or ddpc_store_set_posted (no wait). */
static PyObject *store_set_with(StoreObject *self, PyObject *args,
                                ddpc_status (*set)(DdpcStore *, const char *, const void *,
                                                   size_t)) {
    const char *key;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "sO", &key, &obj)) return NULL;
    if (!store_ready(self)) return NULL;
    Py_buffer val;
    if (PyUnicode_Check(obj)) {
        /* a str is stored as its UTF-8 bytes, as torch's store does */
        Py_ssize_t n;
        const char *u = PyUnicode_AsUTF8AndSize(obj, &n);
        if (!u || PyBuffer_FillInfo(&val, obj, (void *)u, n, 1, PyBUF_SIMPLE) < 0) return NULL;
    } else if (PyObject_GetBuffer(obj, &val, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "store value must be bytes or str, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    ddpc_status st;
    DDPC_NOGIL(st, set(self->c, key, val.buf, (size_t)val.len));
    PyBuffer_Release(&val);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

static PyObject *Store_set(StoreObject *self, PyObject *args) {
    return store_set_with(self, args, ddpc_store_set);
}

static PyObject *Store_set_posted(StoreObject *self, PyObject *args) {
    return store_set_with(self, args, ddpc_store_set_posted);
}

static PyObject *Store_get(StoreObject *self, PyObject *args) {
    const char *key;
    int64_t timeout_ms = 600000;
    if (!PyArg_ParseTuple(args, "s|O&", &key, timeout_ms_converter, &timeout_ms)) return NULL;
    if (!store_ready(self)) return NULL;
    void *val = NULL;
    size_t len = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_get(self->c, key, timeout_ms, &val, &len));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    PyObject *r = PyBytes_FromStringAndSize(val, (Py_ssize_t)len);
    free(val);
    return r;
}

static PyObject *Store_add(StoreObject *self, PyObject *args) {
    const char *key;
    long long delta;
    if (!PyArg_ParseTuple(args, "sL", &key, &delta)) return NULL;
    if (!store_ready(self)) return NULL;
    int64_t out = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_add(self->c, key, (int64_t)delta, &out));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return PyLong_FromLongLong(out);
}

static PyObject *Store_compare_set(StoreObject *self, PyObject *args) {
    const char *key;
    Py_buffer exp, des;
    if (!PyArg_ParseTuple(args, "sy*y*", &key, &exp, &des)) return NULL;
    void *cur = NULL;
    size_t cur_len = 0;
    ddpc_status st = DDPC_OK;
    if (store_ready(self)) {
        DDPC_NOGIL(st, ddpc_store_cas(self->c, key, exp.len ? exp.buf : NULL, (size_t)exp.len,
                                      des.buf, (size_t)des.len, &cur, &cur_len));
    }
    PyBuffer_Release(&exp);
    PyBuffer_Release(&des);
    if (!self->c) return NULL;
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    PyObject *r = PyBytes_FromStringAndSize(cur, (Py_ssize_t)cur_len);
    free(cur);
    return r;
}

static PyObject *Store_delete_key(StoreObject *self, PyObject *args) {
    const char *key;
    if (!PyArg_ParseTuple(args, "s", &key)) return NULL;
    if (!store_ready(self)) return NULL;
    int deleted = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_delete(self->c, key, &deleted));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return PyBool_FromLong(deleted);
}

/* keys: a sequence of str. Fills a NULL-terminated array of borrowed UTF-8 pointers. */
static const char **keys_from_seq(PyObject *seq, Py_ssize_t *n, PyObject **fast) {
    if (PyUnicode_Check(seq)) {
        /* (a str is a sequence too: of one-letter keys) */
        PyErr_Format(PyExc_TypeError, "keys must be a list of str, got the str %R: pass [%R]",
                     seq, seq);
        return NULL;
    }
    *fast = PySequence_Fast(seq, "keys must be a list of str");
    if (!*fast) return NULL;
    *n = PySequence_Fast_GET_SIZE(*fast);
    const char **keys = PyMem_Calloc((size_t)*n + 1, sizeof(char *));
    if (!keys) { Py_CLEAR(*fast); PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(*fast, i);
        if (!PyUnicode_Check(k)) {
            PyErr_Format(PyExc_TypeError, "keys must be str, got %.100s at index %zd",
                         Py_TYPE(k)->tp_name, i);
            PyMem_Free(keys);
            Py_CLEAR(*fast);
            return NULL;
        }
        keys[i] = PyUnicode_AsUTF8(k);
        if (!keys[i]) { PyMem_Free(keys); Py_CLEAR(*fast); return NULL; }
    }
    return keys;
}

static PyObject *Store_check(StoreObject *self, PyObject *args) {
    PyObject *seq, *fast;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O", &seq)) return NULL;
    if (!store_ready(self)) return NULL;
    const char **keys = keys_from_seq(seq, &n, &fast);
    if (!keys) return NULL;
    int present = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_check(self->c, keys, (int)n, &present));
    PyMem_Free(keys);
    Py_DECREF(fast);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return PyBool_FromLong(present);
}

static PyObject *Store_wait(StoreObject *self, PyObject *args) {
    PyObject *seq, *fast;
    Py_ssize_t n;
    int64_t timeout_ms = 600000;
    if (!PyArg_ParseTuple(args, "O|O&", &seq, timeout_ms_converter, &timeout_ms)) return NULL;
    if (!store_ready(self)) return NULL;
    const char **keys = keys_from_seq(seq, &n, &fast);
    if (!keys) return NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_wait(self->c, keys, (int)n, timeout_ms));
    PyMem_Free(keys);
    Py_DECREF(fast);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

static PyObject *Store_num_keys(StoreObject *self, PyObject *unused) {
    (void)unused;
    if (!store_ready(self)) return NULL;
    int64_t n = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_store_num_keys(self->c, &n));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return PyLong_FromLongLong(n);
}

static PyMethodDef Store_methods[] = {
    {"set", (PyCFunction)Store_set, METH_VARARGS, "set(key, value: bytes | str)"},
    {"set_posted", (PyCFunction)Store_set_posted, METH_VARARGS,
     "set_posted(key, value: bytes): a set without waiting for its reply (at most 4 KiB); a "
     "refusal is raised by the next call on this store"},
    {"get", (PyCFunction)Store_get, METH_VARARGS,
     "get(key, timeout=600.0) -> bytes: waits until the key exists"},
    {"add", (PyCFunction)Store_add, METH_VARARGS, "add(key, delta) -> int: the new value"},
    {"compare_set", (PyCFunction)Store_compare_set, METH_VARARGS,
     "compare_set(key, expected: bytes, desired: bytes) -> bytes: the value now stored"},
    {"delete_key", (PyCFunction)Store_delete_key, METH_VARARGS, "delete_key(key) -> bool"},
    {"check", (PyCFunction)Store_check, METH_VARARGS, "check(keys) -> bool: all exist now"},
    {"wait", (PyCFunction)Store_wait, METH_VARARGS, "wait(keys, timeout=600.0)"},
    {"num_keys", (PyCFunction)Store_num_keys, METH_NOARGS, "num_keys() -> int"},
    {"close", (PyCFunction)Store_close, METH_NOARGS, "close the connection (a clean leave)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Store_slots[] = {
    {Py_tp_new, Store_new},
    {Py_tp_dealloc, Store_dealloc},
    {Py_tp_methods, Store_methods},
    {Py_tp_doc, "Store(host, port, token, rank=-1, timeout=60.0): a client of the rendezvous store"},
    {0, NULL},
};

static PyType_Spec Store_spec = {
    "ddpc._C.Store", sizeof(StoreObject), 0, Py_TPFLAGS_DEFAULT, Store_slots,
};

/* ---------------------------------------------------------------- Group / Work */

/* A collective whose Work object was dropped before it finished: the arrays it reads and writes
 * stay referenced until it does. Waiting in the Work's dealloc instead would make every
 * synchronous CUDA collective a host sync. */
typedef struct {
    DdpcWork *w;
    PyObject *keep;
} Parked;

typedef struct {
    PyObject_HEAD
    DdpcGroup *g;
    PyObject *store;   /* keeps the Store alive as long as the group */
    Parked *parked;
    Py_ssize_t nparked, cap_parked;
} GroupObject;

/* Releases parked works that have finished (all of them when `all`: the group is gone, so every
 * work has been completed by its destroy). */
static void reap_parked(GroupObject *self, int all) {
    Py_ssize_t n = self->nparked, kept = 0, ndrop = 0;
    if (n == 0) return;
    /* The arrays are let go only once the list is consistent again: letting one go can run
     * Python code (a __del__, the gc's callback), which may reap this group again. Out of memory
     * for that list, finished works stay parked until a later reap (all: they are let go here,
     * the group being gone). */
    PyObject **drop = PyMem_Malloc((size_t)n * sizeof *drop);
    if (!drop && !all) return;
    for (Py_ssize_t i = 0; i < n; i++) {
        Parked *p = &self->parked[i];
        if (all || ddpc_work_is_completed(p->w)) {
            ddpc_work_release(p->w);
            if (drop) drop[ndrop++] = p->keep;
            else Py_XDECREF(p->keep);
        } else {
            self->parked[kept++] = *p;
        }
    }
    self->nparked = kept;
    for (Py_ssize_t i = 0; i < ndrop; i++) Py_XDECREF(drop[i]);
    PyMem_Free(drop);
}

/* Takes over w and keep; 0 on success, -1 when out of memory (the caller must wait instead). */
static int park(GroupObject *self, DdpcWork *w, PyObject *keep) {
    reap_parked(self, 0);
    if (self->nparked == self->cap_parked) {
        Py_ssize_t cap = self->cap_parked ? self->cap_parked * 2 : 16;
        Parked *grown = PyMem_Realloc(self->parked, (size_t)cap * sizeof *grown);
        if (!grown) return -1;
        self->parked = grown;
        self->cap_parked = cap;
    }
    self->parked[self->nparked].w = w;
    self->parked[self->nparked].keep = keep;
    self->nparked++;
    return 0;
}

/* Takes over w: releases it now if it is done; else keeps it, with keep (the memory it uses; a
 * new reference is taken) alive until it is, parked with the group (go, when it still has one),
 * or, failing that, waits for it here. */
static void hold_until_done(GroupObject *go, DdpcWork *w, PyObject *keep) {
    if (ddpc_work_is_completed(w)) {
        ddpc_work_release(w);
        return;
    }
    Py_XINCREF(keep);
    if (go && go->g && park(go, w, keep) == 0) return;
    Py_XDECREF(keep);
    Py_BEGIN_ALLOW_THREADS
    ddpc_work_wait(w);
    Py_END_ALLOW_THREADS
    ddpc_work_release(w);
}

typedef struct {
    PyObject_HEAD
    DdpcWork *w;
    PyObject *keep;    /* the arrays the collective reads and writes, alive until it is done */
    PyObject *group;
} WorkObject;

static PyObject *Group_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"store", "rank", "world_size", "local_rank", "local_world_size",
                             "backend", "timeout", "prefix", "transport", "host_id",
                             "bind_addr", "device", NULL};
    PyObject *store;
    int rank, world, local_rank = -1, local_world = -1, transport = 0, device = -1;
    const char *backend = "cpu", *prefix = "g0", *host_id = "", *bind_addr = "127.0.0.1";
    int64_t timeout_ms = 600000;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oii|iisO&sissi", kwlist, &store, &rank, &world,
                                     &local_rank, &local_world, &backend, timeout_ms_converter,
                                     &timeout_ms, &prefix, &transport, &host_id, &bind_addr,
                                     &device))
        return NULL;
    ModState *s = state_of_type(tp);
    if (!s) return NULL;
    if (!PyObject_TypeCheck(store, s->StoreType) || !((StoreObject *)store)->c) {
        PyErr_SetString(PyExc_TypeError, "store must be an open ddpc._C.Store");
        return NULL;
    }
    GroupObject *self = (GroupObject *)tp->tp_alloc(tp, 0);
    if (!self) return NULL;
    DdpcGroupConfig cfg = {
        .rank = rank, .world_size = world, .local_rank = local_rank,
        .local_world_size = local_world, .backend = backend, .timeout_ms = timeout_ms,
        .store = ((StoreObject *)store)->c, .prefix = prefix, .transport = (ddpc_transport)transport,
        .host_id = host_id, .bind_addr = bind_addr, .cuda_device = device,
    };
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_create(&cfg, &self->g));
    if (st != DDPC_OK) {
        Py_DECREF(self);
        return raise_status(s, st);
    }
    Py_INCREF(store);
    self->store = store;
    return (PyObject *)self;
}

static void group_destroy(GroupObject *self) {
    if (self->g) {
        DdpcGroup *g = self->g;
        self->g = NULL;
        Py_BEGIN_ALLOW_THREADS
        ddpc_group_destroy(g);
        Py_END_ALLOW_THREADS
    }
    reap_parked(self, 1);
}

static void Group_dealloc(GroupObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    group_destroy(self);
    PyMem_Free(self->parked);
    Py_CLEAR(self->store);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int Group_traverse(GroupObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->store);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int group_ready(GroupObject *self) {
    if (self->g) return 1;
    PyErr_SetString(PyExc_ValueError, "the process group was destroyed");
    return 0;
}

static PyObject *Group_wait_idle(GroupObject *self, PyObject *unused) {
    (void)unused;
    if (!group_ready(self)) return NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_wait_idle(self->g));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

static PyObject *Group_destroy(GroupObject *self, PyObject *unused) {
    (void)unused;
    group_destroy(self);
    Py_RETURN_NONE;
}

/* post(op, send_ptr, recv_ptr, count, dtype, redop, root, device, stream, keep) -> Work */
static PyObject *Group_post(GroupObject *self, PyObject *args) {
    int op, dtype, redop, root, device;
    unsigned long long send, recv, stream;
    unsigned long long count;
    PyObject *keep;
    if (!PyArg_ParseTuple(args, "iKKKiiiiKO", &op, &send, &recv, &count, &dtype, &redop, &root,
                          &device, &stream, &keep))
        return NULL;
    if (!group_ready(self)) return NULL;
    ModState *s = state_of_type(Py_TYPE(self));
    if (self->nparked) reap_parked(self, 0);
    DdpcCollArgs a = {
        .op = (ddpc_coll)op, .send = (const void *)(uintptr_t)send,
        .recv = (void *)(uintptr_t)recv, .count = (size_t)count, .dtype = (ddpc_dtype)dtype,
        .redop = (ddpc_redop)redop, .root = root, .device = device, .stream = (uintptr_t)stream,
    };
    DdpcWork *w = NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_post(self->g, &a, &w));
    if (st != DDPC_OK) return raise_status(s, st);
    WorkObject *wo = PyObject_GC_New(WorkObject, s->WorkType);
    if (!wo) {
        ddpc_work_release(w);
        return NULL;
    }
    wo->w = w;
    Py_INCREF(keep);
    wo->keep = keep;
    Py_INCREF(self);
    wo->group = (PyObject *)self;
    PyObject_GC_Track(wo);
    return (PyObject *)wo;
}

static int dtype_arg(int code, const char *what);

/* rows_exchange(grad, grad_dtype, num_rows, width, sorted_ids, perm, n, src, src_dtype,
 *               wire_dtype, cap, buf, buf_bytes, skip, device, stream, keep): the embedding rows'
 * end of backward (ddpc_rows_exchange), queued on `stream`; keep (the tensors behind buf and the
 * rest) stays alive until the all-gather is done. */
static PyObject *Group_rows_exchange(GroupObject *self, PyObject *args) {
    unsigned long long grad, num_rows, width, ids, perm, n, src, cap, buf, buf_bytes, stream;
    int grad_dt, src_dt, wire_dt, device;
    long long skip;
    PyObject *keep;
    if (!PyArg_ParseTuple(args, "KiKKKKKKiiKKKLiKO", &grad, &grad_dt, &num_rows, &width, &ids,
                          &perm, &n, &src, &src_dt, &wire_dt, &cap, &buf, &buf_bytes, &skip,
                          &device, &stream, &keep))
        return NULL;
    if (!group_ready(self)) return NULL;
    if (!dtype_arg(grad_dt, "rows_exchange: grad") || !dtype_arg(src_dt, "rows_exchange: src") ||
        !dtype_arg(wire_dt, "rows_exchange: wire"))
        return NULL;
    ModState *s = state_of_type(Py_TYPE(self));
    if (self->nparked) reap_parked(self, 0);
    DdpcRowsExchange x = {
        .grad = (void *)(uintptr_t)grad, .grad_dtype = (ddpc_dtype)grad_dt,
        .num_rows = (size_t)num_rows, .width = (size_t)width,
        .sorted_ids = (const int64_t *)(uintptr_t)ids, .perm = (const int64_t *)(uintptr_t)perm,
        .n = (size_t)n, .src = (const void *)(uintptr_t)src, .src_dtype = (ddpc_dtype)src_dt,
        .wire_dtype = (ddpc_dtype)wire_dt, .cap = (size_t)cap, .buf = (void *)(uintptr_t)buf,
        .buf_bytes = (size_t)buf_bytes, .skip = (int64_t)skip, .device = device,
        .stream = (uintptr_t)stream,
    };
    DdpcWork *w = NULL;
    ddpc_status st;
    /* (launches and a post: the GIL goes for the post's locks) */
    DDPC_NOGIL(st, ddpc_rows_exchange(self->g, &x, &w));
    if (w) hold_until_done(self, w, keep);
    if (st != DDPC_OK) return raise_status(s, st);
    Py_RETURN_NONE;
}

/* all_reduce_now(ptr, count, dtype, redop, device, stream) -> bool: a synchronous all-reduce
 * queued on the caller's stream without a Work, when the backend has such a path for it (nccl:
 * small messages between the GPUs of one host); False means nothing was done: post it. */
static PyObject *Group_all_reduce_now(GroupObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 6) {
        PyErr_Format(PyExc_TypeError, "all_reduce_now takes 6 arguments, got %zd", n);
        return NULL;
    }
    unsigned long long ptr = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long count = PyLong_AsUnsignedLongLong(args[1]);
    long dtype = PyLong_AsLong(args[2]), redop = PyLong_AsLong(args[3]);
    long device = PyLong_AsLong(args[4]);
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (!group_ready(self)) return NULL;
    if (dtype < 0 || dtype >= DDPC_NUM_DTYPES || redop < 0 || redop >= DDPC_NUM_REDOPS) {
        PyErr_Format(PyExc_ValueError, "all_reduce_now: dtype %ld / redop %ld out of range",
                     dtype, redop);
        return NULL;
    }
    DdpcCollArgs a = {
        .op = DDPC_COLL_ALLREDUCE, .send = NULL, .recv = (void *)(uintptr_t)ptr,
        .count = (size_t)count, .dtype = (ddpc_dtype)dtype, .redop = (ddpc_redop)redop,
        .root = 0, .device = (int)device, .stream = (uintptr_t)stream,
    };
    int ran = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_all_reduce_now(self->g, &a, &ran));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return PyBool_FromLong(ran);
}

static PyObject *Group_abort(GroupObject *self, PyObject *args) {
    const char *why;
    if (!PyArg_ParseTuple(args, "s", &why)) return NULL;
    if (!group_ready(self)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ddpc_group_abort(self->g, DDPC_ERR_PEER, why);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Group_get_destroyed(GroupObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->g == NULL);
}
static PyObject *Group_get_rank(GroupObject *self, void *c) {
    (void)c;
    return group_ready(self) ? PyLong_FromLong(ddpc_group_rank(self->g)) : NULL;
}
static PyObject *Group_get_size(GroupObject *self, void *c) {
    (void)c;
    return group_ready(self) ? PyLong_FromLong(ddpc_group_size(self->g)) : NULL;
}
static PyObject *Group_get_backend(GroupObject *self, void *c) {
    (void)c;
    return group_ready(self) ? PyUnicode_FromString(ddpc_group_backend(self->g)) : NULL;
}
static PyObject *Group_get_transport(GroupObject *self, void *c) {
    (void)c;
    return group_ready(self) ? PyUnicode_FromString(ddpc_group_transport(self->g)) : NULL;
}
static PyObject *Group_get_timeout(GroupObject *self, void *c) {
    (void)c;
    return group_ready(self) ? PyFloat_FromDouble(ddpc_group_timeout_ms(self->g) / 1000.0) : NULL;
}

static PyObject *Group_get_fast_max_bytes(GroupObject *self, void *c) {
    (void)c;
    return group_ready(self) ? PyLong_FromSize_t(ddpc_group_fast_max_bytes(self->g)) : NULL;
}

static PyObject *Group_get_staged_min_bytes(GroupObject *self, void *c) {
    (void)c;
    return group_ready(self) ? PyLong_FromSize_t(ddpc_group_staged_min_bytes(self->g)) : NULL;
}

static PyObject *Group_get_deferred_count(GroupObject *self, void *c) {
    (void)c;
    if (!group_ready(self)) return NULL;
    return PyLong_FromUnsignedLongLong(ddpc_group_deferred_count(self->g));
}

/* trace_start(capacity) */
/* window_alloc(bytes) -> (address, why): a symmetric window (collective; nccl), or (0, why) */
static PyObject *Group_window_alloc(GroupObject *self, PyObject *args) {
    unsigned long long bytes;
    if (!PyArg_ParseTuple(args, "K", &bytes)) return NULL;
    if (!group_ready(self)) return NULL;
    void *ptr = NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_window_alloc(self->g, (size_t)bytes, &ptr));
    /* Unavailable on every rank alike (the ranks voted): the caller goes on without. */
    if (st == DDPC_ERR_UNAVAILABLE) return Py_BuildValue("(is)", 0, ddpc_last_error());
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return Py_BuildValue("(Ks)", (unsigned long long)(uintptr_t)ptr, "");
}

static PyObject *Group_trace_start(GroupObject *self, PyObject *args) {
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "n", &capacity)) return NULL;
    if (!group_ready(self)) return NULL;
    if (capacity < 1) {
        PyErr_Format(PyExc_ValueError, "a trace needs room for at least one row, got capacity=%zd",
                     capacity);
        return NULL;
    }
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_trace_start(self->g, (size_t)capacity));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

/* trace_mark(stream) */
static PyObject *Group_trace_mark(GroupObject *self, PyObject *args) {
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "K", &stream)) return NULL;
    if (!group_ready(self)) return NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_trace_mark(self->g, (uintptr_t)stream));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

/* trace_stop() -> (rows, dropped); a row is (seq, op, dtype, count, path, deferred, ready, start,
 * wire, reduced, done), the times in ms (NaN where not recorded). */
static PyObject *Group_trace_stop(GroupObject *self, PyObject *unused) {
    (void)unused;
    if (!group_ready(self)) return NULL;
    DdpcTraceRow *rows = NULL;
    size_t n = 0;
    uint64_t dropped = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_group_trace_stop(self->g, &rows, &n, &dropped));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (!list) {
        free(rows);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        const DdpcTraceRow *r = &rows[i];
        PyObject *t = Py_BuildValue("(Kiinii" "ddddd)", (unsigned long long)r->seq, r->op,
                                    r->dtype, (Py_ssize_t)r->count, r->path, r->deferred,
                                    r->ms[0], r->ms[1], r->ms[2], r->ms[3], r->ms[4]);
        if (!t) {
            Py_DECREF(list);
            free(rows);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    free(rows);
    return Py_BuildValue("(NK)", list, (unsigned long long)dropped);
}

static PyGetSetDef Group_getset[] = {
    {"rank", (getter)Group_get_rank, NULL, NULL, NULL},
    {"destroyed", (getter)Group_get_destroyed, NULL, "True once destroy() ran", NULL},
    {"world_size", (getter)Group_get_size, NULL, NULL, NULL},
    {"backend", (getter)Group_get_backend, NULL, NULL, NULL},
    {"transport", (getter)Group_get_transport, NULL, NULL, NULL},
    {"timeout", (getter)Group_get_timeout, NULL, "seconds", NULL},
    {"fast_max_bytes", (getter)Group_get_fast_max_bytes, NULL,
     "largest all_reduce that takes the one-shot path (bytes; 0: none)", NULL},
    {"staged_min_bytes", (getter)Group_get_staged_min_bytes, NULL,
     "smallest all_reduce that goes through pinned host memory on the copy engines (bytes; 0: "
     "none)", NULL},
    {"deferred_count", (getter)Group_get_deferred_count, NULL,
     "collectives issued so far by the backend's posting thread for their callers (the "
     "gradient buckets of wrap_model; 0 on the cpu backend)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* reap(): lets go of the arrays of dropped collectives that have finished, which are otherwise
 * let go at this group's next collective (ddpc.distributed calls it from the gc's callback, so
 * `del model; gc.collect()` frees what the model's last collectives held). */
static PyObject *Group_reap(GroupObject *self, PyObject *unused) {
    (void)unused;
    reap_parked(self, 0);
    Py_RETURN_NONE;
}

static PyMethodDef Group_methods[] = {
    {"reap", (PyCFunction)Group_reap, METH_NOARGS,
     "reap(): let go of the arrays of dropped collectives that have finished (else at the next "
     "collective)"},
    {"post", (PyCFunction)Group_post, METH_VARARGS,
     "post(op, send_ptr, recv_ptr, count, dtype, redop, root, device, stream, keep) -> Work"},
    {"all_reduce_now", (PyCFunction)(void (*)(void))Group_all_reduce_now, METH_FASTCALL,
     "all_reduce_now(ptr, count, dtype, redop, device, stream) -> bool: a synchronous all-reduce "
     "on the caller's stream without a Work when the backend has a path for it; False: post it"},
    {"rows_exchange", (PyCFunction)Group_rows_exchange, METH_VARARGS,
     "rows_exchange(grad, grad_dtype, num_rows, width, sorted_ids, perm, n, src, src_dtype, "
     "wire_dtype, cap, buf, buf_bytes, skip, device, stream, keep): the embedding rows' end of "
     "backward (nccl), queued on stream"},
    {"window_alloc", (PyCFunction)Group_window_alloc, METH_VARARGS,
     "window_alloc(bytes) -> (address, why): device memory registered as an NCCL symmetric "
     "window on every rank (collective; it lives as long as the group); address 0 and the "
     "reason when some rank could not have it"},
    {"trace_start", (PyCFunction)Group_trace_start, METH_VARARGS,
     "trace_start(capacity): record CUDA events at each collective's points from now on (nccl)"},
    {"trace_mark", (PyCFunction)Group_trace_mark, METH_VARARGS,
     "trace_mark(stream): a mark on the stream; the first one is the trace's time zero"},
    {"trace_stop", (PyCFunction)Group_trace_stop, METH_NOARGS,
     "trace_stop() -> (rows, dropped): wait for the trace's events and return its rows"},
    {"abort", (PyCFunction)Group_abort, METH_VARARGS,
     "abort(why): fail this and every later collective on every rank with this message"},
    {"destroy", (PyCFunction)Group_destroy, METH_NOARGS, "free the group"},
    {"wait_idle", (PyCFunction)Group_wait_idle, METH_NOARGS,
     "wait_idle(): every collective posted so far on this rank has finished or failed"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Group_slots[] = {
    {Py_tp_new, Group_new},
    {Py_tp_dealloc, Group_dealloc},
    {Py_tp_traverse, Group_traverse},
    {Py_tp_getset, Group_getset},
    {Py_tp_methods, Group_methods},
    {Py_tp_doc, "Group(store, rank, world_size, ...): a process group of the C core"},
    {0, NULL},
};

static PyType_Spec Group_spec = {
    "ddpc._C.Group", sizeof(GroupObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, Group_slots,
};

static void Work_dealloc(WorkObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    /* Dropping an unfinished collective must not free memory it still writes to: its arrays
     * are parked with the group until it finishes (or, failing that, we wait). */
    if (self->w) hold_until_done((GroupObject *)self->group, self->w, self->keep);
    Py_CLEAR(self->keep);
    Py_CLEAR(self->group);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int Work_traverse(WorkObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->keep);
    Py_VISIT(self->group);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static PyObject *Work_wait(WorkObject *self, PyObject *args) {
    unsigned long long stream = 0;
    int use_stream = 0;
    if (!PyArg_ParseTuple(args, "|Kp", &stream, &use_stream)) return NULL;
    ddpc_status st;
    if (use_stream) {
        DDPC_NOGIL(st, ddpc_work_wait_stream(self->w, (uintptr_t)stream));
    } else {
        DDPC_NOGIL(st, ddpc_work_wait(self->w));
    }
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_TRUE;
}

static PyObject *Work_is_completed(WorkObject *self, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(ddpc_work_is_completed(self->w));
}

static PyObject *Work_failed(WorkObject *self, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(ddpc_work_failed(self->w));
}

static PyObject *Work_get_seq(WorkObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(ddpc_work_seq(self->w));
}

static PyGetSetDef Work_getset[] = {
    {"seq", (getter)Work_get_seq, NULL, "sequence number of the collective (1-based)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Work_methods[] = {
    {"wait", (PyCFunction)Work_wait, METH_VARARGS,
     "wait(stream=0, device_side=False) -> True; raises DistributedError on failure"},
    {"is_completed", (PyCFunction)Work_is_completed, METH_NOARGS, "is_completed() -> bool"},
    {"failed", (PyCFunction)Work_failed, METH_NOARGS,
     "failed() -> bool: completed with an error (wait() raises it)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Work_slots[] = {
    {Py_tp_dealloc, Work_dealloc},
    {Py_tp_traverse, Work_traverse},
    {Py_tp_getset, Work_getset},
    {Py_tp_methods, Work_methods},
    {Py_tp_doc, "handle of an asynchronous collective"},
    {0, NULL},
};

static PyType_Spec Work_spec = {
    "ddpc._C.Work", sizeof(WorkObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, Work_slots,
};

/* ---------------------------------------------------------------- Reducer (reducer.c) */
/* BEGIN REDUCER BINDINGS */

typedef struct {
    PyObject_HEAD
    DdpcReducer *r;
    PyObject *group;   /* the GroupObject whose DdpcGroup the reducer posts to */
    PyObject *keep;    /* list: per bucket, the owner of its memory while the reducer points to
                        * it; then per bucket, its wire buffer's; then per parameter, the
                        * gradient that went to the wire from where it lay (until finalize
                        * wrote the averaged values back into it) */
    int *scratch;      /* nparams ints for unready() */
    int nparams;
    int nbuckets;
} ReducerObject;

/* Drops the gradients held for the reducer's writes back (slots 2 * nbuckets ...). */
static int reducer_drop_grads(ReducerObject *self) {
    if (!self->keep) return 0;
    for (Py_ssize_t k = 2 * (Py_ssize_t)self->nbuckets; k < PyList_GET_SIZE(self->keep); k++) {
        if (PyList_GET_ITEM(self->keep, k) == Py_None) continue;
        Py_INCREF(Py_None);
        if (PyList_SetItem(self->keep, k, Py_None) < 0) return -1;
    }
    return 0;
}

/* Fills out[0..n) from a sequence of ints (NULL seq: leaves out alone and returns 0). */
static int ints_from_seq(PyObject *seq, Py_ssize_t n, const char *what, long long lo,
                         long long hi, long long *out) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s must have %zd entries (one per parameter), got %zd",
                     what, n, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
        if (v < lo || v > hi) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] is %lld, expected a value in [%lld, %lld]",
                         what, i, v, lo, hi);
            Py_DECREF(fast);
            return -1;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *Reducer_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"group", "numels", "dtypes", "devices", "order", "late",
                             "first_bucket_bytes", "bucket_cap_bytes", "comm_dtype", NULL};
    PyObject *group, *numels_o, *dtypes_o, *devices_o, *order_o = Py_None, *late_o = Py_None;
    Py_ssize_t first_bytes = (Py_ssize_t)1 << 20, cap_bytes = (Py_ssize_t)25 << 20;
    int comm_dtype = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|OOnni", kwlist, &group, &numels_o,
                                     &dtypes_o, &devices_o, &order_o, &late_o, &first_bytes,
                                     &cap_bytes, &comm_dtype))
        return NULL;
    if (first_bytes <= 0 || cap_bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "Reducer: bucket sizes must be > 0 bytes (first %zd, cap "
                     "%zd)", first_bytes, cap_bytes);
        return NULL;
    }
    ModState *s = state_of_type(tp);
    if (!s) return NULL;
    if (!PyObject_TypeCheck(group, s->GroupType) || !((GroupObject *)group)->g) {
        PyErr_SetString(PyExc_TypeError, "group must be a live ddpc._C.Group");
        return NULL;
    }
    Py_ssize_t n = PySequence_Size(numels_o);
    if (n < 0) return NULL;
    if (n > INT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "numels has %zd entries, too many parameters", n);
        return NULL;
    }
    size_t cnt = (size_t)n + 1;
    long long *tmp = PyMem_Calloc(cnt * 5, sizeof(long long));
    size_t *numels = PyMem_Calloc(cnt, sizeof(size_t));
    ddpc_dtype *dtypes = PyMem_Calloc(cnt, sizeof(ddpc_dtype));
    int *devices = PyMem_Calloc(cnt, sizeof(int));
    int *order = PyMem_Calloc(cnt, sizeof(int));
    uint8_t *late = PyMem_Calloc(cnt, 1);
    int *scratch = PyMem_Calloc(cnt, sizeof(int));
    ReducerObject *self = NULL;
    if (!tmp || !numels || !dtypes || !devices || !order || !late || !scratch) {
        PyErr_NoMemory();
        goto fail;
    }
    long long *t_num = tmp, *t_dt = tmp + cnt, *t_dev = tmp + 2 * cnt, *t_ord = tmp + 3 * cnt,
              *t_late = tmp + 4 * cnt;
    if (ints_from_seq(numels_o, n, "numels", 0, INT64_MAX, t_num) < 0 ||
        ints_from_seq(dtypes_o, n, "dtypes", 0, DDPC_NUM_DTYPES - 1, t_dt) < 0 ||
        ints_from_seq(devices_o, n, "devices", -1, INT32_MAX, t_dev) < 0 ||
        (order_o != Py_None && ints_from_seq(order_o, n, "order", 0, n - 1, t_ord) < 0) ||
        (late_o != Py_None && ints_from_seq(late_o, n, "late", 0, 1, t_late) < 0))
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        numels[i] = (size_t)t_num[i];
        dtypes[i] = (ddpc_dtype)t_dt[i];
        devices[i] = (int)t_dev[i];
        order[i] = (int)t_ord[i];
        late[i] = (uint8_t)t_late[i];
    }
    self = (ReducerObject *)tp->tp_alloc(tp, 0);
    if (!self) goto fail;
    Py_INCREF(group);
    self->group = group;
    self->nparams = (int)n;
    ddpc_status st = ddpc_reducer_create(((GroupObject *)group)->g, (int)n, numels, dtypes,
                                         devices, order_o != Py_None ? order : NULL,
                                         late_o != Py_None ? late : NULL, (size_t)first_bytes,
                                         (size_t)cap_bytes, comm_dtype, &self->r);
    if (st != DDPC_OK) {
        raise_status(s, st);
        goto fail;
    }
    Py_ssize_t nb = ddpc_reducer_num_buckets(self->r);
    self->nbuckets = (int)nb;
    self->keep = PyList_New(2 * nb + n);
    if (!self->keep) goto fail;
    for (Py_ssize_t b = 0; b < 2 * nb + n; b++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(self->keep, b, Py_None);
    }
    self->scratch = scratch;
    scratch = NULL;
    PyMem_Free(tmp);
    PyMem_Free(numels);
    PyMem_Free(dtypes);
    PyMem_Free(devices);
    PyMem_Free(order);
    PyMem_Free(late);
    return (PyObject *)self;
fail:
    Py_XDECREF(self);
    PyMem_Free(tmp);
    PyMem_Free(numels);
    PyMem_Free(dtypes);
    PyMem_Free(devices);
    PyMem_Free(order);
    PyMem_Free(late);
    PyMem_Free(scratch);
    return NULL;
}

static int reducer_group_alive(ReducerObject *self) {
    return self->group && ((GroupObject *)self->group)->g != NULL;
}

static int reducer_ready(ReducerObject *self) {
    if (!self->r) {
        PyErr_SetString(PyExc_ValueError, "the reducer was closed");
        return 0;
    }
    if (!reducer_group_alive(self)) {
        PyErr_SetString(PyExc_ValueError, "the reducer's process group was destroyed");
        return 0;
    }
    return 1;
}

static void reducer_close(ReducerObject *self) {
    if (!self->r) return;
    DdpcReducer *r = self->r;
    self->r = NULL;
    /* Without its group the reducer cannot release its work objects safely: leak it instead.
     * Otherwise wait for collectives that still write into the buffers held in keep. */
    if (!reducer_group_alive(self)) return;
    Py_BEGIN_ALLOW_THREADS
    ddpc_reducer_destroy(r);
    Py_END_ALLOW_THREADS
}

static void Reducer_dealloc(ReducerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    reducer_close(self);
    Py_CLEAR(self->keep);
    Py_CLEAR(self->group);
    PyMem_Free(self->scratch);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int Reducer_traverse(ReducerObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->group);
    Py_VISIT(self->keep);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static PyObject *Reducer_bucket_info(ReducerObject *self, PyObject *args) {
    int b;
    if (!PyArg_ParseTuple(args, "i", &b)) return NULL;
    if (!reducer_ready(self)) return NULL;
    ddpc_dtype dt;
    int dev;
    size_t count;
    ddpc_status st = ddpc_reducer_bucket_info(self->r, b, &dt, &dev, &count);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return Py_BuildValue("iini", (int)dt, dev, (Py_ssize_t)count,
                         ddpc_reducer_bucket_comm_dtype(self->r, b));
}

static PyObject *Reducer_param_slot(ReducerObject *self, PyObject *args) {
    int i;
    if (!PyArg_ParseTuple(args, "i", &i)) return NULL;
    if (!reducer_ready(self)) return NULL;
    int b;
    size_t off;
    ddpc_status st = ddpc_reducer_param_slot(self->r, i, &b, &off);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    return Py_BuildValue("in", b, (Py_ssize_t)off);
}

static PyObject *Reducer_set_bucket_memory(ReducerObject *self, PyObject *args) {
    int b;
    unsigned long long ptr;
    PyObject *keep = Py_None;
    if (!PyArg_ParseTuple(args, "iK|O", &b, &ptr, &keep)) return NULL;
    if (!reducer_ready(self)) return NULL;
    ddpc_status st = ddpc_reducer_set_bucket_memory(self->r, b, (void *)(uintptr_t)ptr);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    /* b is valid now; the bucket's previous owner may go (the reducer no longer points to it) */
    Py_INCREF(keep);
    if (PyList_SetItem(self->keep, b, keep) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Reducer_set_bucket_wire(ReducerObject *self, PyObject *args) {
    int b;
    unsigned long long ptr;
    PyObject *keep;
    if (!PyArg_ParseTuple(args, "iKO", &b, &ptr, &keep)) return NULL;
    if (!reducer_ready(self)) return NULL;
    ddpc_status st = ddpc_reducer_set_bucket_wire(self->r, b, (void *)(uintptr_t)ptr);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_INCREF(keep);
    if (PyList_SetItem(self->keep, self->nbuckets + b, keep) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Reducer_set_bucket_summed(ReducerObject *self, PyObject *args) {
    int b, summed;
    if (!PyArg_ParseTuple(args, "ip", &b, &summed)) return NULL;
    if (!reducer_ready(self)) return NULL;
    ddpc_status st = ddpc_reducer_set_bucket_summed(self->r, b, summed);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

static PyObject *Reducer_release_bucket(ReducerObject *self, PyObject *args) {
    int b;
    if (!PyArg_ParseTuple(args, "i", &b)) return NULL;
    if (!reducer_ready(self)) return NULL;
    ddpc_status st = ddpc_reducer_release_bucket(self->r, b);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_INCREF(Py_None);
    if (PyList_SetItem(self->keep, b, Py_None) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Reducer_prepare(ReducerObject *self, PyObject *unused) {
    (void)unused;
    if (!reducer_ready(self)) return NULL;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_reducer_prepare(self->r));
    /* An unfinished step's collectives are drained by now: its gradients may go. */
    if (reducer_drop_grads(self) < 0) return NULL;
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

/* Called from a gradient hook once per parameter per step: no tuple. */
static PyObject *Reducer_mark_ready(ReducerObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "mark_ready(i, stream=0) takes 1 or 2 arguments, got %zd",
                     nargs);
        return NULL;
    }
    int overflow = 0;
    long i = PyLong_AsLongAndOverflow(args[0], &overflow);
    if (i == -1 && PyErr_Occurred()) return NULL;
    uintptr_t stream = 0;
    if (nargs == 2) {
        unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        stream = (uintptr_t)v;
    }
    if (!reducer_ready(self)) return NULL;
    if (overflow || i < 0 || i >= self->nparams) {
        PyErr_Format(PyExc_ValueError, "mark_ready: parameter index must be in [0, %d)",
                     self->nparams);
        return NULL;
    }
    /* The GIL stays held, even when this launches a collective (a short, non-blocking post):
     * close() from another thread could otherwise free the reducer under this call. */
    ddpc_status st = ddpc_reducer_mark_ready(self->r, (int)i, stream);
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    Py_RETURN_NONE;
}

static PyObject *int_list(const int *v, int n) {
    PyObject *l = PyList_New(n);
    if (!l) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (!x) { Py_DECREF(l); return NULL; }
        PyList_SET_ITEM(l, i, x);
    }
    return l;
}

/* A list of parameter indices that the reducer writes into its scratch array. */
static PyObject *reducer_indices(ReducerObject *self, int (*get)(DdpcReducer *, int *)) {
    if (!reducer_ready(self)) return NULL;
    int n = get(self->r, self->scratch);
    return int_list(self->scratch, n);
}

static PyObject *Reducer_unready(ReducerObject *self, PyObject *unused) {
    (void)unused;
    return reducer_indices(self, ddpc_reducer_unready);
}

static PyObject *Reducer_finalize(ReducerObject *self, PyObject *args) {
    unsigned long long stream = 0;
    if (!PyArg_ParseTuple(args, "|K", &stream)) return NULL;
    if (!reducer_ready(self)) return NULL;
    int unused = 0;
    ddpc_status st;
    DDPC_NOGIL(st, ddpc_reducer_finalize(self->r, (uintptr_t)stream, &unused));
    if (st != DDPC_OK) return raise_status(state_of_type(Py_TYPE(self)), st);
    /* The writes back are queued; the gradients stay their parameters' (the allocator orders
     * any reuse of their memory after them on the stream). */
    if (reducer_drop_grads(self) < 0) return NULL;
    return PyLong_FromLong(unused);
}

static PyObject *Reducer_take_flushed(ReducerObject *self, PyObject *unused) {
    (void)unused;
    return reducer_indices(self, ddpc_reducer_take_flushed);
}

static PyObject *Reducer_host_times(ReducerObject *self, PyObject *args) {
    int reset = 1;
    if (!PyArg_ParseTuple(args, "|p", &reset)) return NULL;
    if (!reducer_ready(self)) return NULL;
    uint64_t t[2];
    ddpc_reducer_host_times(self->r, t, reset);
    return Py_BuildValue("(dd)", t[0] * 1e-6, t[1] * 1e-6);
}

static PyObject *Reducer_observed_order(ReducerObject *self, PyObject *unused) {
    (void)unused;
    if (!reducer_ready(self)) return NULL;
    size_t n = (size_t)self->nparams + 1;
    int *order = PyMem_Calloc(n, sizeof(int));
    int *count = PyMem_Calloc(n, sizeof(int));
    PyObject *res = NULL;
    if (!order || !count) {
        PyErr_NoMemory();
        goto out;
    }
    ddpc_status st = ddpc_reducer_observed_order(self->r, order, count);
    if (st != DDPC_OK) {
        raise_status(state_of_type(Py_TYPE(self)), st);
        goto out;
    }
    PyObject *o = int_list(order, self->nparams);
    PyObject *c = o ? int_list(count, self->nparams) : NULL;
    if (o && c) res = PyTuple_Pack(2, o, c);
    Py_XDECREF(o);
    Py_XDECREF(c);
out:
    PyMem_Free(order);
    PyMem_Free(count);
    return res;
}

static PyObject *Reducer_close(ReducerObject *self, PyObject *unused) {
    (void)unused;
    int alive = self->r != NULL && reducer_group_alive(self);
    reducer_close(self);
    /* Nothing writes into the buckets any more: their owners may go now, not when the last
     * reference to this object does (a leaked reducer keeps them: a collective may be running). */
    if (alive && self->keep) {
        for (Py_ssize_t b = 0; b < PyList_GET_SIZE(self->keep); b++) {
            Py_INCREF(Py_None);
            if (PyList_SetItem(self->keep, b, Py_None) < 0) return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Reducer_get_num_buckets(ReducerObject *self, void *c) {
    (void)c;
    return reducer_ready(self) ? PyLong_FromLong(ddpc_reducer_num_buckets(self->r)) : NULL;
}

static PyObject *Reducer_get_num_params(ReducerObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->nparams);
}

static PyGetSetDef Reducer_getset[] = {
    {"num_buckets", (getter)Reducer_get_num_buckets, NULL, NULL, NULL},
    {"num_params", (getter)Reducer_get_num_params, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Reducer_methods[] = {
    {"bucket_info", (PyCFunction)Reducer_bucket_info, METH_VARARGS,
     "bucket_info(b) -> (dtype code, device, count, comm dtype code or -1)"},
    {"param_slot", (PyCFunction)Reducer_param_slot, METH_VARARGS,
     "param_slot(i) -> (bucket, element offset)"},
    {"set_bucket_memory", (PyCFunction)Reducer_set_bucket_memory, METH_VARARGS,
     "set_bucket_memory(b, ptr, keep=None): keep owns the memory; the reducer holds "
     "it until bucket b's memory changes or the reducer goes. Allowed between steps, and in a "
     "step before any of b's gradients is marked ready"},
    {"release_bucket", (PyCFunction)Reducer_release_bucket, METH_VARARGS,
     "release_bucket(b): the reducer forgets bucket b's memory (and its keep) until the next "
     "set_bucket_memory(b, ...), which must come before b's gradients are marked ready or the "
     "step is finalized"},
    {"prepare", (PyCFunction)Reducer_prepare, METH_NOARGS, "start a step"},
    {"mark_ready", (PyCFunction)(void (*)(void))Reducer_mark_ready, METH_FASTCALL,
     "mark_ready(i, stream=0): parameter i's gradient is in its slot"},
    {"set_bucket_summed", (PyCFunction)Reducer_set_bucket_summed, METH_VARARGS,
     "set_bucket_summed(b, summed): bucket b's wire is summed and the cast back divides by the "
     "world size (a wire in a symmetric window)"},
    {"set_bucket_wire", (PyCFunction)Reducer_set_bucket_wire, METH_VARARGS,
     "set_bucket_wire(b, ptr, owner): bucket b's wire buffer for the reducer's life"},
    {"unready", (PyCFunction)Reducer_unready, METH_NOARGS,
     "unready() -> [i, ...]: parameters not marked ready so far this step"},
    {"finalize", (PyCFunction)Reducer_finalize, METH_VARARGS,
     "finalize(stream=0) -> number of unused parameters: zero, launch the rest, wait for all"},
    {"take_flushed", (PyCFunction)Reducer_take_flushed, METH_NOARGS,
     "take_flushed() -> [i, ...]: parameters whose gradients were copied into their slots since "
     "the last call (a bucket's go in one batch when it launches); until then .grad stays on "
     "the gradient autograd made"},
    {"host_times", (PyCFunction)Reducer_host_times, METH_VARARGS,
     "host_times(reset=True) -> (mark ms, launch ms): host time spent queueing gradient "
     "copies and bucket collectives since the last reset"},
    {"observed_order", (PyCFunction)Reducer_observed_order, METH_NOARGS,
     "observed_order() -> (order, ready_counts) of the last finished step"},
    {"close", (PyCFunction)Reducer_close, METH_NOARGS,
     "wait for collectives in flight and free the reducer"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Reducer_slots[] = {
    {Py_tp_new, Reducer_new},
    {Py_tp_dealloc, Reducer_dealloc},
    {Py_tp_traverse, Reducer_traverse},
    {Py_tp_getset, Reducer_getset},
    {Py_tp_methods, Reducer_methods},
    {Py_tp_doc, "Reducer(group, numels, dtypes, devices, order=None, late=None, "
                "first_bucket_bytes=1 MiB, bucket_cap_bytes=25 MiB, comm_dtype=-1): the gradient "
                "reducer of the C core"},
    {0, NULL},
};

static PyType_Spec Reducer_spec = {
    "ddpc._C.Reducer", sizeof(ReducerObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    Reducer_slots,
};

/* END REDUCER BINDINGS */

/* ---------------------------------------------------------------- gradient hooks */

/* The per-parameter post-accumulate-grad hooks of a wrapped model run once per parameter per
 * step, on the host path that keeps the GPU fed: the common case (the gradient already lies in
 * its bucket slot during a synced backward) is handled here without running Python; anything
 * else goes to the Python `slow(param, index)` callable. GradHooks is the state the wrapper
 * keeps current (reducer, its views list, the stream, whether the fast path applies now);
 * GradHook(hooks, i) is the callable registered on parameter i. */
typedef struct {
    PyObject_HEAD
    ReducerObject *reducer; /* None until set */
    PyObject *views;        /* list: views[i] is parameter i's slot (or None) */
    PyObject *params;       /* list of the parameters, for .grad once copied into their slots */
    PyObject *names;        /* list of parameter names, for messages */
    PyObject *slow;         /* callable(param, index) */
    PyObject *current_stream; /* callable(device) -> the current stream's handle, or NULL */
    PyObject *need_wire;    /* callable(index): gives parameter index's bucket its wire buffer */
    PyObject *need_memory;  /* callable(index, grad): gives a released bucket memory again */
    PyObject *strides;      /* list or NULL: strides[i] is None when parameter i's slot is
                             * row-major, else the slot's strides (its parameter's: channels_last,
                             * a transposed weight). A fresh gradient with exactly these strides
                             * has the slot's memory image and is copied as one block; one with
                             * others takes the Python path, which copies element by element */
    int device;             /* the CUDA device of the parameters, -1 on the host */
    unsigned long long stream;
    char fast;              /* a synced backward is running and its end is queued */
    char to_wire;           /* fresh gradients of wire buckets go straight to the wire */
    /* host time in the hooks, for the wrapper's host_times() */
    unsigned long long calls, hook_ns, wire_ns, memory_ns, attach_ns, slow_ns;
} GradHooksObject;

typedef struct {
    PyObject_HEAD
    GradHooksObject *hooks;
    Py_ssize_t index;
    PyObject *index_obj;
} GradHookObject;

static PyObject *g_str_grad;          /* interned "grad" */
static PyObject *g_str_is_contiguous; /* interned "is_contiguous" */
static PyObject *g_str_stride;        /* interned "stride" */
static PyObject *g_str_shape;         /* interned "shape" */
static PyObject *g_str_data_ptr;      /* interned "data_ptr" */
static PyObject *g_str_requires_grad; /* interned "requires_grad" */

static int GradHooks_traverse(GradHooksObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->reducer);
    Py_VISIT(self->views);
    Py_VISIT(self->params);
    Py_VISIT(self->names);
    Py_VISIT(self->slow);
    Py_VISIT(self->current_stream);
    Py_VISIT(self->need_wire);
    Py_VISIT(self->need_memory);
    Py_VISIT(self->strides);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int GradHooks_clear(GradHooksObject *self) {
    Py_CLEAR(self->reducer);
    Py_CLEAR(self->views);
    Py_CLEAR(self->params);
    Py_CLEAR(self->names);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->current_stream);
    Py_CLEAR(self->need_wire);
    Py_CLEAR(self->need_memory);
    Py_CLEAR(self->strides);
    return 0;
}

static void GradHooks_dealloc(GradHooksObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    GradHooks_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *GradHooks_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    PyObject *slow, *names;
    static char *kwlist[] = {"slow", "names", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!", kwlist, &slow, &PyList_Type, &names))
        return NULL;
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "GradHooks: slow must be callable");
        return NULL;
    }
    GradHooksObject *self = (GradHooksObject *)tp->tp_alloc(tp, 0);
    if (!self) return NULL;
    Py_INCREF(slow);
    self->slow = slow;
    Py_INCREF(names);
    self->names = names;
    self->device = -1;
    self->to_wire = 1;
    return (PyObject *)self;
}

/* The object attributes of GradHooks (callables or None, lists): the getset closure says which
 * member. */
typedef struct {
    size_t offset;
    const char *name;
} MemberSlot;

static const MemberSlot g_need_wire_slot = {offsetof(GradHooksObject, need_wire), "need_wire"};
static const MemberSlot g_need_memory_slot = {offsetof(GradHooksObject, need_memory),
                                              "need_memory"};
static const MemberSlot g_current_stream_slot = {offsetof(GradHooksObject, current_stream),
                                                 "current_stream"};
static const MemberSlot g_views_slot = {offsetof(GradHooksObject, views), "views"};
static const MemberSlot g_params_slot = {offsetof(GradHooksObject, params), "params"};

static PyObject *GradHooks_get_member(GradHooksObject *self, void *c) {
    PyObject *v = *(PyObject **)((char *)self + ((const MemberSlot *)c)->offset);
    v = v ? v : Py_None;
    Py_INCREF(v);
    return v;
}

static int GradHooks_set_callable(GradHooksObject *self, PyObject *v, void *c) {
    const MemberSlot *slot = c;
    if (v && v != Py_None && !PyCallable_Check(v)) {
        PyErr_Format(PyExc_TypeError, "GradHooks.%s must be callable or None", slot->name);
        return -1;
    }
    PyObject **field = (PyObject **)((char *)self + slot->offset);
    PyObject *old = *field;
    *field = v && v != Py_None ? v : NULL;
    Py_XINCREF(*field);
    Py_XDECREF(old);
    return 0;
}

static PyObject *GradHooks_get_reducer(GradHooksObject *self, void *c) {
    (void)c;
    PyObject *r = self->reducer ? (PyObject *)self->reducer : Py_None;
    Py_INCREF(r);
    return r;
}

static int GradHooks_set_reducer(GradHooksObject *self, PyObject *v, void *c) {
    (void)c;
    ModState *s = state_of_type(Py_TYPE(self));
    if (v && v != Py_None && (!s || !PyObject_TypeCheck(v, s->ReducerType))) {
        PyErr_SetString(PyExc_TypeError, "GradHooks.reducer must be a ddpc._C.Reducer or None");
        return -1;
    }
    PyObject *old = (PyObject *)self->reducer;
    self->reducer = v && v != Py_None ? (ReducerObject *)v : NULL;
    Py_XINCREF(self->reducer);
    Py_XDECREF(old);
    return 0;
}

static int GradHooks_set_list(GradHooksObject *self, PyObject *v, void *c) {
    const MemberSlot *slot = c;
    if (!v || !PyList_Check(v)) {
        PyErr_Format(PyExc_TypeError, "GradHooks.%s must be a list", slot->name);
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(*(PyObject **)((char *)self + slot->offset), v);
    return 0;
}

static PyGetSetDef GradHooks_getset[] = {
    {"reducer", (getter)GradHooks_get_reducer, (setter)GradHooks_set_reducer, NULL, NULL},
    {"views", (getter)GradHooks_get_member, (setter)GradHooks_set_list,
     "views[i] is parameter i's bucket slot, or None", (void *)&g_views_slot},
    {"params", (getter)GradHooks_get_member, (setter)GradHooks_set_list,
     "the parameters (list), whose .grad the hooks point at their slots once the reducer has "
     "copied their gradients there", (void *)&g_params_slot},
    {"need_wire", (getter)GradHooks_get_member, (setter)GradHooks_set_callable,
     "callable(index) that gives parameter index's bucket its wire buffer (made for each step "
     "when the bucket's first gradient arrives), or None",
     (void *)&g_need_wire_slot},
    {"need_memory", (getter)GradHooks_get_member, (setter)GradHooks_set_callable,
     "callable(index, grad) that gives parameter index's released bucket memory again (adopting "
     "grad as the bucket when it can), or None: the Python path does it",
     (void *)&g_need_memory_slot},
    {"current_stream", (getter)GradHooks_get_member, (setter)GradHooks_set_callable,
     "callable(device) -> the handle of the current CUDA stream (None: use `stream`)",
     (void *)&g_current_stream_slot},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef GradHooks_members[] = {
    {"stream", T_ULONGLONG, offsetof(GradHooksObject, stream), 0,
     "the stream backward kernels run on (the forward's), 0 on the host"},
    {"fast", T_BOOL, offsetof(GradHooksObject, fast), 0,
     "True while a synced backward runs with its end-of-backward reduction queued"},
    {"device", T_INT, offsetof(GradHooksObject, device), 0,
     "the CUDA device the parameters are on (passed to current_stream), -1 on the host"},
    {"calls", T_ULONGLONG, offsetof(GradHooksObject, calls), 0,
     "hook calls counted so far (the wrapper's host_times() reads and resets it)"},
    {"hook_ns", T_ULONGLONG, offsetof(GradHooksObject, hook_ns), 0,
     "host nanoseconds spent in the hooks so far, their Python path and need_wire included"},
    {"wire_ns", T_ULONGLONG, offsetof(GradHooksObject, wire_ns), 0,
     "host nanoseconds of hook_ns spent in need_wire"},
    {"memory_ns", T_ULONGLONG, offsetof(GradHooksObject, memory_ns), 0,
     "host nanoseconds of hook_ns spent in need_memory"},
    {"attach_ns", T_ULONGLONG, offsetof(GradHooksObject, attach_ns), 0,
     "host nanoseconds of hook_ns spent pointing .grad at the slots of copied gradients"},
    {"slow_ns", T_ULONGLONG, offsetof(GradHooksObject, slow_ns), 0,
     "host nanoseconds of hook_ns spent in the Python path (slow)"},
    {"strides", T_OBJECT, offsetof(GradHooksObject, strides), 0,
     "list: None where parameter i's slot is row-major, else the slot's strides (a fresh "
     "gradient with other strides takes the Python path); or None (all row-major)"},
    {"to_wire", T_BOOL, offsetof(GradHooksObject, to_wire), 0,
     "True (the default): a fresh gradient of a bucket reduced in another dtype is cast to the "
     "wire from where it lies; False: copied into its bucket slot first (for comparisons)"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot GradHooks_slots[] = {
    {Py_tp_new, GradHooks_new},
    {Py_tp_dealloc, GradHooks_dealloc},
    {Py_tp_traverse, GradHooks_traverse},
    {Py_tp_clear, GradHooks_clear},
    {Py_tp_getset, GradHooks_getset},
    {Py_tp_members, GradHooks_members},
    {Py_tp_doc, "GradHooks(slow, names): shared state of a wrapped model's gradient hooks"},
    {0, NULL},
};

static PyType_Spec GradHooks_spec = {
    "ddpc._C.GradHooks", sizeof(GradHooksObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    GradHooks_slots,
};

static int GradHook_traverse(GradHookObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->hooks);
    Py_VISIT(self->index_obj);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int GradHook_clear(GradHookObject *self) {
    Py_CLEAR(self->hooks);
    Py_CLEAR(self->index_obj);
    return 0;
}

static void GradHook_dealloc(GradHookObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    GradHook_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *GradHook_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    PyObject *hooks;
    Py_ssize_t index;
    static char *kwlist[] = {"hooks", "index", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "On", kwlist, &hooks, &index)) return NULL;
    ModState *s = state_of_type(tp);
    if (!s || !PyObject_TypeCheck(hooks, s->GradHooksType)) {
        PyErr_SetString(PyExc_TypeError, "GradHook: hooks must be a ddpc._C.GradHooks");
        return NULL;
    }
    if (index < 0) {
        PyErr_SetString(PyExc_ValueError, "GradHook: index must be >= 0");
        return NULL;
    }
    GradHookObject *self = (GradHookObject *)tp->tp_alloc(tp, 0);
    if (!self) return NULL;
    self->index_obj = PyLong_FromSsize_t(index);
    if (!self->index_obj) {
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(hooks);
    self->hooks = (GradHooksObject *)hooks;
    self->index = index;
    return (PyObject *)self;
}

/* Rewrites a ValueError from the reducer so it names the parameter. */
static void name_parameter_error(GradHooksObject *h, Py_ssize_t i) {
    if (!PyErr_ExceptionMatches(PyExc_ValueError) || !h->names ||
        i >= PyList_GET_SIZE(h->names))
        return;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *value = PyErr_GetRaisedException();
    PyErr_Format(PyExc_ValueError, "parameter '%U': %S", PyList_GET_ITEM(h->names, i), value);
    Py_XDECREF(value);
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyErr_Format(PyExc_ValueError, "parameter '%U': %S", PyList_GET_ITEM(h->names, i), value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
#endif
}

/* Where a gradient's elements can be copied from as one dense block: 1 with *src set when it
 * does not require grad and has its slot's memory image: contiguous for a row-major slot
 * (slot_strides None), else exactly the slot's strides, which are dense (its dtype, shape and
 * device are its parameter's: autograd checks them). 0 when the Python path must handle it,
 * -1 with an exception set. */
static int grad_copy_source(PyObject *grad, PyObject *slot_strides, const void **src) {
    PyObject *v = PyObject_GetAttr(grad, g_str_requires_grad);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (t != 0) return t < 0 ? -1 : 0;
    int row_major = slot_strides == Py_None;
    v = row_major ? PyObject_CallMethodNoArgs(grad, g_str_is_contiguous)
                  : PyObject_CallMethodNoArgs(grad, g_str_stride);
    if (!v) {
        PyErr_Clear(); /* a sparse gradient has neither: the Python path copies it */
        return 0;
    }
    t = row_major ? PyObject_IsTrue(v) : PyObject_RichCompareBool(v, slot_strides, Py_EQ);
    Py_DECREF(v);
    if (t != 1) return t < 0 ? -1 : 0;
    v = PyObject_CallMethodNoArgs(grad, g_str_data_ptr);
    if (!v) {
        PyErr_Clear(); /* a tensor subclass without storage: the Python path copies it */
        return 0;
    }
    *src = PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    if (!*src) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* Points .grad of each parameter whose gradient the reducer has copied into its slot since the
 * last call at that slot (views[j]); the gradient autograd made goes back to the allocator,
 * after the copy on its stream. Returns -1 with an exception set. */
static int attach_flushed(GradHooksObject *h, ReducerObject *r, PyObject *views) {
    if (!reducer_ready(r)) return -1;
    int n = ddpc_reducer_take_flushed(r->r, r->scratch);
    if (n == 0) return 0; /* (most calls: a gradient waiting for its bucket) */
    PyObject *done = int_list(r->scratch, n);
    if (!done) return -1;
    PyObject *params = h->params; /* own references: setting .grad may run Python */
    Py_XINCREF(params);
    int rc = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(done) && rc == 0; k++) {
        Py_ssize_t j = PyLong_AsSsize_t(PyList_GET_ITEM(done, k));
        if (!params || j < 0 || j >= PyList_GET_SIZE(params) || j >= PyList_GET_SIZE(views) ||
            PyList_GET_ITEM(views, j) == Py_None) {
            PyErr_Format(PyExc_RuntimeError, "gradient hooks: parameter %zd was copied into a "
                         "slot that the hooks do not know", j);
            rc = -1;
            break;
        }
        PyObject *p = PyList_GET_ITEM(params, j), *v = PyList_GET_ITEM(views, j);
        Py_INCREF(p);
        Py_INCREF(v);
        rc = PyObject_SetAttr(p, g_str_grad, v);
        Py_DECREF(v);
        Py_DECREF(p);
    }
    Py_XDECREF(params);
    Py_DECREF(done);
    return rc;
}

static PyObject *GradHook_run(GradHookObject *self, PyObject *args, PyObject *kw) {
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "a gradient hook takes no keyword arguments");
        return NULL;
    }
    if (PyTuple_GET_SIZE(args) != 1) {
        PyErr_Format(PyExc_TypeError, "a gradient hook takes 1 argument (the parameter), got %zd",
                     PyTuple_GET_SIZE(args));
        return NULL;
    }
    PyObject *p = PyTuple_GET_ITEM(args, 0);
    GradHooksObject *h = self->hooks;
    Py_ssize_t i = self->index;
    if (h->fast && h->reducer && h->views) {
        /* Own references first: reading .grad may run Python (a Tensor subclass), which may
         * change the hooks' state. The GIL stays held throughout, so Reducer.close() (a rebuild
         * on another thread) cannot run while this marks a gradient ready. */
        ReducerObject *r = h->reducer;
        PyObject *views = h->views;
        Py_INCREF(r);
        Py_INCREF(views);
        PyObject *ret = NULL, *grad = NULL, *view = NULL;
        int handled = 1;
        grad = PyObject_GetAttr(p, g_str_grad);
        if (!grad) goto done;
        if (i < PyList_GET_SIZE(views)) {
            view = PyList_GET_ITEM(views, i);
            Py_INCREF(view);
        }
        if (!reducer_ready(r)) goto done;
        if (i >= r->nparams) {
            PyErr_Format(PyExc_ValueError, "gradient hook %zd: the reducer has %d parameters", i,
                         r->nparams);
            goto done;
        }
        /* A bucket that goes over the wire in another dtype gets its wire buffer when its first
         * gradient of the step arrives (the wrapper drops it after the step). */
        int state = ddpc_reducer_param_state(r->r, (int)i);
        if (grad != Py_None && (state & DDPC_PARAM_WIRE_BUCKET) &&
            !(state & DDPC_PARAM_HAS_WIRE)) {
            if (!h->need_wire) {
                handled = 0;
                goto done;
            }
            PyObject *idx = PyLong_FromSsize_t(i);
            if (!idx) goto done;
            uint64_t t0 = ddpc_now_ns();
            PyObject *res = PyObject_CallOneArg(h->need_wire, idx);
            h->wire_ns += ddpc_now_ns() - t0;
            Py_DECREF(idx);
            if (!res) goto done;
            Py_DECREF(res);
            if (!reducer_ready(r)) goto done; /* (Python ran: see below) */
            state = ddpc_reducer_param_state(r->r, (int)i);
        }
        /* A fresh gradient of such a bucket is cast to the wire from where it lies: it needs no
         * slot. */
        int wired = h->to_wire && grad != Py_None && grad != view &&
                    (state & DDPC_PARAM_HAS_WIRE);
        if (grad != Py_None && !wired && h->need_memory &&
            (!view || view == Py_None || !(state & DDPC_PARAM_HAS_MEMORY))) {
            /* The first gradient of a bucket released at the forward (its gradients were None):
             * the wrapper gives the bucket memory, or makes this gradient the bucket, and the
             * gradient goes on from here rather than through the whole Python path. */
            uint64_t t0 = ddpc_now_ns();
            PyObject *res = PyObject_CallFunctionObjArgs(h->need_memory, self->index_obj, grad,
                                                         NULL);
            h->memory_ns += ddpc_now_ns() - t0;
            if (!res) goto done;
            Py_DECREF(res);
            if (!reducer_ready(r)) goto done; /* (Python ran: see below) */
            Py_CLEAR(view);
            if (i < PyList_GET_SIZE(views)) {
                view = PyList_GET_ITEM(views, i);
                Py_INCREF(view);
            }
            state = ddpc_reducer_param_state(r->r, (int)i);
        }
        if (grad == Py_None || (!wired && (!view || view == Py_None ||
                                           !(state & DDPC_PARAM_HAS_MEMORY)))) {
            /* No gradient, or its bucket is released (parked or dropped): the Python path gives
             * it memory. */
            handled = 0;
            goto done;
        }
        /* The stream this gradient was made or accumulated on: autograd runs the hook with
         * it current. Copying and marking there orders both after the gradient, and the copy
         * before the source's memory goes back to the allocator (on that stream) below. */
        uintptr_t stream = (uintptr_t)h->stream;
        if (h->current_stream && h->device >= 0) {
            PyObject *dev = PyLong_FromLong(h->device);
            if (!dev) goto done;
            PyObject *sv = PyObject_CallOneArg(h->current_stream, dev);
            Py_DECREF(dev);
            if (!sv) goto done;
            stream = (uintptr_t)PyLong_AsUnsignedLongLong(sv);
            Py_DECREF(sv);
            if (PyErr_Occurred()) goto done;
            if (!reducer_ready(r)) goto done; /* (see below) */
        }
        ddpc_status st;
        if (grad != view) {
            /* A freshly computed gradient (autograd set .grad to it, the slot being empty): the
             * reducer copies it into its slot, then the slot becomes .grad, as the Python path
             * would do. A gradient that requires grad (create_graph=True), or lies in memory
             * otherwise than its slot, goes there instead. */
            const void *src = NULL;
            PyObject *slot_strides = Py_None; /* (own reference: Python runs below) */
            if (h->strides && PyList_Check(h->strides) && i < PyList_GET_SIZE(h->strides))
                slot_strides = PyList_GET_ITEM(h->strides, i);
            Py_INCREF(slot_strides);
            int ok = grad_copy_source(grad, slot_strides, &src);
            Py_DECREF(slot_strides);
            if (ok < 0) goto done;
            if (!ok) {
                handled = 0;
                goto done;
            }
            /* grad_copy_source ran Python (methods of the tensor), which may have let another
             * thread close the reducer. */
            if (!reducer_ready(r)) goto done;
            int direct = 0;
            st = h->to_wire ? ddpc_reducer_mark_ready_grad(r->r, (int)i, src, stream, &direct)
                            : ddpc_reducer_mark_ready_copy(r->r, (int)i, src, stream);
            if (st == DDPC_OK && direct) {
                /* The reducer writes the averaged values back into this gradient at finalize:
                 * hold it until then. */
                Py_INCREF(grad);
                if (PyList_SetItem(r->keep, 2 * (Py_ssize_t)r->nbuckets + i, grad) < 0)
                    goto done;
            }
            /* A gradient to be copied stays .grad (which holds it) until its bucket's copies are
             * queued, together; then .grad becomes the slot. Not before: a second gradient of
             * the same step would be added into a slot that has not received the first. */
        } else {
            st = ddpc_reducer_mark_ready(r->r, (int)i, stream);
        }
        if (st == DDPC_OK) {
            uint64_t t0 = ddpc_now_ns();
            int rc = attach_flushed(h, r, views);
            h->attach_ns += ddpc_now_ns() - t0;
            if (rc < 0) goto done;
        }
        if (st != DDPC_OK) {
            raise_status(state_of_type(Py_TYPE(r)), st);
            name_parameter_error(h, i);
            goto done;
        }
        ret = Py_None;
        Py_INCREF(ret);
    done:
        Py_XDECREF(view);
        Py_XDECREF(grad);
        Py_DECREF(views);
        Py_DECREF(r);
        if (handled) return ret;
    }
    uint64_t t0 = ddpc_now_ns();
    PyObject *ret = PyObject_CallFunctionObjArgs(h->slow, p, self->index_obj, NULL);
    h->slow_ns += ddpc_now_ns() - t0;
    return ret;
}

static PyObject *GradHook_call(GradHookObject *self, PyObject *args, PyObject *kw) {
    GradHooksObject *h = self->hooks;
    Py_INCREF(h);
    uint64_t t0 = ddpc_now_ns();
    PyObject *ret = GradHook_run(self, args, kw);
    h->hook_ns += ddpc_now_ns() - t0;
    h->calls++;
    Py_DECREF(h);
    return ret;
}

static PyType_Slot GradHook_slots[] = {
    {Py_tp_new, GradHook_new},
    {Py_tp_dealloc, GradHook_dealloc},
    {Py_tp_traverse, GradHook_traverse},
    {Py_tp_clear, GradHook_clear},
    {Py_tp_call, GradHook_call},
    {Py_tp_doc, "GradHook(hooks, index): the post-accumulate-grad hook of parameter `index`"},
    {0, NULL},
};

static PyType_Spec GradHook_spec = {
    "ddpc._C.GradHook", sizeof(GradHookObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    GradHook_slots,
};


/* ---------------------------------------------------------------- DistributedSampler (sampler.c) */
/* BEGIN SAMPLER BINDINGS */
/* One rank's indices for one epoch, generated by the core into one int64 buffer when the object is
 * made. It is its own iterator (Python ints, for DataLoader) and exports the buffer (format "q")
 * so NumPy can wrap it without a copy. The buffer lives until the object dies, which no exported
 * view outlives, so views never dangle. */
typedef struct {
    PyObject_HEAD
    int64_t *buf;
    Py_ssize_t count;
    Py_ssize_t pos;
    Py_ssize_t itemsize;  /* the strides the buffer protocol hands out point here */
} SamplerIndicesObject;

static PyObject *SamplerIndices_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"length", "num_replicas", "rank", "shuffle", "seed", "epoch",
                             "drop_last", "pad", NULL};
    long long length;
    int replicas, rank, shuffle, drop_last, pad;
    unsigned long long seed, epoch;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LiipKKpp", kwlist, &length, &replicas, &rank,
                                     &shuffle, &seed, &epoch, &drop_last, &pad))
        return NULL;
    ModState *s = state_of_type(tp);
    if (!s) return NULL;
    int64_t count = ddpc_sampler_num_samples(length, replicas, rank, drop_last, pad);
    if (count < 0) return raise_status(s, DDPC_ERR_INVALID);
    if (count > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t)) return PyErr_NoMemory();
    SamplerIndicesObject *self = (SamplerIndicesObject *)tp->tp_alloc(tp, 0);
    if (!self) return NULL;
    self->itemsize = sizeof(int64_t);
    ddpc_status st = ddpc_sampler_alloc(count, &self->buf);
    if (st == DDPC_OK) {
        int64_t n = 0;
        self->count = (Py_ssize_t)count;
        DDPC_NOGIL(st, ddpc_sampler_indices(length, replicas, rank, shuffle, seed, epoch,
                                            drop_last, pad, self->buf, &n));
    }
    if (st != DDPC_OK) {
        Py_DECREF(self);
        return raise_status(s, st);
    }
    return (PyObject *)self;
}

static void SamplerIndices_dealloc(SamplerIndicesObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    /* count is the allocation size: generation either filled it all or failed. */
    ddpc_sampler_free(self->buf, self->count);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *SamplerIndices_next(SamplerIndicesObject *self) {
    if (self->pos >= self->count) return NULL;
    return PyLong_FromLongLong(self->buf[self->pos++]);
}

static PyObject *SamplerIndices_length_hint(SamplerIndicesObject *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromSsize_t(self->count - self->pos);
}

static PyObject *SamplerIndices_num_samples(PyObject *cls, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"length", "num_replicas", "rank", "drop_last", "pad", NULL};
    long long length;
    int replicas, rank, drop_last, pad;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Liipp", kwlist, &length, &replicas, &rank,
                                     &drop_last, &pad))
        return NULL;
    int64_t count = ddpc_sampler_num_samples(length, replicas, rank, drop_last, pad);
    if (count < 0) return raise_status(state_of_type((PyTypeObject *)cls), DDPC_ERR_INVALID);
    return PyLong_FromLongLong(count);
}

/* As array.array does: a writable 1-d int64 buffer, with shape, strides and format given only
 * when the consumer asks for them. */
static int SamplerIndices_getbuffer(SamplerIndicesObject *self, Py_buffer *view, int flags) {
    static int64_t empty;
    view->obj = Py_NewRef(self);
    view->buf = self->count ? (void *)self->buf : (void *)&empty;
    view->len = self->count * self->itemsize;
    view->readonly = 0;
    view->ndim = 1;
    view->itemsize = self->itemsize;
    view->format = (flags & PyBUF_FORMAT) == PyBUF_FORMAT ? "q" : NULL;
    view->shape = (flags & PyBUF_ND) == PyBUF_ND ? &self->count : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &self->itemsize : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static PyObject *SamplerIndices_get_size(SamplerIndicesObject *self, void *c) {
    (void)c;
    return PyLong_FromSsize_t(self->count);
}

static PyGetSetDef SamplerIndices_getset[] = {
    {"size", (getter)SamplerIndices_get_size, NULL, "number of indices (consumed or not)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef SamplerIndices_methods[] = {
    {"__length_hint__", (PyCFunction)SamplerIndices_length_hint, METH_NOARGS,
     "indices not yet yielded"},
    {"num_samples", (PyCFunction)(void (*)(void))SamplerIndices_num_samples,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "num_samples(length, num_replicas, rank, drop_last, pad) -> int: how many indices the rank "
     "reads per epoch; ValueError for invalid arguments"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot SamplerIndices_slots[] = {
    {Py_tp_new, SamplerIndices_new},
    {Py_tp_dealloc, SamplerIndices_dealloc},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, SamplerIndices_next},
    {Py_tp_methods, SamplerIndices_methods},
    {Py_tp_getset, SamplerIndices_getset},
    {Py_bf_getbuffer, SamplerIndices_getbuffer},
    {Py_tp_doc, "SamplerIndices(length, num_replicas, rank, shuffle, seed, epoch, drop_last, pad): "
                "the indices one rank reads in one epoch (see ddpc.DistributedSampler), made in C "
                "at construction. Iterate for Python ints; the buffer protocol gives int64."},
    {0, NULL},
};

static PyType_Spec SamplerIndices_spec = {
    "ddpc._C.SamplerIndices", sizeof(SamplerIndicesObject), 0, Py_TPFLAGS_DEFAULT,
    SamplerIndices_slots,
};
/* END SAMPLER BINDINGS */

/* ---------------------------------------------------------------- module functions */

static PyObject *mod_cuda_built(PyObject *m, PyObject *unused) {
    (void)m; (void)unused;
    return PyBool_FromLong(ddpc_cuda_built());
}

static PyObject *mod_cuda_device_count(PyObject *m, PyObject *unused) {
    (void)m; (void)unused;
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = ddpc_cuda_device_count();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(n);
}

static PyObject *mod_cuda_set_device(PyObject *m, PyObject *args) {
    int dev;
    if (!PyArg_ParseTuple(args, "i", &dev)) return NULL;
    ddpc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ddpc_cuda_set_device(dev);
    Py_END_ALLOW_THREADS
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    Py_RETURN_NONE;
}

static PyObject *mod_nccl_version(PyObject *m, PyObject *unused) {
    (void)unused;
    char ver[64] = "";
    ddpc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ddpc_nccl_load(ver, sizeof ver);
    Py_END_ALLOW_THREADS
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    return PyUnicode_FromString(ver);
}

/* The DDPC_* settings (csrc/settings.c): [(name, what it does)], every name ddpc reads. */
static PyObject *mod_settings(PyObject *m, PyObject *unused) {
    (void)m;
    (void)unused;
    int n = ddpc_setting_count();
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *t = Py_BuildValue("(ss)", ddpc_setting_name(i), ddpc_setting_about(i));
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

/* check_settings(): raises ValueError for the first DDPC_* setting in the environment whose
 * value is not one. */
static PyObject *mod_check_settings(PyObject *m, PyObject *unused) {
    (void)unused;
    ddpc_status st = ddpc_settings_check();
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    Py_RETURN_NONE;
}

/* check_setting(name, value): raises ValueError when value is not one for that setting, or when
 * ddpc has no such setting. */
static PyObject *mod_check_setting(PyObject *m, PyObject *args) {
    const char *name, *value;
    if (!PyArg_ParseTuple(args, "ss", &name, &value)) return NULL;
    ddpc_status st = ddpc_setting_check_value(name, value);
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    Py_RETURN_NONE;
}

/* setting(name): None when unset, else the checked value: bool (a flag), int (a whole number or
 * DDPC_DEBUG's level), float, or str (a choice as the table spells it, or text). */
static PyObject *mod_setting(PyObject *m, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    DdpcSettingValue v;
    ddpc_status st = ddpc_setting_get(name, &v);
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    if (!v.set) Py_RETURN_NONE;
    switch (v.kind) {
    case DDPC_SETTING_FLAG: return PyBool_FromLong(v.index);
    case DDPC_SETTING_UINT: return PyLong_FromUnsignedLongLong(v.whole);
    case DDPC_SETTING_NUMBER: return PyFloat_FromDouble(v.number);
    case DDPC_SETTING_LOGLEVEL: return PyLong_FromLong(v.index);
    default: return PyUnicode_FromString(v.text);
    }
}

/* setting_flag(name, default) -> bool: a 1/0 setting as the C core reads it. */
static PyObject *mod_setting_flag(PyObject *m, PyObject *args) {
    const char *name;
    int dflt, on;
    if (!PyArg_ParseTuple(args, "sp", &name, &dflt)) return NULL;
    ddpc_status st = ddpc_setting_flag(name, dflt, &on);
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    return PyBool_FromLong(on);
}

/* nccl_p2p_off([disable, level]) -> "NAME=value" or None. */
static PyObject *mod_nccl_p2p_off(PyObject *m, PyObject *args) {
    (void)m;
    const char *disable = NULL, *level = NULL;
    if (!PyArg_ParseTuple(args, "|zz", &disable, &level)) return NULL;
    char why[256];
    int off = PyTuple_GET_SIZE(args) ? ddpc_nccl_p2p_off(disable, level, why, sizeof why)
                                     : ddpc_nccl_p2p_disabled(why, sizeof why);
    if (!off) Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

static int dtype_arg(int code, const char *what) {
    if (code < 0 || code >= DDPC_NUM_DTYPES) {
        PyErr_Format(PyExc_ValueError, "%s: dtype code %d is not one of ddpc's (0..%d)", what, code,
                     DDPC_NUM_DTYPES - 1);
        return 0;
    }
    return 1;
}

/* The embedding rows' accumulation kernel (ddpc_device_rows_accumulate), on raw pointers: the
 * caller (python/ddpc/_rows.py) keeps the tensors alive and on this device. */
static PyObject *mod_device_rows_accumulate(PyObject *m, PyObject *args) {
    unsigned long long grad, ids, perm, rows, stream;
    unsigned long long num_rows, width, n;
    int grad_dt, rows_dt;
    long long skip;
    double scale;
    if (!PyArg_ParseTuple(args, "KiKKKKKKiLdK", &grad, &grad_dt, &num_rows, &width, &ids, &perm,
                          &n, &rows, &rows_dt, &skip, &scale, &stream))
        return NULL;
    if (!dtype_arg(grad_dt, "device_rows_accumulate: grad") ||
        !dtype_arg(rows_dt, "device_rows_accumulate: rows"))
        return NULL;
    ddpc_status st = ddpc_device_rows_accumulate(
        (void *)(uintptr_t)grad, (ddpc_dtype)grad_dt, (size_t)num_rows, (size_t)width,
        (const int64_t *)(uintptr_t)ids, (const int64_t *)(uintptr_t)perm, (size_t)n,
        (const void *)(uintptr_t)rows, (ddpc_dtype)rows_dt, (int64_t)skip, scale,
        (uintptr_t)stream);
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    Py_RETURN_NONE;
}

/* The embedding rows' sort (ddpc_device_sort_ids), on raw pointers: the caller
 * (python/ddpc/_rows.py) keeps the tensors alive and on this device. */
static PyObject *mod_device_sort_ids(PyObject *m, PyObject *args) {
    unsigned long long ids, n, num_rows, sorted, perm, stream;
    if (!PyArg_ParseTuple(args, "KKKKKK", &ids, &n, &num_rows, &sorted, &perm, &stream))
        return NULL;
    ddpc_status st = ddpc_device_sort_ids((const int64_t *)(uintptr_t)ids, (size_t)n,
                                          (size_t)num_rows, (int64_t *)(uintptr_t)sorted,
                                          (int64_t *)(uintptr_t)perm, (uintptr_t)stream);
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    Py_RETURN_NONE;
}

/* The embedding rows' packing kernel (ddpc_device_rows_pack), on raw pointers, for its test. */
static PyObject *mod_device_rows_pack(PyObject *m, PyObject *args) {
    unsigned long long ids_out, rows_out, cap, width, ids, perm, n, src, stream;
    int wire_dt, src_dt;
    if (!PyArg_ParseTuple(args, "KKiKKKKKKiK", &ids_out, &rows_out, &wire_dt, &cap, &width, &ids,
                          &perm, &n, &src, &src_dt, &stream))
        return NULL;
    if (!dtype_arg(wire_dt, "device_rows_pack: wire") ||
        !dtype_arg(src_dt, "device_rows_pack: src"))
        return NULL;
    ddpc_status st = ddpc_device_rows_pack(
        (void *)(uintptr_t)ids_out, (void *)(uintptr_t)rows_out, (ddpc_dtype)wire_dt, (size_t)cap,
        (size_t)width, (const int64_t *)(uintptr_t)ids, (const int64_t *)(uintptr_t)perm,
        (size_t)n, (const void *)(uintptr_t)src, (ddpc_dtype)src_dt, (uintptr_t)stream);
    if (st != DDPC_OK) return raise_status(state_of_module(m), st);
    Py_RETURN_NONE;
}

static PyObject *mod_rows_stride(PyObject *m, PyObject *args) {
    (void)m;
    unsigned long long cap, width;
    int dt;
    if (!PyArg_ParseTuple(args, "KKi", &cap, &width, &dt)) return NULL;
    if (!dtype_arg(dt, "rows_stride")) return NULL;
    return PyLong_FromSize_t(ddpc_rows_stride((size_t)cap, (size_t)width, (ddpc_dtype)dt));
}

static PyObject *mod_dtype_size(PyObject *m, PyObject *args) {
    (void)m;
    int dt;
    if (!PyArg_ParseTuple(args, "i", &dt)) return NULL;
    return PyLong_FromSize_t(ddpc_dtype_size((ddpc_dtype)dt));
}

/* scan_grads(params, views, bucket_of, nbuckets, shapes) -> (slow, released, changed): the
 * wrapper's forward prologue over every parameter, without a Python loop. changed is the first
 * parameter whose shape is no longer shapes[i] (resized after the wrap: its slot no longer
 * fits), else -1; the scan stops there. slow is True when some gradient is not in its slot (set
 * or replaced by the caller) or some bucket holds both gradients and Nones: then the caller's
 * Python path handles everything. Otherwise released lists the buckets all of whose gradients
 * are None (to release or keep parked), in order. */
static PyObject *mod_scan_grads(PyObject *m, PyObject *args) {
    (void)m;
    PyObject *params, *views, *bucket_of, *shapes;
    Py_ssize_t nb;
    if (!PyArg_ParseTuple(args, "O!O!O!nO!", &PyList_Type, &params, &PyList_Type, &views,
                          &PyList_Type, &bucket_of, &nb, &PyList_Type, &shapes))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(params), changed = -1;
    if (PyList_GET_SIZE(views) != n || PyList_GET_SIZE(bucket_of) != n ||
        PyList_GET_SIZE(shapes) != n || nb < 0) {
        PyErr_Format(PyExc_ValueError, "scan_grads: %zd parameters, %zd views, %zd bucket "
                     "indices and %zd buckets do not match", n, PyList_GET_SIZE(views),
                     PyList_GET_SIZE(bucket_of), nb);
        return NULL;
    }
    /* per bucket: members, and how many of them have no gradient */
    Py_ssize_t *cnt = PyMem_Calloc((size_t)(2 * nb + 1), sizeof *cnt);
    if (!cnt) return PyErr_NoMemory();
    int slow = 0;
    PyObject *released = NULL;
    for (Py_ssize_t i = 0; i < n && !slow; i++) {
        Py_ssize_t b = PyLong_AsSsize_t(PyList_GET_ITEM(bucket_of, i));
        if (b == -1 && PyErr_Occurred()) goto out;
        if (b < 0 || b >= nb) {
            PyErr_Format(PyExc_ValueError, "scan_grads: parameter %zd is in bucket %zd of %zd", i,
                         b, nb);
            goto out;
        }
        /* Reading .grad may run Python (a Tensor subclass) that changes the lists: hold the
         * parameter, and look at the sizes again after. */
        PyObject *param = PyList_GET_ITEM(params, i);
        Py_INCREF(param);
        PyObject *shape = PyObject_GetAttr(param, g_str_shape);
        int same = -1;
        if (shape && PyList_GET_SIZE(shapes) == n) {
            PyObject *want = PyList_GET_ITEM(shapes, i);
            Py_INCREF(want);
            same = PyObject_RichCompareBool(shape, want, Py_EQ);
            Py_DECREF(want);
        }
        Py_XDECREF(shape);
        if (same != 1) {
            Py_DECREF(param);
            if (same < 0) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_RuntimeError, "scan_grads: the lists changed during "
                                    "the scan");
                goto out;
            }
            changed = i;
            slow = 1;
            break;
        }
        PyObject *g = PyObject_GetAttr(param, g_str_grad);
        Py_DECREF(param);
        if (!g) goto out;
        if (PyList_GET_SIZE(views) != n || PyList_GET_SIZE(params) != n) {
            Py_DECREF(g);
            PyErr_SetString(PyExc_RuntimeError, "scan_grads: the lists changed during the scan");
            goto out;
        }
        PyObject *v = PyList_GET_ITEM(views, i); /* compared by identity only */
        cnt[2 * b]++;
        if (g == Py_None)
            cnt[2 * b + 1]++;
        else if (g != v)
            slow = 1;
        Py_DECREF(g);
    }
    if (!slow)
        for (Py_ssize_t b = 0; b < nb; b++)
            if (cnt[2 * b + 1] && cnt[2 * b + 1] != cnt[2 * b]) slow = 1;
    released = PyList_New(0);
    if (!released) goto out;
    if (!slow)
        for (Py_ssize_t b = 0; b < nb; b++) {
            if (!cnt[2 * b] || cnt[2 * b + 1] != cnt[2 * b]) continue;
            PyObject *o = PyLong_FromSsize_t(b);
            if (!o || PyList_Append(released, o) < 0) {
                Py_XDECREF(o);
                Py_CLEAR(released);
                goto out;
            }
            Py_DECREF(o);
        }
out:
    PyMem_Free(cnt);
    if (!released) return NULL;
    PyObject *res = Py_BuildValue("(ONn)", slow ? Py_True : Py_False, released, changed);
    return res;
}

static PyMethodDef module_methods[] = {
    {"scan_grads", mod_scan_grads, METH_VARARGS,
     "scan_grads(params, views, bucket_of, nbuckets, shapes) -> (slow, released buckets, the "
     "first parameter whose shape changed or -1)"},
    {"cuda_built", mod_cuda_built, METH_NOARGS, "True when this build has CUDA support"},
    {"cuda_device_count", mod_cuda_device_count, METH_NOARGS, "visible CUDA devices (0 without)"},
    {"cuda_set_device", mod_cuda_set_device, METH_VARARGS, "bind this process to a device"},
    {"nccl_version", mod_nccl_version, METH_NOARGS,
     "load NCCL (dlopen) and return its version; raises when it cannot be found"},
    {"dtype_size", mod_dtype_size, METH_VARARGS, "bytes per element of a dtype code"},
    {"settings", mod_settings, METH_NOARGS,
     "settings() -> [(name, what it does)]: every DDPC_* environment setting ddpc reads"},
    {"check_settings", mod_check_settings, METH_NOARGS,
     "check_settings(): raises ValueError naming the first DDPC_* setting in the environment "
     "whose value is not one, and what it takes"},
    {"check_setting", mod_check_setting, METH_VARARGS,
     "check_setting(name, value): raises ValueError when value is not one for that DDPC_* "
     "setting (or ddpc has no such setting), saying what it takes"},
    {"setting", mod_setting, METH_VARARGS,
     "setting(name): None when the DDPC_* setting is unset, else its checked value (bool, int, "
     "float or str); ValueError when its value is not one"},
    {"setting_flag", mod_setting_flag, METH_VARARGS,
     "setting_flag(name, default) -> bool: a 1/0 DDPC_* setting as the C core reads it"},
    {"nccl_p2p_off", mod_nccl_p2p_off, METH_VARARGS,
     "nccl_p2p_off([disable, level]) -> 'NAME=value' or None: the setting that turns P2P off "
     "between every pair of GPUs, as NCCL reads NCCL_P2P_DISABLE (the number 1) and "
     "NCCL_P2P_LEVEL (LOC or 0); from the environment, or these values (None: unset)"},
    {"device_rows_accumulate", mod_device_rows_accumulate, METH_VARARGS,
     "device_rows_accumulate(grad, grad_dtype, num_rows, width, sorted_ids, perm, n, rows, "
     "rows_dtype, skip, scale, stream): grad[id] += scale * rows of each run of equal ids"},
    {"device_sort_ids", mod_device_sort_ids, METH_VARARGS,
     "device_sort_ids(ids, n, num_rows, sorted, perm, stream): a stable sort of n int64 indices "
     "(n <= DEVICE_SORT_IDS_MAX) in one launch"},
    {"device_rows_pack", mod_device_rows_pack, METH_VARARGS,
     "device_rows_pack(ids_out, rows_out, wire_dtype, cap, width, sorted_ids, perm, n, src, "
     "src_dtype, stream): one rank's part of the rows' all-gather"},
    {"rows_stride", mod_rows_stride, METH_VARARGS,
     "rows_stride(cap, width, wire_dtype) -> bytes of one rank's part of the rows' all-gather"},
    {NULL, NULL, 0, NULL},
};

/* ---------------------------------------------------------------- init */

static PyObject *new_exception(PyObject *m, const char *name, PyObject *bases, const char *doc) {
    PyObject *e = PyErr_NewExceptionWithDoc(name, doc, bases, NULL);
    if (!e) return NULL;
    const char *short_name = strrchr(name, '.') + 1;
    if (PyModule_AddObjectRef(m, short_name, e) < 0) {
        Py_DECREF(e);
        return NULL;
    }
    return e;
}

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **slot) {
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    if (!*slot) return -1;
    return PyModule_AddType(m, *slot);
}

static int module_exec(PyObject *m) {
    ModState *s = state_of_module(m);
    s->DistributedError = new_exception(
        m, "ddpc.DistributedError", PyExc_RuntimeError,
        "A distributed operation failed: a timeout, a peer that died, a mismatch between ranks, "
        "or a refused connection. The message names the operation, the rank and what to do.");
    if (!s->DistributedError) return -1;
    PyObject *tb = PyTuple_Pack(2, s->DistributedError, PyExc_TimeoutError);
    if (!tb) return -1;
    s->TimeoutError = new_exception(m, "ddpc.DistributedTimeoutError", tb,
                                    "A collective or rendezvous step passed its deadline.");
    Py_DECREF(tb);
    if (!s->TimeoutError) return -1;
    s->PeerError = new_exception(m, "ddpc.PeerError", s->DistributedError,
                                 "Another rank died, closed its connection or aborted.");
    if (!s->PeerError) return -1;
    s->MismatchError = new_exception(m, "ddpc.MismatchError", s->DistributedError,
                                     "Ranks called a collective or wrapped a model differently.");
    if (!s->MismatchError) return -1;
    s->AuthError = new_exception(m, "ddpc.AuthError", s->DistributedError,
                                 "The store refused this job token.");
    if (!s->AuthError) return -1;
    if (add_type(m, &StoreServer_spec, &s->StoreServerType) < 0) return -1;
    if (add_type(m, &Store_spec, &s->StoreType) < 0) return -1;
    if (add_type(m, &Group_spec, &s->GroupType) < 0) return -1;
    if (add_type(m, &Work_spec, &s->WorkType) < 0) return -1;
    /* BEGIN TYPE REGISTRATION */
    if (add_type(m, &Reducer_spec, &s->ReducerType) < 0) return -1;
    if (add_type(m, &SamplerIndices_spec, &s->SamplerType) < 0) return -1;
    if (add_type(m, &GradHooks_spec, &s->GradHooksType) < 0) return -1;
    if (add_type(m, &GradHook_spec, &s->GradHookType) < 0) return -1;
    if (!g_str_grad && !(g_str_grad = PyUnicode_InternFromString("grad"))) return -1;
    if (!g_str_is_contiguous &&
        !(g_str_is_contiguous = PyUnicode_InternFromString("is_contiguous")))
        return -1;
    if (!g_str_data_ptr && !(g_str_data_ptr = PyUnicode_InternFromString("data_ptr"))) return -1;
    if (!g_str_stride && !(g_str_stride = PyUnicode_InternFromString("stride"))) return -1;
    if (!g_str_shape && !(g_str_shape = PyUnicode_InternFromString("shape"))) return -1;
    if (!g_str_requires_grad &&
        !(g_str_requires_grad = PyUnicode_InternFromString("requires_grad")))
        return -1;
    /* END TYPE REGISTRATION */
    if (PyModule_AddIntConstant(m, "DEVICE_SORT_IDS_MAX", DDPC_DEVICE_SORT_IDS_MAX) < 0) return -1;
    ddpc_set_interrupt_hook(interrupt_hook);
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    ModState *s = state_of_module(m);
    Py_VISIT(s->DistributedError);
    Py_VISIT(s->TimeoutError);
    Py_VISIT(s->PeerError);
    Py_VISIT(s->MismatchError);
    Py_VISIT(s->AuthError);
    Py_VISIT(s->StoreType);
    Py_VISIT(s->StoreServerType);
    Py_VISIT(s->GroupType);
    Py_VISIT(s->WorkType);
    Py_VISIT(s->ReducerType);
    Py_VISIT(s->SamplerType);
    Py_VISIT(s->GradHooksType);
    Py_VISIT(s->GradHookType);
    return 0;
}

static int module_clear(PyObject *m) {
    ModState *s = state_of_module(m);
    Py_CLEAR(s->DistributedError);
    Py_CLEAR(s->TimeoutError);
    Py_CLEAR(s->PeerError);
    Py_CLEAR(s->MismatchError);
    Py_CLEAR(s->AuthError);
    Py_CLEAR(s->StoreType);
    Py_CLEAR(s->StoreServerType);
    Py_CLEAR(s->GroupType);
    Py_CLEAR(s->WorkType);
    Py_CLEAR(s->ReducerType);
    Py_CLEAR(s->SamplerType);
    Py_CLEAR(s->GradHooksType);
    Py_CLEAR(s->GradHookType);
    return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static PyModuleDef ddpc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ddpc._C",
    .m_doc = "The C core of ddpc: store, process groups, collectives, reducer, sampler.",
    .m_size = sizeof(ModState),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&ddpc_module); }
