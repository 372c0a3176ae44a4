#include "worker/core/tensor_files.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// worker/testdata/tensors/<relative> in the runfiles (files made by gen.py there).
std::string TestData(const std::string& relative) {
  const std::string path = "worker/testdata/tensors/" + relative;
  if (FileExists(path)) return path;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return absl::StrCat(srcdir, "/", workspace, "/", path);
  }
  return path;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out << data;
  ASSERT_TRUE(out.good()) << path;
}

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir();
  if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
  tmpl += "tensor_files_test_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* dir = mkdtemp(buf.data());
  EXPECT_NE(dir, nullptr) << tmpl;
  return dir == nullptr ? std::string() : std::string(dir);
}

template <typename T>
std::vector<T> ReadAs(const ExampleSource& s, int64_t i, bool x) {
  std::vector<uint8_t> xb(s.x().sample_bytes()), yb(s.y().sample_bytes());
  EXPECT_OK(s.Read(i, xb.data(), yb.data()));
  const std::vector<uint8_t>& b = x ? xb : yb;
  std::vector<T> out(b.size() / sizeof(T));
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

TEST(TensorFilesTest, FloatFilesConcatenateInNameOrder) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> train,
                       OpenTensorFiles(TestData("float"), "train"));
  EXPECT_EQ(train->size(), 5);
  EXPECT_EQ(train->x(), (FieldMeta{ElemType::kFloat32, {3, 4}}));
  EXPECT_EQ(train->y(), (FieldMeta{ElemType::kInt64, {}}));
  EXPECT_EQ(train->x().Describe(), "float32[3,4]");
  EXPECT_EQ(train->y().Describe(), "int64[]");
  EXPECT_EQ(train->Describe(),
            absl::StrCat("tensors ", TestData("float"), "/train*.pt (2 files, 5 samples)"));
  // gen.py: x = arange(0, 60) over the two files, 12 values per sample; y = arange(5).
  for (int64_t i = 0; i < 5; ++i) {
    std::vector<float> want(12);
    for (int k = 0; k < 12; ++k) want[k] = static_cast<float>(i * 12 + k);
    EXPECT_EQ(ReadAs<float>(*train, i, true), want) << "sample " << i;
    EXPECT_EQ(ReadAs<int64_t>(*train, i, false), std::vector<int64_t>{i});
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> test,
                       OpenTensorFiles(TestData("float") + "/", "test"));
  EXPECT_EQ(test->size(), 2);
  EXPECT_EQ(test->x(), train->x());
  EXPECT_EQ(ReadAs<float>(*test, 1, true)[0], 112.0f);
  EXPECT_EQ(ReadAs<int64_t>(*test, 1, false), std::vector<int64_t>{8});
}

TEST(TensorFilesTest, Zip64ExtraFields) {
  // zip64/test.pt: float/test-00000.pt with every size and offset in zip64 extra fields.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> s,
                       OpenTensorFiles(TestData("zip64"), "test"));
  EXPECT_EQ(s->size(), 2);
  EXPECT_EQ(s->x(), (FieldMeta{ElemType::kFloat32, {3, 4}}));
  std::vector<float> want(12);
  for (int k = 0; k < 12; ++k) want[k] = static_cast<float>(112 + k);
  EXPECT_EQ(ReadAs<float>(*s, 1, true), want);
  EXPECT_EQ(ReadAs<int64_t>(*s, 1, false), std::vector<int64_t>{8});
}

TEST(TensorFilesTest, ReadOutOfRange) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> s,
                       OpenTensorFiles(TestData("float"), "test"));
  uint8_t x[48], y[8];
  EXPECT_STATUS_MSG(s->Read(2, x, y), absl::StatusCode::kOutOfRange, "sample 2 out of range");
  EXPECT_STATUS(s->Read(-1, x, y), absl::StatusCode::kOutOfRange);
}

TEST(TensorFilesTest, Int64Sequences) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> s, OpenTensorFiles(TestData("seq"), "train"));
  EXPECT_EQ(s->size(), 4);
  EXPECT_EQ(s->x(), (FieldMeta{ElemType::kInt64, {5}}));
  EXPECT_EQ(s->y(), (FieldMeta{ElemType::kInt64, {5}}));
  EXPECT_EQ(ReadAs<int64_t>(*s, 2, true), (std::vector<int64_t>{10, 11, 12, 13, 14}));
  EXPECT_EQ(ReadAs<int64_t>(*s, 3, false), (std::vector<int64_t>{16, 17, 18, 19, 20}));
}

TEST(TensorFilesTest, HalfXFloatYAndIgnoredKey) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> s,
                       OpenTensorFiles(TestData("half"), "train"));
  EXPECT_EQ(s->size(), 3);
  EXPECT_EQ(s->x(), (FieldMeta{ElemType::kFloat16, {2}}));
  EXPECT_EQ(s->y(), (FieldMeta{ElemType::kFloat32, {2}}));
  // float16 of 1.0 (4/4) and 1.25 (5/4): 0x3c00, 0x3d00.
  EXPECT_EQ(ReadAs<uint16_t>(*s, 2, true), (std::vector<uint16_t>{0x3c00, 0x3d00}));
  EXPECT_EQ(ReadAs<float>(*s, 1, false), (std::vector<float>{4.0f, 6.0f}));
}

TEST(TensorFilesTest, Uint8WithStorageOffset) {
  // train-view.pt sorts before train.pt; its x is a slice at storage offset 4.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> s,
                       OpenTensorFiles(TestData("uint8"), "train"));
  EXPECT_EQ(s->size(), 7);
  EXPECT_EQ(s->x(), (FieldMeta{ElemType::kUInt8, {2, 2}}));
  EXPECT_EQ(ReadAs<uint8_t>(*s, 0, true), (std::vector<uint8_t>{204, 205, 206, 207}));
  EXPECT_EQ(ReadAs<uint8_t>(*s, 1, true), (std::vector<uint8_t>{208, 209, 210, 211}));
  EXPECT_EQ(ReadAs<int64_t>(*s, 1, false), std::vector<int64_t>{6});
  EXPECT_EQ(ReadAs<uint8_t>(*s, 3, true), (std::vector<uint8_t>{40, 50, 60, 70}));
  EXPECT_EQ(ReadAs<int64_t>(*s, 6, false), std::vector<int64_t>{4});
}

TEST(TensorFilesTest, ConcurrentReads) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> s,
                       OpenTensorFiles(TestData("float"), "train"));
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      float x[12];
      int64_t y;
      for (int r = 0; r < 500; ++r) {
        const int64_t i = (r + t) % 5;
        if (!s->Read(i, reinterpret_cast<uint8_t*>(x), reinterpret_cast<uint8_t*>(&y)).ok() ||
            x[0] != i * 12 || y != i) {
          ++bad[t];
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad, (std::vector<int>{0, 0, 0, 0}));
}

// Copies testdata file `relative` into a fresh directory as `name`.
std::string DirWith(const std::string& relative, const std::string& name) {
  const std::string dir = MakeTempDir();
  WriteAll(dir + "/" + name, ReadAll(TestData(relative)));
  return dir;
}

TEST(TensorFilesTest, BadFiles) {
  struct Case {
    const char* file;
    const char* message;
  };
  for (const Case& c : {
           Case{"bad/lengths.pt", "x has 3 samples but y has 2"},
           Case{"bad/not_tensor.pt", "x is not a tensor"},
           Case{"bad/noncontig.pt",
                "x (size [4,3], stride [1,4]) is not contiguous; save "
                "x.contiguous() instead"},
           Case{"bad/missing_y.pt", "no key \"y\""},
           Case{"bad/truncated.pt", "not a zip archive"},
           Case{"bad/bigendian.pt", "byte order \"big\" is not little-endian"},
           Case{"bad/deflated.pt", "zip entry test-00000/data.pkl is compressed (method 8)"},
       }) {
    SCOPED_TRACE(c.file);
    const std::string dir = DirWith(c.file, "train-0.pt");
    EXPECT_STATUS_MSG(OpenTensorFiles(dir, "train"), absl::StatusCode::kInvalidArgument,
                      absl::StrCat(dir, "/train-0.pt: ", c.message));
  }
}

TEST(TensorFilesTest, MismatchedShapesNameBothFiles) {
  const std::string dir = TestData("mismatch");
  EXPECT_STATUS_MSG(OpenTensorFiles(dir, "train"), absl::StatusCode::kInvalidArgument,
                    absl::StrCat("x of ", dir, "/train-b.pt is float32[4] per sample but x of ",
                                 dir, "/train-a.pt is float32[3]"));
}

TEST(TensorFilesTest, NoMatchingFilesIsNotFound) {
  EXPECT_STATUS_MSG(OpenTensorFiles(TestData("float"), "valid"), absl::StatusCode::kNotFound,
                    absl::StrCat("no files match ", TestData("float"), "/valid*.pt"));
  EXPECT_STATUS_MSG(OpenTensorFiles(TestData("no_such_dir"), "train"), absl::StatusCode::kNotFound,
                    "no_such_dir/train*.pt");
}

void PutLe(uint64_t v, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

// A zip archive of stored entries (CRCs left 0: the reader does not check them).
std::string MakeZip(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out, central;
  for (const auto& [name, data] : entries) {
    const uint64_t offset = out.size();
    PutLe(0x04034b50, 4, &out);
    PutLe(20, 2, &out);
    for (int k = 0; k < 4; ++k) PutLe(0, 2, &out);  // Flags, method, time, date.
    PutLe(0, 4, &out);                              // CRC.
    PutLe(data.size(), 4, &out);
    PutLe(data.size(), 4, &out);
    PutLe(name.size(), 2, &out);
    PutLe(0, 2, &out);
    out += name + data;
    PutLe(0x02014b50, 4, &central);
    PutLe(20, 2, &central);
    PutLe(20, 2, &central);
    for (int k = 0; k < 4; ++k) PutLe(0, 2, &central);
    PutLe(0, 4, &central);
    PutLe(data.size(), 4, &central);
    PutLe(data.size(), 4, &central);
    PutLe(name.size(), 2, &central);
    for (int k = 0; k < 4; ++k) PutLe(0, 2, &central);  // Extra, comment, disk, attributes.
    PutLe(0, 4, &central);
    PutLe(offset, 4, &central);
    central += name;
  }
  const uint64_t cd_offset = out.size();
  out += central;
  PutLe(0x06054b50, 4, &out);
  PutLe(0, 2, &out);
  PutLe(0, 2, &out);
  PutLe(entries.size(), 2, &out);
  PutLe(entries.size(), 2, &out);
  PutLe(central.size(), 4, &out);
  PutLe(cd_offset, 4, &out);
  PutLe(0, 2, &out);
  return out;
}

TEST(TensorFilesTest, HostilePicklesAreInvalidArgument) {
  using std::string_literals::operator""s;
  const std::string dir = MakeTempDir();
  struct Case {
    std::string pickle;
    std::string message;
  };
  const std::string many_values = "\x80\x02(" + std::string((1 << 17) + 1, 'N') + "t.";
  // A 64 KiB string, memoized, then joined with itself by STACK_GLOBAL 100 times (6 bytes each,
  // each result popped): 12.8 MB of strings from a 65 KB pickle, which would otherwise end as a
  // valid empty dict.
  std::string joins = "\x80\x02X\x00\x00\x01\x00"s + std::string(1 << 16, 'a') +
                      "q\x00"
                      "0"s;
  for (int i = 0; i < 100; ++i)
    joins +=
        "h\x00h\x00\x93"
        "0"s;
  joins += "}.";
  for (const Case& c : {
           Case{"\x80\x02]q\x00."s, "data.pkl does not hold a dict"},
           Case{"\x80\x02}q\x00\xff."s, "unsupported pickle opcode 0xff"},
           Case{"\x80\x02}q\x00(X\x01\x00\x00\x00x"s, "truncated pickle"},
           Case{"\x80\x02}(X\x05\x00\x00\x00xu."s, "truncated pickle"},
           Case{"\x80\x02h\x07."s, "memo 7 is not set"},
           Case{"\x80\x02t."s, "pickle MARK missing"},
           Case{"\x80\x02s."s, "pickle stack underflow"},
           Case{"\x80\x02}N."s, "pickle ends with a malformed stack"},
           Case{"\x80\x02}(X\x01\x00\x00\x00x\x8a\x09"s + std::string(9, '\x01') + "u.",
                "integer of 9 bytes is too large"},
           Case{"\x80\x02}(X\x01\x00\x00\x00xX\x07\x00\x00\x00storageQu."s,
                "persistent id is not a ('storage', type, key, location, numel) tuple"},
           Case{"\x80\x02}(X\x01\x00\x00\x00xctorch\nFloatStorage\n)Ru."s, "x is not a tensor"},
           Case{many_values, "more than 131072 values"},
           Case{joins, "more than 4194304 bytes of strings"},
           Case{"\x80\x02"s + std::string((1 << 20) + 1, 'N'), "more than 1048576"},
       }) {
    SCOPED_TRACE(c.message);
    WriteAll(dir + "/train.pt", MakeZip({{"a/data.pkl", c.pickle}, {"a/version", "3\n"}}));
    EXPECT_STATUS_MSG(OpenTensorFiles(dir, "train"), absl::StatusCode::kInvalidArgument, c.message);
  }
  WriteAll(dir + "/train.pt", MakeZip({{"a/version", "3\n"}}));
  EXPECT_STATUS_MSG(OpenTensorFiles(dir, "train"), absl::StatusCode::kInvalidArgument,
                    "no <archive>/data.pkl entry");
}

TEST(TensorFilesTest, CompressedEntryIsRefused) {
  // Rewrite the method of the first central directory entry (data.pkl) to deflate (8).
  std::string data = ReadAll(TestData("float/test-00000.pt"));
  const size_t cd = data.find("PK\x01\x02");
  ASSERT_NE(cd, std::string::npos);
  data[cd + 10] = 8;
  const std::string dir = MakeTempDir();
  WriteAll(dir + "/test.pt", data);
  EXPECT_STATUS_MSG(OpenTensorFiles(dir, "test"), absl::StatusCode::kInvalidArgument,
                    "is compressed (method 8)");
}

TEST(TensorFilesTest, StorageSizeLiesAreRefused) {
  // Claim more storage than the entry holds: the first sample of y lies past its entry.
  std::string data = ReadAll(TestData("float/test-00000.pt"));
  // In data.pkl, "K\x02\x85" is y's size tuple (2,): make it (100,) for x and y alike.
  const size_t pos = data.find("K\x02\x85");
  ASSERT_NE(pos, std::string::npos);
  data[pos + 1] = 100;
  const std::string dir = MakeTempDir();
  WriteAll(dir + "/test.pt", data);
  EXPECT_STATUS(OpenTensorFiles(dir, "test"), absl::StatusCode::kInvalidArgument);
}

TEST(TensorFilesTest, EveryTruncationIsInvalidArgument) {
  const std::string data = ReadAll(TestData("float/train-00001.pt"));
  const std::string dir = MakeTempDir();
  for (size_t n = 0; n < data.size(); ++n) {
    WriteAll(dir + "/train.pt", data.substr(0, n));
    EXPECT_STATUS(OpenTensorFiles(dir, "train"), absl::StatusCode::kInvalidArgument) << n;
  }
  WriteAll(dir + "/train.pt", data);
  EXPECT_OK(OpenTensorFiles(dir, "train"));
}

}  // namespace
}  // namespace gradmesh
