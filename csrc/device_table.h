// A table whose rows (values and optimizer slots) live in GPU memory.
//
// The key -> row index stays on the host (key_index.h, as in Table); the
// row arena is one device array, grown by doubling. Pull looks rows up on
// the host and gathers them on the device; Push sums duplicates and runs the
// optimizer on the device (device_kernels.h). Row metadata (last step,
// update count) is kept on the host. Same semantics and results as Table
// (table.h), so checkpoints of both are interchangeable.
//
// Thread safety: every public method may be called from any thread; calls
// on one table are serialized by its mutex. Built only with CUDA.
//
// Usage:
//   DeviceTable t(options);
//   t.Pull(n, keys, out, /*out_on_device=*/false, /*train=*/true);
//   t.Push(n, keys, grads, /*grads_on_device=*/true, /*lr=*/0.05f, /*step=*/1);
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "device_kernels.h"
#include "key_index.h"
#include "table.h"

namespace elastic_emb {

// cudaMalloc failed for lack of memory (a MemoryError in Python).
class CudaOutOfMemory : public CudaError {
 public:
  using CudaError::CudaError;
};

// Number of visible CUDA devices (0 when there is no driver or device).
int CudaDeviceCount();

// Plain device memory for arrays handed to Python (DLPack).
void* DeviceMalloc(int64_t bytes);
void DeviceFree(void* data);
void CopyToHost(void* host, const void* device, int64_t bytes);
void CopyToDevice(void* device, const void* host, int64_t bytes);
// Waits for all work on the current device (inputs produced on other streams).
void DeviceSynchronize();

// Device memory owned by RAII; grows, never shrinks.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // Makes room for `bytes` (contents are lost when it grows).
  void* Reserve(int64_t bytes);
  // Makes room for `bytes`, keeping the first `keep` bytes (waits on `stream`).
  void* GrowKeeping(int64_t bytes, int64_t keep, Stream stream);
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

class DeviceTable {
 public:
  // Uses the current CUDA device. Throws CudaError if there is none.
  explicit DeviceTable(const TableOptions& options);
  ~DeviceTable();
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;

  int dim() const { return options_.dim; }
  int num_slots() const { return num_slots_; }

  // As Table::Pull. keys: (n,) host; out: (n, dim), device memory if
  // out_on_device, else host.
  void Pull(int64_t n, const int64_t* keys, float* out, bool out_on_device, bool train);

  // As Table::Push. keys: (n,) host; grads: (n, dim), device memory if
  // grads_on_device, else host.
  void Push(int64_t n, const int64_t* keys, const float* grads, bool grads_on_device,
            float learning_rate, int64_t step);

  // As Table::Import / Export / Erase / Metadata; host memory.
  void Import(int64_t n, const int64_t* keys, const float* values, const float* slots,
              const uint32_t* last_step, const uint32_t* update_count);
  ExportedRows Export(bool with_state = true);  // always with state
  int64_t Erase(int64_t n, const int64_t* keys);
  void Metadata(int64_t n, const int64_t* keys, int64_t* last_step, int64_t* update_count);

  int64_t Size();
  // Device bytes of the arena and scratch, plus host bytes of the index.
  int64_t MemoryBytes();

  // Kernel-only entry points (benchmarks): no index, no metadata.
  // Grows the arena to at least `rows` rows.
  void Reserve(int64_t rows);
  int64_t capacity() const { return capacity_; }
  // rows: device (n,), each < capacity(); out: device (n, dim).
  void GatherRows(const uint32_t* rows, int64_t n, float* out);
  // rows: device (n,), each < capacity(); grads: device (n, dim).
  void ApplyRows(const uint32_t* rows, int64_t n, const float* grads, float learning_rate,
                 int64_t step);
  // Waits for the table's stream.
  void Synchronize();

 private:
  // Row ids of keys (kNoRow for absent ones unless insert); new rows get
  // their initial value and slots on the device. Caller holds mu_.
  void LookupRows(int64_t n, const int64_t* keys, bool insert, std::vector<uint32_t>& rows);
  void EnsureCapacity(int64_t rows);  // caller holds mu_
  // Initial [value | slots] of a key, host. row: (row_floats_,).
  void InitRow(int64_t key, float* row) const;
  // arena[rows[i]] = values[i] ([value | slots] each), via `rows_buffer`; waits.
  void WriteRows(const std::vector<uint32_t>& rows, const std::vector<float>& values,
                 DeviceBuffer& rows_buffer, const char* what);
  // Copies host rows to the device scratch buffer `buffer`; returns it.
  const uint32_t* UploadRows(const std::vector<uint32_t>& rows, DeviceBuffer& buffer);
  void ApplyLocked(const uint32_t* rows, int64_t n, const float* grads, float learning_rate,
                   int64_t step);

  TableOptions options_;
  int num_slots_;
  int row_floats_;  // dim * (1 + num_slots)
  int device_;
  Stream stream_ = nullptr;
  std::mutex mu_;

  KeyIndex index_;
  DeviceBuffer arena_;
  int64_t capacity_ = 0;           // rows the arena holds
  int64_t used_rows_ = 0;          // row ids handed out so far (free ones included)
  std::vector<int64_t> row_keys_;  // key of each used row id
  std::vector<uint32_t> free_rows_;
  std::vector<uint32_t> last_step_, update_count_;  // per row id
  DeviceBuffer rows_dev_, data_dev_, staging_dev_, scratch_dev_;
};

}  // namespace elastic_emb
