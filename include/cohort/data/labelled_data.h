/// \file
/// A user's own labelled data named by one string, as a command line or a config names it, opened
/// as a train and a test split that a classifier reads through one normalisation:
///
///   images:DIR   one sub-folder per class (`DIR/<class>/<image>`); `DIR/train/<class>/`... and
///                `DIR/test/<class>/`... when DIR has both folders, else `test_size` of the images
///                held out as the test split
///   csv:FILE     a numeric CSV with a header line; `label_column` names the class column (whole
///                numbers from 0), every other column is a feature; `test_size` of the rows held
///                out as the test split
///   text:FILE    any file, read as bytes (tokens 0-255) for a language model: rows of `context`
///                tokens and the `context` tokens that follow each by one; the file's last
///                `test_size` of rows held out as the test split
///   random-tokens:ROWS
///                ROWS rows of uniformly random tokens (from `seed`), for throughput runs
///   mnist:DIR    MNIST-format IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte,
///                t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each also .gz) of 10 classes,
///                their own train and test splits (e.g. Debian's dataset-fashion-mnist)
///
/// Rows come out of `normalize` as `input_column` and `target_column`: "image" float [C, H, W] and
/// "label" int64, the shape of the zoo's image classifiers (a CSV row is a [features, 1, 1] image:
/// the mlp reads it as a vector), or "tokens" and "next_tokens" int64 [context], the GPT's.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "cohort/data/dataset.h"
#include "cohort/data/tensor_dataset.h"

namespace cohort::data {

/// How open_labelled_data() reads: the label column, image size, test split and seed.
struct LabelledDataOptions {
  std::string label_column;  ///< csv: the class column (required)
  int64_t image_size = 28;   ///< images: each resized to image_size x image_size
  bool grayscale = false;    ///< images: decoded to one channel
  int64_t context = 128;     ///< text, random-tokens: tokens per row
  double test_size = 0.1;    ///< the test split's fraction where the data has no test split
  uint64_t seed = 0;         ///< draws the held-out test rows
};

/// A labelled data set of the user's, read from images:DIR or csv:FILE: its train and test
/// splits, how to normalise them and its shape.
struct LabelledData {
  /// Where the rows came from.
  enum class Kind {
    kImages,  ///< image folders
    kCsv,     ///< a CSV file
    kText,    ///< a file's bytes, or random tokens
    kMnist,   ///< MNIST-format IDX files
  };
  Kind kind = Kind::kImages;   ///< where the rows came from
  std::filesystem::path path;  ///< the folder or file
  Dataset train;            ///< raw rows: images uint8 [C, H, W] / csv "features" [F], and "label"
  Dataset test;             ///< raw rows of the test split
  BatchFn normalize;        ///< raw rows to "image" float [C, H, W] and "label"
  int64_t channels = 0;     ///< channels of an image (1 for a CSV)
  int64_t image_size = 0;   ///< H = W (1 for a CSV)
  int64_t num_classes = 0;  ///< classes (labels 0 to num_classes - 1)
  std::vector<std::string> class_names;  ///< images: the sub-folders' names; csv: "0", "1", ...
  int64_t context = 0;                   ///< text: tokens per row (num_classes: the vocabulary)
  std::string input_column = "image";    ///< the model's input after `normalize`
  std::string target_column = "label";   ///< its target after `normalize`
  /// One line for logs: what was read, the rows of each split, the classes (the first 10 names)
  /// and the shape.
  std::string describe() const;
};

/// Opens `spec` ("images:DIR", "csv:FILE", "text:FILE", "random-tokens:ROWS" or "mnist:DIR").
/// Throws UsageError naming the value and the fix for an unknown scheme, a missing path, an MNIST
/// folder without its four files or with images that are not square, an image folder without
/// class sub-folders or images, a CSV without data rows, with rows of another length than its
/// header, with a value that is no number or a label that is no whole number from 0, for a text too
/// short for two rows of `context` + 1 bytes, and for too few rows to hold out a test split. Reads
/// the CSV and decodes one image to learn the shapes; the rest is read as it is iterated.
LabelledData open_labelled_data(const std::string& spec, const LabelledDataOptions& options = {});

/// The rows of `dataset` through `normalize`, in memory: the input and target columns as one
/// TensorDataset (the test split of a run's evaluation).
TensorDataset materialize_labelled(const Dataset& dataset, const BatchFn& normalize,
                                   const std::string& input_column = "image",
                                   const std::string& target_column = "label");

}  // namespace cohort::data
