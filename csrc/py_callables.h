// Python callables kept by C++ objects that outlive the call that gave them.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

namespace elastic_emb {

// `f`, shared by C++ threads without touching its reference count; released with the GIL
// taken, whichever thread drops the last reference.
inline std::shared_ptr<pybind11::function> SharedCallable(pybind11::function f) {
  return std::shared_ptr<pybind11::function>(new pybind11::function(std::move(f)),
                                             [](pybind11::function* p) {
                                               pybind11::gil_scoped_acquire gil;
                                               delete p;
                                             });
}

}  // namespace elastic_emb
