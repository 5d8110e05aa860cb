// The nvcc TU of the two-TU program (see host_tu.cpp).
#include <dtensor/core/tensor.hpp>

#include <string>

std::string make_cuda_tensor_in_device_tu() {
  try {
    dtensor::Tensor<float, 1> t({4}, dtensor::Device::cuda(0));
    return "ok";
  } catch (const dtensor::Error& e) {
    return e.what();
  }
}

int device_tu_config() {
  return DTENSOR_HAS_CUDA;
}
