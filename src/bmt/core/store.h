// Store: the small key-value interface used for rendezvous (NCCL unique ids, group set-up).
// The LibTorch layer adapts c10d's TCPStore to it; the core never includes torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bmt::core {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists or the store's timeout passes (then throws DistError naming the key).
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

}  // namespace bmt::core
