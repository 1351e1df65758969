#pragma once
#include <gtest/gtest.h>
#include "bmt/pch.h"
