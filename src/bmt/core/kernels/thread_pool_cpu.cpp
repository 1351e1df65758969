// ThreadPool implementation: one locked FIFO of tasks shared by persistent workers; see thread_pool.h.
#include "bmt/core/kernels/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <string>

#ifdef __linux__
#include <sched.h>
#endif

#include "bmt/core/error.h"

namespace bmt::core::kernels {
namespace {

thread_local bool t_in_worker = false;

int cpus_of_this_process() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

int global_thread_count() {
  if (const char* env = std::getenv("BMT_CPU_THREADS")) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    BMT_CHECK(end != env && *end == '\0' && v >= 1 && v <= 4096, "BMT_CPU_THREADS='", env,
              "' is not a thread count in [1, 4096]");
    return static_cast<int>(v);
  }
  return cpus_of_this_process();
}

}  // namespace

ThreadPool::ThreadPool(int num_workers) {
  BMT_CHECK(num_workers >= 0, "ThreadPool: num_workers must be >= 0, got ", num_workers);
  workers_.reserve(static_cast<size_t>(num_workers));
  for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
  // Tasks still queued (their groups were abandoned) are run here so that no group waits forever.
  while (try_run_one()) {
  }
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool(global_thread_count() - 1);
  return pool;
}

bool ThreadPool::in_worker() { return t_in_worker; }

void ThreadPool::enqueue(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::execute(Task& task) {
  try {
    task.fn();
  } catch (...) {
    std::lock_guard<std::mutex> lock(task.group->mu);
    if (!task.group->error) task.group->error = std::current_exception();
  }
  task.fn = nullptr;  // release captured state before signalling completion
  bool last;
  {
    std::lock_guard<std::mutex> lock(task.group->mu);
    last = --task.group->pending == 0;
  }
  if (last) task.group->cv.notify_all();
}

bool ThreadPool::try_run_one(const TaskGroup::State* group) {
  Task task;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = queue_.begin();
    if (group != nullptr) {
      // From the back: the group waited for is usually among the latest submitted (an asynchronous optimizer step
      // queues Block updates in backward order, the next forward waits for them in the reverse order).
      auto r = std::find_if(queue_.rbegin(), queue_.rend(), [&](const Task& t) { return t.group.get() == group; });
      it = r == queue_.rend() ? queue_.end() : std::prev(r.base());
    }
    if (it == queue_.end()) return false;
    task = std::move(*it);
    queue_.erase(it);
  }
  execute(task);
  return true;
}

void ThreadPool::worker_loop() {
  t_in_worker = true;
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(task);
  }
}

ThreadPool::TaskGroup::TaskGroup(ThreadPool& pool) : pool_(pool), state_(std::make_shared<State>()) {}

ThreadPool::TaskGroup::~TaskGroup() {
  try {
    wait();
  } catch (...) {
  }
}

void ThreadPool::TaskGroup::run(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->pending;
  }
  if (ThreadPool::in_worker() || pool_.num_workers() == 0) {
    // Inline: nested submission from a worker, or no workers (the task still runs before wait() returns).
    Task t{std::move(task), state_};
    execute(t);
    return;
  }
  pool_.enqueue(Task{std::move(task), state_});
}

void ThreadPool::TaskGroup::wait() {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->pending == 0) break;
    }
    if (pool_.try_run_one(state_.get())) continue;  // help with our own queued tasks
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->pending == 0; });
    break;
  }
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::swap(err, state_->error);
  }
  if (err) std::rethrow_exception(err);
}

int64_t ThreadPool::TaskGroup::pending() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->pending;
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t max_chunks = (n + grain - 1) / grain;
  int64_t chunks = std::min<int64_t>(max_chunks, static_cast<int64_t>(num_threads()) * 4);
  if (chunks <= 1 || num_workers() == 0 || in_worker()) {
    fn(0, n);
    return;
  }
  int64_t per_chunk = (n + chunks - 1) / chunks;
  TaskGroup group(*this);
  for (int64_t begin = per_chunk; begin < n; begin += per_chunk) {
    int64_t end = std::min(n, begin + per_chunk);
    group.run([&fn, begin, end] { fn(begin, end); });
  }
  std::exception_ptr first;
  try {
    fn(0, std::min(n, per_chunk));
  } catch (...) {
    first = std::current_exception();
  }
  try {
    group.wait();
  } catch (...) {
    if (!first) first = std::current_exception();
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace bmt::core::kernels
