// SHA-256 against the NIST FIPS 180-4 example vectors (one block, two blocks, a padding that
// spills into a second block, many blocks) and the constant-time token comparison.
#include "common/token_hash.h"

#include <string>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(TokenHashTest, Sha256MatchesNistVectors) {
  EXPECT_EQ(HexOf(Sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(HexOf(Sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(HexOf(Sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(HexOf(Sha256("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
                         "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu")),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(HexOf(Sha256(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // 55 and 56 bytes: the last length that fits one padded block, and the first that does not.
  EXPECT_EQ(HexOf(Sha256(std::string(55, 'a'))),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(HexOf(Sha256(std::string(56, 'a'))),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
}

TEST(TokenHashTest, TokenMatchesOnlyItsOwnHash) {
  const std::string hash = Sha256("0123456789abcdef0123456789abcdef");
  EXPECT_TRUE(TokenMatchesHash("0123456789abcdef0123456789abcdef", hash));
  EXPECT_FALSE(TokenMatchesHash("0123456789abcdef0123456789abcdee", hash));
  EXPECT_FALSE(TokenMatchesHash("", Sha256("")));  // No token never matches.
  EXPECT_FALSE(TokenMatchesHash("x", ""));         // No hash (legacy record) never matches.
  EXPECT_FALSE(TokenMatchesHash("x", "short"));
}

}  // namespace
}  // namespace gradmesh
