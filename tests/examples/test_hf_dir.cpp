// bmt::checkpoint::HfDir and load_hf_safetensors on hand-made directories (single file, index + shards), and the
// messages for broken directories and unsupported configs (export/hf_import.h). Comparisons with transformers
// itself are in test_hf_import.py.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/hf_dir.h"
#include "export/hf_import.h"
#include "export/safetensors.h"

namespace {

namespace ck = bmt::checkpoint;

// (std::filesystem is avoided: libtorch exports its own copies of some of its symbols.)
std::string make_dir(const std::string& name) {
  std::string tmpl = "/tmp/bmt_hf_dir_" + name + "_XXXXXX";
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(HfDir, ShardedIndexViewsAndCountedRanges) {
  const std::string d = make_dir("index");
  at::Tensor a = at::arange(24, at::kFloat).view({4, 6}), b = at::arange(5, at::kFloat) * -1;
  examples::write_safetensors(d + "/part-1.safetensors", {{"a", a}});
  examples::write_safetensors(d + "/part-2.safetensors", {{"b", b}});
  write_text(d + "/model.safetensors.index.json",
             R"({"metadata": {}, "weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}})");
  write_text(d + "/config.json", R"({"model_type": "test", "n": 3})");
  ck::HfDir dir(d);
  EXPECT_EQ(dir.tensor_names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(dir.config().get_int("n"), 3);
  EXPECT_EQ(dir.files_mapped(), 0);  // headers only so far
  at::Tensor va = dir.view("a");
  EXPECT_TRUE(at::equal(va, a));
  EXPECT_EQ(dir.files_mapped(), 1);
  // Elements 5..15 of aᵀ (6, 4) in row-major order: a partial row, whole rows, a partial row.
  at::Tensor got = dir.copy_range(va.t(), 5, 15);
  EXPECT_TRUE(at::equal(got, a.t().contiguous().view({-1}).slice(0, 5, 15)));
  EXPECT_EQ(dir.bytes_copied(), 10 * 4);
  EXPECT_TRUE(at::equal(dir.copy_range(dir.view("b"), 1, 3), b.slice(0, 1, 3)));
  EXPECT_EQ(dir.bytes_copied(), 12 * 4);
  ck::remove_tree(d);
}

TEST(HfDir, LoadsAPlainModuleThroughANameMapAndListsMismatches) {
  const std::string d = make_dir("load");
  at::Tensor w = at::randn({3, 5}), bias = at::randn({3});
  examples::write_safetensors(d + "/model.safetensors", {{"layer.w", w.t().contiguous()}, {"layer.b", bias},
                                                         {"extra", at::zeros({2})}});
  write_text(d + "/config.json", "{}");
  torch::nn::Module m;
  at::Tensor pw = m.register_parameter("weight", at::zeros({3, 5}));
  at::Tensor pb = m.register_parameter("bias", at::zeros({3}));
  ck::HfNameMap map = {{"weight", {"layer.w", true, false}}, {"bias", {"layer.b", false, false}}};
  const std::string strict_error = error_of([&] { ck::load_hf_safetensors(m, d, map); });
  EXPECT_NE(strict_error.find("extra"), std::string::npos) << strict_error;  // unused tensors are listed
  ck::HfLoadOptions options;
  options.ignore = {"extra"};
  ck::HfLoadStats stats;
  ck::load_hf_safetensors(m, d, map, options, &stats);
  EXPECT_TRUE(at::equal(pw, w));
  EXPECT_TRUE(at::equal(pb, bias));
  EXPECT_EQ(stats.bytes_copied, (15 + 3) * 4);
  map["bias"] = {"layer.w", false, false};  // wrong shape: named with both shapes
  const std::string shape_error = error_of([&] { ck::load_hf_safetensors(m, d, map, options); });
  EXPECT_NE(shape_error.find("bias: layer.w is [5, 3], the model needs [3]"), std::string::npos) << shape_error;
  ck::remove_tree(d);
}

TEST(HfDir, BrokenDirectoriesAreNamed) {
  const std::string d = make_dir("broken");
  EXPECT_NE(error_of([&] { ck::HfDir x(d + "/nope"); }).find("is not a directory"), std::string::npos);
  EXPECT_NE(error_of([&] { ck::HfDir x(d); }).find("has no config.json"), std::string::npos);
  write_text(d + "/config.json", "{}");
  EXPECT_NE(error_of([&] { ck::HfDir x(d); }).find("holds no *.safetensors"), std::string::npos);
  write_text(d + "/model.safetensors.index.json", R"({"weight_map": {"a": "gone.safetensors"}})");
  ck::HfDir dir(d);
  EXPECT_NE(error_of([&] { dir.view("a"); }).find("gone.safetensors named by the index is missing"), std::string::npos);
  EXPECT_NE(error_of([&] { dir.config().get_int("n_layer"); }).find("\"n_layer\" is missing"), std::string::npos);
  ck::remove_tree(d);
}

TEST(HfImport, UnsupportedConfigsAreNamed) {
  auto error_for = [](const std::string& json) {
    return error_of([&] { examples::hf_model_config(ck::HfConfig(json, "config.json")); });
  };
  EXPECT_NE(error_for(R"({"model_type": "bert"})").find("supported: gpt2"), std::string::npos);
  const std::string llama = R"({"model_type": "llama", "vocab_size": 16, "num_hidden_layers": 1, "hidden_size": 8,
      "num_attention_heads": 2, "intermediate_size": 16)";
  EXPECT_EQ(error_for(llama + "}"), "");
  EXPECT_NE(error_for(llama + R"(, "rope_scaling": {"type": "linear", "factor": 2.0}})").find("rope_scaling"),
            std::string::npos);
  EXPECT_NE(error_for(llama + R"(, "attention_bias": true})").find("attention_bias"), std::string::npos);
  const examples::ModelConfig c = examples::hf_model_config(
      ck::HfConfig(llama + R"(, "num_key_value_heads": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})",
                   "config.json"));
  EXPECT_EQ(c.arch, "llama");
  EXPECT_EQ(c.kv_heads(), 1);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500.0);
  const std::string gpt = R"({"model_type": "gpt2", "vocab_size": 16, "n_positions": 8, "n_layer": 1, "n_embd": 8,
      "n_head": 2, "n_inner": null)";
  EXPECT_EQ(examples::hf_model_config(ck::HfConfig(gpt + "}", "config.json")).ffn_dim, 32);  // null: 4 n_embd
  EXPECT_NE(error_for(gpt + R"(, "activation_function": "relu"})").find("activation_function = \"relu\""),
            std::string::npos);
}

}  // namespace
