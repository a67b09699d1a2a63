// Python bindings of the native read engine (moestream._native).
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "moestream native read engine";
}
