// gtest predicates for statuses that cross the wire: the code and every expected substring of
// the message, for a grpc::Status (raw stub) or an absl::Status (the real client).
//
//   EXPECT_TRUE(GrpcHas(stub->Push(ctx, req, &resp), absl::StatusCode::kNotFound, {"job x"}));
//   EXPECT_TRUE(AbslHas(client->Pull(spans), absl::StatusCode::kInvalidArgument, {"tensor 3"}));
//
// Codes are compared numerically (grpc::StatusCode and absl::StatusCode agree). Thread safety:
// pure functions.
#ifndef GRADMESH_TESTS_TESTING_GRPC_STATUS_TESTING_H_
#define GRADMESH_TESTS_TESTING_GRPC_STATUS_TESTING_H_

#include <grpcpp/support/status.h>

#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace testutil {

// Success if `s` has `code` and its message holds every one of `substrs`; otherwise a failure
// naming the expected and actual codes (name and number) or the missing substring.
inline ::testing::AssertionResult GrpcHas(const grpc::Status& s, absl::StatusCode code,
                                          std::initializer_list<std::string> substrs) {
  if (static_cast<int>(s.error_code()) != static_cast<int>(code)) {
    return ::testing::AssertionFailure()
           << "expected code " << StatusCodeName(code) << " (" << static_cast<int>(code)
           << "), got " << StatusCodeName(static_cast<absl::StatusCode>(s.error_code())) << " ("
           << static_cast<int>(s.error_code()) << "): " << s.error_message();
  }
  for (const std::string& sub : substrs) {
    if (s.error_message().find(sub) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "message \"" << s.error_message() << "\" lacks \"" << sub << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

// Same for an absl::Status (converted as the services do, rpc/grpc_status.h).
inline ::testing::AssertionResult AbslHas(const absl::Status& s, absl::StatusCode code,
                                          std::initializer_list<std::string> substrs) {
  return GrpcHas(ToGrpcStatus(s), code, substrs);
}

}  // namespace testutil
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_TESTING_GRPC_STATUS_TESTING_H_
