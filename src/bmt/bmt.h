// Umbrella header for C++ users of bmtrain. Library code includes the narrow headers instead.
#pragma once

#include "bmt/block.h"
#include "bmt/block_list.h"
#include "bmt/distributed.h"
#include "bmt/init.h"
#include "bmt/memory_stats.h"
#include "bmt/loss/fused_cross_entropy.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/parallel_layers.h"
#include "bmt/nn/planned_layers.h"
#include "bmt/nn/tp_ops.h"
#include "bmt/nn/tp_plan.h"
#include "bmt/param_registry.h"
#include "bmt/parameter.h"
#include "bmt/state_dict.h"
