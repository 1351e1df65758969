// The message of the bmt::core::Error a callable throws ("<no error>" when it returns normally), for tests that
// check what an error says.
#pragma once

#include <string>
#include <utility>

#include "bmt/core/error.h"

namespace bmt::testing {

template <typename F>
std::string error_of(F&& fn) {
  try {
    std::forward<F>(fn)();
  } catch (const bmt::core::Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace bmt::testing
