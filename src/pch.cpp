// The translation unit that builds the precompiled header src/pch.h once, for every target
// (cohort_defaults in CMakeLists.txt); it defines nothing.
#include "pch.h"
