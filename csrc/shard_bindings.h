// Python bindings of the shard's step clock and the data plane's side of a server
// (shard_core.h): _core.StepClock, _core.ShardCore, _core.ServerCore.
#pragma once

#include <pybind11/pybind11.h>

namespace elastic_emb {

void BindShards(pybind11::module_& m);

}  // namespace elastic_emb
