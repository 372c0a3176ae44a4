#include "common/registry.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

using IntFactory = std::function<int(int)>;

TEST(NamedRegistryTest, FindsRegisteredFactories) {
  NamedRegistry<IntFactory> r("widget");
  r.Set("double", [](int x) { return 2 * x; });
  ASSERT_OK(r.Add("square", [](int x) { return x * x; }));
  ASSERT_OK_AND_ASSIGN(const IntFactory* f, r.Find("square"));
  EXPECT_EQ((*f)(7), 49);
  r.Set("double", [](int x) { return 3 * x; });  // Set replaces.
  ASSERT_OK_AND_ASSIGN(f, r.Find("double"));
  EXPECT_EQ((*f)(7), 21);
  EXPECT_EQ(r.Names(), (std::vector<std::string>{"double", "square"}));
  EXPECT_TRUE(r.Contains("square"));
  EXPECT_FALSE(r.Contains("cube"));
}

TEST(NamedRegistryTest, ErrorsNameTheKindAndTheKnownEntries) {
  NamedRegistry<IntFactory> r("widget");
  r.Set("b", [](int x) { return x; });
  r.Set("a", [](int x) { return x; });
  EXPECT_STATUS_MSG(r.Find("c"), absl::StatusCode::kInvalidArgument,
                    "unknown widget \"c\" (known: a, b)");
  EXPECT_STATUS_MSG(r.Find("c", "c:3", "c takes a number"), absl::StatusCode::kInvalidArgument,
                    "unknown widget \"c:3\" (known: a, b; c takes a number)");
  EXPECT_STATUS_MSG(r.Add("a", [](int x) { return x; }), absl::StatusCode::kAlreadyExists,
                    "widget \"a\" already registered");
  EXPECT_STATUS(r.Add("", [](int x) { return x; }), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(r.Add("z", nullptr), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gradmesh
