#include "wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "batch_keys.h"
#include "check.h"
#include "half.h"
#include "table.h"
#include "varint.h"

namespace elastic_emb::wire {
namespace {

static_assert(sizeof(float) == 4, "float32 payloads");

[[noreturn]] void Malformed(const std::string& what) { throw InvalidArgument(what); }

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

// Reads one message's fields in order.
class Reader {
 public:
  Reader(std::string_view bytes, const char* message)
      : p_(reinterpret_cast<const uint8_t*>(bytes.data())),
        end_(p_ + bytes.size()),
        message_(message) {}

  // The next field's number and wire type; false at the end.
  bool Next(int& field, int& type) {
    if (p_ >= end_) return false;
    const uint64_t tag = Varint();
    field = static_cast<int>(tag >> 3);
    type = static_cast<int>(tag & 7);
    if (field == 0) Malformed(std::string(message_) + " holds a field numbered 0");
    return true;
  }

  uint64_t Varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ >= end_) Malformed(std::string(message_) + " ends inside a varint (truncated)");
      const uint8_t b = *p_++;
      value |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return value;
    }
    Malformed(std::string(message_) + " holds a varint beyond 64 bits");
  }

  std::string_view Bytes() {
    const uint64_t n = Varint();
    if (n > static_cast<uint64_t>(end_ - p_)) {
      Malformed(std::string(message_) + " holds a field longer than the message (truncated)");
    }
    std::string_view out(reinterpret_cast<const char*>(p_), static_cast<size_t>(n));
    p_ += n;
    return out;
  }

  // A field of `type` checked to be what `field` of the message must be.
  void Expect(int field, int type, int expected) const {
    if (type != expected) {
      std::ostringstream os;
      os << message_ << " field " << field << " has wire type " << type << ", not " << expected;
      Malformed(os.str());
    }
  }

  void Skip(int type) {
    switch (type) {
      case kVarint:
        Varint();
        return;
      case kFixed64:
        Advance(8);
        return;
      case kLengthDelimited:
        Bytes();
        return;
      case kFixed32:
        Advance(4);
        return;
      default:
        Malformed(std::string(message_) + " holds a field of unknown wire type " +
                  std::to_string(type));
    }
  }

 private:
  void Advance(size_t n) {
    if (n > static_cast<size_t>(end_ - p_)) Malformed(std::string(message_) + " is truncated");
    p_ += n;
  }

  const uint8_t* p_;
  const uint8_t* end_;
  const char* message_;
};

int64_t Int(Reader& r, int field, int type) {
  r.Expect(field, type, kVarint);
  return static_cast<int64_t>(r.Varint());
}

int32_t Int32(Reader& r, int field, int type) {
  return static_cast<int32_t>(static_cast<uint32_t>(Int(r, field, type)));
}

std::string_view Bytes(Reader& r, int field, int type) {
  r.Expect(field, type, kLengthDelimited);
  return r.Bytes();
}

// Whether `s` is UTF-8 as Python's strict decoder reads it: no overlong forms, no
// surrogates, nothing above U+10FFFF.
bool IsUtf8(std::string_view s) {
  static constexpr uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = 0;  // the sequence's length, from its first byte (0: no first byte)
    if (c < 0x80) {
      n = 1;
    } else if ((c & 0xE0) == 0xC0) {
      n = 2;
    } else if ((c & 0xF0) == 0xE0) {
      n = 3;
    } else if ((c & 0xF8) == 0xF0) {
      n = 4;
    }
    if (n == 0 || i + n > s.size()) return false;
    uint32_t point = n == 1 ? c : c & (0x7F >> n);
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      point = (point << 6) | (b & 0x3F);
    }
    if (n > 1 && (point < kLeast[n] || point > 0x10FFFF || (point >= 0xD800 && point <= 0xDFFF))) {
      return false;
    }
    i += n;
  }
  return true;
}

// A table's name: checked as UTF-8 when parsed, before anything reads the request.
std::string Name(Reader& r, int field, int type) {
  const std::string_view name = Bytes(r, field, type);
  if (!IsUtf8(name)) Malformed("a table name is not UTF-8");
  return std::string(name);
}

std::vector<int64_t> DecodeKeys(std::string_view raw, int32_t encoding, const std::string& table) {
  const std::string what = "`keys of " + table + "`";
  std::vector<int64_t> keys;
  if (encoding == kKeysRaw) {
    if (raw.size() % 8 != 0) {
      Malformed(what + " has " + std::to_string(raw.size()) +
                " bytes, not a whole number of int64 keys");
    }
    keys.resize(raw.size() / 8);
    if (!raw.empty()) std::memcpy(keys.data(), raw.data(), raw.size());  // (data(): null if empty)
    return keys;
  }
  if (encoding != kKeysDeltaVarint) {
    Malformed("Unknown key encoding " + std::to_string(encoding) + " of " + what);
  }
  // Each key takes 1 byte or more: counted before any is decoded (a small encoding must not
  // make a large vector).
  const auto ends = static_cast<size_t>(std::count_if(
      raw.begin(), raw.end(), [](char b) { return (static_cast<uint8_t>(b) & 0x80) == 0; }));
  if (ends > kMaxKeysPerTable) {
    Malformed(what + " holds " + std::to_string(ends) + " keys, above the " +
              std::to_string(kMaxKeysPerTable) + " one table of a request may carry");
  }
  std::string error;
  if (!DecodeDeltaVarint(reinterpret_cast<const uint8_t*>(raw.data()), raw.size(), keys, error)) {
    Malformed(what + " " + error);
  }
  return keys;
}

PulledTable ParsePulledTable(std::string_view bytes) {
  Reader r(bytes, "TableKeys");
  PulledTable t;
  std::string_view keys, versions;
  int32_t key_encoding = kKeysRaw;
  int field, type;
  while (r.Next(field, type)) {
    switch (field) {
      case 1:
        t.name = Name(r, field, type);
        break;
      case 2:
        keys = Bytes(r, field, type);
        break;
      case 3:
        key_encoding = Int32(r, field, type);
        break;
      case 4:
        versions = Bytes(r, field, type);
        break;
      default:
        r.Skip(type);
    }
  }
  t.keys = DecodeKeys(keys, key_encoding, t.name);
  t.has_versions = !versions.empty();
  if (t.has_versions) {
    if (versions.size() != 4 * t.keys.size()) {
      Malformed("`versions of " + t.name + "` holds " + std::to_string(versions.size()) +
                " bytes; " + std::to_string(t.keys.size()) + " uint32 values expected");
    }
    t.versions.resize(t.keys.size());
    std::memcpy(t.versions.data(), versions.data(), versions.size());
  }
  return t;
}

PushedTable ParsePushedTable(std::string_view bytes) {
  Reader r(bytes, "TableGradients");
  PushedTable t;
  std::string_view keys;
  int32_t key_encoding = kKeysRaw;
  int field, type;
  while (r.Next(field, type)) {
    switch (field) {
      case 1:
        t.name = Name(r, field, type);
        break;
      case 2:
        keys = Bytes(r, field, type);
        break;
      case 3:
        t.gradient_bytes = Bytes(r, field, type);
        break;
      case 4:
        t.gradient_exponent = Int32(r, field, type);
        break;
      case 5:
        key_encoding = Int32(r, field, type);
        break;
      default:
        r.Skip(type);
    }
  }
  t.keys = DecodeKeys(keys, key_encoding, t.name);
  return t;
}

void PutVarint(uint64_t v, std::string& out) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// The size of a length-delimited field of `n` bytes (0 when omitted: proto3 leaves
// empty fields out).
size_t FieldSize(size_t n) { return n == 0 ? 0 : 1 + VarintSize(n) + n; }

void PutFieldHeader(int field, size_t n, std::string& out) {
  out.push_back(static_cast<char>((field << 3) | kLengthDelimited));
  PutVarint(n, out);
}

void PutBytesField(int field, const void* data, size_t n, std::string& out) {
  if (n == 0) return;
  PutFieldHeader(field, n, out);
  out.append(static_cast<const char*>(data), n);
}

size_t FloatSize(int32_t enc) { return enc == kFloat32 ? 4 : 2; }

void CheckEncoding(int32_t enc, const std::string& what) {
  if (enc != kFloat32 && enc != kFloat16 && enc != kBfloat16) {
    Malformed("Unknown encoding " + std::to_string(enc) + " of `" + what +
              "`; known: ['bfloat16', 'float16', 'float32']");
  }
}

const char* EncodingName(int32_t enc) {
  return enc == kFloat32 ? "float32" : enc == kFloat16 ? "float16" : "bfloat16";
}

}  // namespace

PullRequest ParsePullRequest(std::string_view bytes) {
  Reader r(bytes, "PullRequest");
  PullRequest request;
  int field, type;
  while (r.Next(field, type)) {
    switch (field) {
      case 1:
        request.worker = Int32(r, field, type);
        break;
      case 2:
        request.step = Int(r, field, type);
        break;
      case 3:
        request.train = Int(r, field, type) != 0;
        break;
      case 4:
        request.encoding = Int32(r, field, type);
        break;
      case 5:
        request.timeout_ms = Int(r, field, type);
        break;
      case 6:
        request.tables.push_back(ParsePulledTable(Bytes(r, field, type)));
        break;
      case 15:
        request.range = Int32(r, field, type);
        break;
      default:
        r.Skip(type);
    }
  }
  return request;
}

PushRequest ParsePushRequest(std::string_view bytes) {
  Reader r(bytes, "PushRequest");
  PushRequest request;
  int field, type;
  while (r.Next(field, type)) {
    switch (field) {
      case 1:
        request.worker = Int32(r, field, type);
        break;
      case 2:
        request.step = Int(r, field, type);
        break;
      case 3:
        request.encoding = Int32(r, field, type);
        break;
      case 4:
        request.tables.push_back(ParsePushedTable(Bytes(r, field, type)));
        break;
      case 15:
        request.range = Int32(r, field, type);
        break;
      default:
        r.Skip(type);
    }
  }
  return request;
}

std::vector<std::string_view> ParseParts(std::string_view bytes) {
  Reader r(bytes, "ranges request");
  std::vector<std::string_view> parts;
  int field, type;
  while (r.Next(field, type)) {
    if (field == 1) {
      parts.push_back(Bytes(r, field, type));
    } else {
      r.Skip(type);
    }
  }
  return parts;
}

std::string JoinParts(const std::vector<std::string_view>& parts) {
  size_t size = 0;
  for (const auto& p : parts) size += 1 + VarintSize(p.size()) + p.size();
  std::string out;
  out.reserve(size);
  for (const auto& p : parts) {
    PutFieldHeader(1, p.size(), out);  // an empty part still counts: one element each
    out.append(p.data(), p.size());
  }
  return out;
}

void DecodeFloats(std::string_view bytes, int32_t enc, int64_t n, float* out, const char* what,
                  const std::string& table) {
  const std::string name = std::string(what) + " of " + table;
  CheckEncoding(enc, name);
  const size_t need = static_cast<size_t>(n) * FloatSize(enc);
  if (bytes.size() != need) {
    Malformed("`" + name + "` has " + std::to_string(bytes.size()) + " bytes; " +
              std::to_string(n) + " values in " + EncodingName(enc) + " need " +
              std::to_string(need));
  }
  if (enc == kFloat32) {
    if (need > 0) std::memcpy(out, bytes.data(), need);  // (an empty table: out may be null)
    return;
  }
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  for (int64_t i = 0; i < n; ++i) {
    const auto bits = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
    out[i] = enc == kFloat16 ? HalfToFloat(bits) : Bfloat16ToFloat(bits);
  }
}

void EncodeFloats(const float* values, int64_t n, int32_t enc, std::string& out) {
  const size_t start = out.size();
  out.resize(start + static_cast<size_t>(n) * FloatSize(enc));
  char* p = out.data() + start;
  if (enc == kFloat32) {
    std::memcpy(p, values, static_cast<size_t>(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t bits = enc == kFloat16 ? FloatToHalf(values[i]) : FloatToBfloat16(values[i]);
    p[2 * i] = static_cast<char>(bits & 0xFF);
    p[2 * i + 1] = static_cast<char>(bits >> 8);
  }
}

void DecodeGradients(PushRequest& request, const std::vector<int>& dims) {
  EE_CHECK(dims.size() == request.tables.size(),
           dims.size() << " dims for a push of " << request.tables.size() << " tables");
  for (size_t i = 0; i < request.tables.size(); ++i) {
    PushedTable& t = request.tables[i];
    for (size_t j = 0; j < i; ++j) {
      if (request.tables[j].name == t.name) {
        Malformed("Table '" + t.name + "' appears twice in one push");
      }
    }
    const int64_t n = static_cast<int64_t>(t.keys.size()) * dims[i];
    const std::string name = "gradients of " + t.name;
    CheckEncoding(request.encoding, name);
    const size_t need = static_cast<size_t>(n) * FloatSize(request.encoding);
    if (t.gradient_bytes.size() != need) {  // (before sizing the buffer by the keys' count)
      Malformed("`" + name + "` has " + std::to_string(t.gradient_bytes.size()) + " bytes; " +
                std::to_string(t.keys.size()) + " rows of dim " + std::to_string(dims[i]) + " in " +
                EncodingName(request.encoding) + " need " + std::to_string(need));
    }
    t.gradients.resize(static_cast<size_t>(n));
    DecodeFloats(t.gradient_bytes, request.encoding, n, t.gradients.data(), "gradients", t.name);
    if (t.gradient_exponent > kMaxGradientExponent || t.gradient_exponent < -kMaxGradientExponent) {
      Malformed("gradient_exponent " + std::to_string(t.gradient_exponent) + " of '" + t.name +
                "' is absurd");
    }
    if (t.gradient_exponent != 0) {
      for (float& g : t.gradients) g = std::ldexp(g, -t.gradient_exponent);
    }
  }
}

std::string NonfiniteProblem(const std::vector<int64_t>& keys, const std::vector<float>& grads,
                             int dim) {
  if (grads.empty()) return "";
  // On the bits of |g|: finite iff below the exponent of Inf, and for those the order of
  // the bits is the order of the values (a loop the compiler vectorizes).
  constexpr uint32_t kInfBits = 0x7f800000u;
  uint32_t largest_bits = 0;
  for (float g : grads) {
    uint32_t bits;
    std::memcpy(&bits, &g, sizeof(bits));
    largest_bits = std::max(largest_bits, bits & 0x7fffffffu);
  }
  if (largest_bits < kInfBits) {
    float largest;
    std::memcpy(&largest, &largest_bits, sizeof(largest));
    const double rows = static_cast<double>(keys.size());
    const double bound = static_cast<double>(largest) * rows *
                         std::exp(std::min(rows * std::ldexp(1.0, -24), 700.0));
    if (bound < static_cast<double>(std::numeric_limits<float>::max())) return "";
  }
  std::ostringstream os;
  if (largest_bits < kInfBits) {
    std::vector<int64_t> unique;
    std::vector<float> sums;
    SumByKey(static_cast<int64_t>(keys.size()), keys.data(), grads.data(), dim, unique, sums);
    int64_t overflowing = 0;
    for (size_t u = 0; u < unique.size(); ++u) {
      const float* s = sums.data() + u * static_cast<size_t>(dim);
      overflowing += std::any_of(s, s + dim, [](float x) { return !std::isfinite(x); });
    }
    if (overflowing == 0) return "";
    os << "the gradients of " << overflowing << " of " << unique.size()
       << " keys sum to values beyond float32's range (Inf)";
  } else {
    const auto bad =
        std::count_if(grads.begin(), grads.end(), [](float x) { return !std::isfinite(x); });
    os << bad << " of " << grads.size() << " gradient values are not finite (NaN or Inf)";
  }
  return os.str();
}

bool KeysOutside(const std::vector<int64_t>& keys, int64_t num_slots, int64_t begin, int64_t end) {
  return std::any_of(keys.begin(), keys.end(), [&](int64_t k) {
    const int64_t slot = VirtualSlot(k, num_slots);
    return slot < begin || slot >= end;
  });
}

std::string AnswerPull(const PullRequest& request, const std::vector<RowSource>& sources) {
  EE_CHECK(sources.size() == request.tables.size(),
           sources.size() << " row sources for a pull of " << request.tables.size() << " tables");
  CheckEncoding(request.encoding, "values");
  const size_t item = FloatSize(request.encoding);
  std::string out;
  if (request.encoding != kFloat32) {
    out.push_back(static_cast<char>(1 << 3 | kVarint));
    PutVarint(static_cast<uint64_t>(request.encoding), out);
  }
  std::vector<float> rows;
  std::vector<uint32_t> now;
  std::vector<int64_t> last_step, update_count;
  std::vector<uint8_t> same;
  for (size_t i = 0; i < sources.size(); ++i) {
    const PulledTable& t = request.tables[i];
    const RowSource& source = sources[i];
    const auto n = static_cast<int64_t>(t.keys.size());
    const int dim = source.table != nullptr ? source.table->dim() : source.dim;
    const size_t width = static_cast<size_t>(dim);
    // Versions before rows (elastic_emb.ps.server.shard.Shard.pull says why).
    const uint32_t* versions = source.versions;
    if (t.has_versions && source.table != nullptr) {
      last_step.resize(static_cast<size_t>(n));
      update_count.resize(static_cast<size_t>(n));
      source.table->Metadata(n, t.keys.data(), last_step.data(), update_count.data());
      now.resize(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) {
        now[k] = update_count[k] > 0 ? static_cast<uint32_t>(last_step[k]) : 0;
      }
      versions = now.data();
    }
    const float* values = source.rows;
    if (source.table != nullptr) {
      rows.resize(static_cast<size_t>(n) * width);
      source.table->Pull(n, t.keys.data(), rows.data(), request.train);
      values = rows.data();
    }
    const bool cached = t.has_versions && versions != nullptr;
    int64_t changed = n;
    if (cached) {
      same.assign(static_cast<size_t>(n), 0);
      for (int64_t k = 0; k < n; ++k) {
        same[k] = versions[k] == t.versions[k] && versions[k] != 0;
        changed -= same[k];
      }
    }
    const size_t value_bytes = static_cast<size_t>(changed) * width * item;
    const size_t version_bytes = cached ? 4 * static_cast<size_t>(changed) : 0;
    const size_t bit_bytes = cached ? static_cast<size_t>((n + 7) / 8) : 0;
    PutFieldHeader(2,
                   FieldSize(t.name.size()) + FieldSize(value_bytes) + FieldSize(version_bytes) +
                       FieldSize(bit_bytes),
                   out);
    PutBytesField(1, t.name.data(), t.name.size(), out);
    if (!cached) {
      if (value_bytes != 0) {
        PutFieldHeader(2, value_bytes, out);
        EncodeFloats(values, n * dim, request.encoding, out);
      }
      continue;
    }
    if (value_bytes != 0) {
      PutFieldHeader(2, value_bytes, out);
      for (int64_t k = 0; k < n; ++k) {
        if (!same[k]) EncodeFloats(values + k * dim, dim, request.encoding, out);
      }
    }
    if (version_bytes != 0) {
      PutFieldHeader(3, version_bytes, out);
      for (int64_t k = 0; k < n; ++k) {
        if (!same[k]) out.append(reinterpret_cast<const char*>(&versions[k]), 4);
      }
    }
    if (bit_bytes != 0) {  // numpy.packbits: the first of 8 flags in the high bit
      PutFieldHeader(4, bit_bytes, out);
      for (int64_t b = 0; b < n; b += 8) {
        uint8_t byte = 0;
        for (int64_t k = b; k < std::min(n, b + 8); ++k) byte |= same[k] << (7 - (k - b));
        out.push_back(static_cast<char>(byte));
      }
    }
  }
  return out;
}

// The worker's side.

RangeSplit::RangeSplit(const std::vector<std::pair<const int64_t*, int64_t>>& keys,
                       const std::vector<int64_t>& starts, int64_t num_slots)
    : num_ranges_(static_cast<int64_t>(starts.size())), order_(keys.size()), bounds_(keys.size()) {
  for (size_t t = 0; t < keys.size(); ++t) {
    order_[t].resize(static_cast<size_t>(keys[t].second));
    bounds_[t].resize(starts.size() + 1);
    SplitBySlotRange(keys[t].second, keys[t].first, num_ranges_, starts.data(), num_slots,
                     order_[t].data(), bounds_[t].data());
  }
}

namespace {

size_t VarintFieldSize(int64_t value) {
  return value == 0 ? 0 : 1 + VarintSize(static_cast<uint64_t>(value));
}

void PutVarintField(int field, int64_t value, std::string& out) {
  if (value == 0) return;  // proto3 leaves defaults out
  out.push_back(static_cast<char>((field << 3) | kVarint));
  PutVarint(static_cast<uint64_t>(value), out);  // a negative int32 as 10 bytes, as protobuf
}

// A table's keys in range r, in split order, as a TableKeys/TableGradients `keys` field
// would carry them: delta + varint unless raw is smaller (wire.encode_keys_compact).
int32_t EncodeKeysCompact(const OutgoingTable& t, const int64_t* at, int64_t n,
                          std::vector<int64_t>& keys, std::string& out) {
  keys.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keys[i] = t.keys[at[i]];
  out.clear();
  EncodeDeltaVarint(n, keys.data(), out);
  if (out.size() <= 8 * static_cast<size_t>(n)) return kKeysDeltaVarint;
  out.assign(reinterpret_cast<const char*>(keys.data()), 8 * static_cast<size_t>(n));
  return kKeysRaw;
}

}  // namespace

std::string EncodePull(int32_t worker, int64_t step, bool train, int32_t encoding,
                       int64_t timeout_ms, const std::vector<OutgoingTable>& tables,
                       const RangeSplit& split, int64_t r) {
  std::string out, keys_bytes, entry;
  std::vector<int64_t> keys;
  for (size_t t = 0; t < tables.size(); ++t) {
    int64_t n;
    const int64_t* at = split.positions(t, r, n);
    if (n == 0) continue;
    const OutgoingTable& table = tables[t];
    const int32_t key_encoding = EncodeKeysCompact(table, at, n, keys, keys_bytes);
    entry.clear();
    PutBytesField(1, table.name.data(), table.name.size(), entry);
    PutBytesField(2, keys_bytes.data(), keys_bytes.size(), entry);
    PutVarintField(3, key_encoding, entry);
    if (table.held != nullptr) {
      PutFieldHeader(4, 4 * static_cast<size_t>(n), entry);
      for (int64_t i = 0; i < n; ++i) {
        entry.append(reinterpret_cast<const char*>(&table.held[at[i]]), 4);
      }
    }
    if (out.empty()) {
      PutVarintField(1, worker, out);
      PutVarintField(2, step, out);
      PutVarintField(3, train ? 1 : 0, out);
      PutVarintField(4, encoding, out);
      PutVarintField(5, timeout_ms, out);
    }
    PutFieldHeader(6, entry.size(), out);
    out += entry;
  }
  return out;
}

int32_t GradientExponent(const float* values, int64_t n, int32_t encoding) {
  if (encoding != kFloat16 || n == 0) return 0;
  float largest = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(values[i]);
    if (!(a <= std::numeric_limits<float>::max())) return 0;  // NaN or Inf: no scale
    largest = std::max(largest, a);
  }
  if (largest == 0.0f) return 0;
  int exponent;
  std::frexp(largest, &exponent);  // largest in [2^(exponent-1), 2^exponent)
  return std::clamp(14 - (exponent - 1), -100, 100);
}

std::string EncodePush(int32_t worker, int64_t step, int32_t encoding,
                       const std::vector<OutgoingTable>& tables, const RangeSplit& split,
                       int64_t r) {
  CheckEncoding(encoding, "gradients");
  const size_t item = FloatSize(encoding);
  size_t estimate = 32;
  for (size_t t = 0; t < tables.size(); ++t) {
    int64_t n;
    split.positions(t, r, n);
    estimate += tables[t].name.size() + static_cast<size_t>(n) * (9 + tables[t].dim * item) + 32;
  }
  std::string out, keys_bytes;
  out.reserve(estimate);
  PutVarintField(1, worker, out);
  PutVarintField(2, step, out);
  PutVarintField(3, encoding, out);
  std::vector<int64_t> keys;
  std::vector<float> grads;
  for (size_t t = 0; t < tables.size(); ++t) {
    int64_t n;
    const int64_t* at = split.positions(t, r, n);
    const OutgoingTable& table = tables[t];
    const int32_t key_encoding = EncodeKeysCompact(table, at, n, keys, keys_bytes);
    const size_t width = static_cast<size_t>(table.dim);
    const size_t values = static_cast<size_t>(n) * width;
    int32_t exponent = 0;
    if (encoding != kFloat32) {  // gathered, scaled, then encoded
      grads.resize(values);
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(grads.data() + i * width, table.gradients + at[i] * width, 4 * width);
      }
      exponent = GradientExponent(grads.data(), n * table.dim, encoding);
      if (exponent != 0) {
        for (float& g : grads) g = std::ldexp(g, exponent);
      }
    }
    const size_t gradient_bytes = values * item;
    PutFieldHeader(4,
                   FieldSize(table.name.size()) + FieldSize(keys_bytes.size()) +
                       FieldSize(gradient_bytes) + VarintFieldSize(exponent) +
                       VarintFieldSize(key_encoding),
                   out);
    PutBytesField(1, table.name.data(), table.name.size(), out);
    PutBytesField(2, keys_bytes.data(), keys_bytes.size(), out);
    if (gradient_bytes != 0) {
      PutFieldHeader(3, gradient_bytes, out);
      if (encoding == kFloat32) {  // gathered straight into the message
        const size_t at_byte = out.size();
        out.resize(at_byte + gradient_bytes);
        char* p = out.data() + at_byte;
        for (int64_t i = 0; i < n; ++i) {
          std::memcpy(p + i * width * 4, table.gradients + at[i] * width, 4 * width);
        }
      } else {
        EncodeFloats(grads.data(), n * table.dim, encoding, out);
      }
    }
    PutVarintField(4, exponent, out);
    PutVarintField(5, key_encoding, out);
  }
  return out;
}

void DecodePull(std::string_view response, const std::vector<OutgoingTable>& tables,
                const RangeSplit& split, int64_t r, const std::vector<IncomingTable>& out) {
  Reader reader(response, "PullResponse");
  int32_t encoding = kFloat32;
  std::vector<std::string_view> answers;
  int field, type;
  while (reader.Next(field, type)) {
    if (field == 1) {
      encoding = Int32(reader, field, type);
    } else if (field == 2) {
      answers.push_back(Bytes(reader, field, type));
    } else {
      reader.Skip(type);
    }
  }
  CheckEncoding(encoding, "values");
  std::vector<float> rows;
  std::vector<uint32_t> versions;
  size_t next = 0;
  for (size_t t = 0; t < tables.size(); ++t) {
    int64_t n;
    const int64_t* at = split.positions(t, r, n);
    if (n == 0) continue;
    const OutgoingTable& table = tables[t];
    if (next >= answers.size()) {
      Malformed("a Pull of range " + std::to_string(r) + " answered " +
                std::to_string(answers.size()) + " tables; more were asked");
    }
    Reader entry(answers[next++], "TableValues");
    std::string_view name, values, version_bytes, bits;
    while (entry.Next(field, type)) {
      switch (field) {
        case 1:
          name = Bytes(entry, field, type);
          break;
        case 2:
          values = Bytes(entry, field, type);
          break;
        case 3:
          version_bytes = Bytes(entry, field, type);
          break;
        case 4:
          bits = Bytes(entry, field, type);
          break;
        default:
          entry.Skip(type);
      }
    }
    if (name != table.name) {
      Malformed("a Pull's answer holds table '" + std::string(name) + "' where '" + table.name +
                "' was asked");
    }
    const size_t width = static_cast<size_t>(table.dim);
    const IncomingTable& dest = out[t];
    if (bits.empty()) {  // every row
      rows.resize(static_cast<size_t>(n) * width);
      DecodeFloats(values, encoding, n * table.dim, rows.data(), "rows", table.name);
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(dest.rows + at[i] * width, rows.data() + i * width, 4 * width);
      }
      continue;
    }
    if (dest.unchanged == nullptr) {
      Malformed("`unchanged` of " + table.name + " came for rows the worker does not cache");
    }
    if (bits.size() != static_cast<size_t>((n + 7) / 8)) {
      Malformed("`unchanged` of " + table.name + " holds " + std::to_string(bits.size() * 8) +
                " bits; " + std::to_string(n) + " expected");
    }
    int64_t changed = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool same = (static_cast<uint8_t>(bits[i / 8]) >> (7 - i % 8)) & 1;
      dest.unchanged[at[i]] = same;
      changed += !same;
    }
    rows.resize(static_cast<size_t>(changed) * width);
    DecodeFloats(values, encoding, changed * table.dim, rows.data(), "rows", table.name);
    if (version_bytes.size() != 4 * static_cast<size_t>(changed)) {
      Malformed("`versions of " + table.name + "` holds " +
                std::to_string(version_bytes.size() / 4) + " values; " + std::to_string(changed) +
                " expected");
    }
    versions.resize(static_cast<size_t>(changed));
    std::memcpy(versions.data(), version_bytes.data(), version_bytes.size());
    int64_t k = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (dest.unchanged[at[i]]) continue;
      std::memcpy(dest.rows + at[i] * width, rows.data() + k * width, 4 * width);
      dest.versions[at[i]] = versions[k++];
    }
  }
  if (next != answers.size()) {
    Malformed("a Pull of range " + std::to_string(r) + " answered " +
              std::to_string(answers.size()) + " tables; " + std::to_string(next) + " were asked");
  }
}

std::string EncodePushResponse(int64_t step) {
  std::string out;
  PutVarintField(1, step, out);
  return out;
}

ReplicateRequest ParseReplicateRequest(std::string_view bytes) {
  Reader r(bytes, "ReplicateRequest");
  ReplicateRequest change;
  int field, type;
  while (r.Next(field, type)) {
    switch (field) {
      case 1:
        change.group = Int32(r, field, type);
        break;
      case 2:
        change.epoch = Int(r, field, type);
        break;
      case 3:
        change.sequence = Int(r, field, type);
        break;
      case 4:
        change.method = std::string(Bytes(r, field, type));
        break;
      case 5:
        change.request = Bytes(r, field, type);
        break;
      case 6:
        change.primary = std::string(Bytes(r, field, type));
        break;
      default:
        r.Skip(type);
    }
  }
  return change;
}

std::string EncodeReplicateRequest(const ReplicateRequest& change) {
  std::string out;
  out.reserve(change.request.size() + change.method.size() + change.primary.size() + 48);
  PutVarintField(1, change.group, out);
  PutVarintField(2, change.epoch, out);
  PutVarintField(3, change.sequence, out);
  PutBytesField(4, change.method.data(), change.method.size(), out);
  PutBytesField(5, change.request.data(), change.request.size(), out);
  PutBytesField(6, change.primary.data(), change.primary.size(), out);
  return out;
}

std::string EncodeReplicateResponse(int64_t sequence) {
  std::string out;
  PutVarintField(1, sequence, out);
  return out;
}

}  // namespace elastic_emb::wire
