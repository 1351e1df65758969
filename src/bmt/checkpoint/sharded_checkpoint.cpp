#include "bmt/checkpoint/sharded_checkpoint.h"

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <mutex>
#include <set>

#include "bmt/checkpoint/atomic_dir_internal.h"
#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/comm_util_internal.h"
#include "bmt/checkpoint/save_job_internal.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/host_staging_internal.h"
#include "bmt/checkpoint/load_staging_internal.h"
#include "bmt/core/error.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/runtime/init.h"
#include "bmt/params/pending_update.h"

namespace bmt::checkpoint {

TrainingState& TrainingState::add(const std::string& name, std::shared_ptr<ShardedStateProvider> provider) {
  BMT_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "model" && name != "rng",
            "TrainingState::add: component name \"", name, "\" must be non-empty, without '/', and not model/rng");
  for (const auto& c : components) BMT_CHECK(c.first != name, "TrainingState::add: duplicate component ", name);
  components.emplace_back(name, std::move(provider));
  return *this;
}
TrainingState& TrainingState::add(const std::string& name, optim::OptimManager& m) { return add(name, sharded_state(m)); }
TrainingState& TrainingState::add(const std::string& name, optim::BmtOptimizer& o) { return add(name, sharded_state(o)); }
TrainingState& TrainingState::add(const std::string& name, optim::lr_scheduler::WarmupLRScheduler& s) {
  return add(name, sharded_state(s));
}

struct SaveHandle::State {
  std::unique_ptr<detail::SaveJob> job;
  SaveStats stats;
  bool waited = false;
  std::string final_error;
  ~State() {
    if (!job) return;
    job->finish();  // program end or a dropped handle: the write completes
    if (!waited && !job->error().empty())
      std::fprintf(stderr, "bmt::checkpoint: an async save to %s failed and was never waited for: %s\n",
                   stats.dir.c_str(), job->error().c_str());
  }
};

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// SaveOptions::device_staging's process-wide off switch (a Python script cannot reach SaveOptions).
EnvSwitch g_device_staging("BMT_CKPT_DEVICE_STAGING");

// Reading straight into the live tensors (checksummed blocks in parallel, one pass), on CPU and GPU ranks alike
// (GPU destinations go through the pinned ring + cudaMemcpyAsync; confirmed on an H200 at gpt2-124m and gpt-1.3b,
// 2026-12-01). BMT_CKPT_LOAD_IN_PLACE=0 restores the per-tensor read + copy, for comparisons.
bool load_in_place_enabled() {
  static const int forced = [] {
    const char* e = std::getenv("BMT_CKPT_LOAD_IN_PLACE");
    if (!e || !*e) return -1;
    return std::string(e) == "0" ? 0 : 1;
  }();
  return forced != 0;
}

// A damaged checkpoint (as opposed to one that does not match the training state).
bool is_read_failure(const std::string& e) {
  return e.find("checksum mismatch") != std::string::npos || e.find("truncated") != std::string::npos;
}

std::mutex g_pending_mutex;
std::shared_ptr<SaveHandle::State> g_pending;  // the async save in flight (not yet waited)

SaveStats wait_state(SaveHandle::State& s) {
  if (s.waited) {
    BMT_CHECK(s.final_error.empty(), s.final_error);
    return s.stats;
  }
  s.job->finish();
  s.stats.write_s = s.job->write_s();
  s.stats.total_s = s.job->total_s();
  const WriteProfile& p = s.job->profile();
  s.stats.wait_data_s = p.wait_data_s;
  s.stats.write_syscalls_s = p.write_s;
  s.stats.crc_wait_s = p.crc_wait_s;
  s.stats.fsync_s = p.fsync_s;
  s.waited = true;
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    if (g_pending.get() == &s) g_pending.reset();
  }
  try {
    detail::raise_if_any_failed(*config().comm, s.job->error(), "checkpoint save to " + s.stats.dir);
  } catch (const std::exception& e) {
    s.final_error = e.what();
    // Every rank's part has ended: no writer can recreate files in the temporary directory any more.
    if (config().comm->rank() == 0) {
      try {
        remove_tree(s.job->tmp_dir());
      } catch (...) {
      }
    }
    throw;
  }
  return s.stats;
}

}  // namespace

SaveStats SaveHandle::wait() {
  BMT_CHECK(state_ != nullptr, "SaveHandle::wait on an empty handle");
  return wait_state(*state_);
}

bool SaveHandle::done() const { return state_ && state_->job->finished(); }
double SaveHandle::stall_s() const { return state_ ? state_->stats.stall_s : 0.0; }

void wait_pending_save() {
  std::shared_ptr<SaveHandle::State> pending;
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    pending = g_pending;
  }
  if (pending) wait_state(*pending);
}

void release_snapshot_buffers() {
  wait_pending_save();
  free_host_chunks();
}

namespace {

// Step 1 of a save (collective): this rank's slices, the plan and the shard files' layout, identical on every rank.
struct SavePlan {
  std::vector<LocalSlice> slices;
  std::vector<PlannedEntry> plan;
  FileLayout layout;
};

SavePlan plan_save(const TrainingState& state, core::Communicator& comm, int tp_size, const std::string& what) {
  const int rank = comm.rank();
  SavePlan sp;
  std::vector<LocalSlice>& slices = sp.slices;
  std::string err = detail::capture_error([&] {
    std::unordered_map<const void*, std::string> names;
    if (state.model) {
      names = param_names(*state.model);
      slices = model_slices(*state.model);
    }
    for (const auto& c : state.components) {
      auto s = provider_slices(c.first, *c.second, names, rank);
      slices.insert(slices.end(), std::make_move_iterator(s.begin()), std::make_move_iterator(s.end()));
    }
    if (state.rng) {
      auto s = rng_slices(rank, tp_size);
      slices.insert(slices.end(), std::make_move_iterator(s.begin()), std::make_move_iterator(s.end()));
    }
  });
  detail::raise_if_any_failed(comm, err, what);
  std::vector<SliceDecl> decls;
  for (const LocalSlice& s : slices) decls.push_back(s.decl);
  std::vector<std::vector<SliceDecl>> all;
  for (const std::string& s : detail::all_gather_strings(comm, encode_decls(decls))) all.push_back(decode_decls(s));
  sp.plan = plan_pieces(all);
  sp.layout = layout_shard_files(sp.plan, comm.size());
  return sp;
}

}  // namespace

void prepare_async_save(const TrainingState& state) {
  wait_pending_save();  // no save may use the chunks while they are prepared
  const Config& cfg = config();
  core::Communicator& comm = *cfg.comm;
  SavePlan sp = plan_save(state, comm, cfg.tp_size, "preparing an async checkpoint save");
  const int64_t nbytes = sp.layout.file_nbytes[static_cast<size_t>(comm.rank())];
  bool on_device = false;
  for (const LocalSlice& s : sp.slices) on_device |= !s.data.is_cpu();
  const int64_t chunk = stage_chunk_nbytes();
  prepare_host_chunks((nbytes + chunk - 1) / chunk, on_device);
}

bool async_save_prepared() { return host_chunks_prepared(); }

SaveHandle save(const std::string& dir_in, const TrainingState& state, const SaveOptions& options) {
  const auto t0 = Clock::now();
  wait_pending_save();
  wait_all_pending_updates();  // asynchronous optimizer steps still writing parameters (optimizers wait themselves)
  const Config& cfg = config();
  core::Communicator& comm = *cfg.comm;
  const int rank = comm.rank(), world = comm.size();
  const std::string dir = strip_trailing_slashes(dir_in);
  BMT_CHECK(options.checksum_block_nbytes > 0, "checkpoint save: checksum_block_nbytes must be positive");
  BMT_CHECK(state.step >= 0, "checkpoint save of ", dir, ": step must be >= 0, got ", state.step);

  // 1. This rank's slices, then the plan (identical on every rank).
  SavePlan sp = plan_save(state, comm, cfg.tp_size, "checkpoint save to " + dir);
  std::vector<LocalSlice>& slices = sp.slices;
  const std::vector<PlannedEntry>& plan = sp.plan;
  const FileLayout& layout = sp.layout;
  std::string err;

  // 2. The temporary directory ("!" + message on failure).
  std::string tmp;
  if (rank == 0) {
    std::string e = detail::capture_error([&] {
      repair_and_clean(dir);
      tmp = make_temp_dir(dir);
    });
    if (!e.empty()) tmp = "!" + e;
  }
  tmp = detail::broadcast_string(comm, tmp, 0);
  BMT_CHECK(tmp.empty() || tmp[0] != '!', "checkpoint save to ", dir, " failed on rank 0: ", tmp.substr(1));

  // 3. This rank's part.
  detail::SaveJobSpec spec;
  spec.dir = dir;
  spec.tmp_dir = tmp;
  spec.rank = rank;
  spec.world_size = world;
  spec.items = rank_write_items(plan, layout, slices, rank);
  spec.file_nbytes = layout.file_nbytes[static_cast<size_t>(rank)];
  spec.allow_exchange = options.allow_exchange;
  spec.timeout = cfg.timeout.count() > 0 ? cfg.timeout : std::chrono::milliseconds(std::chrono::minutes(10));
  CheckpointMetadata& m = spec.meta_template;
  m.world_size = world;
  m.step = state.step;
  m.created_by = "bmtrain (C++) sharded checkpoint";
  m.user_metadata = state.user_metadata;
  m.checksum_block_nbytes = options.checksum_block_nbytes;
  if (rank == 0) m.entries = layout.entries;

  auto hs = std::make_shared<SaveHandle::State>();
  hs->stats.plan_s = seconds_since(t0);
  hs->stats.dir = dir;
  hs->stats.rank_nbytes = spec.file_nbytes;
  for (int64_t n : layout.file_nbytes) hs->stats.total_nbytes += n;
  if (options.async) {
    const auto ts = Clock::now();
    const bool device_staging = options.device_staging && g_device_staging.enabled();
    err = detail::capture_error([&] {
      spec.snapshot = std::make_unique<ShardSnapshot>(spec.items, spec.file_nbytes, device_staging);
      hs->stats.device_staged = spec.snapshot->device_staged();
    });
    spec.items.clear();
    hs->stats.snapshot_s = seconds_since(ts);
    slices.clear();
    hs->job = std::make_unique<detail::SaveJob>(std::move(spec));
    hs->job->started = t0;
    if (err.empty()) hs->job->start_async();
    else hs->job->run_failed(err);  // reported by wait(), like a write failure
    hs->stats.stall_s = seconds_since(t0);
    {
      std::lock_guard<std::mutex> lock(g_pending_mutex);
      g_pending = hs;
    }
    return SaveHandle(hs);
  }
  hs->job = std::make_unique<detail::SaveJob>(std::move(spec));
  hs->job->started = t0;
  hs->job->run();
  wait_state(*hs);
  hs->stats.stall_s = seconds_since(t0);
  return SaveHandle(hs);
}

LoadInfo load(const std::string& dir, TrainingState& state, const LoadOptions& options) {
  const auto t_check = Clock::now();
  wait_pending_save();
  wait_all_pending_updates();  // an update still running would overwrite the loaded values
  const Config& cfg = config();
  core::Communicator& comm = *cfg.comm;
  const int rank = comm.rank(), world = comm.size();
  const std::string what = "checkpoint load from " + dir;
  std::unique_ptr<CheckpointReader> reader;
  detail::raise_if_any_failed(comm, detail::capture_error([&] { reader = std::make_unique<CheckpointReader>(dir); }),
                              what);
  LoadInfo info;
  info.path = reader->path();
  info.step = reader->metadata().step;
  info.saved_world_size = reader->metadata().world_size;
  info.user_metadata = reader->metadata().user_metadata;

  // Check everything first.
  std::vector<std::string> errors;
  std::vector<std::pair<LoadTarget, const EntryMeta*>> model_work;
  std::vector<optim::StateDict> component_sds;
  std::vector<std::vector<DeferredStateRead>> component_deferred(state.components.size());
  std::string err = detail::capture_error([&] {
    std::unordered_map<const void*, std::string> names;
    if (state.model) {
      names = param_names(*state.model);
      std::set<std::string> wanted;
      for (LoadTarget& t : model_targets(*state.model)) {
        wanted.insert(t.key);
        const EntryMeta* e = reader->find(t.key);
        if (!e) {
          info.missing_keys.push_back(t.key.substr(6));
        } else if (std::string m = entry_mismatch(*e, t.dtype, t.range); !m.empty()) {
          errors.push_back(t.key.substr(6) + ": " + m);
        } else {
          model_work.emplace_back(std::move(t), e);
        }
      }
      for (const EntryMeta& e : reader->metadata().entries)
        if (e.key.rfind("model/", 0) == 0 && !wanted.count(e.key)) info.unexpected_keys.push_back(e.key.substr(6));
      // Pipeline stages hold different layers: a key is unexpected only when no rank wants it.
      if (cfg.pipe_size > 1) info.unexpected_keys = detail::keys_on_every_rank(comm, info.unexpected_keys);
      if (options.strict && !info.missing_keys.empty()) {
        std::string s = "missing model keys:";
        for (const auto& k : info.missing_keys) s += " " + k;
        errors.push_back(s);
      }
      if (options.strict && !info.unexpected_keys.empty()) {
        std::string s = "unexpected model keys:";
        for (const auto& k : info.unexpected_keys) s += " " + k;
        errors.push_back(s + " (pass strict = false to load the matching keys only)");
      }
    }
    for (size_t i = 0; i < state.components.size(); ++i)
      component_sds.push_back(provider_state_from(state.components[i].first, *state.components[i].second, names, rank,
                                                  world, *reader, errors,
                                                  load_in_place_enabled() ? &component_deferred[i] : nullptr));
    for (const auto& c : state.components) {
      bool found = false;
      for (const EntryMeta& e : reader->metadata().entries) {
        auto it = e.attrs.find("component");
        if (it != e.attrs.end() && it->second == c.first) {
          found = true;
          break;
        }
      }
      if (!found) errors.push_back("the checkpoint has no state for component \"" + c.first + "\"");
    }
  });
  if (err.empty() && !errors.empty()) {
    // A damaged block is met once per entry stored in it: report each distinct problem once. Read failures
    // (checksums, truncation) come first: they are not a mismatch of the training state.
    std::vector<std::string> unique;
    for (const auto& e : errors)
      if (std::find(unique.begin(), unique.end(), e) == unique.end()) unique.push_back(e);
    std::stable_partition(unique.begin(), unique.end(), is_read_failure);
    const bool damaged = is_read_failure(unique.front());
    err = damaged ? "the checkpoint is damaged:" : "the checkpoint does not match the training state:";
    for (const auto& e : unique) err += "\n    " + e;
  }
  detail::raise_if_any_failed(comm, err, what);
  info.check_s = seconds_since(t_check);
  const int64_t check_bytes = reader->bytes_read();
  const auto t_apply = Clock::now();

  // Apply: model first (optimizers may derive state from parameters), then components, then RNG. Tensors that
  // can be are read straight into place (load_staging_internal.h), all of a part in one batch of reads.
  err = detail::capture_error([&] {
    at::NoGradGuard no_grad;
    const auto t_model = Clock::now();
    std::vector<InPlaceLoad> in_place;
    for (auto& [t, e] : model_work) {
      if (load_in_place_enabled() && stored_like(*e, t.range) &&
          can_load_in_place(*e, t.range.begin, t.range.end, t.dst)) {
        in_place.push_back({e, t.range.begin, t.range.end, t.dst});
      } else {
        at::Tensor v = read_param_range(*reader, *e, t.range);
        t.dst.copy_(v.view(t.dst.sizes()));
      }
    }
    load_in_place(*reader, in_place);
    info.model_s = seconds_since(t_model);
    info.model_bytes_read = reader->bytes_read() - check_bytes;
    const auto t_state = Clock::now();
    for (size_t i = 0; i < state.components.size(); ++i) {
      ShardedStateProvider& provider = *state.components[i].second;
      provider.load_state_dict(component_sds[i]);
      if (component_deferred[i].empty()) continue;
      // The placeholders' live tensors, filled from the files.
      const optim::StateDict views = provider.state_views();
      in_place.clear();
      for (const DeferredStateRead& d : component_deferred[i]) {
        auto it = views.find(d.sd_key);
        if (it == views.end()) continue;  // state this optimizer does not keep (e.g. master of an fp32 parameter)
        if (can_load_in_place(*d.entry, d.begin, d.end, it->second)) {
          in_place.push_back({d.entry, d.begin, d.end, it->second});
        } else {
          BMT_CHECK(it->second.numel() == d.end - d.begin, "checkpoint: ", state.components[i].first, " state ",
                    d.sd_key, " has ", it->second.numel(), " elements after loading, the checkpoint ", d.end - d.begin);
          it->second.copy_(reader->read(*d.entry, d.begin, d.end).view(it->second.sizes()));
        }
      }
      load_in_place(*reader, in_place);
    }
    info.state_s = seconds_since(t_state);
    info.state_bytes_read = reader->bytes_read() - check_bytes - info.model_bytes_read;
    if (options.rng && reader->metadata().world_size == world) {
      // Generator states belong to a rank's role: restored only when the tp size is unchanged too.
      const std::string tp = std::to_string(cfg.tp_size);
      info.rng_restored = restore_rng(rank, [&](const std::string& key) {
        const EntryMeta* e = reader->find(key);
        if (!e) return at::Tensor();
        auto it = e->attrs.find("tp_size");
        return (it == e->attrs.end() ? std::string("1") : it->second) == tp ? reader->read_full(*e) : at::Tensor();
      }) > 0;
    }
  });
  // Bytes are verified as they land in place (no second pass), so damage found here comes after parts of the
  // model and optimizer were overwritten: say so, the caller must not train on from this state.
  if (is_read_failure(err))
    err = "the checkpoint is damaged (the model and optimizer are now partly overwritten: load a good checkpoint "
          "before training on):\n    " + err;
  detail::raise_if_any_failed(comm, err, what);
  info.apply_s = seconds_since(t_apply);
  info.bytes_read = reader->bytes_read();
  state.step = info.step;
  state.user_metadata = info.user_metadata;
  return info;
}

}  // namespace bmt::checkpoint
