/*
 * The eval callback of a non-tail shard, in C.
 *
 * llama.cpp's scheduler asks the callback about every node of the graph before it
 * computes them (about 290 nodes per Gemma 3 270M decode step on a 6-layer slice).
 * As a Python callback each question takes the GIL and a ctypes round trip: ~0.2 ms
 * per step on warm caches, more right after a graph has streamed the weights
 * through them, and the compute thread then also waits whenever the event loop holds
 * the GIL. Here a question is one strcmp and the compute thread never touches Python.
 *
 * The ggml functions are reached through pointers that Python takes from the ggml
 * library llama-cpp-python loaded, so this file needs no ggml headers and no link
 * against that library. The state layout is mirrored by a ctypes Structure in
 * engines/hidden_capture.py; state_layout() lets Python check that the two agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*tensor_name_fn)(const void *tensor);
typedef size_t (*tensor_nbytes_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

#define CAPTURE_NAME_BYTES 64

typedef struct {
    tensor_name_fn tensor_name;     /* ggml_get_name */
    tensor_nbytes_fn tensor_nbytes; /* ggml_nbytes */
    tensor_get_fn tensor_get;       /* ggml_backend_tensor_get */
    char *destination;              /* rows for this llama_decode; NULL outside one */
    size_t capacity;                /* bytes at destination */
    size_t written;                 /* bytes copied so far */
    size_t row_bytes;               /* one hidden row, n_embd * 4 */
    int failed;                     /* a captured tensor did not fit */
    char name[CAPTURE_NAME_BYTES];  /* the tensor to copy out, NUL-terminated */
} capture_state;

static bool capture_eval(void *tensor, bool ask, void *user_data)
{
    capture_state *state = user_data;
    if (ask) {
        const char *name = state->tensor_name(tensor);
        return name != NULL && strcmp(name, state->name) == 0;
    }
    size_t nbytes = state->tensor_nbytes(tensor);
    if (state->destination == NULL || state->row_bytes == 0 || nbytes % state->row_bytes != 0 ||
        nbytes > state->capacity - state->written) {
        state->failed = 1;
        return false;
    }
    state->tensor_get(tensor, state->destination + state->written, 0, nbytes);
    state->written += nbytes;
    /* Nothing after the captured tensor is needed (the passthrough layer exists only to
     * keep every row in it); false ends the computation of this graph split here. */
    return false;
}

static PyObject *callback_address(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)capture_eval);
}

static PyObject *state_layout(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}",
        "size", (Py_ssize_t)sizeof(capture_state),
        "tensor_name", (Py_ssize_t)offsetof(capture_state, tensor_name),
        "tensor_nbytes", (Py_ssize_t)offsetof(capture_state, tensor_nbytes),
        "tensor_get", (Py_ssize_t)offsetof(capture_state, tensor_get),
        "destination", (Py_ssize_t)offsetof(capture_state, destination),
        "capacity", (Py_ssize_t)offsetof(capture_state, capacity),
        "written", (Py_ssize_t)offsetof(capture_state, written),
        "row_bytes", (Py_ssize_t)offsetof(capture_state, row_bytes),
        "failed", (Py_ssize_t)offsetof(capture_state, failed),
        "name", (Py_ssize_t)offsetof(capture_state, name));
}

static PyMethodDef methods[] = {
    {"callback_address", callback_address, METH_NOARGS,
     "Address of the C eval callback (ggml_backend_sched_eval_callback)."},
    {"state_layout", state_layout, METH_NOARGS,
     "Size and field offsets of the callback's state, to check the ctypes mirror."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "engines._hidden_capture",
    "llama.cpp eval callback that copies a non-tail shard's hidden rows without the GIL.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hidden_capture(void)
{
    return PyModule_Create(&module_def);
}
