// bench_train: examples/06_train.cpp (the model, its layouts, the one-rank check, the time split and the
// collective pins) with every operator new counted (bench/common/alloc_counter.hpp), so it also reports
// the heap per rank: live before training, the peak over the steps after the first (AdamW's state exists
// by then), live after. bench/train/train_vs_torch.sh runs it with --no-check --json FILE for each layout
// next to bench/train/torch_train.py; BENCHMARKS.md ("Training step") has the numbers.
#include "../common/alloc_counter.hpp"

#define DTENSOR_TRAIN_COUNT_HEAP 1
#include "../../examples/06_train.cpp"
