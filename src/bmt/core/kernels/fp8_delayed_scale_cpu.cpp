// CPU twin of delayed scaling's record (fp8_delayed_scale_internal.h): the CUDA kernel's test reference.
#include <algorithm>
#include <cmath>
#include <limits>

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_delayed_scale_internal.h"

namespace bmt::core::kernels {

void fp8_delayed_record_cpu(const Fp8DelayedState& s, float* call_inv) {
  BMT_CHECK(s.history && s.len > 0 && s.scale && s.inv && s.amax && call_inv,
            "fp8_delayed_record_cpu: null state or a history of length ", s.len);
  const float amax = *s.amax;
  const bool finite = std::isfinite(amax);
  *call_inv = finite ? *s.inv : std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = s.len - 1; i > 0; --i) s.history[i] = s.history[i - 1];
  s.history[0] = finite ? amax : 0.0f;
  const float m = *std::max_element(s.history, s.history + s.len);
  fp8_scale_of(m, s.format, s.scale, s.inv);
  *s.amax = 0.0f;
}

}  // namespace bmt::core::kernels
