// Argument checks that throw instead of aborting.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace elastic_emb {

// Thrown for invalid arguments; pybind11 maps it to Python's ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
[[noreturn]] inline void ThrowInvalid(const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << msg << " (" << file << ":" << line << ")";
  throw InvalidArgument(os.str());
}
}  // namespace detail

}  // namespace elastic_emb

// EE_CHECK(cond, streamable message): throws InvalidArgument with file and line.
#define EE_CHECK(cond, msg)                                                        \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::ostringstream ee_check_os_;                                             \
      ee_check_os_ << msg;                                                         \
      ::elastic_emb::detail::ThrowInvalid(__FILE__, __LINE__, ee_check_os_.str()); \
    }                                                                              \
  } while (0)
