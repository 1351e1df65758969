#pragma once
#include <gtest/gtest.h>
#include "bmt/pch_internal.h"
