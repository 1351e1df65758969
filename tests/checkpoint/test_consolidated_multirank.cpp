// Consolidated files (bmt::save / bmt::load): both formats round-trip at world size 2 with a small chunk size
// (rank 0's buffer stays within the documented bound), hold exactly bmt::state_dict's keys and values, load at
// world size 3 into a differently wrapped model, and report every mismatch together.
#include "bmt/checkpoint/consolidated.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/params/param_init.h"
#include "ckpt_test_util.h"

using namespace ckpt_test;
namespace ck = bmt::checkpoint;

namespace {

// init_parameters on torch's default generator (InitParametersOptions::torch_generator): the values
// tiny::reference_params reproduces. These tests check the engine against that reference, not the initialisers.
void init_like_reference(torch::nn::Module& model) {
  bmt::InitParametersOptions o;
  o.torch_generator = true;
  bmt::init_parameters(model, o);
}

void expect_reference_values(torch::nn::Module& model) {
  bmt::StateDict sd = bmt::state_dict(model);
  auto ref = tiny::reference_params(tiny::Dims{}, kSeed);
  ASSERT_EQ(sd.size(), ref.size());
  for (auto& kv : ref) EXPECT_TRUE(at::equal(sd.at(kv.first), kv.second.detach())) << kv.first;
}

}  // namespace

TEST(ConsolidatedFile, RoundTripBothFormatsAcrossWorldSizes) {
  SharedDir dir("consolidated");
  bmt::testing::run_ranks(2, [&] {
    tiny::Model model(tiny::Dims{}, {}, true);
    at::manual_seed(kSeed);
    init_like_reference(model);
    bmt::StateDict sd = bmt::state_dict(model);
    for (const char* name : {"model.safetensors", "model.pt"}) {
      const bool pt = std::string(name).find(".pt") != std::string::npos;
      bmt::ConsolidatedOptions o;
      o.chunk_nbytes = 96;
      bmt::ConsolidatedStats st = bmt::save(model, dir / name, o);
      if (bmt::rank() == 0) {
        const int64_t largest = 16 * 8 * 4;
        EXPECT_LE(st.rank0_peak_nbytes, 96 + (pt ? largest : 0)) << name;
        auto f = ck::open_tensor_file(dir / name);
        ASSERT_EQ(f->tensors().size(), sd.size());
        for (size_t i = 0; i < f->tensors().size(); ++i) {
          const auto& ti = f->tensors()[i];
          at::Tensor v = at::empty(ti.shape);
          f->read(i, 0, static_cast<int64_t>(v.nbytes()), v.data_ptr());
          ASSERT_TRUE(sd.count(ti.name)) << ti.name;
          EXPECT_TRUE(at::equal(v, sd[ti.name])) << ti.name;
        }
      }
      {
        at::NoGradGuard ng;
        for (auto& p : model.parameters()) p.detach().fill_(-7);
      }
      bmt::load(model, dir / name, true, o);
      expect_reference_values(model);
    }
  });
  bmt::testing::run_ranks(3, [&] {
    for (const char* name : {"model.safetensors", "model.pt"}) {
      bmt::BlockOptions opts;
      opts.zero_level = 2;
      tiny::Model model(tiny::Dims{}, opts, false);
      bmt::LoadResult r = bmt::load(model, dir / name);
      EXPECT_TRUE(r.missing_keys.empty() && r.unexpected_keys.empty());
      expect_reference_values(model);
    }
  });
}

TEST(ConsolidatedFile, MismatchesAreListedTogetherOnEveryRank) {
  SharedDir dir("consolidated_err");
  bmt::testing::run_ranks(2, [&] {
    tiny::Model model(tiny::Dims{}, {}, true);
    bmt::save(model, dir / "m.safetensors");
    tiny::Dims other;
    other.ff = 32;
    other.layers = 4;
    tiny::Model wrong(other, {}, true);
    std::string msg;
    try {
      bmt::load(wrong, dir / "m.safetensors");
    } catch (const bmt::core::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("missing keys: layers.3.ln.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("layers.0.fc1.weight: file has F32 [16, 8], model has F32 [32, 8]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("layers.2.fc2.weight: file has F32 [8, 16], model has F32 [8, 32]"), std::string::npos) << msg;
    EXPECT_THROW(bmt::load(model, dir / "absent.pt"), bmt::core::Error);
    // Any name but *.safetensors is torch.save's format (BMTrain's bmt.save), so "m.bin" reads back as one.
    bmt::save(model, dir / "m.bin");
    tiny::Model from_bin(tiny::Dims{}, {}, true);
    EXPECT_TRUE(bmt::load(from_bin, dir / "m.bin").missing_keys.empty());
    // strict = false loads what matches and reports the rest.
    tiny::Dims more;
    more.layers = 4;
    tiny::Model bigger(more, {}, true);
    bmt::LoadResult r = bmt::load(bigger, dir / "m.safetensors", false);
    EXPECT_EQ(r.missing_keys.size(), 6u);
    EXPECT_TRUE(r.unexpected_keys.empty());
  });
}
