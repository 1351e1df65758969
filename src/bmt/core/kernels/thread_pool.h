// ThreadPool: a persistent pool of CPU worker threads for the CPU kernels (offloaded Adam, inf/nan checks).
// Torch-free.
//
// Invariants:
//  * Threads are created once (constructor) and joined once (destructor): no kernel ever spawns threads per call
//    (BMTrain's CPU Adam created one std::thread per core per parameter per step).
//  * ThreadPool::global() has BMT_CPU_THREADS - 1 workers (default: the CPUs of this process's affinity mask
//    minus one); the calling thread is the remaining one: parallel_for and TaskGroup::wait() run queued tasks
//    themselves, so a pool with 0 workers still completes everything (serially, inside wait()).
//  * Work submitted from inside a worker is run inline (no nested fan-out, no deadlock).
//  * Tasks are independent and never wait for each other; a task may block on an external event (e.g. a CUDA copy
//    finishing), which only delays the pool.
//  * The first exception thrown by a task of a group is rethrown by that group's wait(); other tasks still run.
//  * TaskGroup::wait() helps by running queued tasks of ITS group only: another group's work (e.g. the optimizer
//    updates of other parameters, queued earlier) would delay its return for no reason of its own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace bmt::core::kernels {

class ThreadPool {
 public:
  explicit ThreadPool(int num_workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process-wide pool used by bmtrain's CPU kernels (created on first use).
  static ThreadPool& global();

  int num_workers() const { return static_cast<int>(workers_.size()); }
  // Workers + the calling thread.
  int num_threads() const { return num_workers() + 1; }

  // A set of asynchronously running tasks. run() returns at once; wait() blocks until all tasks of the group are
  // done (running the group's queued tasks itself meanwhile) and rethrows the first task exception (once); several
  // threads may wait at the same time. The destructor waits
  // (swallowing exceptions): never let a group die while its tasks reference caller memory.
  class TaskGroup {
   public:
    explicit TaskGroup(ThreadPool& pool);
    ~TaskGroup();
    TaskGroup(const TaskGroup&) = delete;
    TaskGroup& operator=(const TaskGroup&) = delete;
    void run(std::function<void()> task);
    void wait();
    // Number of tasks submitted and not yet finished.
    int64_t pending() const;

   private:
    friend class ThreadPool;
    struct State {
      std::mutex mu;
      std::condition_variable cv;
      int64_t pending = 0;
      std::exception_ptr error;
    };
    ThreadPool& pool_;
    std::shared_ptr<State> state_;
  };

  // Calls fn(begin, end) on disjoint ranges covering [0, n), each of at least `grain` elements (except the last),
  // in parallel on the workers and the caller; returns when all ranges are done. Rethrows the first exception.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // True on a worker thread of any ThreadPool.
  static bool in_worker();

 private:
  struct Task {
    std::function<void()> fn;
    std::shared_ptr<TaskGroup::State> group;
  };
  void enqueue(Task task);
  // Runs one queued task (of `group` only, when given) on the calling thread; false if there was none.
  bool try_run_one(const TaskGroup::State* group = nullptr);
  static void execute(Task& task);
  void worker_loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace bmt::core::kernels
