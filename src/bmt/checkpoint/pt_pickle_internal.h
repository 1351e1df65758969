// Reading the pickle ("data.pkl") of a torch.save archive holding a dict of tensors, torch-free: our own small
// pickle machine for the opcodes torch.save emits (protocols 2-5), so no private torch API is involved and
// Python-written state dicts (OrderedDict with a _metadata attribute, nn.Parameter wrappers, shared storages,
// views with offsets and strides) load.
//
// Invariants (it reads untrusted bytes and is fuzzed): every read is bounds-checked; the stack, the memo and the
// number of values are bounded, and memo cycles cannot leak (containers are emptied at the end); only these callables are "executed": torch._utils._rebuild_tensor(_v2),
// torch._utils._rebuild_parameter(_with_state), collections.OrderedDict (anything else becomes an opaque value,
// an error if it is where a tensor must be); persistent ids must be ('storage', torch.<T>Storage, key, location,
// numel); a tensor's elements must lie inside its storage. Errors throw bmt::core::Error naming `what`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace bmt::checkpoint {

struct PickledTensor {
  std::string name;         // the dict key
  std::string dtype;        // safetensors name, from the storage class
  std::string storage_key;  // the archive record is "data/<storage_key>"
  int64_t storage_numel = 0;
  int64_t storage_offset = 0;  // elements
  std::vector<int64_t> shape, strides;

  bool is_contiguous() const;
};

// The entries of the top-level dict, in pickle order.
std::vector<PickledTensor> parse_torch_pickle(std::string_view bytes, const std::string& what);

}  // namespace bmt::checkpoint
