// Precompiled header: the heavy, stable includes every translation unit of cohort uses.
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>
