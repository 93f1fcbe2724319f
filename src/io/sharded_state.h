// What a rank holds of a model's global tensors, piece by piece: the one description that
// checkpoint writes and reads, resharding (a file read at another layout) and the Hugging Face
// export all go through. It is Megatron-Core's ShardedTensor (global shape, global offset,
// local shape, replica id) and a chunk of PyTorch's distributed checkpoint, for a rank's flat
// buffers.
//
// A piece is an N-d block of one global tensor: `offset` and `shape` per dimension. The block's
// elements sit row-major and end to end in the rank's flat buffers from element `at`. Every
// block of one tensor that several ranks hold alike (replicas: data-parallel ranks without ZeRO,
// tensor ranks holding a replicated parameter) is written by them in row blocks, replica r of
// R writing rows row_piece(shape, r, R) of it, so that together the pieces of all ranks write
// every element of every global tensor exactly once. What builds a description from the
// parallel layout is ShardedModelCheckpoint::describe (io/sharded_model_state.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "state/params.h"

namespace dstrain {

struct TensorPiece {
  int tensor = 0;               // the global tensor: its id in the file's registry
  std::vector<int64_t> offset;  // where the block starts in the global tensor, per dimension
  Shape shape;                  // the block (zero rows: an empty piece)
  int64_t at = 0;               // its first element in the rank's flat buffers
  int replica = 0;              // this rank among the `replicas` ranks holding the same block
  int replicas = 1;

  int64_t numel() const { return shape.numel(); }
  // The rows of the block this rank writes.
  RowPiece written() const { return row_piece(shape, replica, replicas); }
};

// The block of its global tensor that parameter p's placement gives: the whole tensor (whole
// or a routed expert's own), or tensor piece `index` of `count` along `dim`; `at` is p's offset
// in its registry, `tensor` is -1 (the caller knows the file).
TensorPiece placement_block(const ParamInfo& p);

// A contiguous run of a global tensor's row-major elements inside a piece: `global` is its
// first element in the global tensor, `local` in the piece, `elems` its length.
struct PieceRun {
  int64_t global = 0, local = 0, elems = 0;
};

// Every piece a rank holds, at most one per global tensor, and the size of the flat buffers
// they lie in.
struct ShardedState {
  std::vector<TensorPiece> pieces;
  int64_t numel = 0;  // elements of each flat buffer (at least every piece's at + numel)

  // The pieces of whole tensors in the registry's layout (each at its offset), held alike by
  // `replicas` ranks of which this is `replica`: one process, or data-parallel replicas with
  // nothing else split.
  static ShardedState whole(const ParamRegistry& reg, int replica = 0, int replicas = 1);

  // Checks each piece against the file's global shapes and the buffer size; the message names
  // the tensor and what is wrong.
  void check(const ParamRegistry& file) const;
};

// The runs of rows [rows.row_begin, + rows.rows) of `piece` (a block of a tensor of shape
// `global`), in order: one run when the block spans every element of its trailing dimensions,
// one per row of them otherwise (a matrix split along dimension 1: one run per row).
std::vector<PieceRun> piece_runs(const TensorPiece& piece, const Shape& global, const RowPiece& rows);

}  // namespace dstrain
