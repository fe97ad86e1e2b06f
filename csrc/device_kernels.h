// CUDA kernels of the GPU table (device_kernels.cu), callable from host code
// compiled without nvcc. Every pointer marked "device" is GPU memory; calls
// are asynchronous on `stream` unless said otherwise, and report a launch
// or CUDA error by throwing elastic_emb::CudaError (invalid sizes: InvalidArgument,
// check.h). n == 0 launches nothing. Device pointers need only float
// alignment: a call takes float4 (or float2) loads and stores when the
// widths, row strides and pointers allow it, so a row_floats that is a
// multiple of 4 keeps the arena on the fastest path.
//
// The row arena is one device array of `capacity` rows, `row_floats` floats
// each: [value (dim) | slots (num_slots * dim)]; a row id indexes it.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "key_index.h"  // kNoRow
#include "update_rules.h"

namespace elastic_emb {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Stream = void*;  // a cudaStream_t (kept opaque for host-only code)

// out[i, :] = arena[rows[i], 0:dim] for i < n; zeros where rows[i] == kNoRow.
// arena: device (capacity, row_floats); rows: device (n,); out: device (n, dim).
void GatherRows(const float* arena, int64_t row_floats, int dim, const uint32_t* rows, int64_t n,
                float* out, Stream stream);

// arena[rows[i], 0:width] = src[i, 0:width] for i < n (rows distinct;
// entries equal to kNoRow are skipped).
// src: device (n, width), row-major.
void ScatterRows(float* arena, int64_t row_floats, int width, const uint32_t* rows, int64_t n,
                 const float* src, Stream stream);

// out[positions[i], :] = src[i, :] for i < n. out: device (?, dim); src:
// device (n, dim); positions: device (n,), distinct.
void ScatterOutput(float* out, int dim, const int64_t* positions, int64_t n, const float* src,
                   Stream stream);

// Device scratch a push of n gradients needs (bytes), for ApplyGradients:
// sorted rows and positions and CUB's radix sort storage (any alignment).
// n <= 2^32 - 1. Synchronous; launches nothing, but asks CUB for the current
// device's sizes, so call it with the device of the ApplyGradients current.
int64_t ApplyGradientsScratchBytes(int64_t n);

// One optimizer step: gradients of equal rows are summed in input order (a
// stable sort by row, then each distinct row adds its run sequentially, so
// the sum is the CPU core's, bit for bit), then `rule` updates each distinct
// row and its slots once. No atomics.
// arena: device; rows: device (n,), no kNoRow, each < capacity; grads: device
// (n, dim); scratch: device, ApplyGradientsScratchBytes(n) bytes.
// Asynchronous on `stream`.
void ApplyGradients(float* arena, int64_t row_floats, int dim, const UpdateRule& rule,
                    const uint32_t* rows, int64_t n, const float* grads, void* scratch,
                    Stream stream);

}  // namespace elastic_emb
