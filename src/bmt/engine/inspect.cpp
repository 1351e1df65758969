#include "bmt/engine/inspect.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"

namespace bmt::inspect {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

// One row of the batched reductions: [count, sum, sum_sq, has, max, -min] for the value, the same for the
// gradient. Columns 0-3 and 6-9 add up, the others take the max.
constexpr int kCols = 12;

void put_moments(double* row, const Moments* m) {
  if (!m || m->count == 0) {
    row[0] = row[1] = row[2] = 0;
    row[3] = m ? 1 : 0;
    row[4] = row[5] = -kInf;
    return;
  }
  row[0] = m->count;
  row[1] = m->sum;
  row[2] = m->sum_sq;
  row[3] = 1;
  row[4] = m->max;
  row[5] = -m->min;
}

Moments take_moments(const double* row) {
  Moments m;
  m.count = row[0];
  m.sum = row[1];
  m.sum_sq = row[2];
  m.max = row[4];
  m.min = -row[5];
  return m;
}

// Combines the rows of `rows` (n x kCols, CPU double) over comm, in place: two collectives for all rows.
void combine(at::Tensor& rows, core::Communicator& comm) {
  if (comm.size() <= 1 || rows.size(0) == 0) return;
  const auto dev = config().device;
  at::Tensor sums = at::cat({rows.narrow(1, 0, 4), rows.narrow(1, 6, 4)}, 1).contiguous().to(dev);
  at::Tensor maxes = at::cat({rows.narrow(1, 4, 2), rows.narrow(1, 10, 2)}, 1).contiguous().to(dev);
  sums = distributed::raw_all_reduce(sums, core::ReduceOp::kSum, comm).cpu();
  maxes = distributed::raw_all_reduce(maxes, core::ReduceOp::kMax, comm).cpu();
  rows.narrow(1, 0, 4).copy_(sums.narrow(1, 0, 4));
  rows.narrow(1, 6, 4).copy_(sums.narrow(1, 4, 4));
  rows.narrow(1, 4, 2).copy_(maxes.narrow(1, 0, 2));
  rows.narrow(1, 10, 2).copy_(maxes.narrow(1, 2, 2));
}

// Reduces the rows whose group key is the same communicator together (every rank sees the same sequence of
// communicators, so the collectives pair up).
void combine_by_comm(at::Tensor& rows, const std::vector<core::Communicator*>& comm_of_row) {
  std::vector<core::Communicator*> order;
  std::map<core::Communicator*, std::vector<int64_t>> members;
  for (size_t i = 0; i < comm_of_row.size(); ++i) {
    core::Communicator* c = comm_of_row[i];
    if (!c) continue;
    if (!members.count(c)) order.push_back(c);
    members[c].push_back(static_cast<int64_t>(i));
  }
  for (core::Communicator* c : order) {
    at::Tensor idx = at::tensor(members[c], at::kLong);
    at::Tensor part = rows.index_select(0, idx);
    combine(part, *c);
    rows.index_copy_(0, idx, part);
  }
}

void fill_stats(TensorStats& s, const double* row) {
  Moments v = take_moments(row);
  s.mean = v.mean();
  s.std = v.std();
  s.min = v.count > 0 ? v.min : std::nan("");
  s.max = v.count > 0 ? v.max : std::nan("");
  if (row[6 + 3] > 0) {
    Moments g = take_moments(row + 6);
    s.grad_mean = g.mean();
    s.grad_std = g.std();
    s.grad_min = g.count > 0 ? g.min : std::nan("");
    s.grad_max = g.count > 0 ? g.max : std::nan("");
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  // Python's tuple repr, as BMTrain prints it: (2, 3) and (3,).
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) s += ",";
  return s + ")";
}
}  // namespace

void Moments::add(const at::Tensor& x) {
  if (!x.defined() || x.numel() == 0) return;
  at::Tensor d = x.detach().reshape({-1}).to(at::kDouble);
  at::Tensor packed = at::stack({d.sum(), (d * d).sum(), d.max(), d.min()}).cpu();
  const double* p = packed.data_ptr<double>();
  const double n = static_cast<double>(x.numel());
  min = count > 0 ? std::min(min, p[3]) : p[3];
  max = count > 0 ? std::max(max, p[2]) : p[2];
  count += n;
  sum += p[0];
  sum_sq += p[1];
}

double Moments::std() const {
  if (count <= 0) return std::nan("");
  const double m = sum / count;
  return std::sqrt(std::max(0.0, sum_sq / count - m * m));
}

// ---------------------------------------------------------------------------------------------------------------
// inspect_model

std::vector<TensorStats> inspect_parameters(const std::vector<std::pair<std::string, at::Tensor>>& named,
                                            const std::string& pattern) {
  std::vector<TensorStats> out;
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : named) {
    if (!detail::glob_match(pattern, name)) continue;
    TensorStats s;
    s.name = name;
    if (ParamMeta* m = find_meta(p)) {
      BMT_CHECK(!(m->block && m->block->is_gathered()), "inspect_model: parameter '", name, "' belongs to a Block "
                "that is running (called from inside a forward?); call inspect_model between steps");
      s.shape = m->logical_shape();
    } else {
      s.shape = p.sizes().vec();
    }
    out.push_back(std::move(s));
    params.push_back(p);
  }
  at::Tensor rows = at::zeros({static_cast<int64_t>(params.size()), kCols}, at::kDouble);
  std::vector<core::Communicator*> zero_comm(params.size(), nullptr), tp_comm(params.size(), nullptr);
  const Config* cfg = is_initialized() ? &config() : nullptr;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    ParamMeta* m = find_meta(p);
    Moments v, g;
    v.add(p);  // a DistributedParameter's tensor is its shard: elements [shard_begin, shard_end) of the whole
    at::Tensor grad = m ? main_grad(p) : p.grad();
    g.add(grad);
    double* row = rows[static_cast<int64_t>(i)].data_ptr<double>();
    put_moments(row, &v);
    put_moments(row + 6, grad.defined() ? &g : nullptr);
    if (m) {
      zero_comm[i] = m->comm.get();
      if (m->is_tp_split() && cfg && cfg->tp_comm) tp_comm[i] = cfg->tp_comm.get();
    }
  }
  combine_by_comm(rows, zero_comm);  // the shards of one tp piece
  combine_by_comm(rows, tp_comm);    // the pieces of a tensor-parallel parameter
  for (size_t i = 0; i < out.size(); ++i) fill_stats(out[i], rows[static_cast<int64_t>(i)].data_ptr<double>());
  return out;
}

std::vector<TensorStats> inspect_model(torch::nn::Module& module, const std::string& pattern) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& item : module.named_parameters(/*recurse=*/true)) named.emplace_back(item.key(), item.value());
  return inspect_parameters(named, pattern);
}

// ---------------------------------------------------------------------------------------------------------------
// inspect_tensor / record_tensor

struct RecordedTensor {
  std::string name, group;
  at::Tensor value;  // detached
  at::Tensor grad;   // detached copy, once the backward reached it
  bool hooked = false;
};

struct InspectTensor::State {
  mutable std::mutex mu;
  std::vector<RecordedTensor> records;
};

namespace {
// Open scopes, innermost last. Global (not thread-local): a Block's recompute runs in the backward, on whatever
// thread the autograd engine uses for the device.
std::mutex g_scopes_mu;
std::vector<std::shared_ptr<InspectTensor::State>> g_scopes;

// The recompute being replayed on this thread (it runs on the thread that called the Block's backward).
struct Replay {
  std::shared_ptr<InspectTensor::State> state;
  size_t next = 0, end = 0;
};
thread_local Replay* t_replay = nullptr;

std::shared_ptr<InspectTensor::State> innermost() {
  std::lock_guard<std::mutex> lock(g_scopes_mu);
  return g_scopes.empty() ? nullptr : g_scopes.back();
}

void hook_gradient(const std::shared_ptr<InspectTensor::State>& state, size_t index, const at::Tensor& x) {
  std::weak_ptr<InspectTensor::State> weak = state;
  x.register_hook([weak, index](const at::Tensor& grad) {
    auto st = weak.lock();
    if (!st || !grad.defined()) return;
    at::Tensor copy = grad.detach().clone();
    std::lock_guard<std::mutex> lock(st->mu);
    st->records[index].grad = std::move(copy);
  });
  state->records[index].hooked = true;  // caller holds st->mu
}

const RecordedTensor& find_record(const InspectTensor::State& st, const std::string& name, const std::string& group,
                                  int64_t index) {
  std::vector<const RecordedTensor*> hits;
  for (const auto& r : st.records)
    if (r.name == name && r.group == group) hits.push_back(&r);
  const std::string who = group.empty() ? name : group + "." + name;
  BMT_CHECK(!hits.empty(), "inspect_tensor: nothing was recorded as '", who, "'");
  if (index < 0) {
    BMT_CHECK(hits.size() == 1, "inspect_tensor: '", who, "' was recorded ", hits.size(),
              " times; pass the index of the record you want");
    return *hits[0];
  }
  BMT_CHECK(index < static_cast<int64_t>(hits.size()), "inspect_tensor: '", who, "' was recorded ", hits.size(),
            " times; index ", index, " is out of range");
  return *hits[static_cast<size_t>(index)];
}
}  // namespace

InspectTensor::InspectTensor() : state_(std::make_shared<State>()) {
  std::lock_guard<std::mutex> lock(g_scopes_mu);
  g_scopes.push_back(state_);
}

InspectTensor::~InspectTensor() { close(); }

void InspectTensor::close() {
  std::lock_guard<std::mutex> lock(g_scopes_mu);
  for (auto it = g_scopes.begin(); it != g_scopes.end(); ++it)
    if (*it == state_) {
      g_scopes.erase(it);
      break;
    }
}

size_t InspectTensor::size() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->records.size();
}

at::Tensor InspectTensor::get_tensor(const std::string& name, const std::string& group, int64_t index) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return find_record(*state_, name, group, index).value;
}

at::Tensor InspectTensor::get_grad(const std::string& name, const std::string& group, int64_t index) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return find_record(*state_, name, group, index).grad;
}

std::vector<TensorStats> InspectTensor::summary() const {
  std::vector<RecordedTensor> recs;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    recs = state_->records;
  }
  const bool dist = is_initialized() && config().comm && config().comm->size() > 1;
  const int world = dist ? config().comm->size() : 1;
  if (dist) {
    // Every rank must have recorded as many tensors, or the batched reductions below would not pair up.
    at::Tensor n = at::tensor({static_cast<double>(recs.size()), -static_cast<double>(recs.size())}, at::kDouble);
    at::Tensor r = distributed::raw_all_reduce(n.to(config().device), core::ReduceOp::kMax, *config().comm).cpu();
    BMT_CHECK(r[0].item<double>() == -r[1].item<double>(), "inspect_tensor: the ranks recorded different numbers of "
              "tensors (", recs.size(), " here, between ", -r[1].item<double>(), " and ", r[0].item<double>(),
              " over the world); every rank must run the same forward code under the same scope");
  }
  std::vector<TensorStats> out;
  at::Tensor rows = at::zeros({static_cast<int64_t>(recs.size()), kCols}, at::kDouble);
  std::map<std::pair<std::string, std::string>, int> seen;
  for (size_t i = 0; i < recs.size(); ++i) {
    const RecordedTensor& r = recs[i];
    TensorStats s;
    const int index = seen[{r.group, r.name}]++;
    s.name = (r.group.empty() ? "" : r.group + ".") + std::to_string(index) + "." + r.name;
    s.shape = r.value.sizes().vec();
    if (!s.shape.empty()) s.shape[0] *= world;
    out.push_back(std::move(s));
    Moments v, g;
    v.add(r.value);
    g.add(r.grad);
    double* row = rows[static_cast<int64_t>(i)].data_ptr<double>();
    put_moments(row, &v);
    put_moments(row + 6, r.grad.defined() ? &g : nullptr);
  }
  if (dist) combine(rows, *config().comm);
  for (size_t i = 0; i < out.size(); ++i) fill_stats(out[i], rows[static_cast<int64_t>(i)].data_ptr<double>());
  return out;
}

void record_tensor(const at::Tensor& x, const std::string& name, const std::string& group) {
  if (t_replay) {
    // A Block's recompute: the first run recorded this already; only the gradient is new.
    Replay& rp = *t_replay;
    if (!rp.state || rp.next >= rp.end) return;
    const size_t index = rp.next++;
    std::lock_guard<std::mutex> lock(rp.state->mu);
    RecordedTensor& rec = rp.state->records[index];
    if (rec.name == name && rec.group == group && !rec.hooked && x.requires_grad()) hook_gradient(rp.state, index, x);
    return;
  }
  auto state = innermost();
  if (!state) return;
  BMT_CHECK(x.defined(), "record_tensor('", name, "'): the tensor is undefined");
  BMT_CHECK(!is_distributed_param(x), "record_tensor('", name,
            "'): the tensor is a parameter; record activations (inspect parameters with inspect_model)");
  std::lock_guard<std::mutex> lock(state->mu);
  state->records.push_back(RecordedTensor{name, group, x.detach(), at::Tensor(), false});
  if (x.requires_grad()) hook_gradient(state, state->records.size() - 1, x);
}

std::string format_summary(const std::vector<TensorStats>& summary) {
  size_t name_w = 4;
  for (const auto& s : summary) name_w = std::max(name_w, s.name.size());
  name_w += 4;
  auto ljust = [](std::string s, size_t w) { return s.size() < w ? s + std::string(w - s.size(), ' ') : s; };
  auto rjust = [](std::string s, size_t w) { return s.size() < w ? std::string(w - s.size(), ' ') + s : s; };
  auto num = [&](const std::optional<double>& v) {
    if (!v) return std::string(10, ' ');
    char buf[64];
    std::snprintf(buf, sizeof buf, "%10.4f", *v);
    return std::string(buf);
  };
  std::ostringstream os;
  os << ljust("name", name_w) << " " << ljust("shape", 20);
  for (const char* h : {"max", "min", "std", "mean", "grad_std", "grad_mean"}) os << " " << rjust(h, 10);
  for (const auto& s : summary) {
    os << "\n" << ljust(s.name, name_w) << " " << ljust(shape_str(s.shape), 20) << " " << num(s.max) << " "
       << num(s.min) << " " << num(s.std) << " " << num(s.mean) << " " << num(s.grad_std) << " " << num(s.grad_mean);
  }
  return os.str();
}

namespace detail {

RecordMark mark() {
  if (t_replay) return RecordMark{t_replay->state, t_replay->next};
  auto state = innermost();
  if (!state) return {};
  std::lock_guard<std::mutex> lock(state->mu);
  return RecordMark{state, state->records.size()};
}

RecordSpan span_since(const RecordMark& m) {
  if (!m.state) return {};
  if (t_replay && t_replay->state == m.state) return RecordSpan{m.state, m.begin, t_replay->next};
  std::lock_guard<std::mutex> lock(m.state->mu);
  return RecordSpan{m.state, m.begin, m.state->records.size()};
}

ReplayScope::ReplayScope(const RecordSpan& span) : previous_(t_replay) {
  t_replay = new Replay{span.state, span.begin, span.end};
}

ReplayScope::~ReplayScope() {
  delete t_replay;
  t_replay = static_cast<Replay*>(previous_);
}

bool glob_match(const std::string& pattern, const std::string& name) {
  // Iterative matcher with one backtrack point for the last '*' (fnmatch semantics without path rules).
  size_t p = 0, n = 0, star_p = std::string::npos, star_n = 0;
  auto match_one = [&](size_t& pi, char c) -> bool {  // advances pi past one pattern element; true if c matches
    if (pattern[pi] == '?') {
      ++pi;
      return true;
    }
    if (pattern[pi] == '[') {
      size_t j = pi + 1;
      bool negate = j < pattern.size() && pattern[j] == '!';
      if (negate) ++j;
      bool hit = false;
      size_t k = j;
      for (; k < pattern.size() && (pattern[k] != ']' || k == j); ++k) {
        if (k + 2 < pattern.size() && pattern[k + 1] == '-' && pattern[k + 2] != ']') {
          hit = hit || (c >= pattern[k] && c <= pattern[k + 2]);
          k += 2;
        } else {
          hit = hit || c == pattern[k];
        }
      }
      if (k >= pattern.size()) {  // no closing ']': a literal '['
        ++pi;
        return c == '[';
      }
      pi = k + 1;
      return hit != negate;
    }
    return pattern[pi++] == c;
  };
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star_p = ++p;
      star_n = n;
      continue;
    }
    size_t pi = p;
    if (p < pattern.size() && match_one(pi, name[n])) {
      p = pi;
      ++n;
      continue;
    }
    if (star_p == std::string::npos) return false;
    p = star_p;
    n = ++star_n;
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace detail
}  // namespace bmt::inspect
