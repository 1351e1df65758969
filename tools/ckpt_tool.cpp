// bmt-ckpt: inspect, verify and export sharded bmtrain checkpoints without launching the training job.
//   bmt-ckpt info <ckpt-dir> [--entries]       summary (version, world size, step, metadata, files, entries)
//   bmt-ckpt verify <ckpt-dir>                 reads every shard file completely and checks every checksum
//   bmt-ckpt export <ckpt-dir> <out.safetensors|out.pt> [--prefix P] [--chunk-mib N]
//                                              consolidated file with the unwrapped model's keys and LOGICAL
//                                              tensors (TP-split parameters reassembled from their tp pieces)
// Exit status: 0 on success, 1 on a checkpoint problem (message on stderr), 2 on bad usage.
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/export.h"

namespace {

int usage() {
  std::cerr << "usage:\n"
               "  bmt-ckpt info <ckpt-dir> [--entries]\n"
               "  bmt-ckpt verify <ckpt-dir>\n"
               "  bmt-ckpt export <ckpt-dir> <out.safetensors|out.pt> [--prefix model/] [--chunk-mib 64]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() < 2) return usage();
  const std::string cmd = args[0], dir = args[1];
  try {
    if (cmd == "info") {
      bool entries = args.size() > 2 && args[2] == "--entries";
      if (args.size() > 3 || (args.size() == 3 && !entries)) return usage();
      std::cout << bmt::checkpoint::describe_checkpoint(dir, entries);
      return 0;
    }
    if (cmd == "verify") {
      if (args.size() != 2) return usage();
      bmt::checkpoint::CheckpointReader reader(dir);
      auto problems = reader.verify_all();
      for (const auto& p : problems) std::cerr << "bmt-ckpt: " << p << "\n";
      if (!problems.empty()) return 1;
      std::cout << "ok: " << reader.path() << " (" << reader.metadata().files.size() << " files verified)\n";
      return 0;
    }
    if (cmd == "export") {
      if (args.size() < 3) return usage();
      std::string prefix = "model/";
      int64_t chunk_mib = 64;
      for (size_t i = 3; i < args.size(); i += 2) {
        if (i + 1 >= args.size()) return usage();
        if (args[i] == "--prefix") prefix = args[i + 1];
        else if (args[i] == "--chunk-mib") chunk_mib = std::atoll(args[i + 1].c_str());
        else return usage();
      }
      if (chunk_mib <= 0) return usage();
      auto stats = bmt::checkpoint::export_consolidated(dir, args[2], prefix, chunk_mib << 20);
      std::cout << "exported " << stats.num_tensors << " tensors (" << stats.nbytes << " bytes) to " << args[2]
                << "; peak buffer " << stats.peak_buffer_nbytes << " bytes\n";
      return 0;
    }
    return usage();
  } catch (const std::exception& e) {
    std::cerr << "bmt-ckpt: " << e.what() << "\n";
    return 1;
  }
}
