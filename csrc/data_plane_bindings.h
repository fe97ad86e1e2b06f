// Python bindings of the data plane (data_plane.h): _core.DataPlaneServer,
// _core.DataPlaneConnection and _core.data_plane_call_many.
#pragma once

#include <pybind11/pybind11.h>

namespace elastic_emb {

void BindDataPlane(pybind11::module_& m);

}  // namespace elastic_emb
