/* The native half of memfabric-zbal 1.2.0, simulated for npu-shim's tests.
 *
 * The wheel's zbal/zbal.cpython-311-x86_64-linux-gnu.so is two things in one file: the extension
 * module zbal.zbal (bootstrap, allocator statistics, the DeepEP adaptor) and the allocator library
 * that zbal_module.py opens with ctypes and hands to torch_npu's NPUPluggableAllocator.  It links
 * libtorch_npu and CANN's libopapi, so it cannot load off an Ascend image.  The test command
 * builds this file under the same name next to the wheel's own Python files
 * (dev/shimdev/npu_layers.py, ensure_zbal_layer): importing zbal.zbal and both ctypes loads then
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
void zbal_pluggable_begin_allocate_to_pool(int device) { (void)device; }
void zbal_pluggable_end_allocate_to_pool(int device) { (void)device; }
void zbal_pluggable_release_pool(int device) { (void)device; }

/* zbal_get_symm_base_addr(): the base of the symmetric heap; a static block stands in for it. */
static char symm_heap[64];

void *zbal_get_symm_base_addr(void)
{
    return symm_heap;
}
