// The parameter server's hot messages (protos/elastic_emb/ps/v1/ps.proto:
// PullRequest, PushRequest, PullResponse and the *Ranges wrappers), read and
// written here in the protobuf wire format, so that a shard handles a request
// in one C++ call: decode every table's keys and gradients, gather or apply,
// encode the response. Only these messages' fields are known; unknown fields
// are skipped, as protobuf does. The other messages stay in Python.
//
// Malformed input (a truncated field, a length beyond the message, a payload
// of the wrong size) throws InvalidArgument naming the field; nothing of a
// request is applied before all of it is read and checked.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace elastic_emb {

class Table;

namespace wire {

// ps.proto's Encoding of float payloads.
enum FloatEncoding : int32_t { kFloat32 = 0, kFloat16 = 1, kBfloat16 = 2 };
// ps.proto's KeyEncoding.
enum KeyEncoding : int32_t { kKeysRaw = 0, kKeysDeltaVarint = 1 };

// Gradients scaled beyond 2^+-200 are not a float16 range fix but a bad request.
constexpr int32_t kMaxGradientExponent = 200;
// One table's keys in one request (2^27: 1 GiB of int64, the largest message).
constexpr size_t kMaxKeysPerTable = size_t{1} << 27;

// One table's part of a Pull.
struct PulledTable {
  std::string name;
  std::vector<int64_t> keys;
  bool has_versions = false;       // the worker caches rows: `versions` holds one per key
  std::vector<uint32_t> versions;  // the version of the row the worker holds (0: none)
};

struct PullRequest {
  int32_t worker = 0;
  int64_t step = 0;
  bool train = false;
  int32_t encoding = kFloat32;
  int64_t timeout_ms = 0;
  int32_t range = 0;
  std::vector<PulledTable> tables;
};

// One table's part of a Push. `gradients` is empty until DecodeGradients.
struct PushedTable {
  std::string name;
  std::vector<int64_t> keys;
  std::string_view gradient_bytes;  // into the request's bytes
  int32_t gradient_exponent = 0;
  std::vector<float> gradients;  // (keys.size(), dim), float32, unscaled
};

struct PushRequest {
  int32_t worker = 0;
  int64_t step = 0;
  int32_t encoding = kFloat32;
  int32_t range = 0;
  std::vector<PushedTable> tables;
};

// Parsers. `bytes` must outlive a PushRequest (gradient_bytes points into it).
PullRequest ParsePullRequest(std::string_view bytes);
PushRequest ParsePushRequest(std::string_view bytes);
// The parts (field 1, length-delimited) of a PullRangesRequest or PushRangesRequest.
std::vector<std::string_view> ParseParts(std::string_view bytes);
// The parts' messages wrapped as a PullRangesResponse or PushRangesResponse.
std::string JoinParts(const std::vector<std::string_view>& parts);

// Decodes every table's gradients, table i of width dims[i]; refuses a table
// named twice, a payload of the wrong size, an unknown encoding, an absurd
// exponent.
void DecodeGradients(PushRequest& request, const std::vector<int>& dims);

// Why a push of these gradients must not be applied ("" when it may): a
// value that is not finite, or equal keys whose float32 sum in order is not
// (the same test and text as elastic_emb.tables.table.check_finite_gradients).
std::string NonfiniteProblem(const std::vector<int64_t>& keys, const std::vector<float>& grads,
                             int dim);

// Whether any key's virtual slot (VirtualSlot, num_slots) is outside [begin, end).
bool KeysOutside(const std::vector<int64_t>& keys, int64_t num_slots, int64_t begin, int64_t end);

// What answers one table of a Pull: its table (rows gathered now, versions
// read first when the worker caches), or rows and versions gathered already.
struct RowSource {
  Table* table = nullptr;
  const float* rows = nullptr;         // (n, dim), when table is null
  const uint32_t* versions = nullptr;  // (n,), when table is null and the worker caches
  int dim = 0;
};

// A PushResponse: the shard's step.
std::string EncodePushResponse(int64_t step);

// A change a primary sends its backups (ReplicateRequest): `request` is the serialized
// request of `method` (into the parsed bytes, which must outlive it).
struct ReplicateRequest {
  int32_t group = 0;
  int64_t epoch = 0;
  int64_t sequence = 0;
  std::string method;
  std::string_view request;
  std::string primary;
};
ReplicateRequest ParseReplicateRequest(std::string_view bytes);
std::string EncodeReplicateRequest(const ReplicateRequest& change);
// A ReplicateResponse: the sequence applied.
std::string EncodeReplicateResponse(int64_t sequence);

// The PullResponse answering `request`, table i from sources[i].
std::string AnswerPull(const PullRequest& request, const std::vector<RowSource>& sources);

// The worker's side: the requests of a step that touches many tables, one per slot
// range, and the rows of the answers, each in one call.

// Each table's keys split by slot range (SplitBySlotRange): for table t and range r, the
// positions of its keys that the range owns, ordered by key as uint64.
class RangeSplit {
 public:
  // keys[t]: table t's keys (pointer, count); starts: each range's first slot (starts[0] == 0).
  RangeSplit(const std::vector<std::pair<const int64_t*, int64_t>>& keys,
             const std::vector<int64_t>& starts, int64_t num_slots);

  size_t num_tables() const { return order_.size(); }
  int64_t num_ranges() const { return num_ranges_; }
  // Positions into table t's keys of range r's keys: [begin, begin + count).
  const int64_t* positions(size_t t, int64_t r, int64_t& count) const {
    const auto& b = bounds_[t];
    count = b[r + 1] - b[r];
    return order_[t].data() + b[r];
  }

 private:
  int64_t num_ranges_;
  std::vector<std::vector<int64_t>> order_, bounds_;
};

// One table of a worker's request: its keys (as split), with a Pull the versions of the rows
// the worker caches (null: none) and with a Push the gradients (n, dim).
struct OutgoingTable {
  std::string name;
  const int64_t* keys = nullptr;
  const uint32_t* held = nullptr;
  const float* gradients = nullptr;
  int dim = 0;
};

// Range r's PullRequest (without `range`: the router adds it): the tables that have keys in
// the range; "" when none has.
std::string EncodePull(int32_t worker, int64_t step, bool train, int32_t encoding,
                       int64_t timeout_ms, const std::vector<OutgoingTable>& tables,
                       const RangeSplit& split, int64_t r);

// Range r's PushRequest (without `range`): every table, those without keys in the range too
// (a sync step needs every worker's push on every range). 16-bit gradients are scaled by the
// power of two that brings the largest magnitude to [2^14, 2^15) (GradientExponent).
std::string EncodePush(int32_t worker, int64_t step, int32_t encoding,
                       const std::vector<OutgoingTable>& tables, const RangeSplit& split,
                       int64_t r);

// The power of two for float16 gradients (0 for other encodings, none finite or all zero).
int32_t GradientExponent(const float* values, int64_t n, int32_t encoding);

// Where the rows of a Pull's answers go, per table: rows (n, dim); with a cache, each row's
// version and whether the range left it out as unchanged since the version held.
struct IncomingTable {
  float* rows = nullptr;
  uint32_t* versions = nullptr;  // null without a cache
  uint8_t* unchanged = nullptr;  // null without a cache
};

// Decodes range r's PullResponse (answering EncodePull's request for it) into `out`; throws
// InvalidArgument when it does not answer that request.
void DecodePull(std::string_view response, const std::vector<OutgoingTable>& tables,
                const RangeSplit& split, int64_t r, const std::vector<IncomingTable>& out);

// Float payloads: float32 `(n)` values in encoding `enc`, and back.
void EncodeFloats(const float* values, int64_t n, int32_t enc, std::string& out);
void DecodeFloats(std::string_view bytes, int32_t enc, int64_t n, float* out, const char* what,
                  const std::string& table);

}  // namespace wire
}  // namespace elastic_emb
