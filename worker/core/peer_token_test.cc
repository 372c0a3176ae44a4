// CheckPeerToken (worker/core/peer_token.h): exact codes for each case.
#include "worker/core/peer_token.h"

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(PeerTokenTest, EmptyExpectedTokenIsOpen) {
  EXPECT_TRUE(CheckPeerToken("", std::nullopt, "w").ok());
  EXPECT_TRUE(CheckPeerToken("", "anything", "w").ok());
}

TEST(PeerTokenTest, MissingTokenIsUnauthenticated) {
  absl::Status st = CheckPeerToken("s3cret", std::nullopt, "gossip job j rank 1");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(st.message(),
            "gossip job j rank 1: no job token (metadata x-gradmesh-job-token) on the call");
}

TEST(PeerTokenTest, WrongTokenIsPermissionDenied) {
  for (absl::string_view wrong : {"", "s3cre", "s3cret!", "S3cret", "other-job-token"}) {
    absl::Status st = CheckPeerToken("s3cret", wrong, "ring job j rank 0");
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << wrong;
    EXPECT_EQ(st.message().find("s3cret"), absl::string_view::npos) << st;
  }
  EXPECT_TRUE(CheckPeerToken("s3cret", "s3cret", "w").ok());
}

TEST(PeerTokenTest, EqualsComparesWholeStrings) {
  EXPECT_TRUE(PeerTokenEquals("", ""));
  EXPECT_TRUE(PeerTokenEquals("abc", "abc"));
  EXPECT_FALSE(PeerTokenEquals("abc", "abd"));
  EXPECT_FALSE(PeerTokenEquals("abc", "ab"));
  EXPECT_FALSE(PeerTokenEquals("ab", "abc"));
  EXPECT_FALSE(PeerTokenEquals("", "a"));
}

TEST(PeerTokenTest, RankTokenMustBeTheClaimedRanks) {
  const std::vector<std::string> hashes = {Sha256("rank-zero-token"), Sha256("rank-one-token")};
  EXPECT_TRUE(CheckRankToken({}, 5, std::nullopt, "w").ok());  // Not checked.
  EXPECT_TRUE(CheckRankToken(hashes, 1, "rank-one-token", "w").ok());
  absl::Status st = CheckRankToken(hashes, 1, std::nullopt, "gossip job j rank 0");
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(st.message(),
            "gossip job j rank 0: no rank token (metadata x-gradmesh-rank-token) on the call");
  // Rank 0's own valid token does not make it rank 1.
  st = CheckRankToken(hashes, 1, "rank-zero-token", "gossip job j rank 0");
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(st.message(),
            "gossip job j rank 0: the rank token (metadata x-gradmesh-rank-token) is not rank 1's");
  for (int64_t bad : {int64_t{-1}, int64_t{2}, int64_t{1} << 40}) {
    EXPECT_EQ(CheckRankToken(hashes, bad, "rank-one-token", "w").code(),
              absl::StatusCode::kPermissionDenied)
        << bad;
  }
  EXPECT_EQ(CheckRankToken(hashes, 1, "", "w").code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace gradmesh
