// Python bindings of the parameter server's hot messages (wire.h):
// _core.PullMessage, _core.PushMessage, and the parts of a *Ranges request.
#pragma once

#include <pybind11/pybind11.h>

namespace elastic_emb {

void BindRequests(pybind11::module_& m);

}  // namespace elastic_emb
