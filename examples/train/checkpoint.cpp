#include "train/checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bmt/core/error.h"
#include "bmt/distributed.h"
#include "bmt/optim/state_dict.h"
#include "bmt/state_dict.h"

namespace examples {

namespace fs = std::filesystem;

void write_file_atomic(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    BMT_CHECK(f.good(), "checkpoint: cannot write '", tmp, "'");
    f << contents;
    f.flush();
    BMT_CHECK(f.good(), "checkpoint: write to '", tmp, "' failed (disk full?)");
  }
  fs::rename(tmp, path);
}

namespace {

void save_state_atomic(const bmt::optim::StateDict& sd, const std::string& path) {
  bmt::optim::save_state_dict(sd, path + ".tmp");
  fs::rename(path + ".tmp", path);
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08ld", static_cast<long>(step));
  return buf;
}

}  // namespace

std::string save_checkpoint(const std::string& root, int64_t step, LanguageModel& model,
                            const bmt::optim::OptimManager& optim) {
  const auto& cfg = bmt::config();
  const std::string dir = (fs::path(root) / step_dir_name(step)).string();
  if (cfg.rank == 0) fs::create_directories(dir);
  bmt::synchronize();
  bmt::StateDict model_state = bmt::state_dict(model);  // collective: gathers every parameter
  if (cfg.rank == 0) save_state_atomic(bmt::optim::StateDict(model_state.begin(), model_state.end()), dir + "/model.pt");
  bmt::optim::StateDict optim_state = optim.state_dict();
  optim_state["trainer.step"] = bmt::optim::int_entry(step);
  optim_state["trainer.world_size"] = bmt::optim::int_entry(cfg.world_size);
  optim_state["trainer.tp_size"] = bmt::optim::int_entry(cfg.tp_size);
  save_state_atomic(optim_state, dir + "/optim.rank" + std::to_string(cfg.rank) + ".pt");
  bmt::synchronize();  // every rank's files are in place before `latest` points at them
  if (cfg.rank == 0) write_file_atomic((fs::path(root) / "latest").string(), step_dir_name(step) + "\n");
  bmt::synchronize();
  return dir;
}

std::optional<ResumeInfo> load_checkpoint(const std::string& root, LanguageModel& model, bmt::optim::OptimManager& optim) {
  const auto& cfg = bmt::config();
  const fs::path latest = fs::path(root) / "latest";
  if (!fs::exists(latest)) return std::nullopt;
  std::string name;
  std::ifstream(latest) >> name;
  BMT_CHECK(!name.empty(), "checkpoint: '", latest.string(), "' is empty");
  ResumeInfo info;
  info.dir = (fs::path(root) / name).string();
  bmt::optim::StateDict model_state = bmt::optim::load_state_dict_file(info.dir + "/model.pt");
  bmt::load_state_dict(model, bmt::StateDict(model_state.begin(), model_state.end()), /*strict=*/true);

  // Every rank reads rank 0's file for the step; its own file only when the shards match.
  const std::string own = info.dir + "/optim.rank" + std::to_string(cfg.rank) + ".pt";
  bmt::optim::StateDict rank0 = bmt::optim::load_state_dict_file(info.dir + "/optim.rank0.pt");
  info.step = bmt::optim::get_int(rank0, "trainer.step", "checkpoint");
  const int64_t saved_world = bmt::optim::get_int(rank0, "trainer.world_size", "checkpoint");
  const int64_t saved_tp = rank0.count("trainer.tp_size") ? bmt::optim::get_int(rank0, "trainer.tp_size", "checkpoint") : 1;
  if (saved_world == cfg.world_size && saved_tp == cfg.tp_size) {
    bmt::optim::StateDict mine = cfg.rank == 0 ? rank0 : bmt::optim::load_state_dict_file(own);
    mine.erase("trainer.step");
    mine.erase("trainer.world_size");
    mine.erase("trainer.tp_size");
    optim.load_state_dict(mine);
    info.optimizer_restored = true;
  } else {
    // Optimizer shards were cut for another world or tp size: restart the moments, keep the LR schedule position.
    for (const auto& sched : optim.lr_schedulers())
      if (sched) sched->step(info.step);
  }
  bmt::synchronize();
  return info;
}

}  // namespace examples
