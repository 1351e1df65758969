// Shared by the attention tests (tests/nn, tests/engine, tests/cuda): the causal attention written out with torch's
// ops (the independent reference), a closeness check against it, and a counter of calls to named ATen ops on every
// thread.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace bmt::testing {

// softmax(q kᵀ / √hd + causal mask) v, k and v repeated for grouped-query heads; in q's dtype (tests pass double).
inline at::Tensor reference_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t rep = q.size(1) / k.size(1), T = q.size(2);
  const at::Tensor kk = k.repeat_interleave(rep, 1), vv = v.repeat_interleave(rep, 1);
  at::Tensor scores = at::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  scores = scores.masked_fill(at::ones({T, T}, q.options().dtype(at::kBool)).triu(1),
                              -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), vv);
}

// got within tol of want's largest magnitude (plus tol): defined, same shape, max |got - want| <= tol (1 + max |want|).
inline void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(err, tol * (1.0 + want.abs().max().item<double>())) << what;
}

// Counts, while alive, the calls of the ATen ops named (e.g. "aten::_scaled_dot_product_flash_attention_for_cpu")
// on every thread: the backward's recompute runs on autograd's threads. One counter at a time.
class OpCallCounter {
 public:
  explicit OpCallCounter(std::vector<std::string> names) {
    names_() = std::move(names);
    count_() = 0;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(
        [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          const std::string name = fn.name();
          for (const std::string& n : names_())
            if (name == n) ++count_();
          return nullptr;
        }));
  }
  ~OpCallCounter() { at::removeCallback(handle_); }
  OpCallCounter(const OpCallCounter&) = delete;
  OpCallCounter& operator=(const OpCallCounter&) = delete;
  int count() const { return count_().load(); }
  void reset() { count_() = 0; }

 private:
  static std::vector<std::string>& names_() {
    static std::vector<std::string> names;
    return names;
  }
  static std::atomic<int>& count_() {
    static std::atomic<int> count{0};
    return count;
  }
  at::CallbackHandle handle_;
};

}  // namespace bmt::testing
