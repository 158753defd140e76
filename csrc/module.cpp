// The Python module pfl_kernels._C.  It has no Python functions of its own: importing it
// runs the TORCH_LIBRARY_IMPL blocks of csrc/cpu/*.cpp (and csrc/cuda/*.cu), which
// register kernels for the ops whose schemas pfl_kernels/ops/*.py define.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "C++ kernels of pfl-kernels (registered on import)", -1, nullptr};
  return PyModule_Create(&module_def);
}
}
