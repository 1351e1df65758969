// GatedPool: a one-worker ThreadPool whose worker can be held. While closed, tasks queued on the pool run only
// inside a waiter's TaskGroup::wait() (which runs its own group's tasks), so a test can tell deterministically
// which waits ran which work (e.g. that an asynchronous optimizer step left updates running).
#pragma once

#include <future>
#include <memory>

#include "bmt/core/kernels/thread_pool.h"

namespace bmt::testing {

class GatedPool {
 public:
  GatedPool() = default;
  GatedPool(const GatedPool&) = delete;
  GatedPool& operator=(const GatedPool&) = delete;
  ~GatedPool() {
    if (release_) open();
  }
  // Returns once the worker is held.
  void close() {
    if (release_) return;
    release_ = std::make_shared<std::promise<void>>();
    auto busy = std::make_shared<std::promise<void>>();
    std::shared_future<void> released = release_->get_future().share();
    gate_.run([busy, released] {
      busy->set_value();
      released.wait();
    });
    busy->get_future().wait();
  }
  void open() {
    if (!release_) return;
    release_->set_value();
    release_.reset();
    gate_.wait();
  }

  core::kernels::ThreadPool pool{1};

 private:
  core::kernels::ThreadPool::TaskGroup gate_{pool};
  std::shared_ptr<std::promise<void>> release_;
};

}  // namespace bmt::testing
