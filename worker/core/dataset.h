// Training data for workers: datasets by name (IDX image sets: mnist, fashion-mnist; .pt
// tensor files: tensors), sharded and shuffled mini-batches of any ExampleSource
// (worker/core/examples.h) with a background prefetch thread, and evaluation batches.
//
// This header deliberately does not include LibTorch: batches are raw bytes, and the worker
// turns them into tensors (torch::from_blob with the source's FieldMeta).
//
// Sharding follows PyTorch's DistributedSampler. Every worker computes the same permutation of
// the training set for each epoch (EpochPermutation), and worker `rank` of `world_size` takes
// the positions p of that permutation with p % world_size == rank. Batches are consecutive
// groups of `batch_size` of those positions, so batch t of worker r in an epoch is
//
//   { perm[(t * B + j) * W + r] : j in [0, B) }
//
// and the union over all ranks of batch t is perm[t*B*W, (t+1)*B*W): exactly batch t of a
// single process running with batch size B*W. Every worker has the same number of steps per
// epoch, floor(size / (B*W)); the remaining size % (B*W) samples at the end of each epoch's
// permutation are dropped (which samples those are changes from epoch to epoch).
//
// Error codes of the IDX loaders: a missing file is NOT_FOUND; any problem with a file's contents
// (bad magic number, truncated or over-long data, corrupt gzip stream, image/label count mismatch,
// label out of range) is INVALID_ARGUMENT; other I/O failures map errno to a code. Messages name
// the file.
#ifndef GRADMESH_WORKER_DATASET_H_
#define GRADMESH_WORKER_DATASET_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/core/examples.h"

namespace gradmesh {

// Images with one label each, as stored in IDX files: `size` images of rows x cols bytes.
struct ImageSet {
  int64_t size = 0;
  int32_t rows = 0;
  int32_t cols = 0;
  std::vector<uint8_t> pixels;  // size * rows * cols, image-major then row-major.
  std::vector<uint8_t> labels;  // size.
};

// Reads an IDX image file (magic 0x00000803: count, rows, cols, then pixels) and an IDX label
// file (magic 0x00000801: count, then labels). Header integers are big-endian. Files are read
// through zlib, so each may be gzipped or plain. The two counts must match and each file must
// hold exactly the bytes its header announces.
absl::StatusOr<ImageSet> LoadIdxPair(const std::string& images_path,
                                     const std::string& labels_path);

// The training and test sets of an IDX dataset, with the per-pixel normalisation constants
// (applied to pixel / 255) and the number of classes.
struct DatasetFiles {
  ImageSet train;
  ImageSet test;
  float mean = 0;
  float stddev = 1;
  int num_classes = 0;
};

// Loads IDX dataset `name` ("mnist" or "fashion-mnist"; anything else is INVALID_ARGUMENT)
// from directory `dir`, which must hold train-images-idx3-ubyte, train-labels-idx1-ubyte,
// t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, each optionally with a ".gz" suffix (the
// plain file wins if both exist). Also checks that train and test images have the same
// dimensions and that every label is below num_classes (INVALID_ARGUMENT otherwise).
absl::StatusOr<DatasetFiles> LoadIdxDataset(const std::string& name, const std::string& dir);

// An image set as an ExampleSource: sample i is x float32 [1, rows, cols] with values
// (pixel / 255 - mean) / stddev (computed in float, exactly as 256-entry table lookups) and
// y int64 [] = label. INVALID_ARGUMENT if the set is inconsistent (pixel or label count not
// matching size, rows or cols <= 0 with images) or stddev is not finite and > 0 or mean not
// finite. `description` is what Describe() returns ("mnist /data/mnist train").
absl::StatusOr<std::unique_ptr<ExampleSource>> MakeImageSource(ImageSet images, float mean,
                                                               float stddev,
                                                               std::string description);

// Opens dataset `name` from directory `dir`:
// * "mnist", "fashion-mnist": LoadIdxDataset, as image sources (num_classes 10);
// * "tensors": OpenTensorFiles(dir, "train") and OpenTensorFiles(dir, "test")
//   (worker/core/tensor_files.h; num_classes 0); without test*.pt files JobData.test is null
//   (the job trains and is not evaluated).
// An unknown name is INVALID_ARGUMENT listing KnownDatasets(); other errors as those
// functions return them, annotated with the dataset and dir.
absl::StatusOr<JobData> LoadDataset(const std::string& name, const std::string& dir);

// Names LoadDataset() accepts, sorted: "fashion-mnist", "mnist", "tensors".
std::vector<std::string> KnownDatasets();

// Produces one worker's shard of shuffled training batches, epoch after epoch, prepared ahead
// of time by a background thread into a bounded queue.
//
// Thread safety: Next() may be called from any thread (calls are serialised and each batch is
// returned exactly once), the other methods are const and safe anywhere. The ExampleSource
// passed to Create() must outlive the loader (its Read() is called from the prefetch thread).
// Destroying the loader stops and joins the prefetch thread promptly, even if batches remain
// unconsumed; it must not race with a Next() call in another thread.
//
// Errors: if the source's Read() fails, the prefetch thread stops producing; Next() returns
// the batches queued before the failure, then nullopt (also on every later call), and
// status() returns the error. Callers tell the normal end from a failure by status().
class BatchLoader {
 public:
  struct Options {
    int32_t rank = 0;         // This worker, in [0, world_size).
    int32_t world_size = 1;   // Number of workers sharing the data (> 0).
    int64_t batch_size = 64;  // Samples per batch per worker (> 0).
    int64_t epochs = 1;       // Passes over the data (>= 0); ignored when max_steps > 0.
    // 0: produce epochs * steps_per_epoch() batches. > 0: produce exactly max_steps batches,
    // cycling through as many epochs as needed (the last one possibly partial).
    int64_t max_steps = 0;
    uint64_t seed = 1;       // Data-order seed; must be the same on every worker.
    int prefetch_depth = 4;  // Batches prepared ahead (> 0).
    // Resume: the first batch produced is the one of overall step first_step (>= 0); the
    // batches before it are skipped, so a resumed run sees exactly the data it would have.
    int64_t first_step = 0;
  };

  // Validates `options` against `source` (INVALID_ARGUMENT on an out-of-range field, a null
  // or empty source, or a non-empty run in which batch_size * world_size exceeds the sample
  // count or a batch's bytes overflow) and starts the prefetch thread.
  static absl::StatusOr<std::unique_ptr<BatchLoader>> Create(const ExampleSource* source,
                                                             const Options& options);

  // The permutation of [0, n) used in `epoch` for data-order `seed`. A std::mt19937_64 is
  // seeded through std::seed_seq with the 32-bit halves of seed and epoch (both fully
  // specified by the C++ standard), then a Fisher-Yates shuffle draws swap position j for
  // index i as rng() % (i + 1). The slight modulo bias is irrelevant here; what matters is
  // that the result is identical on every platform and every worker (unlike
  // std::shuffle / std::uniform_int_distribution, whose algorithms are unspecified).
  static std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch);

  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Returns the next batch, blocking until the prefetch thread has made it, or nullopt once
  // the batches of steps [first_step, total_steps()) have been returned, or after a read
  // error (see status()); nullopt again on every later call.
  std::optional<Batch> Next();

  // OK, or the first error of the source's Read() in the prefetch thread (which then stopped
  // producing).
  absl::Status status() const;

  // Batches per full epoch for every worker: floor(size / (batch_size * world_size)).
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // Batches this loader produces in all: max_steps if > 0, else epochs * steps_per_epoch().
  int64_t total_steps() const { return total_steps_; }
  const Options& options() const { return options_; }

 private:
  // Arguments already validated by Create().
  BatchLoader(const ExampleSource* source, const Options& options, int64_t steps_per_epoch);

  // Body of the prefetch thread.
  void Produce();
  // Builds batch `t` of `epoch` (overall step `step`) from that epoch's permutation.
  absl::StatusOr<Batch> MakeBatch(const std::vector<int64_t>& perm, int64_t epoch, int64_t t,
                                  int64_t step) const;

  const ExampleSource* const source_;
  const Options options_;
  const int64_t steps_per_epoch_;
  const int64_t total_steps_;

  mutable absl::Mutex mu_;
  absl::CondVar not_empty_;  // Signalled when a batch is queued or production ends.
  absl::CondVar not_full_;   // Signalled when a batch is taken or stop_ is set.
  std::deque<Batch> queue_ ABSL_GUARDED_BY(mu_);
  bool producer_done_ ABSL_GUARDED_BY(mu_) = false;  // All batches queued, or an error.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;           // The destructor asks the thread to end.
  absl::Status status_ ABSL_GUARDED_BY(mu_);         // The prefetch thread's read error.

  std::thread thread_;  // Started last in Create(), joined in the destructor.
};

// Samples [begin, begin + count) of `source`, in order, as one batch (epoch 0, step 0,
// indices begin...): evaluation reads a test set in chunks this way, so a large one is never
// all in memory. OUT_OF_RANGE unless 0 <= begin, 0 <= count and begin + count <= size();
// the source's Read() errors as they are. Thread safety: as the source's Read().
absl::StatusOr<Batch> ReadBatch(const ExampleSource& source, int64_t begin, int64_t count);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_DATASET_H_
