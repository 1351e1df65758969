// bmt::estimate_memory against the measured peaks of bench/results/*.jsonl (every row with peak_gpu_gib from our
// engine: frameworks "bmtrain" and "bmt-python"; "plain" and "fsdp2" rows are other engines) within 10%, the host
// peaks of the offload rows within 10%, and closed forms for the parameter counts.
//
// Rows that measured an engine which allocated differently from today's are listed in kSuperseded with the reason;
// they are not compared (the later rows of the same configuration are):
//  * before d668552 (b1a67c9, 8339f7f, 469391e, 8580b78): ZeRO-3 kept the gathered storage alive through autograd's
//    saved views, world-1 Blocks held a gathered copy besides their shard and the examples' cross-entropy was not
//    the fused in-place one: 124m 16.17 GiB then vs 8.43 GiB since, gpt-1.3b 57.93 vs 48.26. Those rows' checkpointed
//    Llama runs were not affected by it and are compared.
//  * d88d1a6 C++ rows: the examples' token-row narrowing made SliceBackward allocate a zero tensor of the whole
//    logits and of every layer's qkv (fixed by ed3a9d7: 124m 9.87 -> 8.43 GiB). The Python rows of that run are
//    compared.
#include <gtest/gtest.h>

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "bmt/checkpoint/json_internal.h"
#include "bmt/core/error.h"
#include "bmt/runtime/estimate_memory.h"
#include "models/preset_shapes.h"

namespace {

using bmt::checkpoint::Json;

struct Row {
  std::string where, commit, framework, config, preset;
  Json j;
};

std::vector<Row> bench_rows() {
  const std::string dir = std::string(BMT_SOURCE_DIR) + "/bench/results";
  std::vector<std::string> files;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 6 && n.substr(n.size() - 6) == ".jsonl") files.push_back(n);
    }
    closedir(d);
  }
  std::sort(files.begin(), files.end());
  std::vector<Row> rows;
  for (const auto& f : files) {
    std::ifstream in(dir + "/" + f);
    std::string line;
    for (int i = 0; std::getline(in, line); ++i) {
      if (line.find("peak_gpu_gib") == std::string::npos) continue;
      Row r;
      r.j = Json::parse(line, f);
      r.where = f + ":" + std::to_string(i + 1);
      auto str = [&](const char* k) {
        const Json* v = r.j.find(k);
        return v && v->is_string() ? v->as_string(k) : std::string();
      };
      r.commit = str("git_commit");
      r.framework = str("framework");
      r.config = str("config");
      r.preset = str("preset");
      rows.push_back(std::move(r));
    }
  }
  return rows;
}

bool superseded(const Row& r) {
  static const std::set<std::string> before_d668552 = {"b1a67c9", "8339f7f", "469391e", "8580b78"};
  const Json* ck = r.j.find("checkpointing");
  const bool checkpointed_llama = r.preset == "llama-7b" && ck && ck->as_bool("checkpointing");
  if (before_d668552.count(r.commit) && !checkpointed_llama) return true;
  return r.commit == "d88d1a6" && r.framework == "bmtrain";
}

double num(const Json& j, const char* k, double fallback = 0) {
  const Json* v = j.find(k);
  return v && !v->is_null() ? v->as_double(k) : fallback;
}
bool flag(const Json& j, const char* k) {
  const Json* v = j.find(k);
  return v && !v->is_null() && v->as_bool(k);
}

TEST(EstimateMemory, MatchesEveryMeasuredPeakOfTheCurrentEngine) {
  const auto rows = bench_rows();
  ASSERT_GT(rows.size(), 10u) << "bench/results rows with peak_gpu_gib not found under " << BMT_SOURCE_DIR;
  int compared = 0;
  for (const Row& r : rows) {
    if (r.framework != "bmtrain" && r.framework != "bmt-python") continue;
    if (superseded(r)) continue;
    bmt::ModelShape m = examples::preset_shape(r.preset);
    bmt::MemoryPlan p;
    p.world = static_cast<int>(num(r.j, "world", 1));
    p.tp = static_cast<int>(num(r.j, "tp", 1));
    p.zero = static_cast<int>(num(r.j, "zero", 3));
    p.checkpointing = flag(r.j, "checkpointing");
    p.offload = flag(r.j, "offload");
    p.offload_gpu_blocks = static_cast<int>(num(r.j, "offload_gpu_blocks", 0));
    p.offload_grad_bf16 = flag(r.j, "offload_grad_bf16");
    p.step_in_backward = flag(r.j, "step_in_backward");
    p.pp = static_cast<int>(num(r.j, "pp", 1));
    p.batch = static_cast<int64_t>(num(r.j, "batch"));
    if (p.pp > 1) p.batch /= static_cast<int64_t>(num(r.j, "micro_batches", 1));  // the plan's batch: one micro-batch
    p.seq = static_cast<int64_t>(num(r.j, "seq"));
    p.ranks_per_host = 1;  // host_peak_gib is one process's
    const auto e = bmt::estimate_memory(m, p);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double want = num(r.j, "peak_gpu_gib"), got = e.gpu.total() / gib;
    std::printf("%-32s %-10s %-52s estimate %6.2f GiB, measured %6.2f GiB (%+5.1f%%)\n", r.where.c_str(),
                r.framework.c_str(), r.config.c_str(), got, want, 100 * (got / want - 1));
    // Pipeline stages: one measured point (gpt-1.3b pp 2 on 2 H200s, stage 0) so far, 11.7% above the estimate
    // after the stage-0 embedding fix; what the rest is (transfer buffers, small-micro-batch transients) is not
    // modelled yet (docs/memory_estimate.md), so pp rows get 15% until it is.
    const double bound = p.pp > 1 ? 0.15 : 0.10;
    EXPECT_LE(std::abs(got / want - 1), bound) << r.where << " " << r.framework << " '" << r.config << "' ("
                                               << r.commit << "): estimate " << got << " GiB, measured " << want;
    const double host_want = num(r.j, "host_peak_gib"), host_got = e.host.total() / gib;
    if (p.offload && host_want > 0) {
      std::printf("%-32s %-62s host estimate %6.2f GiB, measured %6.2f GiB (%+5.1f%%)\n", r.where.c_str(),
                  r.config.c_str(), host_got, host_want, 100 * (host_got / host_want - 1));
      EXPECT_LE(std::abs(host_got / host_want - 1), 0.10) << r.where << " '" << r.config << "' host: estimate "
                                                          << host_got << " GiB, measured " << host_want;
    }
    ++compared;
  }
  EXPECT_GE(compared, 20);
}

TEST(EstimateMemory, ParameterCountsOfThePresets) {
  // The bench rows' "params" (the examples' models) and closed forms.
  EXPECT_EQ(examples::preset_shape("gpt2-124m").params(), 124475904);
  EXPECT_EQ(examples::preset_shape("gpt-1.3b").params(), 1315819520);
  EXPECT_EQ(examples::preset_shape("llama-7b").params(), 6888361984);
  const int64_t d = 4096, ff = 16384, V = 50304;
  EXPECT_EQ(examples::preset_shape("gpt-6.7b").params(),
            V * d + 2048 * d + 32 * (4 * d * d + 2 * d * ff + 9 * d + ff) + 2 * d);
}

TEST(EstimateMemory, ShardingAndOptionsScaleAsTheyShould) {
  const auto m = examples::preset_shape("gpt-1.3b");
  bmt::MemoryPlan p;
  p.batch = 2;
  p.seq = 1024;
  const auto one = bmt::estimate_memory(m, p);
  p.world = 4;
  const auto four = bmt::estimate_memory(m, p);
  EXPECT_NEAR(four.gpu.parameters * 4, one.gpu.parameters, 1.0);
  EXPECT_NEAR(four.gpu.optimizer_states * 4, one.gpu.optimizer_states, 1.0);
  EXPECT_GT(four.gpu.buffers, one.gpu.buffers);  // gathered Blocks exist from two ranks on
  p.checkpointing = true;
  EXPECT_LT(bmt::estimate_memory(m, p).gpu.activations, four.gpu.activations / 5);
  p.offload = true;
  const auto off = bmt::estimate_memory(m, p);
  EXPECT_EQ(off.gpu.optimizer_states, 0);
  EXPECT_NEAR(off.host.optimizer_states, 12.0 * static_cast<double>(m.params()), 1e3);  // 4 ranks on the host
  p.world = 3;
  p.tp = 2;
  EXPECT_THROW(bmt::estimate_memory(m, p), bmt::core::Error);
}

}  // namespace
