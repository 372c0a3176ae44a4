#include "worker/core/dataset.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <system_error>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "worker/core/tensor_files.h"

namespace gradmesh {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;
constexpr uint32_t kLabelsMagic = 0x00000801;
// gzread() takes an unsigned int length; reading in bounded chunks also lets a file whose
// header lies about its size fail on truncation before we allocate everything it claims.
constexpr size_t kReadChunk = size_t{1} << 20;

struct DatasetInfo {
  const char* name;
  float mean;
  float stddev;
  int num_classes;
};

// Constants are the ones torchvision users conventionally normalise with.
constexpr DatasetInfo kDatasets[] = {
    {"mnist", 0.1307f, 0.3081f, 10},
    {"fashion-mnist", 0.2860f, 0.3530f, 10},
};
// train*.pt / test*.pt files (worker/core/tensor_files.h).
constexpr char kTensorsDataset[] = "tensors";

// Closes the gzFile on every return path.
class GzReader {
 public:
  GzReader(gzFile file, std::string path) : file_(file), path_(std::move(path)) {}
  ~GzReader() { gzclose(file_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  static absl::StatusOr<std::unique_ptr<GzReader>> Open(const std::string& path) {
    // stat() first so that a missing file is reported as NOT_FOUND rather than whatever
    // gzopen() leaves in errno.
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      const int err = errno;
      return absl::Status(absl::ErrnoToStatusCode(err),
                          absl::StrCat("cannot open ", path, ": ", std::strerror(err)));
    }
    if (!S_ISREG(st.st_mode)) {
      // A directory, or a FIFO or device whose open would block the job's start for good.
      return absl::InvalidArgumentError(
          absl::StrCat(path, S_ISDIR(st.st_mode) ? " is a directory" : " is not a regular file",
                       ", not an IDX file"));
    }
    errno = 0;
    gzFile file = gzopen(path.c_str(), "rb");
    if (file == nullptr) {
      const int err = errno;
      return absl::Status(err != 0 ? absl::ErrnoToStatusCode(err) : absl::StatusCode::kInternal,
                          absl::StrCat("cannot open ", path, ": ",
                                       err != 0 ? std::strerror(err) : "gzopen failed"));
    }
    return std::make_unique<GzReader>(file, path);
  }

  // Appends exactly `n` bytes to `out`; `what` names the data for error messages.
  absl::Status ReadAppend(uint64_t n, const char* what, std::vector<uint8_t>* out) {
    const size_t start = out->size();
    uint64_t done = 0;
    while (done < n) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(n - done, kReadChunk));
      // Grow geometrically ourselves (resize() alone need not), capped at the final size.
      if (out->capacity() < start + done + want) {
        out->reserve(static_cast<size_t>(std::min<uint64_t>(
            start + n, std::max<uint64_t>(2 * out->capacity(), start + done + want))));
      }
      out->resize(start + done + want);
      const int got = gzread(file_, out->data() + start + done, static_cast<unsigned>(want));
      if (got < 0) return CorruptError();
      done += static_cast<uint64_t>(got);
      if (static_cast<size_t>(got) < want) {
        // A short read is end of file, unless zlib flagged a broken stream.
        int errnum = Z_OK;
        gzerror(file_, &errnum);
        if (errnum != Z_OK) return CorruptError();
        out->resize(start + done);
        return absl::InvalidArgumentError(
            absl::StrCat(path_, ": truncated ", what, ": expected ", n, " bytes, found ", done));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint32_t> ReadBigEndian32(const char* what) {
    std::vector<uint8_t> b;
    RETURN_IF_ERROR(ReadAppend(4, what, &b));
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  }

  // The header's sizes must account for the whole file: extra bytes mean a wrong or
  // damaged file, not something to silently ignore.
  absl::Status ExpectEnd() {
    uint8_t byte;
    const int got = gzread(file_, &byte, 1);
    if (got < 0) return CorruptError();
    if (got > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": unexpected data after the last item announced in the header"));
    }
    int errnum = Z_OK;
    gzerror(file_, &errnum);
    if (errnum != Z_OK) return CorruptError();
    return absl::OkStatus();
  }

  const std::string& path() const { return path_; }

 private:
  absl::Status CorruptError() {
    int errnum = Z_OK;
    const char* msg = gzerror(file_, &errnum);
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": corrupt compressed data: ", msg != nullptr ? msg : "unknown zlib error"));
  }

  gzFile file_;
  std::string path_;
};

absl::Status CheckMagic(const GzReader& reader, uint32_t magic, uint32_t expected,
                        const char* kind) {
  if (magic == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: bad magic number 0x%08x for an IDX %s file (expected 0x%08x)",
                      reader.path(), magic, kind, expected));
}

void MakeLut(float mean, float stddev, float lut[256]) {
  for (int p = 0; p < 256; ++p) {
    lut[p] = (static_cast<float>(p) / 255.0f - mean) / stddev;
  }
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return absl::StrCat(dir, "/", name);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// `dir`/`base` if it exists, else `dir`/`base`.gz if that exists, else NOT_FOUND.
absl::StatusOr<std::string> FindIdxFile(const std::string& dir, const std::string& base) {
  const std::string plain = JoinPath(dir, base);
  if (Exists(plain)) return plain;
  const std::string gz = plain + ".gz";
  if (Exists(gz)) return gz;
  return absl::NotFoundError(absl::StrCat("neither ", plain, " nor ", gz, " exists"));
}

// An ImageSet as samples: x float32 [1, rows, cols] normalised through a table, y int64 [].
class ImageSource : public ExampleSource {
 public:
  ImageSource(ImageSet images, float mean, float stddev, std::string description)
      : images_(std::move(images)), description_(std::move(description)) {
    MakeLut(mean, stddev, lut_);
    x_.type = ElemType::kFloat32;
    x_.dims = {1, images_.rows, images_.cols};
    y_.type = ElemType::kInt64;
  }

  int64_t size() const override { return images_.size; }
  const FieldMeta& x() const override { return x_; }
  const FieldMeta& y() const override { return y_; }

  absl::Status Read(int64_t i, uint8_t* x_out, uint8_t* y_out) const override {
    if (i < 0 || i >= images_.size) {
      return absl::OutOfRangeError(
          absl::StrCat(description_, ": sample ", i, " out of range [0, ", images_.size, ")"));
    }
    const int64_t pixels = int64_t{images_.rows} * images_.cols;
    const uint8_t* src = images_.pixels.data() + i * pixels;
    for (int64_t k = 0; k < pixels; ++k) {
      std::memcpy(x_out + k * sizeof(float), &lut_[src[k]], sizeof(float));
    }
    const int64_t label = images_.labels[i];
    std::memcpy(y_out, &label, sizeof(label));
    return absl::OkStatus();
  }

  std::string Describe() const override {
    return absl::StrCat(description_, " (", images_.size, " images of ", images_.rows, "x",
                        images_.cols, ")");
  }

 private:
  const ImageSet images_;
  const std::string description_;
  float lut_[256];  // Normalised value of each pixel byte; written only in the constructor.
  FieldMeta x_, y_;
};

}  // namespace

absl::StatusOr<ImageSet> LoadIdxPair(const std::string& images_path,
                                     const std::string& labels_path) {
  ImageSet set;
  {
    ASSIGN_OR_RETURN(std::unique_ptr<GzReader> in, GzReader::Open(images_path));
    ASSIGN_OR_RETURN(const uint32_t magic, in->ReadBigEndian32("header"));
    RETURN_IF_ERROR(CheckMagic(*in, magic, kImagesMagic, "image"));
    ASSIGN_OR_RETURN(const uint32_t count, in->ReadBigEndian32("header"));
    ASSIGN_OR_RETURN(const uint32_t rows, in->ReadBigEndian32("header"));
    ASSIGN_OR_RETURN(const uint32_t cols, in->ReadBigEndian32("header"));
    // Bounds keep every later product (count * rows * cols, rows * cols) within int64 and
    // the dimensions within int32.
    constexpr uint32_t kMaxSide = 1 << 16;
    if (rows == 0 || cols == 0 || rows > kMaxSide || cols > kMaxSide) {
      return absl::InvalidArgumentError(absl::StrCat(images_path, ": image size ", rows, "x", cols,
                                                     " out of range [1, ", kMaxSide, "]"));
    }
    set.size = count;
    set.rows = static_cast<int32_t>(rows);
    set.cols = static_cast<int32_t>(cols);
    RETURN_IF_ERROR(in->ReadAppend(uint64_t{count} * rows * cols, "pixel data", &set.pixels));
    RETURN_IF_ERROR(in->ExpectEnd());
  }
  {
    ASSIGN_OR_RETURN(std::unique_ptr<GzReader> in, GzReader::Open(labels_path));
    ASSIGN_OR_RETURN(const uint32_t magic, in->ReadBigEndian32("header"));
    RETURN_IF_ERROR(CheckMagic(*in, magic, kLabelsMagic, "label"));
    ASSIGN_OR_RETURN(const uint32_t count, in->ReadBigEndian32("header"));
    if (count != set.size) {
      return absl::InvalidArgumentError(absl::StrCat("count mismatch: ", images_path, " has ",
                                                     set.size, " images but ", labels_path, " has ",
                                                     count, " labels"));
    }
    RETURN_IF_ERROR(in->ReadAppend(count, "label data", &set.labels));
    RETURN_IF_ERROR(in->ExpectEnd());
  }
  return set;
}

std::vector<std::string> KnownDatasets() {
  std::vector<std::string> known = {kTensorsDataset};
  for (const DatasetInfo& d : kDatasets) known.push_back(d.name);
  std::sort(known.begin(), known.end());
  return known;
}

absl::StatusOr<DatasetFiles> LoadIdxDataset(const std::string& name, const std::string& dir) {
  const DatasetInfo* info = nullptr;
  std::vector<std::string> known;
  for (const DatasetInfo& d : kDatasets) {
    known.push_back(d.name);
    if (name == d.name) info = &d;
  }
  if (info == nullptr) {
    std::sort(known.begin(), known.end());
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown IDX dataset \"", name, "\"; known IDX datasets: ", absl::StrJoin(known, ", ")));
  }
  const std::string context = absl::StrCat("dataset ", name, " in ", dir);
  auto load = [&](const char* images_base, const char* labels_base) -> absl::StatusOr<ImageSet> {
    ASSIGN_OR_RETURN(const std::string images_path, FindIdxFile(dir, images_base));
    ASSIGN_OR_RETURN(const std::string labels_path, FindIdxFile(dir, labels_base));
    ASSIGN_OR_RETURN(ImageSet set, LoadIdxPair(images_path, labels_path));
    for (int64_t i = 0; i < set.size; ++i) {
      if (set.labels[i] >= info->num_classes) {
        return absl::InvalidArgumentError(absl::StrCat(labels_path, ": label ", int{set.labels[i]},
                                                       " of item ", i, " is not below the ",
                                                       info->num_classes, " classes of ", name));
      }
    }
    return set;
  };

  DatasetFiles files;
  files.mean = info->mean;
  files.stddev = info->stddev;
  files.num_classes = info->num_classes;
  auto train = load("train-images-idx3-ubyte", "train-labels-idx1-ubyte");
  if (!train.ok()) return Annotate(train.status(), context);
  files.train = *std::move(train);
  auto test = load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte");
  if (!test.ok()) return Annotate(test.status(), context);
  files.test = *std::move(test);
  if (files.train.rows != files.test.rows || files.train.cols != files.test.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": training images are ", files.train.rows, "x", files.train.cols,
                     " but test images are ", files.test.rows, "x", files.test.cols));
  }
  return files;
}

absl::StatusOr<std::unique_ptr<ExampleSource>> MakeImageSource(ImageSet images, float mean,
                                                               float stddev,
                                                               std::string description) {
  if (images.size < 0 || (images.size > 0 && (images.rows <= 0 || images.cols <= 0)) ||
      images.rows < 0 || images.cols < 0 ||
      images.pixels.size() != static_cast<uint64_t>(images.size) * images.rows * images.cols ||
      images.labels.size() != static_cast<uint64_t>(images.size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(description, ": inconsistent image set: ", images.pixels.size(),
                     " pixels and ", images.labels.size(), " labels for ", images.size,
                     " images of ", images.rows, "x", images.cols));
  }
  if (!std::isfinite(mean) || !std::isfinite(stddev) || !(stddev > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        description, ": need a finite mean and stddev > 0, got mean=", mean, " stddev=", stddev));
  }
  return std::make_unique<ImageSource>(std::move(images), mean, stddev, std::move(description));
}

absl::StatusOr<JobData> LoadDataset(const std::string& name, const std::string& dir) {
  JobData data;
  if (name == kTensorsDataset) {
    const std::string context = absl::StrCat("dataset ", name, " in ", dir);
    auto train = OpenTensorFiles(dir, "train");
    if (!train.ok()) return Annotate(train.status(), context);
    // Test files are optional (the train files are in this directory, so NotFound means no
    // test*.pt): a job without them trains and is not evaluated.
    auto test = OpenTensorFiles(dir, "test");
    if (!test.ok() && !absl::IsNotFound(test.status())) return Annotate(test.status(), context);
    if (test.ok() && !TestFitsTraining(**train, **test)) {
      return absl::InvalidArgumentError(
          absl::StrCat(context, ": training samples are x ", (*train)->x().Describe(), ", y ",
                       (*train)->y().Describe(), " but test samples are x ",
                       (*test)->x().Describe(), ", y ", (*test)->y().Describe()));
    }
    data.train = *std::move(train);
    if (test.ok()) data.test = *std::move(test);
    return data;
  }
  if (std::none_of(std::begin(kDatasets), std::end(kDatasets),
                   [&](const DatasetInfo& d) { return name == d.name; })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown dataset \"", name, "\"; known datasets: ", absl::StrJoin(KnownDatasets(), ", ")));
  }
  ASSIGN_OR_RETURN(DatasetFiles files, LoadIdxDataset(name, dir));
  ASSIGN_OR_RETURN(data.train, MakeImageSource(std::move(files.train), files.mean, files.stddev,
                                               absl::StrCat(name, " ", dir, " train")));
  ASSIGN_OR_RETURN(data.test, MakeImageSource(std::move(files.test), files.mean, files.stddev,
                                              absl::StrCat(name, " ", dir, " test")));
  data.num_classes = files.num_classes;
  return data;
}

// ---------------------------------------------------------------------------------------------
// BatchLoader

absl::StatusOr<std::unique_ptr<BatchLoader>> BatchLoader::Create(const ExampleSource* source,
                                                                 const Options& options) {
  if (source == nullptr) return absl::InvalidArgumentError("BatchLoader: null source");
  const int64_t size = source->size();
  if (size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BatchLoader: empty source ", source->Describe()));
  }
  const Options& o = options;
  if (o.world_size <= 0 || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("BatchLoader: rank ", o.rank, " not in [0, world_size=", o.world_size, ")"));
  }
  if (o.batch_size <= 0 || o.epochs < 0 || o.max_steps < 0 || o.prefetch_depth <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BatchLoader: need batch_size > 0, epochs >= 0, max_steps >= 0 and prefetch_depth > 0; "
        "got batch_size=",
        o.batch_size, " epochs=", o.epochs, " max_steps=", o.max_steps,
        " prefetch_depth=", o.prefetch_depth));
  }
  // Written to avoid overflowing batch_size * world_size.
  const int64_t steps_per_epoch =
      o.batch_size > size / o.world_size ? 0 : size / (o.batch_size * o.world_size);
  if (o.first_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("BatchLoader: first_step must be >= 0, got ", o.first_step));
  }
  if ((o.epochs > 0 || o.max_steps > 0) && steps_per_epoch == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BatchLoader: batch_size ", o.batch_size, " x world_size ", o.world_size, " exceeds the ",
        size, " samples of ", source->Describe(), ", so an epoch has no full batch"));
  }
  if (o.max_steps == 0 && steps_per_epoch > 0 &&
      o.epochs > std::numeric_limits<int64_t>::max() / steps_per_epoch) {
    return absl::InvalidArgumentError(absl::StrCat("BatchLoader: epochs ", o.epochs, " too large"));
  }
  // A batch is at most all samples (batch_size * world_size <= size when any is produced);
  // check its bytes fit anyway, as a source's sizes are only bounded by its files.
  const int64_t sample_bytes = source->x().sample_bytes() + source->y().sample_bytes();
  if ((o.epochs > 0 || o.max_steps > 0) && sample_bytes > 0 &&
      o.batch_size > std::numeric_limits<int64_t>::max() / 2 / sample_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("BatchLoader: batch_size ", o.batch_size, " of ",
                                                   sample_bytes, "-byte samples"));
  }
  auto loader = absl::WrapUnique(new BatchLoader(source, options, steps_per_epoch));
  try {
    loader->thread_ = std::thread(&BatchLoader::Produce, loader.get());
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("BatchLoader: cannot start the prefetch thread: ", e.what()));
  }
  return loader;
}

BatchLoader::BatchLoader(const ExampleSource* source, const Options& options,
                         int64_t steps_per_epoch)
    : source_(source),
      options_(options),
      steps_per_epoch_(steps_per_epoch),
      total_steps_(options.max_steps > 0 ? options.max_steps : options.epochs * steps_per_epoch_) {}

BatchLoader::~BatchLoader() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    not_full_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

std::vector<int64_t> BatchLoader::EpochPermutation(int64_t n, uint64_t seed, int64_t epoch) {
  if (n <= 0) return {};
  const uint64_t e = static_cast<uint64_t>(epoch);
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(e), static_cast<uint32_t>(e >> 32)};
  std::mt19937_64 rng(seq);
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

absl::StatusOr<Batch> BatchLoader::MakeBatch(const std::vector<int64_t>& perm, int64_t epoch,
                                             int64_t t, int64_t step) const {
  const int64_t b = options_.batch_size;
  const int64_t w = options_.world_size;
  const size_t xb = static_cast<size_t>(source_->x().sample_bytes());
  const size_t yb = static_cast<size_t>(source_->y().sample_bytes());
  Batch batch;
  batch.epoch = epoch;
  batch.step = step;
  batch.size = b;
  batch.x.resize(static_cast<size_t>(b) * xb);
  batch.y.resize(static_cast<size_t>(b) * yb);
  batch.indices.reserve(b);
  for (int64_t j = 0; j < b; ++j) {
    const int64_t index = perm[(t * b + j) * w + options_.rank];
    RETURN_IF_ERROR(source_->Read(index, batch.x.data() + j * xb, batch.y.data() + j * yb));
    batch.indices.push_back(index);
  }
  return batch;
}

void BatchLoader::Produce() {
  // Resuming at first_step: skip whole epochs, then batches, without building them.
  int64_t step =
      steps_per_epoch_ == 0 ? 0 : options_.first_step - options_.first_step % steps_per_epoch_;
  // (Not step / steps_per_epoch_ when an epoch has no step: a division by zero, UBSan saw it.)
  const int64_t first_epoch = steps_per_epoch_ == 0 ? 0 : step / steps_per_epoch_;
  for (int64_t epoch = first_epoch; step < total_steps_; ++epoch) {
    const std::vector<int64_t> perm = EpochPermutation(source_->size(), options_.seed, epoch);
    for (int64_t t = 0; t < steps_per_epoch_ && step < total_steps_; ++t, ++step) {
      if (step < options_.first_step) continue;
      // Built outside the lock so the consumer can keep taking batches meanwhile.
      absl::StatusOr<Batch> batch = MakeBatch(perm, epoch, t, step);
      absl::MutexLock lock(&mu_);
      if (!batch.ok()) {
        status_ = Annotate(batch.status(), absl::StrCat("BatchLoader step ", step));
        producer_done_ = true;
        not_empty_.SignalAll();
        return;
      }
      while (!stop_ && queue_.size() >= static_cast<size_t>(options_.prefetch_depth)) {
        not_full_.Wait(&mu_);
      }
      if (stop_) return;
      queue_.push_back(*std::move(batch));
      not_empty_.Signal();
    }
  }
  absl::MutexLock lock(&mu_);
  producer_done_ = true;
  not_empty_.SignalAll();
}

std::optional<Batch> BatchLoader::Next() {
  absl::MutexLock lock(&mu_);
  while (queue_.empty() && !producer_done_) not_empty_.Wait(&mu_);
  if (queue_.empty()) return std::nullopt;
  Batch batch = std::move(queue_.front());
  queue_.pop_front();
  not_full_.Signal();
  return batch;
}

absl::Status BatchLoader::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::StatusOr<Batch> ReadBatch(const ExampleSource& source, int64_t begin, int64_t count) {
  if (begin < 0 || count < 0 || begin > source.size() || count > source.size() - begin) {
    return absl::OutOfRangeError(absl::StrCat("ReadBatch: samples [", begin, ", +", count,
                                              ") not within the ", source.size(), " of ",
                                              source.Describe()));
  }
  const size_t xb = static_cast<size_t>(source.x().sample_bytes());
  const size_t yb = static_cast<size_t>(source.y().sample_bytes());
  Batch batch;
  batch.size = count;
  batch.x.resize(static_cast<size_t>(count) * xb);
  batch.y.resize(static_cast<size_t>(count) * yb);
  batch.indices.reserve(count);
  for (int64_t j = 0; j < count; ++j) {
    RETURN_IF_ERROR(source.Read(begin + j, batch.x.data() + j * xb, batch.y.data() + j * yb));
    batch.indices.push_back(begin + j);
  }
  return batch;
}

}  // namespace gradmesh
