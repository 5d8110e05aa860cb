// 06 on GPUs: examples/06_train.cpp compiled by nvcc and linked with NCCL and cuBLAS, so its --device cuda
// path exists (the default here): the same model, layouts, one-rank check and collective pins, with every
// tensor on the rank's CUDA device. 06_train.cpp's header has the flags and "On CUDA" the details.
//
//   dtensor-run --nproc-per-node 4 ./example_06_train_cuda --layout fsdp_tp --dtype float   # 4 GPUs
//   # two ranks on one GPU (tests; each rank its own NCCL_HOSTID):
//   DTENSOR_TEST_HOSTID_PER_RANK=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
//     dtensor-run --nproc-per-node 2 ./example_06_train_cuda --layout hsdp --dtype float --steps 3
//
// Exits 77 (ctest's skip) when no CUDA device is visible.
#include "06_train.cpp"
