// Test helpers for absl::Status (this Abseil has no StatusIs matcher).
//
//   EXPECT_STATUS(s, absl::StatusCode::kNotFound);
//   EXPECT_STATUS_MSG(s, absl::StatusCode::kInvalidArgument, "tensor 3");
//   ASSERT_OK(s); ASSERT_OK_AND_ASSIGN(auto v, StatusOrFn());
#ifndef GRADMESH_COMMON_STATUS_TESTING_H_
#define GRADMESH_COMMON_STATUS_TESTING_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace testing_internal {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

inline ::testing::AssertionResult StatusHas(const absl::Status& s, absl::StatusCode code,
                                            const std::string& substr) {
  if (s.code() != code) {
    return ::testing::AssertionFailure()
           << "expected code " << StatusCodeName(code) << ", got " << s.ToString();
  }
  if (std::string(s.message()).find(substr) == std::string::npos) {
    return ::testing::AssertionFailure()
           << "message \"" << s.message() << "\" lacks \"" << substr << "\"";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace testing_internal
}  // namespace gradmesh

#define EXPECT_STATUS(expr, code)                      \
  EXPECT_TRUE(::gradmesh::testing_internal::StatusHas( \
      ::gradmesh::testing_internal::GetStatus(expr), code, ""))
#define EXPECT_STATUS_MSG(expr, code, substr)          \
  EXPECT_TRUE(::gradmesh::testing_internal::StatusHas( \
      ::gradmesh::testing_internal::GetStatus(expr), code, substr))
#define ASSERT_OK(expr)                                \
  ASSERT_TRUE(::gradmesh::testing_internal::StatusHas( \
      ::gradmesh::testing_internal::GetStatus(expr), absl::StatusCode::kOk, ""))
#define EXPECT_OK(expr)                                \
  EXPECT_TRUE(::gradmesh::testing_internal::StatusHas( \
      ::gradmesh::testing_internal::GetStatus(expr), absl::StatusCode::kOk, ""))
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  GM_ASSERT_OK_AND_ASSIGN_IMPL_(GM_STATUS_CONCAT_(gm_test_so_, __LINE__), lhs, rexpr)
#define GM_ASSERT_OK_AND_ASSIGN_IMPL_(var, lhs, rexpr) \
  auto var = (rexpr);                                  \
  ASSERT_OK(var);                                      \
  lhs = std::move(var).value()

#endif  // GRADMESH_COMMON_STATUS_TESTING_H_
