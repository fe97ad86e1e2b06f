// NumPy arrays at the Python boundary of the C++ core: argument checks, and
// vectors handed to NumPy without a copy.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "check.h"

namespace elastic_emb::py_arrays {

namespace py = pybind11;

// Checks dtype, C-contiguity and shape of an argument before any C++ runs.
// shape entries of -1 match any size.
template <typename T>
py::array_t<T> CheckArray(const py::array& a, const char* name, std::vector<py::ssize_t> shape) {
  EE_CHECK(py::isinstance<py::array_t<T>>(a) && a.dtype().is(py::dtype::of<T>()),
           "`" << name << "` must have dtype " << std::string(py::str(py::dtype::of<T>()))
               << ", got " << std::string(py::str(a.dtype())));
  EE_CHECK(a.ndim() == static_cast<py::ssize_t>(shape.size()),
           "`" << name << "` must have " << shape.size() << " dimension(s), got " << a.ndim());
  for (size_t d = 0; d < shape.size(); ++d) {
    EE_CHECK(shape[d] < 0 || a.shape(d) == shape[d], "`" << name << "` has size " << a.shape(d)
                                                         << " in dimension " << d << ", expected "
                                                         << shape[d]);
  }
  EE_CHECK(a.flags() & py::array::c_style, "`" << name << "` must be C-contiguous");
  return py::array_t<T>(a);
}

// Hands a vector's buffer to numpy without copying.
template <typename T, typename A>
py::array_t<T> ToNumpy(std::vector<T, A>&& v, std::vector<py::ssize_t> shape) {
  using Vector = std::vector<T, A>;
  auto* owned = new Vector(std::move(v));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<Vector*>(p); });
  return py::array_t<T>(shape, owned->data(), free_when_done);
}

}  // namespace elastic_emb::py_arrays
