// Training data as the training loop sees it: a random-access source of (x, y) samples whose
// fields have a fixed element type and per-sample shape, and mini-batches of raw bytes made
// from it. Free of LibTorch (the loop turns a Batch into tensors with from_blob) and of gRPC.
//
// Sources:
// * IDX image sets (mnist, fashion-mnist; worker/core/dataset.h): x float32 [1, rows, cols],
//   normalised; y int64 [] (class index).
// * "tensors" (worker/core/tensor_files.h): train*.pt / test*.pt files written by
//   torch.save({"x": X, "y": Y}, f); x and y of the files' dtypes and per-sample shapes,
//   read sample by sample with pread (a file is never loaded whole).
//
// Thread safety: an ExampleSource's const methods may be called concurrently (Read is used by
// the prefetch thread while the loop evaluates).
#ifndef GRADMESH_WORKER_CORE_EXAMPLES_H_
#define GRADMESH_WORKER_CORE_EXAMPLES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gradmesh {

// Element types of dataset fields and model buffers (the subset of PyTorch's dtypes that
// torch.save writes for the common storages).
enum class ElemType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt64,
  kInt32,
  kInt16,
  kInt8,
  kUInt8,
  kBool,
};

// Bytes per element.
int ElemSize(ElemType type);
// PyTorch's name: "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
// "int8", "uint8", "bool".
const char* ElemTypeName(ElemType type);
// True for float32/float64/float16/bfloat16.
bool IsFloating(ElemType type);

// One field (x or y) of every sample: element type and the shape of one sample (without the
// leading sample dimension; empty for a scalar such as a class index).
struct FieldMeta {
  ElemType type = ElemType::kFloat32;
  std::vector<int64_t> dims;

  int64_t numel() const;         // Product of dims (1 for a scalar).
  int64_t sample_bytes() const;  // numel() * ElemSize(type).
  // "float32[1,28,28]" (per sample), for messages and logs.
  std::string Describe() const;
  bool operator==(const FieldMeta& o) const { return type == o.type && dims == o.dims; }
  bool operator!=(const FieldMeta& o) const { return !(*this == o); }
};

// Whether targets `b` can stand in for targets `a`: the same per-sample shape and the same
// kind (class indices of any integer dtype, which the losses take alike; float targets of any
// float dtype, converted to the output's), as a test set saved apart from its training set
// often has them (int32 labels beside int64 ones).
bool TargetsCompatible(const FieldMeta& a, const FieldMeta& b);

// A random-access set of samples.
class ExampleSource {
 public:
  virtual ~ExampleSource() = default;

  virtual int64_t size() const = 0;
  virtual const FieldMeta& x() const = 0;
  virtual const FieldMeta& y() const = 0;

  // Copies sample i (in [0, size())) into x_out (x().sample_bytes() bytes) and y_out
  // (y().sample_bytes() bytes). Errors (I/O, i out of range) name the file and the sample.
  virtual absl::Status Read(int64_t i, uint8_t* x_out, uint8_t* y_out) const = 0;

  // What the source is, for logs and errors ("tensors /data/kjv (3 files, 120000 samples)").
  virtual std::string Describe() const = 0;
};

// Whether `test` can be evaluated by a model trained on `train`: the same inputs (the model
// takes the training inputs' dtype and shape) and compatible targets.
bool TestFitsTraining(const ExampleSource& train, const ExampleSource& test);

// A mini-batch: `size` samples, each field as contiguous bytes of [size, dims...] in the
// source's element type (little-endian, row-major), ready for torch::from_blob.
struct Batch {
  int64_t size = 0;
  std::vector<uint8_t> x;        // size * x.sample_bytes() bytes.
  std::vector<uint8_t> y;        // size * y.sample_bytes() bytes.
  std::vector<int64_t> indices;  // The samples' indices into the source, in batch order.
  int64_t epoch = 0;             // Epoch this batch belongs to (0-based).
  int64_t step = 0;              // Step index within the worker's whole run, 0-based.
};

// The training and test sets of a job.
struct JobData {
  std::unique_ptr<ExampleSource> train;
  std::unique_ptr<ExampleSource> test;  // Null: the dataset has no test set.
  // Classes of a classification dataset when known from the dataset itself (IDX: 10); 0
  // when not known (tensors: the model's output says).
  int num_classes = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_EXAMPLES_H_
