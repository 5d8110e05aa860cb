#pragma once
// Sharded checkpoints: save named DTensors from any mesh and placements, load them onto another mesh,
// other placements and another number of ranks; consolidate them into one safetensors file.
//
//   namespace ckpt = dtensor::checkpoint;
//   ckpt::save("run/step-100", {{"w", w}, {"b", b}});              // collective over the tensors' world
//   auto w2 = ckpt::load<DTensor<float, 2, Mesh3, Shard<1>>>("run/step-100", "w", mesh3);  // no collective
//   ckpt::load_into("run/step-100", "b", b3);                      // into a DTensor of the saved shape
//   ckpt::consolidate("run/step-100", "model.safetensors");        // one process, full tensors
//
// On disk, a checkpoint is a directory (on a file system every rank sees):
//   rank-<r>.safetensors  the blocks rank r holds, one safetensors tensor "<name>/<r>" per DTensor; a
//                         block held by several ranks (Replicate axes) is written once, by the rank at
//                         coordinate 0 of those axes
//   index.json            per tensor: dtype, global shape and its blocks (file, tensor key, global offset,
//                         shape, data_offsets, a CRC-32C per chunk_bytes of the block's bytes); "files":
//                         every file's size; "weight_map": key -> file, as in Hugging Face indexes
// A load reads index.json, intersects this rank's target block with every saved block, and reads only
// the chunks those intersections touch (pread), checking each chunk's CRC-32C, each file's size and
// header against the index. Partial tensors cannot be saved (their values are not the tensor's):
// redistribute them to Replicate or Shard first.
//
// Saving is atomic: the files go to "<dir>.tmp", rank 0 writes the index, fsyncs, and swaps the
// directory in (renameat2 RENAME_EXCHANGE where the file system has it; else the old one is renamed
// aside first, and a crash between the two renames leaves it at "<dir>.old"). A save that fails or dies
// before the swap leaves the previous checkpoint as it was; the next save clears the stale "<dir>.tmp".
// save_async (async_save.hpp) does the same in the background, from a copy of the values of its call.

#include "dtensor/checkpoint/async_save.hpp"
#include "dtensor/checkpoint/load.hpp"
#include "dtensor/checkpoint/save.hpp"
