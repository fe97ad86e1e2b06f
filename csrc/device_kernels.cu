// CUDA kernels of the GPU table (API and contracts: device_kernels.h).
//
// Duplicate rows in ApplyGradients (no atomics, no races):
//   1. positions[i] = i for i < n (uint32, in scratch).
//   2. cub::DeviceRadixSort::SortPairs with keys = row ids, values =
//      positions. LSD radix sort is stable, so among equal rows the positions
//      stay ascending, i.e. in input order: the order of the CPU core's
//      std::sort of (row << 32 | position) in Table::Push.
//   3. One launch over all n sorted entries (grid-stride, so any n). Entry i
//      starts a run when i == 0 or sorted_rows[i - 1] != sorted_rows[i]; other
//      entries do nothing. A run start is owned by one group of threads
//      (1 to 32 lanes of a warp), and element j of the row by exactly one lane
//      of that group: the lane sums the run's gradients of j sequentially in
//      input order, as the CPU does (acc = g[first]; acc += g[second]; ...; a
//      run of one uses g[first] as is), then applies UpdateElement
//      (update_rules.h) once to the value and slots of j. Distinct runs are
//      distinct rows, so every arena element has a single writer. The number
//      of distinct rows is never read back to the host: the call stays
//      asynchronous.
//
// Bit-identical results with the CPU core need IEEE float32 arithmetic
// without contraction: compile this file with --fmad=false and without
// --use_fast_math (which would turn off -prec-div, -prec-sqrt and denormals).
//
// Vectorized memory access: each kernel moves V floats at a time, V = 4
// (float4), 2 (float2) or 1, the widest for which the row width, every row
// stride (the arena's row_floats, a dense buffer's width) and every base
// pointer are multiples of V floats (4 * V bytes); other shapes, e.g. odd dim,
// take the scalar path. A row of width / V vectors is handled by a group of G
// lanes, G the next power of two of width / V capped at 32, so small rows do
// not idle most of a warp; blocks have 256 threads (256 / G rows), with a
// grid-stride loop over rows. Index arithmetic is 64-bit throughout.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <initializer_list>
#include <string>

#include "check.h"
#include "device_kernels.h"
#include "update_rules.h"

namespace elastic_emb {
namespace {

constexpr int kBlockThreads = 256;
// Grid-stride loops cover any n; more blocks than this gain nothing.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;
constexpr size_t kScratchAlign = 256;
constexpr int kMaxSlots = 2;

inline cudaStream_t AsCuda(Stream stream) { return static_cast<cudaStream_t>(stream); }

[[noreturn]] void ThrowCuda(const char* what, cudaError_t err) {
  throw CudaError(std::string("elastic_emb CUDA error in ") + what + ": " +
                  cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")");
}

// After a kernel launch: reports a bad launch configuration or an earlier
// asynchronous error of the context.
void CheckLaunch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) ThrowCuda(kernel, err);
}

void CheckCall(const char* what, cudaError_t err) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so it is reported once
    ThrowCuda(what, err);
  }
}

// ---------------------------------------------------------------------------
// V-float vectors held in registers.

template <int V>
__device__ __forceinline__ void LoadVec(const float* p, float (&x)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    x[0] = t.x;
    x[1] = t.y;
    x[2] = t.z;
    x[3] = t.w;
  } else if constexpr (V == 2) {
    const float2 t = *reinterpret_cast<const float2*>(p);
    x[0] = t.x;
    x[1] = t.y;
  } else {
    x[0] = *p;
  }
}

// Read-only for the whole kernel: may go through the non-coherent cache.
template <int V>
__device__ __forceinline__ void LoadVecRO(const float* p, float (&x)[V]) {
  if constexpr (V == 4) {
    const float4 t = __ldg(reinterpret_cast<const float4*>(p));
    x[0] = t.x;
    x[1] = t.y;
    x[2] = t.z;
    x[3] = t.w;
  } else if constexpr (V == 2) {
    const float2 t = __ldg(reinterpret_cast<const float2*>(p));
    x[0] = t.x;
    x[1] = t.y;
  } else {
    x[0] = __ldg(p);
  }
}

template <int V>
__device__ __forceinline__ void StoreVec(float* p, const float (&x)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  } else if constexpr (V == 2) {
    *reinterpret_cast<float2*>(p) = make_float2(x[0], x[1]);
  } else {
    *p = x[0];
  }
}

template <int V>
__device__ __forceinline__ void CopyVec(const float* src, float* dst) {
  float x[V];
  LoadVecRO<V>(src, x);
  StoreVec<V>(dst, x);
}

// Thread placement of the row kernels: group (of 1 << group_log2 lanes) per
// row, kBlockThreads / group rows per block, grid-stride over rows.
struct RowLanes {
  int64_t first;   // this group's first row
  int64_t stride;  // rows per grid
  int lane;        // lane within the group
  int group;       // lanes per group
};

__device__ __forceinline__ RowLanes MakeRowLanes(int group_log2) {
  const int rows_per_block = kBlockThreads >> group_log2;
  RowLanes r;
  r.first = static_cast<int64_t>(blockIdx.x) * rows_per_block + (threadIdx.x >> group_log2);
  r.stride = static_cast<int64_t>(gridDim.x) * rows_per_block;
  r.group = 1 << group_log2;
  r.lane = threadIdx.x & (r.group - 1);
  return r;
}

// ---------------------------------------------------------------------------
// Kernels.

template <int V>
__global__ void __launch_bounds__(kBlockThreads)
    GatherRowsKernel(const float* __restrict__ arena, int64_t row_floats, int dim,
                     const uint32_t* __restrict__ rows, int64_t n, float* __restrict__ out,
                     int group_log2) {
  const RowLanes t = MakeRowLanes(group_log2);
  const int nvec = dim / V;
  for (int64_t i = t.first; i < n; i += t.stride) {
    const uint32_t row = rows[i];
    float* dst = out + i * dim;
    if (row == kNoRow) {
      float zero[V];
#pragma unroll
      for (int k = 0; k < V; ++k) zero[k] = 0.0f;
      for (int c = t.lane; c < nvec; c += t.group) StoreVec<V>(dst + c * V, zero);
    } else {
      const float* src = arena + static_cast<int64_t>(row) * row_floats;
      for (int c = t.lane; c < nvec; c += t.group) CopyVec<V>(src + c * V, dst + c * V);
    }
  }
}

template <int V>
__global__ void __launch_bounds__(kBlockThreads)
    ScatterRowsKernel(float* __restrict__ arena, int64_t row_floats, int width,
                      const uint32_t* __restrict__ rows, int64_t n, const float* __restrict__ src,
                      int group_log2) {
  const RowLanes t = MakeRowLanes(group_log2);
  const int nvec = width / V;
  for (int64_t i = t.first; i < n; i += t.stride) {
    const uint32_t row = rows[i];
    if (row == kNoRow) continue;
    const float* s = src + i * width;
    float* dst = arena + static_cast<int64_t>(row) * row_floats;
    for (int c = t.lane; c < nvec; c += t.group) CopyVec<V>(s + c * V, dst + c * V);
  }
}

template <int V>
__global__ void __launch_bounds__(kBlockThreads)
    ScatterOutputKernel(float* __restrict__ out, int dim, const int64_t* __restrict__ positions,
                        int64_t n, const float* __restrict__ src, int group_log2) {
  const RowLanes t = MakeRowLanes(group_log2);
  const int nvec = dim / V;
  for (int64_t i = t.first; i < n; i += t.stride) {
    const float* s = src + i * dim;
    float* dst = out + positions[i] * dim;
    for (int c = t.lane; c < nvec; c += t.group) CopyVec<V>(s + c * V, dst + c * V);
  }
}

__global__ void __launch_bounds__(kBlockThreads) IotaKernel(uint32_t* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = static_cast<uint32_t>(i);
  }
}

// keys: the row ids sorted ascending; pos: their input positions, ascending
// among equal rows. See the comment at the top of the file.
template <int V>
__global__ void __launch_bounds__(kBlockThreads)
    ApplyGradientsKernel(float* __restrict__ arena, int64_t row_floats, int dim, UpdateRule rule,
                         int num_slots, const uint32_t* __restrict__ keys,
                         const uint32_t* __restrict__ pos, int64_t n,
                         const float* __restrict__ grads, int group_log2) {
  const RowLanes t = MakeRowLanes(group_log2);
  const int nvec = dim / V;
  for (int64_t i = t.first; i < n; i += t.stride) {
    const uint32_t row = keys[i];
    if (i > 0 && keys[i - 1] == row) continue;  // not a run start
    float* value = arena + static_cast<int64_t>(row) * row_floats;
    float* slots = value + dim;
    const float* first = grads + static_cast<int64_t>(pos[i]) * dim;
    for (int c = t.lane; c < nvec; c += t.group) {
      const int j = c * V;
      // The run's gradient sum for elements j .. j + V - 1, in input order.
      float acc[V];
      LoadVecRO<V>(first + j, acc);
      for (int64_t e = i + 1; e < n && keys[e] == row; ++e) {
        float g[V];
        LoadVecRO<V>(grads + static_cast<int64_t>(pos[e]) * dim + j, g);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += g[k];
      }
      // The row's elements in registers, laid out for UpdateElement with
      // dim = V: value v[k], slot s of element k at sl[s * V + k].
      float v[V];
      float sl[kMaxSlots * V];
      LoadVec<V>(value + j, v);
#pragma unroll
      for (int s = 0; s < kMaxSlots; ++s) {
        if (s < num_slots) {
          float x[V];
          LoadVec<V>(slots + static_cast<int64_t>(s) * dim + j, x);
#pragma unroll
          for (int k = 0; k < V; ++k) sl[s * V + k] = x[k];
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) sl[s * V + k] = 0.0f;
        }
      }
#pragma unroll
      for (int k = 0; k < V; ++k) UpdateElement(rule, V, k, acc[k], v, sl);
      StoreVec<V>(value + j, v);
#pragma unroll
      for (int s = 0; s < kMaxSlots; ++s) {
        if (s < num_slots) {
          float x[V];
#pragma unroll
          for (int k = 0; k < V; ++k) x[k] = sl[s * V + k];
          StoreVec<V>(slots + static_cast<int64_t>(s) * dim + j, x);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Host-side launch planning.

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The widest vector (4, 2 or 1 floats) that `width`, every stride and every
// pointer allow.
int PickVec(int width, std::initializer_list<int64_t> strides,
            std::initializer_list<const void*> pointers) {
  for (int v : {4, 2}) {
    bool ok = width % v == 0;
    for (int64_t s : strides) ok = ok && s % v == 0;
    for (const void* p : pointers) ok = ok && Aligned(p, sizeof(float) * v);
    if (ok) return v;
  }
  return 1;
}

struct RowPlan {
  int group_log2;
  unsigned blocks;
};

// A group of lanes per row of `nvec` vectors, as many rows per block as fit.
RowPlan PlanRows(int64_t n, int nvec) {
  RowPlan p{0, 0};
  while ((1 << p.group_log2) < nvec && p.group_log2 < 5) ++p.group_log2;
  const int64_t rows_per_block = kBlockThreads >> p.group_log2;
  p.blocks = static_cast<unsigned>(std::min((n + rows_per_block - 1) / rows_per_block, kMaxBlocks));
  return p;
}

// Launches kernel<V> for the V of `vec`.
#define EE_LAUNCH_VEC(vec, kernel, blocks, stream, ...)                   \
  do {                                                                    \
    switch (vec) {                                                        \
      case 4:                                                             \
        kernel<4><<<(blocks), kBlockThreads, 0, (stream)>>>(__VA_ARGS__); \
        break;                                                            \
      case 2:                                                             \
        kernel<2><<<(blocks), kBlockThreads, 0, (stream)>>>(__VA_ARGS__); \
        break;                                                            \
      default:                                                            \
        kernel<1><<<(blocks), kBlockThreads, 0, (stream)>>>(__VA_ARGS__); \
        break;                                                            \
    }                                                                     \
    CheckLaunch(#kernel);                                                 \
  } while (0)

// ApplyGradients scratch, from a 256-byte aligned base: sorted rows, input
// positions, sorted positions, CUB temp storage; each 256-byte aligned.
struct ScratchLayout {
  size_t sorted_rows = 0;
  size_t positions = 0;
  size_t sorted_positions = 0;
  size_t temp = 0;
  size_t temp_bytes = 0;
  size_t total = 0;
};

size_t AlignUp(size_t x) { return (x + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// Positions are uint32, and so is CUB's item count.
void CheckPushSize(int64_t n) {
  EE_CHECK(n >= 0 && n <= int64_t{0xFFFFFFFF},
           "a device push takes at most 2^32 - 1 gradients, got " << n);
}

ScratchLayout MakeScratchLayout(int64_t n, cudaStream_t stream) {
  ScratchLayout l;
  // A size query: launches nothing; depends on n, the types and the current
  // device only.
  CheckCall("cub::DeviceRadixSort::SortPairs (temp storage size)",
            cub::DeviceRadixSort::SortPairs(
                nullptr, l.temp_bytes, static_cast<const uint32_t*>(nullptr),
                static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
                static_cast<uint32_t*>(nullptr), static_cast<uint32_t>(n), 0, 32, stream));
  const size_t array = AlignUp(sizeof(uint32_t) * static_cast<size_t>(n));
  l.sorted_rows = 0;
  l.positions = l.sorted_rows + array;
  l.sorted_positions = l.positions + array;
  l.temp = l.sorted_positions + array;
  l.total = l.temp + AlignUp(l.temp_bytes);
  return l;
}

}  // namespace

// ---------------------------------------------------------------------------
// API.

void GatherRows(const float* arena, int64_t row_floats, int dim, const uint32_t* rows, int64_t n,
                float* out, Stream stream) {
  EE_CHECK(n >= 0, "GatherRows: n must be >= 0, got " << n);
  EE_CHECK(dim > 0 && row_floats >= dim, "GatherRows: need 0 < dim <= row_floats, got dim "
                                             << dim << ", row_floats " << row_floats);
  if (n == 0) return;
  const int vec = PickVec(dim, {row_floats}, {arena, out});
  const RowPlan plan = PlanRows(n, dim / vec);
  EE_LAUNCH_VEC(vec, GatherRowsKernel, plan.blocks, AsCuda(stream), arena, row_floats, dim, rows, n,
                out, plan.group_log2);
}

void ScatterRows(float* arena, int64_t row_floats, int width, const uint32_t* rows, int64_t n,
                 const float* src, Stream stream) {
  EE_CHECK(n >= 0, "ScatterRows: n must be >= 0, got " << n);
  EE_CHECK(width > 0 && row_floats >= width, "ScatterRows: need 0 < width <= row_floats, got width "
                                                 << width << ", row_floats " << row_floats);
  if (n == 0) return;
  const int vec = PickVec(width, {row_floats}, {arena, src});
  const RowPlan plan = PlanRows(n, width / vec);
  EE_LAUNCH_VEC(vec, ScatterRowsKernel, plan.blocks, AsCuda(stream), arena, row_floats, width, rows,
                n, src, plan.group_log2);
}

void ScatterOutput(float* out, int dim, const int64_t* positions, int64_t n, const float* src,
                   Stream stream) {
  EE_CHECK(n >= 0, "ScatterOutput: n must be >= 0, got " << n);
  EE_CHECK(dim > 0, "ScatterOutput: dim must be positive, got " << dim);
  if (n == 0) return;
  const int vec = PickVec(dim, {}, {out, src});
  const RowPlan plan = PlanRows(n, dim / vec);
  EE_LAUNCH_VEC(vec, ScatterOutputKernel, plan.blocks, AsCuda(stream), out, dim, positions, n, src,
                plan.group_log2);
}

int64_t ApplyGradientsScratchBytes(int64_t n) {
  CheckPushSize(n);
  if (n == 0) return 0;
  // kScratchAlign - 1 spare bytes: the caller's pointer need not be aligned.
  return static_cast<int64_t>(MakeScratchLayout(n, nullptr).total + kScratchAlign - 1);
}

void ApplyGradients(float* arena, int64_t row_floats, int dim, const UpdateRule& rule,
                    const uint32_t* rows, int64_t n, const float* grads, void* scratch,
                    Stream stream) {
  CheckPushSize(n);
  const int num_slots = rule.num_slots;
  EE_CHECK(dim > 0 && row_floats >= static_cast<int64_t>(dim) * (1 + num_slots),
           "ApplyGradients: need 0 < dim and dim * (1 + " << num_slots << " slots) <= row_floats, "
                                                          << "got dim " << dim << ", row_floats "
                                                          << row_floats);
  if (n == 0) return;
  EE_CHECK(scratch != nullptr, "ApplyGradients: scratch is null");
  const cudaStream_t s = AsCuda(stream);
  const ScratchLayout l = MakeScratchLayout(n, s);
  const uintptr_t raw = reinterpret_cast<uintptr_t>(scratch);
  char* base = reinterpret_cast<char*>((raw + kScratchAlign - 1) / kScratchAlign * kScratchAlign);
  auto* sorted_rows = reinterpret_cast<uint32_t*>(base + l.sorted_rows);
  auto* positions = reinterpret_cast<uint32_t*>(base + l.positions);
  auto* sorted_positions = reinterpret_cast<uint32_t*>(base + l.sorted_positions);
  void* temp = base + l.temp;
  size_t temp_bytes = l.temp_bytes;

  const unsigned iota_blocks =
      static_cast<unsigned>(std::min((n + kBlockThreads - 1) / kBlockThreads, kMaxBlocks));
  IotaKernel<<<iota_blocks, kBlockThreads, 0, s>>>(positions, n);
  CheckLaunch("IotaKernel");

  // Stable: equal rows keep their positions ascending.
  CheckCall("cub::DeviceRadixSort::SortPairs",
            cub::DeviceRadixSort::SortPairs(temp, temp_bytes, rows, sorted_rows, positions,
                                            sorted_positions, static_cast<uint32_t>(n), 0, 32, s));
  CheckLaunch("cub::DeviceRadixSort::SortPairs");

  const int vec = PickVec(dim, {row_floats}, {arena, grads});
  const RowPlan plan = PlanRows(n, dim / vec);
  EE_LAUNCH_VEC(vec, ApplyGradientsKernel, plan.blocks, s, arena, row_floats, dim, rule, num_slots,
                sorted_rows, sorted_positions, n, grads, plan.group_log2);
}

}  // namespace elastic_emb
