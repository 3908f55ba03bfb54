// `import mla_ops._C` loads this library, whose static registrations (registration.cpp,
// native_op.cpp) put the kernels on the dispatcher; the module itself is empty: everything is
// reached through torch.ops.mla.* and torch.ops.mla_native.* (pytorch/extension-cpp does the same).
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                                      "mla-ops native CPU kernels: registered on torch.ops.mla", -1, nullptr};
  return PyModule_Create(&module);
}
