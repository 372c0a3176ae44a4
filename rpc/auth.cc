// API-token authentication helpers (see auth.h).
#include "rpc/auth.h"

#include <grpcpp/client_context.h>
#include <grpcpp/server_context.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/file_read.h"
#include "common/status.h"

namespace gradmesh {

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, " is a directory; name the file holding the token"));
  }
  // A token rides every call as a header (gRPC's limit for all of them is 8 KiB).
  ASSIGN_OR_RETURN(const std::string text, ReadFileUpTo(path, 64 << 10, "token file"));
  const std::string token(absl::StripAsciiWhitespace(text));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, " is empty; write a secret token into it"));
  }
  for (unsigned char c : token) {
    if (c < 0x21 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token file ", path,
          " must hold one token without spaces or control characters (it is sent as a header)"));
    }
  }
  return token;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Accumulate every difference, so the time does not reveal the first mismatch. Comparing
  // against `a` itself when lengths differ keeps the loop length independent of `b`'s bytes.
  const absl::string_view other = a.size() == b.size() ? b : a;
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(other[i]);
  }
  return diff == 0;
}

absl::Status CheckBearerToken(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                              absl::string_view token, absl::string_view what) {
  const absl::Status denied = absl::UnauthenticatedError(absl::StrCat("missing or wrong ", what));
  const auto range = metadata.equal_range(kAuthorizationMetadataKey);
  if (range.first == range.second) return denied;
  // Exactly one header: a second one would make the meaning ambiguous.
  if (std::next(range.first) != range.second) return denied;
  const absl::string_view value(range.first->second.data(), range.first->second.size());
  const absl::string_view prefix(kBearerPrefix);
  if (value.size() < prefix.size() || value.substr(0, prefix.size()) != prefix) return denied;
  if (!ConstantTimeEquals(value.substr(prefix.size()), token)) return denied;
  return absl::OkStatus();
}

void AddBearerToken(absl::string_view token, grpc::ClientContext* context) {
  if (token.empty()) return;
  context->AddMetadata(kAuthorizationMetadataKey, absl::StrCat(kBearerPrefix, token));
}

absl::Status TokenChecker::Check(const grpc::ServerContextBase& context) const {
  if (token_.empty()) return absl::OkStatus();
  return CheckBearerToken(context.client_metadata(), token_, what_);
}

}  // namespace gradmesh
