// The sanitizers' settings of a build with COHORT_SANITIZE=ON, compiled into each of its programs
// (the tests, the CLI, the workers they start, the examples), so that a test run by ctest, by hand
// or by CI reports the same findings: ASAN_OPTIONS and UBSAN_OPTIONS in the environment add to them
// or override them.
//
// libtorch itself is not instrumented, so some of AddressSanitizer's checks are off: leaks
// (libtorch keeps allocations for the life of the process), container overflows (its std::vector
// code is not annotated: a vector it grows looks overflowed to ours) and ODR checks of its
// globals. Any finding ends the process (abort_on_error, halt_on_error) with its report.
extern "C" {
const char* __asan_default_options();
const char* __ubsan_default_options();

const char* __asan_default_options() {
  return "detect_leaks=0:detect_container_overflow=0:detect_odr_violation=0:abort_on_error=1";
}
const char* __ubsan_default_options() { return "print_stacktrace=1:halt_on_error=1"; }
}
