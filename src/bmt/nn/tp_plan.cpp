#include "bmt/nn/tp_plan.h"

#include <vector>

#include "bmt/core/error.h"

namespace bmt::nn {
namespace {

constexpr TpStyle kStyles[] = {TpStyle::kReplicated, TpStyle::kColumn, TpStyle::kRow, TpStyle::kVocabEmbedding,
                               TpStyle::kVocabHead};

std::vector<std::string> components(const std::string& name) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (true) {
    const size_t dot = name.find('.', begin);
    out.push_back(name.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin));
    if (dot == std::string::npos) return out;
    begin = dot + 1;
  }
}

}  // namespace

const char* tp_style_name(TpStyle style) {
  switch (style) {
    case TpStyle::kReplicated: return "replicated";
    case TpStyle::kColumn: return "column";
    case TpStyle::kRow: return "row";
    case TpStyle::kVocabEmbedding: return "vocab_embedding";
    case TpStyle::kVocabHead: return "vocab_head";
  }
  return "unknown";
}

TpStyle tp_style_from_name(const std::string& name) {
  std::string known;
  for (TpStyle s : kStyles) {
    if (name == tp_style_name(s)) return s;
    known += std::string(known.empty() ? "" : ", ") + tp_style_name(s);
  }
  BMT_ERROR("tp plan: unknown style '", name, "' (expected one of ", known, ")");
}

void validate_tp_plan(const TpPlan& plan) {
  for (const auto& [name, layout] : plan.modules) {
    bool empty_component = false;
    for (const std::string& c : components(name)) empty_component |= c.empty();
    BMT_CHECK(!empty_component, "tp plan: module name '", name, "' is empty or has an empty component; write a "
              "module path such as \"layers.*.attn.c_attn\"");
    BMT_CHECK(layout.split_groups >= 1, "tp plan: '", name, "' has split_groups = ", layout.split_groups,
              "; it must be at least 1");
    BMT_CHECK(layout.split_groups == 1 || layout.style == TpStyle::kColumn, "tp plan: '", name, "' has split_groups = ",
              layout.split_groups, " with style ", tp_style_name(layout.style),
              "; fused blocks are a column-parallel option (use style column, or split_groups 1)");
  }
}

bool tp_plan_name_matches(const std::string& pattern, const std::string& name) {
  const std::vector<std::string> p = components(pattern), n = components(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != "*" && p[i] != n[i]) return false;
  return true;
}

const std::pair<const std::string, TpLayout>* find_tp_entry(const TpPlan& plan, const std::string& name) {
  const std::pair<const std::string, TpLayout>* found = nullptr;
  for (const auto& entry : plan.modules) {
    if (!tp_plan_name_matches(entry.first, name)) continue;
    BMT_CHECK(found == nullptr, "tp plan: module '", name, "' matches both '", found->first, "' and '", entry.first,
              "'; keep one entry per module");
    found = &entry;
  }
  return found;
}

}  // namespace bmt::nn
