// ThreadPool: coverage of parallel_for, exceptions, async task groups, persistence of threads.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/thread_pool.h"

using bmt::core::kernels::ThreadPool;

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  for (int workers : {0, 1, 3}) {
    ThreadPool pool(workers);
    for (int64_t n : {0, 1, 5, 1000, 100003}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.parallel_for(n, 7, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "n=" << n << " i=" << i;
    }
  }
}

TEST(ThreadPool, ExceptionsPropagate) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(1000, 1, [](int64_t b, int64_t) {
    if (b > 0) throw std::runtime_error("boom");
  }), std::runtime_error);
  ThreadPool::TaskGroup group(pool);
  group.run([] { throw bmt::core::Error("task failed"); });
  group.run([] {});
  EXPECT_THROW(group.wait(), bmt::core::Error);
  group.wait();  // the error was consumed
  EXPECT_EQ(group.pending(), 0);
}

TEST(ThreadPool, TaskGroupRunsAsynchronouslyAndWaits) {
  ThreadPool pool(2);
  std::atomic<int> done{0};
  ThreadPool::TaskGroup group(pool);
  for (int i = 0; i < 100; ++i) group.run([&] { done++; });
  group.wait();
  EXPECT_EQ(done.load(), 100);
}

TEST(ThreadPool, NoThreadsPerCall) {
  ThreadPool pool(2);
  std::mutex mu;
  std::set<std::thread::id> ids;
  for (int rep = 0; rep < 200; ++rep) {
    pool.parallel_for(64, 1, [&](int64_t, int64_t) {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    });
  }
  EXPECT_LE(ids.size(), 3u);  // 2 workers + the caller, whatever the number of calls
}

TEST(ThreadPool, NestedSubmissionRunsInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(8, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(100, 1, [&](int64_t bb, int64_t ee) { sum += ee - bb; });
  });
  EXPECT_EQ(sum.load(), 800);
}

TEST(ThreadPool, WaitRunsOnlyItsOwnGroupsTasks) {
  ThreadPool pool(1);
  std::promise<void> worker_busy, release;
  std::shared_future<void> released = release.get_future().share();
  ThreadPool::TaskGroup gate(pool);
  gate.run([&worker_busy, released] {
    worker_busy.set_value();
    released.wait();
  });
  worker_busy.get_future().wait();  // the only worker is blocked: queued tasks run only when a waiter runs them
  std::atomic<int> a_done{0}, b_done{0};
  ThreadPool::TaskGroup a(pool), b(pool);
  for (int i = 0; i < 3; ++i) a.run([&] { a_done++; });
  for (int i = 0; i < 3; ++i) b.run([&] { b_done++; });
  b.wait();  // queued after a's tasks, yet does not run them
  EXPECT_EQ(b_done.load(), 3);
  EXPECT_EQ(a_done.load(), 0);
  EXPECT_EQ(a.pending(), 3);
  release.set_value();
  a.wait();
  gate.wait();
  EXPECT_EQ(a_done.load(), 3);
}
