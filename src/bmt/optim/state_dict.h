// Moved to bmt/optim/flat_state_dict.h (kept for includes not yet switched; remove once examples/train includes it).
#pragma once

#include "bmt/optim/flat_state_dict.h"
