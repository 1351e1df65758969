// StateDict: the checkpoint format of bmtrain's optimizers, LR schedulers and OptimManager.
//
// A flat std::map from dotted keys to tensors. Scalars are 0-dim CPU tensors (float64 for real numbers, int64
// for counters and flags); state tensors are CPU copies (never views of live optimizer state). Nested objects are
// stored under a prefix ("optimizers.0.state.3.exp_avg"). This is torch::serialize-friendly: save_state_dict /
// load_state_dict_file write and read it through torch::serialize archives (as one c10::Dict), and every value is
// a plain tensor that a checkpoint layer can store alongside model weights.
//
// Reading helpers throw bmt::core::Error naming the missing key or the wrong kind of value, so loading a state
// dict from another model or optimizer fails clearly.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>

namespace bmt::optim {

using StateDict = std::map<std::string, at::Tensor>;

at::Tensor scalar_entry(double value);
at::Tensor int_entry(int64_t value);

// The tensor at key; throws if missing (`what` names the object being loaded, for the message).
const at::Tensor& get_entry(const StateDict& sd, const std::string& key, const char* what);
double get_double(const StateDict& sd, const std::string& key, const char* what);
int64_t get_int(const StateDict& sd, const std::string& key, const char* what);
bool has_entry(const StateDict& sd, const std::string& key);

// dst[prefix + k] = v for every entry of src.
void put_prefixed(StateDict& dst, const std::string& prefix, const StateDict& src);
// The entries of src whose key starts with prefix, with the prefix removed.
StateDict get_prefixed(const StateDict& src, const std::string& prefix);

// Writes / reads a StateDict to / from a file through torch::serialize (OutputArchive / InputArchive).
void save_state_dict(const StateDict& sd, const std::string& path);
StateDict load_state_dict_file(const std::string& path);

// Serialised bytes of a torch::serialize archive <-> a uint8 CPU tensor (used for plain torch optimizers).
at::Tensor bytes_to_tensor(const std::string& bytes);
std::string tensor_to_bytes(const at::Tensor& t);

}  // namespace bmt::optim
