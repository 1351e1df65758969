// Errors of the torch-free core: every failure is an exception carrying file:line and a composed message.
// Two kinds: user errors (bad argument, wrong topology, timeout) -> bmt::core::Error via BMT_CHECK;
// internal invariants (a bug in bmtrain) -> bmt::core::InternalError via BMT_ASSERT.
// Never exit()/abort(): the library is also loaded into Python.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace bmt::core {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

class InternalError : public Error {
 public:
  explicit InternalError(const std::string& what) : Error(what) {}
};

// A collective or point-to-point operation failed or timed out (peer died, network error).
class DistError : public Error {
 public:
  explicit DistError(const std::string& what) : Error(what) {}
};

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// Strips the directory part of __FILE__ so messages stay short.
constexpr const char* base_name(const char* path) {
  const char* base = path;
  for (const char* p = path; *p; ++p)
    if (*p == '/') base = p + 1;
  return base;
}

}  // namespace bmt::core

#define BMT_THROW_AS(ExcType, ...)                                                                    \
  throw ExcType(::bmt::core::concat(::bmt::core::base_name(__FILE__), ":", __LINE__, ": ", __VA_ARGS__))

#define BMT_ERROR(...) BMT_THROW_AS(::bmt::core::Error, __VA_ARGS__)

// User-facing check: the message should name the problem, the values and the fix.
#define BMT_CHECK(cond, ...)                \
  do {                                      \
    if (!(cond)) BMT_ERROR(__VA_ARGS__);    \
  } while (false)

// Internal invariant: failing means a bug in bmtrain itself.
#define BMT_ASSERT(cond, ...)                                                                \
  do {                                                                                       \
    if (!(cond))                                                                             \
      BMT_THROW_AS(::bmt::core::InternalError, "internal error (please report): ", #cond, " ", \
                   ::bmt::core::concat(__VA_ARGS__));                                        \
  } while (false)
