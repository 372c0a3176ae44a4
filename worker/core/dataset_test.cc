#include "worker/core/dataset.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/core/examples.h"

namespace gradmesh {
namespace {

using Bytes = std::vector<uint8_t>;

void PutBigEndian32(uint32_t v, Bytes* out) {
  out->push_back(static_cast<uint8_t>(v >> 24));
  out->push_back(static_cast<uint8_t>(v >> 16));
  out->push_back(static_cast<uint8_t>(v >> 8));
  out->push_back(static_cast<uint8_t>(v));
}

Bytes IdxImages(uint32_t count, uint32_t rows, uint32_t cols, const Bytes& pixels,
                uint32_t magic = 0x00000803) {
  Bytes out;
  PutBigEndian32(magic, &out);
  PutBigEndian32(count, &out);
  PutBigEndian32(rows, &out);
  PutBigEndian32(cols, &out);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}

Bytes IdxLabels(const Bytes& labels, uint32_t magic = 0x00000801) {
  Bytes out;
  PutBigEndian32(magic, &out);
  PutBigEndian32(static_cast<uint32_t>(labels.size()), &out);
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

Bytes Gzip(const Bytes& data) {
  uLongf size = compressBound(data.size()) + 64;
  Bytes out(size);
  z_stream zs = {};
  // windowBits 15 + 16: gzip wrapper, as gzopen() expects.
  EXPECT_EQ(deflateInit2(&zs, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY),
            Z_OK);
  zs.next_in = const_cast<Bytes::value_type*>(data.data());
  zs.avail_in = static_cast<uInt>(data.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

void WriteFile(const std::string& path, const Bytes& data) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  if (!data.empty()) {
    ASSERT_EQ(std::fwrite(data.data(), 1, data.size(), f), data.size());
  }
  ASSERT_EQ(std::fclose(f), 0);
}

// A fresh directory per test, so tests cannot see each other's files.
std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir();
  if (tmpl.empty() || tmpl.back() != '/') tmpl += '/';
  tmpl += "dataset_test_XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* dir = mkdtemp(buf.data());
  EXPECT_NE(dir, nullptr) << tmpl;
  return dir == nullptr ? std::string() : std::string(dir);
}

// Three 2x3 images with distinct pixels and labels.
const Bytes kPixels = {0, 1, 2, 3, 4, 5, 10, 20, 30, 40, 50, 60, 255, 254, 128, 127, 7, 9};
const Bytes kLabels = {7, 0, 9};

void ExpectSmallSet(const ImageSet& set) {
  EXPECT_EQ(set.size, 3);
  EXPECT_EQ(set.rows, 2);
  EXPECT_EQ(set.cols, 3);
  EXPECT_EQ(set.pixels, kPixels);
  EXPECT_EQ(set.labels, kLabels);
}

class IdxTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTempDir(); }
  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }
  std::string dir_;
};

TEST_F(IdxTest, LoadsPlainFiles) {
  WriteFile(Path("img"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  ASSERT_OK_AND_ASSIGN(ImageSet set, LoadIdxPair(Path("img"), Path("lbl")));
  ExpectSmallSet(set);
}

TEST_F(IdxTest, LoadsGzippedFiles) {
  WriteFile(Path("img.gz"), Gzip(IdxImages(3, 2, 3, kPixels)));
  WriteFile(Path("lbl.gz"), Gzip(IdxLabels(kLabels)));
  ASSERT_OK_AND_ASSIGN(ImageSet set, LoadIdxPair(Path("img.gz"), Path("lbl.gz")));
  ExpectSmallSet(set);
}

TEST_F(IdxTest, LoadsMixedFiles) {
  WriteFile(Path("img.gz"), Gzip(IdxImages(3, 2, 3, kPixels)));
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  ASSERT_OK_AND_ASSIGN(ImageSet set, LoadIdxPair(Path("img.gz"), Path("lbl")));
  ExpectSmallSet(set);
}

TEST_F(IdxTest, EmptySetIsValid) {
  WriteFile(Path("img"), IdxImages(0, 28, 28, {}));
  WriteFile(Path("lbl"), IdxLabels({}));
  ASSERT_OK_AND_ASSIGN(ImageSet set, LoadIdxPair(Path("img"), Path("lbl")));
  EXPECT_EQ(set.size, 0);
  EXPECT_EQ(set.rows, 28);
  EXPECT_TRUE(set.pixels.empty());
}

TEST_F(IdxTest, MissingFileIsNotFound) {
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  EXPECT_STATUS_MSG(LoadIdxPair(Path("nope"), Path("lbl")), absl::StatusCode::kNotFound,
                    Path("nope"));
  WriteFile(Path("img"), IdxImages(3, 2, 3, kPixels));
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img"), Path("nope.gz")), absl::StatusCode::kNotFound,
                    Path("nope.gz"));
}

// A FIFO (or device) where an IDX file should be is refused at once: opening it would block
// the job's start for as long as nothing writes to it.
TEST_F(IdxTest, AFifoIsRefusedNotOpened) {
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  ASSERT_EQ(mkfifo(Path("fifo").c_str(), 0600), 0);
  EXPECT_STATUS_MSG(LoadIdxPair(Path("fifo"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("fifo") + " is not a regular file, not an IDX file");
}

TEST_F(IdxTest, TruncatedPixelsAreInvalidArgument) {
  Bytes img = IdxImages(3, 2, 3, kPixels);
  img.pop_back();
  WriteFile(Path("img"), img);
  WriteFile(Path("img.gz"), Gzip(img));
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("img") + ": truncated pixel data: expected 18 bytes, found 17");
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img.gz"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("img.gz") + ": truncated");
}

TEST_F(IdxTest, TruncatedHeaderAndLabelsAreInvalidArgument) {
  WriteFile(Path("img"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("short"), Bytes{0, 0, 8, 3, 0, 0});
  WriteFile(Path("empty"), Bytes{});
  Bytes lbl = IdxLabels(kLabels);
  lbl.pop_back();
  WriteFile(Path("lbl"), lbl);
  EXPECT_STATUS_MSG(LoadIdxPair(Path("short"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("short") + ": truncated header");
  EXPECT_STATUS_MSG(LoadIdxPair(Path("empty"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("empty") + ": truncated header");
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("lbl") + ": truncated label data");
}

TEST_F(IdxTest, CorruptGzipStreamIsInvalidArgument) {
  // Cut a gzip stream in the middle of its deflate data.
  Bytes big(5000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>((i * 7919) >> 3);
  Bytes gz = Gzip(IdxImages(5, 20, 50, big));
  gz.resize(gz.size() / 2);
  WriteFile(Path("img.gz"), gz);
  WriteFile(Path("lbl"), IdxLabels({1, 2, 3, 4, 5}));
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img.gz"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("img.gz"));
}

TEST_F(IdxTest, BadMagicIsInvalidArgument) {
  WriteFile(Path("img"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  WriteFile(Path("bad_img"), IdxImages(3, 2, 3, kPixels, /*magic=*/0x00000801));
  WriteFile(Path("bad_lbl"), IdxLabels(kLabels, /*magic=*/0x00000803));
  EXPECT_STATUS_MSG(LoadIdxPair(Path("bad_img"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("bad_img") + ": bad magic number 0x00000801");
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img"), Path("bad_lbl")), absl::StatusCode::kInvalidArgument,
                    Path("bad_lbl") + ": bad magic number 0x00000803");
  // Swapped arguments are caught by the magic numbers too.
  EXPECT_STATUS(LoadIdxPair(Path("lbl"), Path("img")), absl::StatusCode::kInvalidArgument);
}

TEST_F(IdxTest, CountMismatchIsInvalidArgument) {
  WriteFile(Path("img"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("lbl"), IdxLabels({1, 2}));
  EXPECT_STATUS_MSG(
      LoadIdxPair(Path("img"), Path("lbl")), absl::StatusCode::kInvalidArgument,
      "count mismatch: " + Path("img") + " has 3 images but " + Path("lbl") + " has 2 labels");
}

TEST_F(IdxTest, TrailingDataIsInvalidArgument) {
  Bytes img = IdxImages(3, 2, 3, kPixels);
  img.push_back(0);
  WriteFile(Path("img"), img);
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    Path("img") + ": unexpected data");
}

TEST_F(IdxTest, ZeroImageSizeIsInvalidArgument) {
  WriteFile(Path("img"), IdxImages(3, 0, 3, {}));
  WriteFile(Path("lbl"), IdxLabels(kLabels));
  EXPECT_STATUS_MSG(LoadIdxPair(Path("img"), Path("lbl")), absl::StatusCode::kInvalidArgument,
                    "image size 0x3");
}

TEST_F(IdxTest, LoadDatasetFindsPlainAndGzippedFiles) {
  const Bytes test_pixels = {9, 8, 7, 6, 5, 4};
  WriteFile(Path("train-images-idx3-ubyte.gz"), Gzip(IdxImages(3, 2, 3, kPixels)));
  WriteFile(Path("train-labels-idx1-ubyte"), IdxLabels(kLabels));
  WriteFile(Path("t10k-images-idx3-ubyte"), IdxImages(1, 2, 3, test_pixels));
  WriteFile(Path("t10k-labels-idx1-ubyte.gz"), Gzip(IdxLabels({4})));
  for (const char* dir_suffix : {"", "/"}) {
    ASSERT_OK_AND_ASSIGN(DatasetFiles files, LoadIdxDataset("fashion-mnist", dir_ + dir_suffix));
    ExpectSmallSet(files.train);
    EXPECT_EQ(files.test.size, 1);
    EXPECT_EQ(files.test.pixels, test_pixels);
    EXPECT_EQ(files.test.labels, Bytes{4});
    EXPECT_FLOAT_EQ(files.mean, 0.2860f);
    EXPECT_FLOAT_EQ(files.stddev, 0.3530f);
    EXPECT_EQ(files.num_classes, 10);
  }
  ASSERT_OK_AND_ASSIGN(DatasetFiles mnist, LoadIdxDataset("mnist", dir_));
  EXPECT_FLOAT_EQ(mnist.mean, 0.1307f);
  EXPECT_FLOAT_EQ(mnist.stddev, 0.3081f);
}

TEST_F(IdxTest, LoadDatasetPrefersPlainFile) {
  WriteFile(Path("train-images-idx3-ubyte"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("train-images-idx3-ubyte.gz"), Bytes{1, 2, 3});  // Garbage, never read.
  WriteFile(Path("train-labels-idx1-ubyte"), IdxLabels(kLabels));
  WriteFile(Path("t10k-images-idx3-ubyte"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("t10k-labels-idx1-ubyte"), IdxLabels(kLabels));
  ASSERT_OK_AND_ASSIGN(DatasetFiles files, LoadIdxDataset("mnist", dir_));
  ExpectSmallSet(files.train);
  ExpectSmallSet(files.test);
}

TEST_F(IdxTest, LoadDatasetErrors) {
  EXPECT_STATUS_MSG(LoadDataset("cifar10", dir_), absl::StatusCode::kInvalidArgument,
                    "unknown dataset \"cifar10\"; known datasets: fashion-mnist, mnist, tensors");
  EXPECT_EQ(KnownDatasets(), (std::vector<std::string>{"fashion-mnist", "mnist", "tensors"}));
  EXPECT_STATUS_MSG(LoadIdxDataset("tensors", dir_), absl::StatusCode::kInvalidArgument,
                    "unknown IDX dataset \"tensors\"; known IDX datasets: fashion-mnist, mnist");
  EXPECT_STATUS_MSG(LoadIdxDataset("mnist", dir_), absl::StatusCode::kNotFound,
                    Path("train-images-idx3-ubyte.gz"));
  EXPECT_STATUS(LoadIdxDataset("mnist", Path("no_such_dir")), absl::StatusCode::kNotFound);

  WriteFile(Path("train-images-idx3-ubyte"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("train-labels-idx1-ubyte"), IdxLabels(kLabels));
  EXPECT_STATUS_MSG(LoadIdxDataset("mnist", dir_), absl::StatusCode::kNotFound,
                    Path("t10k-images-idx3-ubyte"));

  // Label 10 is out of range for 10 classes.
  WriteFile(Path("t10k-images-idx3-ubyte"), IdxImages(1, 2, 3, {1, 2, 3, 4, 5, 6}));
  WriteFile(Path("t10k-labels-idx1-ubyte"), IdxLabels({10}));
  EXPECT_STATUS_MSG(LoadIdxDataset("mnist", dir_), absl::StatusCode::kInvalidArgument,
                    "label 10 of item 0");

  // Test images with other dimensions than the training images.
  WriteFile(Path("t10k-images-idx3-ubyte"), IdxImages(1, 3, 2, {1, 2, 3, 4, 5, 6}));
  WriteFile(Path("t10k-labels-idx1-ubyte"), IdxLabels({1}));
  EXPECT_STATUS_MSG(LoadIdxDataset("mnist", dir_), absl::StatusCode::kInvalidArgument,
                    "training images are 2x3 but test images are 3x2");
}

// Bytes of a float / int64 value, as a source writes them.
template <typename T>
std::vector<uint8_t> BytesOf(const std::vector<T>& values) {
  std::vector<uint8_t> out(values.size() * sizeof(T));
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

TEST_F(IdxTest, LoadDatasetMakesNormalisedSources) {
  const Bytes test_pixels = {9, 8, 7, 6, 5, 4};
  WriteFile(Path("train-images-idx3-ubyte"), IdxImages(3, 2, 3, kPixels));
  WriteFile(Path("train-labels-idx1-ubyte"), IdxLabels(kLabels));
  WriteFile(Path("t10k-images-idx3-ubyte"), IdxImages(1, 2, 3, test_pixels));
  WriteFile(Path("t10k-labels-idx1-ubyte"), IdxLabels({4}));
  ASSERT_OK_AND_ASSIGN(JobData data, LoadDataset("mnist", dir_));
  EXPECT_EQ(data.num_classes, 10);
  ASSERT_NE(data.train, nullptr);
  ASSERT_NE(data.test, nullptr);
  EXPECT_EQ(data.train->size(), 3);
  EXPECT_EQ(data.test->size(), 1);
  EXPECT_EQ(data.train->x(), (FieldMeta{ElemType::kFloat32, {1, 2, 3}}));
  EXPECT_EQ(data.train->y(), (FieldMeta{ElemType::kInt64, {}}));
  EXPECT_EQ(data.test->x(), data.train->x());
  // Sample 2 of the training set: pixels 255 254 128 127 7 9, label 9, with mnist's constants
  // computed as the loader always has: (p / 255 - mean) / stddev in float.
  std::vector<uint8_t> x(24), y(8);
  ASSERT_OK(data.train->Read(2, x.data(), y.data()));
  std::vector<float> want;
  for (uint8_t p : {255, 254, 128, 127, 7, 9}) {
    want.push_back((static_cast<float>(p) / 255.0f - 0.1307f) / 0.3081f);
  }
  EXPECT_EQ(x, BytesOf(want));
  EXPECT_EQ(y, BytesOf(std::vector<int64_t>{9}));
  EXPECT_FLOAT_EQ(want[0], 2.8214867f);  // (1 - 0.1307) / 0.3081.
  ASSERT_OK(data.test->Read(0, x.data(), y.data()));
  EXPECT_EQ(y, BytesOf(std::vector<int64_t>{4}));
  EXPECT_STATUS(data.train->Read(3, x.data(), y.data()), absl::StatusCode::kOutOfRange);

  EXPECT_STATUS_MSG(LoadDataset("mnist", Path("nope")), absl::StatusCode::kNotFound,
                    "dataset mnist in " + Path("nope"));
}

// worker/testdata/tensors/<relative> in the runfiles (made by gen.py there).
std::string TensorTestData(const std::string& relative) {
  const std::string path = "worker/testdata/tensors/" + relative;
  struct stat st;
  if (stat(path.c_str(), &st) == 0) return path;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return absl::StrCat(srcdir, "/", workspace, "/", path);
  }
  return path;
}

TEST(LoadDatasetTest, Tensors) {
  ASSERT_OK_AND_ASSIGN(JobData data, LoadDataset("tensors", TensorTestData("float")));
  EXPECT_EQ(data.num_classes, 0);
  EXPECT_EQ(data.train->size(), 5);
  EXPECT_EQ(data.test->size(), 2);
  EXPECT_EQ(data.train->x(), (FieldMeta{ElemType::kFloat32, {3, 4}}));
  // Sample 4 of train: x = arange(48, 60), y = 4 (gen.py).
  ASSERT_OK_AND_ASSIGN(Batch b, ReadBatch(*data.train, 3, 2));
  std::vector<float> want_x;
  for (int k = 36; k < 60; ++k) want_x.push_back(static_cast<float>(k));
  EXPECT_EQ(b.x, BytesOf(want_x));
  EXPECT_EQ(b.y, BytesOf(std::vector<int64_t>{3, 4}));

  // Test labels of another integer dtype are taken as they are; test inputs of another dtype
  // are refused (the model takes the training inputs').
  ASSERT_OK_AND_ASSIGN(JobData labels32, LoadDataset("tensors", TensorTestData("labels32")));
  EXPECT_EQ(labels32.train->y(), (FieldMeta{ElemType::kInt64, {}}));
  EXPECT_EQ(labels32.test->y(), (FieldMeta{ElemType::kInt32, {}}));
  ASSERT_OK_AND_ASSIGN(Batch t, ReadBatch(*labels32.test, 0, 2));
  EXPECT_EQ(t.y, BytesOf(std::vector<int32_t>{1, 0}));
  EXPECT_STATUS_MSG(LoadDataset("tensors", TensorTestData("xdouble")),
                    absl::StatusCode::kInvalidArgument,
                    "training samples are x float32[2], y int64[] but test samples are x "
                    "float64[2], y int64[]");

  // A directory without test*.pt files: a training set, and no test set.
  ASSERT_OK_AND_ASSIGN(JobData seq, LoadDataset("tensors", TensorTestData("seq")));
  EXPECT_EQ(seq.train->size(), 4);
  EXPECT_EQ(seq.test, nullptr);
  // Without train*.pt files there is nothing to train on.
  EXPECT_STATUS_MSG(LoadDataset("tensors", TensorTestData("bad")), absl::StatusCode::kNotFound,
                    absl::StrCat("dataset tensors in ", TensorTestData("bad"), ": no files match ",
                                 TensorTestData("bad"), "/train*.pt"));
}

// ---------------------------------------------------------------------------------------------
// Batches

// n images of 2x2 whose pixels encode the index (so batches can be checked against it).
ImageSet Synthetic(int64_t n) {
  ImageSet set;
  set.size = n;
  set.rows = 2;
  set.cols = 2;
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 4; ++k) set.pixels.push_back(static_cast<uint8_t>((i * 4 + k) % 256));
    set.labels.push_back(static_cast<uint8_t>(i % 10));
  }
  return set;
}

constexpr float kMean = 0.5f;
constexpr float kStd = 0.25f;

float Normalised(uint8_t p) { return (static_cast<float>(p) / 255.0f - kMean) / kStd; }

// A source over a copy of `set`, normalised with kMean and kStd.
std::unique_ptr<ExampleSource> Source(const ImageSet& set) {
  auto source = MakeImageSource(set, kMean, kStd, "synthetic");
  EXPECT_OK(source);
  return source.ok() ? *std::move(source) : nullptr;
}

// Checks that a batch's x and y are the normalised pixels and labels of its indices.
void ExpectBatchMatchesIndices(const ImageSet& set, const Batch& batch) {
  ASSERT_EQ(batch.indices.size(), static_cast<size_t>(batch.size));
  ASSERT_EQ(batch.y.size(), static_cast<size_t>(batch.size) * sizeof(int64_t));
  ASSERT_EQ(batch.x.size(), static_cast<size_t>(batch.size) * 4 * sizeof(float));
  for (int64_t j = 0; j < batch.size; ++j) {
    const int64_t i = batch.indices[j];
    ASSERT_GE(i, 0);
    ASSERT_LT(i, set.size);
    int64_t label;
    std::memcpy(&label, batch.y.data() + j * sizeof(int64_t), sizeof(label));
    EXPECT_EQ(label, set.labels[i]);
    for (int k = 0; k < 4; ++k) {
      float x;
      std::memcpy(&x, batch.x.data() + (j * 4 + k) * sizeof(float), sizeof(x));
      EXPECT_EQ(x, Normalised(set.pixels[i * 4 + k]));
    }
  }
}

std::vector<Batch> Drain(BatchLoader* loader) {
  std::vector<Batch> out;
  while (std::optional<Batch> b = loader->Next()) out.push_back(*std::move(b));
  EXPECT_OK(loader->status());
  return out;
}

std::vector<Batch> RunLoader(const ImageSet& set, const BatchLoader::Options& options) {
  std::unique_ptr<ExampleSource> source = Source(set);
  auto loader = BatchLoader::Create(source.get(), options);
  EXPECT_OK(loader);
  if (!loader.ok()) return {};
  return Drain(loader->get());
}

TEST(EpochPermutationTest, IsAPermutationAndDeterministic) {
  const std::vector<int64_t> p = BatchLoader::EpochPermutation(1000, 42, 3);
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(p, BatchLoader::EpochPermutation(1000, 42, 3));
  EXPECT_NE(p, BatchLoader::EpochPermutation(1000, 42, 4));
  EXPECT_NE(p, BatchLoader::EpochPermutation(1000, 43, 3));
  // The high halves of seed and epoch matter too.
  EXPECT_NE(p, BatchLoader::EpochPermutation(1000, 42 + (uint64_t{1} << 32), 3));
  EXPECT_NE(p, BatchLoader::EpochPermutation(1000, 42, 3 + (int64_t{1} << 32)));
  EXPECT_TRUE(BatchLoader::EpochPermutation(0, 1, 0).empty());
  EXPECT_EQ(BatchLoader::EpochPermutation(1, 1, 0), std::vector<int64_t>{0});
}

TEST(EpochPermutationTest, GoldenValues) {
  // Pinned so that a change of algorithm (which would silently desynchronise workers built
  // from different versions) fails loudly. mt19937_64 and seed_seq are fully specified by
  // the standard, so these hold on every conforming platform.
  EXPECT_EQ(BatchLoader::EpochPermutation(10, 1, 0),
            (std::vector<int64_t>{2, 1, 8, 9, 6, 7, 3, 5, 0, 4}));
  EXPECT_EQ(BatchLoader::EpochPermutation(10, 1, 1),
            (std::vector<int64_t>{4, 6, 2, 3, 7, 9, 0, 8, 5, 1}));
}

TEST(BatchLoaderTest, ShardsUnionToSingleProcessBatches) {
  const ImageSet set = Synthetic(50);
  BatchLoader::Options o;
  o.batch_size = 3;
  o.epochs = 2;
  o.seed = 7;
  o.world_size = 2;
  o.rank = 0;
  const std::vector<Batch> r0 = RunLoader(set, o);
  o.rank = 1;
  const std::vector<Batch> r1 = RunLoader(set, o);
  BatchLoader::Options single = o;
  single.rank = 0;
  single.world_size = 1;
  single.batch_size = 6;
  const std::vector<Batch> s = RunLoader(set, single);

  // floor(50 / 6) = 8 steps per epoch, for every rank and for the single process.
  ASSERT_EQ(r0.size(), 16u);
  ASSERT_EQ(r1.size(), 16u);
  ASSERT_EQ(s.size(), 16u);
  for (size_t t = 0; t < s.size(); ++t) {
    SCOPED_TRACE(absl::StrCat("step ", t));
    for (const Batch* b : {&r0[t], &r1[t], &s[t]}) {
      EXPECT_EQ(b->step, static_cast<int64_t>(t));
      EXPECT_EQ(b->epoch, static_cast<int64_t>(t / 8));
      ExpectBatchMatchesIndices(set, *b);
    }
    EXPECT_EQ(r0[t].size, 3);
    EXPECT_EQ(s[t].size, 6);
    // Interleaved: rank r's j-th sample is the single process's sample 2j + r.
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(r0[t].indices[j], s[t].indices[2 * j]);
      EXPECT_EQ(r1[t].indices[j], s[t].indices[2 * j + 1]);
    }
    std::set<int64_t> ranks(r0[t].indices.begin(), r0[t].indices.end());
    ranks.insert(r1[t].indices.begin(), r1[t].indices.end());
    EXPECT_EQ(ranks, std::set<int64_t>(s[t].indices.begin(), s[t].indices.end()));
  }

  // Within an epoch each sample goes to at most one worker, all but the 50 % 6 = 2 samples
  // at the end of the epoch's permutation are used, and the single process sees batch t as
  // perm[6t, 6t + 6).
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    const std::vector<int64_t> perm = BatchLoader::EpochPermutation(50, 7, epoch);
    std::multiset<int64_t> seen;
    for (int64_t t = 0; t < 8; ++t) {
      const size_t step = static_cast<size_t>(epoch * 8 + t);
      seen.insert(r0[step].indices.begin(), r0[step].indices.end());
      seen.insert(r1[step].indices.begin(), r1[step].indices.end());
      EXPECT_EQ(s[step].indices,
                std::vector<int64_t>(perm.begin() + 6 * t, perm.begin() + 6 * t + 6));
    }
    EXPECT_EQ(seen.size(), 48u);
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 48u);
    EXPECT_EQ(seen.count(perm[48]), 0u);
    EXPECT_EQ(seen.count(perm[49]), 0u);
  }
  // Epochs are shuffled differently.
  EXPECT_NE(r0[0].indices, r0[8].indices);
}

TEST(BatchLoaderTest, DeterministicAcrossLoaders) {
  const ImageSet set = Synthetic(40);
  BatchLoader::Options o;
  o.batch_size = 4;
  o.epochs = 3;
  o.seed = 123;
  o.world_size = 3;
  o.rank = 2;
  const std::vector<Batch> a = RunLoader(set, o);
  o.prefetch_depth = 1;  // The queue depth must not change the data.
  const std::vector<Batch> b = RunLoader(set, o);
  ASSERT_EQ(a.size(), 9u);  // floor(40 / 12) = 3 per epoch.
  ASSERT_EQ(b.size(), a.size());
  for (size_t t = 0; t < a.size(); ++t) {
    EXPECT_EQ(a[t].indices, b[t].indices);
    EXPECT_EQ(a[t].x, b[t].x);
    EXPECT_EQ(a[t].y, b[t].y);
    EXPECT_EQ(a[t].epoch, b[t].epoch);
  }
  o.seed = 124;
  const std::vector<Batch> c = RunLoader(set, o);
  ASSERT_EQ(c.size(), a.size());
  bool any_different = false;
  for (size_t t = 0; t < a.size(); ++t) any_different |= a[t].indices != c[t].indices;
  EXPECT_TRUE(any_different);
}

TEST(BatchLoaderTest, MaxStepsCyclesEpochs) {
  const ImageSet set = Synthetic(50);
  BatchLoader::Options o;
  o.batch_size = 6;
  o.epochs = 1;  // Ignored: max_steps wins.
  o.max_steps = 20;
  const std::unique_ptr<ExampleSource> source = Source(set);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(source.get(), o));
  EXPECT_EQ(loader->steps_per_epoch(), 8);
  EXPECT_EQ(loader->total_steps(), 20);
  const std::vector<Batch> batches = Drain(loader.get());
  ASSERT_EQ(batches.size(), 20u);
  for (size_t t = 0; t < batches.size(); ++t) {
    EXPECT_EQ(batches[t].step, static_cast<int64_t>(t));
    EXPECT_EQ(batches[t].epoch, static_cast<int64_t>(t / 8));
  }
  // The end is sticky.
  EXPECT_FALSE(loader->Next().has_value());
  EXPECT_FALSE(loader->Next().has_value());

  o.max_steps = 0;
  o.epochs = 2;
  ASSERT_OK_AND_ASSIGN(loader, BatchLoader::Create(source.get(), o));
  EXPECT_EQ(loader->total_steps(), 16);
}

TEST(BatchLoaderTest, ZeroEpochsProducesNothing) {
  const ImageSet set = Synthetic(10);
  BatchLoader::Options o;
  o.batch_size = 100;  // Too big, but there is nothing to produce anyway.
  o.epochs = 0;
  const std::unique_ptr<ExampleSource> source = Source(set);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(source.get(), o));
  EXPECT_EQ(loader->total_steps(), 0);
  EXPECT_FALSE(loader->Next().has_value());
}

TEST(BatchLoaderTest, DestroyedEarlyDoesNotHang) {
  const ImageSet set = Synthetic(100);
  const std::unique_ptr<ExampleSource> source = Source(set);
  BatchLoader::Options o;
  o.batch_size = 2;
  o.max_steps = 1000000;
  o.prefetch_depth = 1;
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(source.get(), o));
    // Never consumed: the producer is blocked on a full queue.
  }
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(source.get(), o));
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(loader->Next().has_value());
  }
  {
    // Destroyed right away, possibly before the thread even ran.
    o.prefetch_depth = 4;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(source.get(), o));
  }
}

TEST(BatchLoaderTest, ConcurrentConsumersGetEachBatchOnce) {
  const ImageSet set = Synthetic(64);
  BatchLoader::Options o;
  o.batch_size = 1;
  o.epochs = 20;
  o.prefetch_depth = 2;
  const std::unique_ptr<ExampleSource> source = Source(set);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(source.get(), o));
  std::vector<int64_t> steps[2];
  std::vector<std::thread> threads;
  for (int c = 0; c < 2; ++c) {
    threads.emplace_back([&loader, &steps, c] {
      while (std::optional<Batch> b = loader->Next()) steps[c].push_back(b->step);
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<int64_t> all = steps[0];
  all.insert(all.end(), steps[1].begin(), steps[1].end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), 64u * 20);
  for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i));
  // Each consumer sees its batches in order.
  for (const auto& s : steps) EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
}

TEST(BatchLoaderTest, CreateValidates) {
  const ImageSet set = Synthetic(10);
  const std::unique_ptr<ExampleSource> source = Source(set);
  const BatchLoader::Options good;  // batch 64 > 10 images: fixed below per case.
  auto with = [&](auto edit) {
    BatchLoader::Options o = good;
    o.batch_size = 2;
    edit(o);
    return BatchLoader::Create(source.get(), o).status();
  };
  EXPECT_OK(with([](BatchLoader::Options&) {}));
  EXPECT_STATUS_MSG(with([](BatchLoader::Options& o) { o.rank = 2, o.world_size = 2; }),
                    absl::StatusCode::kInvalidArgument, "rank 2 not in [0, world_size=2)");
  EXPECT_STATUS(with([](BatchLoader::Options& o) { o.rank = -1; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(with([](BatchLoader::Options& o) { o.world_size = 0; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(with([](BatchLoader::Options& o) { o.batch_size = 0; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(with([](BatchLoader::Options& o) { o.epochs = -1; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(with([](BatchLoader::Options& o) { o.max_steps = -1; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(with([](BatchLoader::Options& o) { o.prefetch_depth = 0; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS_MSG(with([](BatchLoader::Options& o) { o.batch_size = 3, o.world_size = 4; }),
                    absl::StatusCode::kInvalidArgument, "exceeds the 10 samples of synthetic");
  EXPECT_STATUS_MSG(
      with([](BatchLoader::Options& o) { o.batch_size = int64_t{1} << 62, o.world_size = 8; }),
      absl::StatusCode::kInvalidArgument, "exceeds");
  EXPECT_STATUS_MSG(BatchLoader::Create(nullptr, BatchLoader::Options{}),
                    absl::StatusCode::kInvalidArgument, "null source");
  BatchLoader::Options o = good;
  o.batch_size = 2;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> empty,
                       MakeImageSource(ImageSet{}, kMean, kStd, "empty set"));
  EXPECT_STATUS_MSG(BatchLoader::Create(empty.get(), o), absl::StatusCode::kInvalidArgument,
                    "empty source empty set");
}

TEST(MakeImageSourceTest, Validates) {
  EXPECT_STATUS_MSG(MakeImageSource(Synthetic(10), kMean, 0.0f, "s"),
                    absl::StatusCode::kInvalidArgument, "s: need a finite mean and stddev > 0");
  EXPECT_STATUS(MakeImageSource(Synthetic(10), kMean, -1.0f, "s"),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(MakeImageSource(Synthetic(10), NAN, kStd, "s"), absl::StatusCode::kInvalidArgument);
  ImageSet broken = Synthetic(10);
  broken.labels.pop_back();
  EXPECT_STATUS_MSG(MakeImageSource(broken, kMean, kStd, "s"), absl::StatusCode::kInvalidArgument,
                    "s: inconsistent image set: 40 pixels and 9 labels for 10 images of 2x2");
  broken = Synthetic(10);
  broken.pixels.push_back(0);
  EXPECT_STATUS(MakeImageSource(broken, kMean, kStd, "s"), absl::StatusCode::kInvalidArgument);
}

// A source whose Read fails for one index (I/O errors in the prefetch thread).
class FailingSource : public ExampleSource {
 public:
  FailingSource(int64_t size, int64_t bad) : size_(size), bad_(bad) {}
  int64_t size() const override { return size_; }
  const FieldMeta& x() const override { return x_; }
  const FieldMeta& y() const override { return y_; }
  absl::Status Read(int64_t i, uint8_t* x_out, uint8_t* y_out) const override {
    if (i == bad_) return absl::DataLossError(absl::StrCat("disk ate sample ", i));
    std::memcpy(x_out, &i, sizeof(i));
    const int32_t y = static_cast<int32_t>(i % 3);
    std::memcpy(y_out, &y, sizeof(y));
    return absl::OkStatus();
  }
  std::string Describe() const override { return "failing"; }

 private:
  const int64_t size_, bad_;
  const FieldMeta x_{ElemType::kInt64, {}};
  const FieldMeta y_{ElemType::kInt32, {}};
};

TEST(BatchLoaderTest, ReadErrorEndsProductionAndIsReported) {
  BatchLoader::Options o;
  o.batch_size = 2;
  o.epochs = 3;
  o.seed = 5;
  // The step whose batch holds sample 7 first: batches before it arrive, then nullopt.
  const std::vector<int64_t> perm = BatchLoader::EpochPermutation(10, 5, 0);
  const int64_t bad_step = (std::find(perm.begin(), perm.end(), 7) - perm.begin()) / 2;
  FailingSource source(10, 7);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(&source, o));
  int64_t got = 0;
  while (std::optional<Batch> b = loader->Next()) {
    EXPECT_EQ(b->step, got);
    ASSERT_EQ(b->x.size(), 16u);
    ASSERT_EQ(b->y.size(), 8u);
    int64_t x0;
    std::memcpy(&x0, b->x.data(), sizeof(x0));
    EXPECT_EQ(x0, b->indices[0]);
    ++got;
  }
  EXPECT_EQ(got, bad_step);
  EXPECT_STATUS_MSG(loader->status(), absl::StatusCode::kDataLoss, "disk ate sample 7");
  EXPECT_FALSE(loader->Next().has_value());
  EXPECT_STATUS(loader->status(), absl::StatusCode::kDataLoss);
}

TEST(ReadBatchTest, ReadsSamplesInOrder) {
  const ImageSet set = Synthetic(7);
  const std::unique_ptr<ExampleSource> source = Source(set);
  int64_t next = 0;
  for (int64_t begin = 0; begin < 7; begin += 3) {
    const int64_t count = std::min<int64_t>(3, 7 - begin);
    ASSERT_OK_AND_ASSIGN(Batch batch, ReadBatch(*source, begin, count));
    EXPECT_EQ(batch.size, count);
    EXPECT_EQ(batch.epoch, 0);
    EXPECT_EQ(batch.step, 0);
    ExpectBatchMatchesIndices(set, batch);
    for (int64_t index : batch.indices) EXPECT_EQ(index, next++);
  }
  EXPECT_EQ(next, 7);
  ASSERT_OK_AND_ASSIGN(Batch empty, ReadBatch(*source, 7, 0));
  EXPECT_EQ(empty.size, 0);
  EXPECT_TRUE(empty.x.empty());
  EXPECT_STATUS_MSG(ReadBatch(*source, 5, 3), absl::StatusCode::kOutOfRange,
                    "samples [5, +3) not within the 7 of synthetic");
  EXPECT_STATUS(ReadBatch(*source, -1, 1), absl::StatusCode::kOutOfRange);
  EXPECT_STATUS(ReadBatch(*source, 0, -1), absl::StatusCode::kOutOfRange);
  EXPECT_STATUS(ReadBatch(*source, 8, 0), absl::StatusCode::kOutOfRange);
  FailingSource failing(10, 4);
  EXPECT_STATUS_MSG(ReadBatch(failing, 2, 5), absl::StatusCode::kDataLoss, "disk ate sample 4");
}

// ---------------------------------------------------------------------------------------------
// Real data, when the environment provides it.

std::string RealDataDir(const std::string& name, const std::string& probe) {
  const char* root = std::getenv("GRADMESH_DATA_DIR");
  if (root == nullptr || *root == '\0') return "";
  const std::string dir = absl::StrCat(root, "/", name);
  struct stat st;
  return stat(absl::StrCat(dir, "/", probe).c_str(), &st) == 0 ? dir : "";
}

TEST(RealDataTest, Mnist) {
  const std::string dir = RealDataDir("mnist", "train-images-idx3-ubyte");
  if (dir.empty()) GTEST_SKIP() << "GRADMESH_DATA_DIR/mnist/train-images-idx3-ubyte not found";
  ASSERT_OK_AND_ASSIGN(DatasetFiles files, LoadIdxDataset("mnist", dir));
  EXPECT_EQ(files.train.size, 60000);
  EXPECT_EQ(files.test.size, 10000);
  EXPECT_EQ(files.train.rows, 28);
  EXPECT_EQ(files.train.cols, 28);
  EXPECT_EQ(files.test.rows, 28);
  EXPECT_EQ(files.test.cols, 28);
  EXPECT_EQ(files.train.labels[0], 5);
  EXPECT_EQ(files.test.labels[0], 7);
  EXPECT_EQ(files.num_classes, 10);

  // A full epoch over real data, split over 4 workers, covers 60000 - 60000 % 256 samples.
  ASSERT_OK_AND_ASSIGN(JobData data, LoadDataset("mnist", dir));
  const ExampleSource* train = data.train.get();
  EXPECT_EQ(train->size(), 60000);
  BatchLoader::Options o;
  o.batch_size = 64;
  o.world_size = 4;
  std::set<int64_t> seen;
  for (o.rank = 0; o.rank < 4; ++o.rank) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<BatchLoader> loader, BatchLoader::Create(train, o));
    EXPECT_EQ(loader->steps_per_epoch(), 234);
    for (const Batch& b : Drain(loader.get())) seen.insert(b.indices.begin(), b.indices.end());
  }
  EXPECT_EQ(seen.size(), 234u * 256);
}

TEST(RealDataTest, FashionMnist) {
  const std::string dir = RealDataDir("fashion-mnist", "train-images-idx3-ubyte.gz");
  if (dir.empty()) {
    GTEST_SKIP() << "GRADMESH_DATA_DIR/fashion-mnist/train-images-idx3-ubyte.gz not found";
  }
  ASSERT_OK_AND_ASSIGN(DatasetFiles files, LoadIdxDataset("fashion-mnist", dir));
  EXPECT_EQ(files.train.size, 60000);
  EXPECT_EQ(files.test.size, 10000);
  EXPECT_EQ(files.train.rows, 28);
  EXPECT_EQ(files.train.cols, 28);
  EXPECT_EQ(files.train.labels[0], 9);
}

TEST(BatchLoaderResumeTest, FirstStepSkipsExactlyTheEarlierBatches) {
  ImageSet images;
  images.size = 50;
  images.rows = images.cols = 2;
  images.pixels.assign(50 * 4, 7);
  images.labels.assign(50, 1);
  BatchLoader::Options o;
  o.rank = 1;
  o.world_size = 2;
  o.batch_size = 4;  // 6 steps per epoch.
  o.epochs = 3;
  o.seed = 9;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ExampleSource> source,
                       MakeImageSource(images, 0.f, 1.f, "sevens"));
  auto full = BatchLoader::Create(source.get(), o);
  ASSERT_TRUE(full.ok());
  std::vector<Batch> all;
  while (auto b = (*full)->Next()) all.push_back(std::move(*b));
  ASSERT_EQ(all.size(), 18u);
  for (int64_t first : {0, 5, 6, 13, 18}) {
    o.first_step = first;
    auto resumed = BatchLoader::Create(source.get(), o);
    ASSERT_TRUE(resumed.ok());
    int64_t step = first;
    while (auto b = (*resumed)->Next()) {
      EXPECT_EQ(b->step, step);
      EXPECT_EQ(b->indices, all[step].indices) << "first_step " << first << " step " << step;
      EXPECT_EQ(b->epoch, all[step].epoch);
      ++step;
    }
    EXPECT_EQ(step, 18) << "first_step " << first;
  }
  o.first_step = -1;
  EXPECT_EQ(BatchLoader::Create(source.get(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gradmesh
