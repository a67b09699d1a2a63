// The extension module moestream._native: one init function per area, each in its own
// bindings file (read_engine_bindings.cpp, device_copy_bindings.cpp).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_read_engine(py::module_& m);   // read_engine_bindings.cpp
void bind_device_copy(py::module_& m);   // device_copy_bindings.cpp

PYBIND11_MODULE(_native, m) {
  m.doc() =
      "moestream native read engine: a C++ thread pool that reads whole expert blocks with "
      "pread, bypassing the page cache, into caller-owned buffers; host-to-host copies of "
      "byte spans (copy_spans); and the CUDA copier, which loads the CUDA runtime at run time.";
  bind_read_engine(m);
  bind_device_copy(m);
}
