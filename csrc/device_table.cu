#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>

#include "check.h"
#include "device_table.h"
#include "initializer.h"
#include "update_rules.h"

namespace elastic_emb {
namespace {

cudaStream_t AsStream(Stream s) { return static_cast<cudaStream_t>(s); }

void CudaCheck(cudaError_t status, const char* what, int64_t bytes = -1) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clears a non-sticky error
  std::ostringstream message;
  if (status == cudaErrorMemoryAllocation) {
    message << "CUDA out of memory: " << what;
    if (bytes >= 0) message << " needs " << bytes << " bytes";
    throw CudaOutOfMemory(message.str());
  }
  message << "CUDA error in " << what << ": " << cudaGetErrorString(status);
  throw CudaError(message.str());
}

}  // namespace

// DeviceBuffer.

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

void* DeviceBuffer::Reserve(int64_t bytes) {
  if (bytes <= bytes_) return data_;
  const int64_t grown = std::max<int64_t>(bytes, bytes_ + bytes_ / 2);
  if (data_ != nullptr) {
    CudaCheck(cudaFree(data_), "cudaFree");  // waits for work still using it
    data_ = nullptr;
    bytes_ = 0;
  }
  CudaCheck(cudaMalloc(&data_, grown), "a scratch buffer", grown);
  bytes_ = grown;
  return data_;
}

void* DeviceBuffer::GrowKeeping(int64_t bytes, int64_t keep, Stream stream) {
  if (bytes <= bytes_) return data_;
  void* grown = nullptr;
  CudaCheck(cudaMalloc(&grown, bytes), "growing the GPU table's row arena", bytes);
  if (keep > 0) {
    cudaError_t status =
        cudaMemcpyAsync(grown, data_, keep, cudaMemcpyDeviceToDevice, AsStream(stream));
    if (status == cudaSuccess) status = cudaStreamSynchronize(AsStream(stream));
    if (status != cudaSuccess) cudaFree(grown);
    CudaCheck(status, "copying the row arena");
  }
  if (data_ != nullptr) cudaFree(data_);
  data_ = grown;
  bytes_ = bytes;
  return data_;
}

// DeviceTable.

DeviceTable::DeviceTable(const TableOptions& options) : options_(options) {
  options_.Validate();
  num_slots_ = options_.optimizer.NumSlots();
  row_floats_ = options_.dim * (1 + num_slots_);
  int count = 0;
  CudaCheck(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (count == 0) throw CudaError("no CUDA device is visible");
  CudaCheck(cudaGetDevice(&device_), "cudaGetDevice");
  cudaStream_t stream;
  CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = stream;
}

DeviceTable::~DeviceTable() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(AsStream(stream_));
    cudaStreamDestroy(AsStream(stream_));
  }
}

void DeviceTable::EnsureCapacity(int64_t rows) {
  if (rows <= capacity_) return;
  EE_CHECK(rows <= static_cast<int64_t>(kNoRow), "a GPU table holds fewer than 2^32 rows");
  const int64_t capacity =
      std::min<int64_t>(std::max<int64_t>({rows, capacity_ * 2, 1024}), kNoRow);
  const int64_t bytes = capacity * row_floats_ * static_cast<int64_t>(sizeof(float));
  arena_.GrowKeeping(bytes, capacity_ * row_floats_ * static_cast<int64_t>(sizeof(float)), stream_);
  capacity_ = capacity;
  row_keys_.resize(capacity);
  last_step_.resize(capacity);
  update_count_.resize(capacity);
}

void DeviceTable::InitRow(int64_t key, float* row) const {
  InitialValue(options_.initializer, key, options_.dim, row);
  options_.optimizer.InitSlots(options_.dim, row + options_.dim);
}

const uint32_t* DeviceTable::UploadRows(const std::vector<uint32_t>& rows, DeviceBuffer& buffer) {
  const int64_t bytes = static_cast<int64_t>(rows.size() * sizeof(uint32_t));
  auto* device = static_cast<uint32_t*>(buffer.Reserve(std::max<int64_t>(bytes, 4)));
  CudaCheck(cudaMemcpyAsync(device, rows.data(), bytes, cudaMemcpyHostToDevice, AsStream(stream_)),
            "uploading row ids");
  return device;
}

void DeviceTable::LookupRows(int64_t n, const int64_t* keys, bool insert,
                             std::vector<uint32_t>& rows) {
  rows.resize(n);
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = index_.Find(keys[i], KeyHash(keys[i]));
    missing += rows[i] == kNoRow;
  }
  if (!insert || missing == 0) return;
  // Grow first, so that running out of memory changes nothing.
  EnsureCapacity(used_rows_ +
                 std::max<int64_t>(0, missing - static_cast<int64_t>(free_rows_.size())));
  std::vector<uint32_t> fresh;
  std::vector<float> initial;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] != kNoRow) continue;
    // Found if an equal key earlier in this call inserted it.
    rows[i] = index_.FindOrInsert(keys[i], KeyHash(keys[i]), [&] {
      uint32_t row;
      if (!free_rows_.empty()) {
        row = free_rows_.back();
        free_rows_.pop_back();
      } else {
        row = static_cast<uint32_t>(used_rows_++);
      }
      row_keys_[row] = keys[i];
      last_step_[row] = update_count_[row] = 0;
      fresh.push_back(row);
      initial.resize(fresh.size() * row_floats_);
      InitRow(keys[i], initial.data() + (fresh.size() - 1) * row_floats_);
      return row;
    });
  }
  if (fresh.empty()) return;
  // The scratch buffers may be reallocated by the caller next: WriteRows waits.
  WriteRows(fresh, initial, scratch_dev_, "initializing rows");
}

void DeviceTable::WriteRows(const std::vector<uint32_t>& rows, const std::vector<float>& values,
                            DeviceBuffer& rows_buffer, const char* what) {
  const int64_t m = static_cast<int64_t>(rows.size());
  const uint32_t* rows_dev = UploadRows(rows, rows_buffer);
  auto* staged = static_cast<float*>(staging_dev_.Reserve(m * row_floats_ * sizeof(float)));
  CudaCheck(cudaMemcpyAsync(staged, values.data(), m * row_floats_ * sizeof(float),
                            cudaMemcpyHostToDevice, AsStream(stream_)),
            what);
  ScatterRows(static_cast<float*>(arena_.data()), row_floats_, row_floats_, rows_dev, m, staged,
              stream_);
  CudaCheck(cudaStreamSynchronize(AsStream(stream_)), what);
}

void DeviceTable::Pull(int64_t n, const int64_t* keys, float* out, bool out_on_device, bool train) {
  std::lock_guard<std::mutex> lock(mu_);
  const int dim = options_.dim;
  std::vector<uint32_t> rows;
  LookupRows(n, keys, train, rows);
  if (n == 0) return;
  const uint32_t* rows_dev = UploadRows(rows, rows_dev_);
  const int64_t out_bytes = n * dim * static_cast<int64_t>(sizeof(float));
  float* out_dev = out_on_device ? out : static_cast<float*>(data_dev_.Reserve(out_bytes));
  elastic_emb::GatherRows(static_cast<const float*>(arena_.data()), row_floats_, dim, rows_dev, n,
                          out_dev, stream_);
  if (!out_on_device) {
    CudaCheck(cudaMemcpyAsync(out, out_dev, out_bytes, cudaMemcpyDeviceToHost, AsStream(stream_)),
              "downloading pulled rows");
  }
  CudaCheck(cudaStreamSynchronize(AsStream(stream_)), "pull");
  if (train) return;
  // Absent keys (gathered as zeros) get their initial value.
  std::vector<int64_t> absent;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] == kNoRow) absent.push_back(i);
  }
  if (absent.empty()) return;
  const int64_t m = static_cast<int64_t>(absent.size());
  if (!out_on_device) {
    for (int64_t i : absent) InitialValue(options_.initializer, keys[i], dim, out + i * dim);
    return;
  }
  std::vector<float> initial(m * dim);
  for (int64_t a = 0; a < m; ++a) {
    InitialValue(options_.initializer, keys[absent[a]], dim, initial.data() + a * dim);
  }
  auto* positions = static_cast<int64_t*>(scratch_dev_.Reserve(m * sizeof(int64_t)));
  auto* staged = static_cast<float*>(staging_dev_.Reserve(m * dim * sizeof(float)));
  CudaCheck(cudaMemcpyAsync(positions, absent.data(), m * sizeof(int64_t), cudaMemcpyHostToDevice,
                            AsStream(stream_)),
            "uploading positions");
  CudaCheck(cudaMemcpyAsync(staged, initial.data(), m * dim * sizeof(float), cudaMemcpyHostToDevice,
                            AsStream(stream_)),
            "uploading initial values");
  ScatterOutput(out, dim, positions, m, staged, stream_);
  CudaCheck(cudaStreamSynchronize(AsStream(stream_)), "pull");
}

void DeviceTable::ApplyLocked(const uint32_t* rows, int64_t n, const float* grads,
                              float learning_rate, int64_t step) {
  const UpdateRule rule =
      MakeUpdateRule(options_.optimizer, MakeStepScalars(options_.optimizer, learning_rate, step));
  if (n == 0) return;
  void* scratch = scratch_dev_.Reserve(ApplyGradientsScratchBytes(n));
  ApplyGradients(static_cast<float*>(arena_.data()), row_floats_, options_.dim, rule, rows, n,
                 grads, scratch, stream_);
}

void DeviceTable::Push(int64_t n, const int64_t* keys, const float* grads, bool grads_on_device,
                       float learning_rate, int64_t step) {
  CheckStep(step);  // before any key is inserted
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint32_t> rows;
  LookupRows(n, keys, /*insert=*/true, rows);
  const uint32_t* rows_dev = UploadRows(rows, rows_dev_);
  const float* grads_dev = grads;
  if (!grads_on_device && n > 0) {
    const int64_t bytes = n * options_.dim * static_cast<int64_t>(sizeof(float));
    auto* staged = static_cast<float*>(data_dev_.Reserve(bytes));
    CudaCheck(cudaMemcpyAsync(staged, grads, bytes, cudaMemcpyHostToDevice, AsStream(stream_)),
              "uploading gradients");
    grads_dev = staged;
  }
  ApplyLocked(rows_dev, n, grads_dev, learning_rate, step);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  for (uint32_t row : rows) {
    last_step_[row] = static_cast<uint32_t>(step);
    ++update_count_[row];
  }
  CudaCheck(cudaStreamSynchronize(AsStream(stream_)), "push");
}

void DeviceTable::Import(int64_t n, const int64_t* keys, const float* values, const float* slots,
                         const uint32_t* last_step, const uint32_t* update_count) {
  std::lock_guard<std::mutex> lock(mu_);
  const int dim = options_.dim;
  const int slot_floats = num_slots_ * dim;
  std::vector<uint32_t> rows;
  LookupRows(n, keys, /*insert=*/true, rows);
  // The last of equal keys wins: walk backwards, keep each row once.
  std::vector<uint32_t> distinct;
  std::vector<float> staged;
  std::vector<bool> seen(used_rows_, false);
  for (int64_t i = n - 1; i >= 0; --i) {
    const uint32_t row = rows[i];
    if (seen[row]) continue;
    seen[row] = true;
    distinct.push_back(row);
    const size_t at = staged.size();
    staged.resize(at + row_floats_);
    std::copy(values + i * dim, values + (i + 1) * dim, staged.begin() + at);
    if (slots != nullptr) {
      std::copy(slots + i * slot_floats, slots + (i + 1) * slot_floats, staged.begin() + at + dim);
    } else {
      options_.optimizer.InitSlots(dim, staged.data() + at + dim);
    }
    last_step_[row] = last_step != nullptr ? last_step[i] : 0;
    update_count_[row] = update_count != nullptr ? update_count[i] : 0;
  }
  if (!distinct.empty()) WriteRows(distinct, staged, rows_dev_, "importing rows");
}

ExportedRows DeviceTable::Export(bool /*with_state*/) {
  std::lock_guard<std::mutex> lock(mu_);
  const int dim = options_.dim;
  const int slot_floats = num_slots_ * dim;
  std::vector<uint32_t> rows;
  for (int64_t r = 0; r < used_rows_; ++r) {
    const int64_t key = row_keys_[r];
    if (index_.Find(key, KeyHash(key)) == static_cast<uint32_t>(r)) rows.push_back(r);
  }
  const int64_t m = static_cast<int64_t>(rows.size());
  ExportedRows out;
  out.keys.resize(m);
  out.values.resize(m * dim);
  out.slots.resize(m * slot_floats);
  out.last_step.resize(m);
  out.update_count.resize(m);
  if (m == 0) return out;
  std::vector<float> both(m * row_floats_);
  const uint32_t* rows_dev = UploadRows(rows, rows_dev_);
  auto* gathered = static_cast<float*>(data_dev_.Reserve(m * row_floats_ * sizeof(float)));
  elastic_emb::GatherRows(static_cast<const float*>(arena_.data()), row_floats_, row_floats_,
                          rows_dev, m, gathered, stream_);
  CudaCheck(cudaMemcpyAsync(both.data(), gathered, m * row_floats_ * sizeof(float),
                            cudaMemcpyDeviceToHost, AsStream(stream_)),
            "downloading rows");
  CudaCheck(cudaStreamSynchronize(AsStream(stream_)), "export");
  for (int64_t i = 0; i < m; ++i) {
    const float* row = both.data() + i * row_floats_;
    std::copy(row, row + dim, out.values.begin() + i * dim);
    std::copy(row + dim, row + row_floats_, out.slots.begin() + i * slot_floats);
    out.keys[i] = row_keys_[rows[i]];
    out.last_step[i] = last_step_[rows[i]];
    out.update_count[i] = update_count_[rows[i]];
  }
  return out;
}

int64_t DeviceTable::Erase(int64_t n, const int64_t* keys) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t erased = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t row = index_.Erase(keys[i], KeyHash(keys[i]));
    if (row == kNoRow) continue;
    free_rows_.push_back(row);
    ++erased;
  }
  return erased;
}

void DeviceTable::Metadata(int64_t n, const int64_t* keys, int64_t* last_step,
                           int64_t* update_count) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t row = index_.Find(keys[i], KeyHash(keys[i]));
    last_step[i] = row == kNoRow ? int64_t{-1} : int64_t{last_step_[row]};
    update_count[i] = row == kNoRow ? int64_t{-1} : int64_t{update_count_[row]};
  }
}

int64_t DeviceTable::Size() {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.size();
}

int64_t DeviceTable::MemoryBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return arena_.bytes() + rows_dev_.bytes() + data_dev_.bytes() + staging_dev_.bytes() +
         scratch_dev_.bytes() + index_.MemoryBytes() +
         static_cast<int64_t>(
             row_keys_.capacity() * sizeof(int64_t) +
             (last_step_.capacity() + update_count_.capacity() + free_rows_.capacity()) *
                 sizeof(uint32_t));
}

void DeviceTable::Reserve(int64_t rows) {
  std::lock_guard<std::mutex> lock(mu_);
  EnsureCapacity(rows);
}

void DeviceTable::GatherRows(const uint32_t* rows, int64_t n, float* out) {
  std::lock_guard<std::mutex> lock(mu_);
  elastic_emb::GatherRows(static_cast<const float*>(arena_.data()), row_floats_, options_.dim, rows,
                          n, out, stream_);
}

void DeviceTable::ApplyRows(const uint32_t* rows, int64_t n, const float* grads,
                            float learning_rate, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  ApplyLocked(rows, n, grads, learning_rate, step);
}

void DeviceTable::Synchronize() {
  CudaCheck(cudaStreamSynchronize(AsStream(stream_)), "synchronize");
}

void* DeviceMalloc(int64_t bytes) {
  void* data = nullptr;
  CudaCheck(cudaMalloc(&data, std::max<int64_t>(bytes, 1)), "allocating a device array", bytes);
  return data;
}

void DeviceFree(void* data) { cudaFree(data); }

void CopyToHost(void* host, const void* device, int64_t bytes) {
  CudaCheck(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "copying to the host");
}

void CopyToDevice(void* device, const void* host, int64_t bytes) {
  CudaCheck(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "copying to the device");
}

void DeviceSynchronize() { CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace elastic_emb
