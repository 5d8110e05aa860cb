// A plain C++ TU of a program that also has an nvcc TU (device_tu.cu): both make a cuda:0 tensor. With
// dtensor::cuda linked, both see DTENSOR_HAS_CUDA=1 and the same Tensor; the link order must not matter.
#include <dtensor/core/tensor.hpp>

#include <string>

std::string make_cuda_tensor_in_host_tu() {
  try {
    dtensor::Tensor<float, 1> t({4}, dtensor::Device::cuda(0));
    return "ok";
  } catch (const dtensor::Error& e) {
    return e.what();
  }
}

int host_tu_config() {
  return DTENSOR_HAS_CUDA;
}
