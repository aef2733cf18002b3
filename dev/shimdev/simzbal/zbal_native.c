/* The native half of memfabric-zbal 1.2.0, simulated for npu-shim's tests.
 *
 * The wheel's zbal/zbal.cpython-311-x86_64-linux-gnu.so is two things in one file: the extension
 * module zbal.zbal (bootstrap, allocator statistics, the DeepEP adaptor) and the allocator library
 * that zbal_module.py opens with ctypes and hands to torch_npu's NPUPluggableAllocator.  It links
 * libtorch_npu and CANN's libopapi, so it cannot load off an Ascend image.  The test command
 * builds this file under the same name next to the wheel's own Python files
 * (dev/shimdev/envs/npu_layers.py, ensure_zbal_layer): importing zbal.zbal and both ctypes loads then
 * go through the real import machinery and the real dynamic loader.
 *
 * What the module holds is Python (shimdev.simzbal.native), so tests can drive it; the allocator
 * entry points are plain C with the signatures torch_npu calls them with.  No allocation is ever
 * routed through them: the simulated NPU keeps tensors on the CPU.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <sys/types.h>

static struct PyModuleDef zbal_module = {
    PyModuleDef_HEAD_INIT, "zbal", "Simulated native module of memfabric-zbal (npu-shim tests).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

/* The module is filled by shimdev.simzbal.native.populate, which also registers the submodules
 * zbal.zbal.allocator and zbal.zbal.deepep_adaptor the wheel's Python files import from. */
PyMODINIT_FUNC PyInit_zbal(void)
{
    PyObject *module = PyModule_Create(&zbal_module);
    if (module == NULL) {
        return NULL;
    }
    PyObject *impl = PyImport_ImportModule("shimdev.simzbal.native");
    if (impl == NULL) {
        Py_DECREF(module);
        return NULL;
    }
    PyObject *done = PyObject_CallMethod(impl, "populate", "O", module);
    Py_DECREF(impl);
    if (done == NULL) {
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(done);
    return module;
}

/* torch_npu's NPUPluggableAllocator: void *alloc(ssize_t size, int device, aclrtStream stream) and
 * void free(void *ptr, size_t size, int device, aclrtStream stream). */
void *zbal_pluggable_malloc(ssize_t size, int device, void *stream)
{
    (void)device;
    (void)stream;
    return malloc(size > 0 ? (size_t)size : 1);
}

void zbal_pluggable_free(void *ptr, size_t size, int device, void *stream)
{
    (void)size;
    (void)device;
    (void)stream;
    free(ptr);
}

/* The hooks switch_to_allocator() sets with set_*_fn: nothing to do without a device. */
void zbal_pluggable_init(int device_count) { (void)device_count; }
void zbal_pluggable_empty_cache(int check_error) { (void)check_error; }
void zbal_pluggable_record_stream(void *ptr, void *stream) { (void)ptr; (void)stream; }
void zbal_pluggable_erase_stream(void *ptr, void *stream) { (void)ptr; (void)stream; }
void zbal_pluggable_get_device_stats(int device) { (void)device; }

/* The graph-pool hooks switch_to_allocator() sets only with ZBAL_ENABLE_GRAPH=1.  torch_npu calls
 * them with the types its setters cast to (torch_npu/csrc/npu/Module.cpp):
 *   begin: void(int device, c10_npu::MempoolId_t pool, std::function<bool(aclrtStream)> filter)
 *   end, release: void(int device, c10_npu::MempoolId_t pool)
 * MempoolId_t is std::pair<unsigned long long, unsigned long long>: two integer registers, as this
 * struct is passed.  The filter, a std::function (not trivially copyable), is passed by address;
 * the real library copies it (its manager is called) -- here only whether one came is noted: a
 * caller from Python cannot build a std::function.  What the library does with the call (which of
 * its allocators takes the pool, the bytes it holds) is shimdev.simzbal.native's pool_* functions. */
typedef struct {
    unsigned long long first;
    unsigned long long second;
} mempool_id_t;

static void pool_call(const char *name, int device, mempool_id_t pool, int with_filter)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *impl = PyImport_ImportModule("shimdev.simzbal.native");
    PyObject *done = NULL;
    if (impl != NULL) {
        if (with_filter < 0) {
            done = PyObject_CallMethod(impl, name, "i(KK)", device, pool.first, pool.second);
        } else {
            done = PyObject_CallMethod(impl, name, "i(KK)O", device, pool.first, pool.second,
                                       with_filter ? Py_True : Py_False);
        }
        Py_DECREF(impl);
    }
    if (done == NULL) {
        /* a void C hook cannot raise: the error is printed, as a C++ allocator would abort loudly */
        PyErr_Print();
    } else {
        Py_DECREF(done);
    }
    PyGILState_Release(gil);
}

void zbal_pluggable_begin_allocate_to_pool(int device, mempool_id_t pool, const void *filter)
{
    pool_call("pool_begin", device, pool, filter != NULL);
}

void zbal_pluggable_end_allocate_to_pool(int device, mempool_id_t pool)
{
    pool_call("pool_end", device, pool, -1);
}

void zbal_pluggable_release_pool(int device, mempool_id_t pool)
{
    pool_call("pool_release", device, pool, -1);
}

/* zbal_get_symm_base_addr(): the base of the symmetric heap; a static block stands in for it. */
static char symm_heap[64];

void *zbal_get_symm_base_addr(void)
{
    return symm_heap;
}
