// Moved to bmt/module_state.h (kept for includes not yet switched; remove once examples/train includes it).
#pragma once

#include "bmt/params/module_state.h"
