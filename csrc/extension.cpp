// specdec_kernels._C: the Python module that loads the native ops.
//
// Ops are declared once here (schemas in the `specdec` namespace) and implemented per device
// in their own files with TORCH_LIBRARY_IMPL: CPU in <op>.cpp, CUDA in <op>_cuda.cpp over a
// torch-free <op>.cu.  Importing this module registers them as torch.ops.specdec.<op>.
#include <Python.h>
#include <torch/library.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "specdec_kernels native ops", -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(specdec, m) {
  // compact_kv_cache: one [L, 2, B, Hkv, S, D] buffer or a list of [B, Hkv, S, D] tensors.
  m.def("compact_kv_cache(Tensor(a!)[] caches, Tensor cache_seqlens, Tensor accepted_indices, Tensor num_accepted) -> ()");
}
