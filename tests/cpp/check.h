// A tiny test harness: CHECK macros that count failures, no framework (the
// tests also build under Bazel without external dependencies).
#ifndef MOE_JAX_TESTS_CPP_CHECK_H_
#define MOE_JAX_TESTS_CPP_CHECK_H_

#include <cstdio>
#include <sstream>
#include <string>

namespace moe_jax_test {

inline int& Failures() {
  static int failures = 0;
  return failures;
}

inline void Fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  ++Failures();
}

template <typename A, typename B>
std::string Pair(const A& a, const B& b) {
  std::ostringstream os;
  os << " (" << a << " vs " << b << ")";
  return os.str();
}

// Returns the process exit code.
inline int Report(const char* name) {
  if (Failures() == 0) {
    std::printf("%s: all checks passed\n", name);
    return 0;
  }
  std::printf("%s: %d check(s) failed\n", name, Failures());
  return 1;
}

}  // namespace moe_jax_test

#define CHECK(cond)                                          \
  do {                                                       \
    if (!(cond)) moe_jax_test::Fail(__FILE__, __LINE__, #cond); \
  } while (0)

#define CHECK_EQ(a, b)                                                    \
  do {                                                                    \
    const auto& check_a_ = (a);                                           \
    const auto& check_b_ = (b);                                           \
    if (!(check_a_ == check_b_))                                          \
      moe_jax_test::Fail(__FILE__, __LINE__,                              \
                         #a " == " #b + moe_jax_test::Pair(check_a_, check_b_)); \
  } while (0)

// CHECK that a string contains a substring.
#define CHECK_CONTAINS(haystack, needle)                                  \
  do {                                                                    \
    const std::string check_h_ = (haystack);                              \
    const std::string check_n_ = (needle);                                \
    if (check_h_.find(check_n_) == std::string::npos)                     \
      moe_jax_test::Fail(__FILE__, __LINE__,                              \
                         "\"" + check_h_ + "\" contains \"" + check_n_ + "\""); \
  } while (0)

#endif  // MOE_JAX_TESTS_CPP_CHECK_H_
